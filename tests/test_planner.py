"""The planner offers only plans its accountant certifies, and converts epochs to steps in one way.

Proactive DP is van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A Multiple Target Optimization Framework
for DP-SGD"; its plans are checked against the conditions (32)-(35) of Thm B.4 for the run actually offered:
constant expected batch s for T whole rounds.
"""

import itertools
import json
import math

import pytest

from dptrain.accounting import dpsgd_ledger, epsilon, steps_for_epochs
from dptrain.accounting.proactive import (
    SampleSizes,
    check_theorem_b4,
    dp_calculator_simple,
    plan_proactive,
)
from dptrain.cli import main
from dptrain.proactive.planner import PLAN_ACCOUNTANTS, plan_budget, plan_from_sigma

SIGMAS = (6.572, 7.5, 9.0, 12.10881, 19.29962)
SIZES = (10_000, 50_000, 60_000)
EPOCHS = (3, 5, 7, 20)


def holds(eps, delta, sigma, n, s, steps, gamma_mode="fixed_point"):
    return check_theorem_b4(eps, delta, sigma, SampleSizes.constant(s, steps, n), gamma_mode).holds


def test_the_reviewers_plan_was_not_certified_and_now_is(capsys):
    # The D.4 calculator's s = floor(kN/T_min) = 800 needs ceil(350000/800) = 438 rounds, K = 350,400 > kN,
    # and (34) misses by 0.07%.
    raw = dp_calculator_simple(6.572, 50_000, 7)
    assert raw["s_max"] == 800 and not holds(raw["epsilon"], raw["delta"], 6.572, 50_000, 800, 438)
    argv = [
        "plan",
        "--from-sigma",
        "6.572",
        "--dataset-size",
        "50000",
        "--epochs",
        "7",
        "--gamma",
        "fixed-point",
    ]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["s_max"], plan["T_min"]) == (799, 439)
    assert plan["theorem_b4"]["holds"] and plan["certified"]
    assert plan["T_min_theorem"] == pytest.approx(437.31, abs=0.01)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "s_max      = 799" in text and "Thm B.4 holds" in text


@pytest.mark.parametrize("gamma", ["fixed_point", "paper"])
def test_every_from_sigma_plan_holds_and_is_the_largest_that_does(gamma):
    checked = 0
    for sigma, n, k in itertools.product(SIGMAS, SIZES, EPOCHS):
        raw = dp_calculator_simple(sigma, n, k, gamma_mode=gamma)
        plan = plan_from_sigma(sigma, n, k, gamma=gamma)
        s, steps = plan["s_max"], plan["T_min"]
        if raw["s_max"] < 1:
            continue
        eps, delta = plan["epsilon"], plan["delta"]
        assert 1 <= s <= raw["s_max"] and steps == math.ceil(k * n / s - 1e-9)
        assert plan["theorem_b4"]["holds"] and holds(eps, delta, sigma, n, s, steps, gamma)
        if s < raw["s_max"]:  # stepped down: the next larger batch does not hold
            assert not holds(eps, delta, sigma, n, s + 1, math.ceil(k * n / (s + 1) - 1e-9), gamma)
        if gamma == "fixed_point":  # the accountant itself certifies the plan's ledger within its epsilon
            ledger = dpsgd_ledger(sigma, s / n, steps, dataset_size=n)
            assert epsilon(ledger, delta, "proactive").epsilon <= eps
        checked += 1
    assert checked >= 50


def test_paper_mode_keeps_the_papers_tables():
    # Tables 9-11's s_max (gamma by the paper's iteration) already hold: nothing to adjust.
    for (sigma, n, k), s_max in [
        ((19.29962, 10_000, 5), 26),
        ((12.10881, 60_000, 6), 288),
        ((6.572, 50_000, 7), 406),
    ]:
        assert plan_from_sigma(sigma, n, k, gamma="paper")["s_max"] == s_max


def test_every_proactive_budget_plan_is_certified_within_the_budget():
    for eps, n, k in itertools.product((0.05, 0.1, 0.3, 0.5, 1.0, 2.0), SIZES, (2, 3, 5, 7, 10, 20)):
        delta = 1 / n
        try:
            plan = plan_proactive(eps, delta, n, k)
        except Exception as e:  # a refusal is allowed, never an uncertified plan
            assert "Thm B.4" in str(e) or "no batch size" in str(e)
            continue
        s, steps, sigma = plan["s_max"], plan["T_min"], plan["noise_multiplier"]
        assert plan["valid"] and holds(eps, delta, sigma, n, s, steps)
        assert epsilon(dpsgd_ledger(sigma, s / n, steps, dataset_size=n), delta, "proactive").epsilon <= eps


@pytest.mark.parametrize("eps,n,k", [(0.05, 10_000, 5), (0.5, 50_000, 7)])
def test_every_accountants_budget_plan_is_its_own_certified_ledger(eps, n, k):
    result = plan_budget(eps, 1 / n, n, k, accountants=PLAN_ACCOUNTANTS)
    assert {p["accountant"] for p in result["plans"]} == set(PLAN_ACCOUNTANTS)
    for p in result["plans"]:
        name, s, steps = p["accountant"], p["s_max"], p["T_min"]
        ledger = dpsgd_ledger(p["noise_multiplier"], s / n, steps, dataset_size=n)
        report = epsilon(ledger, 1 / n, name)
        assert report.epsilon <= eps and p["valid"]
        if name == "proactive":
            assert holds(eps, 1 / n, p["noise_multiplier"], n, s, steps)
            continue
        # rdp, pld, gdp: epochs -> steps in the one way (expected passes = steps * q) and the plan's own numbers
        assert steps == steps_for_epochs(k, s / n)
        assert report.epsilon == p["epsilon"] and report.certified == p["certified"] == (name != "gdp")
        # the largest batch: one more exceeds the budget
        bigger = dpsgd_ledger(
            p["noise_multiplier"], (s + 1) / n, steps_for_epochs(k, (s + 1) / n), dataset_size=n
        )
        assert epsilon(bigger, 1 / n, name).epsilon > eps
    assert result["tightest"] in ("rdp", "pld")
