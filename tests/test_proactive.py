"""Proactive DP (van Dijk et al., "Proactive DP: A Multiple Target Optimization Framework for DP-SGD"): closed
forms, gamma, condition checkers, calculators, accountant, planner."""

import json
import math
import warnings

import numpy as np
import pytest

from dptrain.accounting import Ledger, dpsgd_ledger, epsilon
from dptrain.accounting.ledger import gaussian_step_event, step_facts
from dptrain.accounting.proactive import (
    SampleSizes,
    certify_theorem_b4,
    check_theorem_3_1,
    check_theorem_b4,
    dp_calculator_full,
    dp_calculator_simple,
    eps_from_sigma,
    gamma_rhs,
    h,
    increasing_sample_sizes,
    plan_proactive,
    sigma_from_eps,
    solve_gamma,
)
from dptrain.cli import main
from dptrain.errors import AccountingError
from dptrain.randomness.generators import NotPrivateWarning

TABLES_9_11 = [  # (sigma, N, k) -> eps, s_max, s_max_asym (paper Tables 9-11, App. D.4 calculator)
    ((19.29962, 10_000, 5), 0.0497, 26, 198),
    ((12.10881, 60_000, 6), 0.1521, 288, 3042),
    ((6.572, 50_000, 7), 0.5253, 406, 7504),
]


def test_h_values_and_closed_form_inverse():
    assert h(6) == pytest.approx(0.4158, abs=5e-5) and h(10) == pytest.approx(0.5844, abs=5e-5)
    assert h(2.5) - 1 / (2.5 * math.e) > 0  # App. B.4: g(sigma) = 1/(e sigma) for sigma >= 2.5
    for eps, delta in [(0.05, 1e-4), (0.3, 1e-5), (2.0, 1e-6)]:
        assert eps_from_sigma(sigma_from_eps(eps, delta), delta) == pytest.approx(eps)
    # eq. (6) with eps < 0.5, delta = 1/N: sigma >= sqrt(2 + 4 ln N) (6.23 for N = 1e4, 6.93 for 1e5).
    assert sigma_from_eps(0.5, 1e-4) == pytest.approx(math.sqrt(2 + 4 * math.log(1e4)))


@pytest.mark.parametrize("params,eps,s_max,s_asym", TABLES_9_11)
def test_d4_calculator_reproduces_tables_9_11_in_paper_mode(params, eps, s_max, s_asym):
    r = dp_calculator_simple(*params, gamma_mode="paper")
    assert round(r["epsilon"], 4) == eps
    assert r["s_max"] == s_max and r["s_max_asym"] == s_asym


@pytest.mark.parametrize("params,eps,s_max,s_asym", TABLES_9_11)
def test_certified_gamma_is_a_valid_solution_below_the_papers(params, eps, s_max, s_asym):
    sigma, n, k = params
    e = eps_from_sigma(sigma, 1 / n)
    paper, tight = solve_gamma(e, k, sigma, "paper"), solve_gamma(e, k, sigma)
    assert tight >= gamma_rhs(tight, e, k, sigma)  # satisfies the fixed-point inequality (certified form)
    assert tight * (1 - 1e-6) < gamma_rhs(tight * (1 - 1e-6), e, k, sigma)  # ... and is the smallest
    assert 2 <= tight < paper  # the paper's first iterate is valid but not the smallest
    assert dp_calculator_simple(sigma, n, k)["s_max"] >= s_max


def test_certified_form_is_never_below_the_printed_form():
    # sigma/(1 - a - 2 sqrt(a)) >= sigma/(1 - sqrt(a))^2: the certified RHS is the more conservative one.
    for a_eps, k, sigma in [(0.05, 5, 19.3), (0.5, 7, 6.6), (0.1, 50, 13.6)]:
        for gm in (2.0, 3.0, 5.0):
            assert gamma_rhs(gm, a_eps, k, sigma) >= gamma_rhs(gm, a_eps, k, sigma, paper_compat=True)


def test_gamma_tends_to_two_as_epochs_grow():
    sigma = sigma_from_eps(0.2, 1e-5)
    gammas = [solve_gamma(0.2, k, sigma) for k in (5, 50, 500, 5000)]
    assert gammas == sorted(gammas, reverse=True)
    assert gammas[-1] == pytest.approx(2.0, abs=0.01) and gammas[0] > 2.5


def test_fixed_points_in_paper_compat_form():
    # Our reproduction of gamma* with the printed (B.3) for (N, k, eps) rows, sigma from (6), delta = 1/N.
    for n, k, eps, expected in [
        (1e4, 5, 0.05, 3.1279),
        (1e4, 50, 0.1, 2.2164),
        (6e4, 6, 0.15, 3.6578),
        (5e4, 7, 0.5, 4.5602),
        (1e5, 100, 0.4, 2.2643),
    ]:
        sigma = sigma_from_eps(eps, 1 / n)
        assert solve_gamma(eps, k, sigma, paper_compat=True) == pytest.approx(expected, abs=5e-4)


def test_theorem_3_1_checker_rejects_documented_failures():
    n, k, eps = 10_000, 5, 0.05
    sigma = sigma_from_eps(eps, 1 / n)
    t_ok = math.ceil(solve_gamma(eps, k, sigma) * k**2 / eps)
    assert check_theorem_3_1(eps, 1 / n, sigma, n, k, t_ok).holds
    failing = {
        "eps < 0.5": dict(eps=0.6, sigma=sigma_from_eps(0.6, 1 / n)),
        "N >= 1e4": dict(n=5_000, delta=1 / 5_000),
        "theta <= 6.85": dict(theta=7.0),
        "delta <= 1/N": dict(delta=1e-3),
        "(7)": dict(k=4.0),  # minimum k for (7) at N = 1e4 is 4.235 (our computation from (7))
        "(8)": dict(steps=t_ok / 2),
        "(6)": dict(sigma=sigma - 1),
    }
    for name, change in failing.items():
        args = dict(eps=eps, delta=1 / n, sigma=sigma, n=n, k=k, steps=t_ok, theta=1.0) | change
        report = check_theorem_3_1(**args)
        assert name in [c.name for c in report.failed], (name, report.explain_failure())


def test_theorem_b4_checker_names_the_failing_condition():
    n, sigma, delta = 10_000, 19.29962, 1e-4
    eps = eps_from_sigma(sigma, delta)
    ok = check_theorem_b4(eps, delta, sigma, SampleSizes.constant(26, 1924, n))
    assert ok.holds
    too_few_rounds = check_theorem_b4(eps, delta, sigma, SampleSizes.constant(1000, 50, n))
    assert {"(34)"} <= {c.name for c in too_few_rounds.failed}
    assert "(34) fails: eps >= gamma theta^2 (K/N)(s_bar/N)" in too_few_rounds.explain_failure()
    less_noise = check_theorem_b4(eps, delta, sigma / 2, SampleSizes.constant(26, 1924, n))
    assert "(35)" in {c.name for c in less_noise.failed}


def test_bad_inputs_are_clear_errors(capsys):
    with pytest.raises(AccountingError, match="sigma\\^2 > 2"):
        eps_from_sigma(1.4, 1e-5)
    with pytest.raises(AccountingError, match="k must be a finite number > 0"):
        solve_gamma(0.1, 0, 10.0)
    for args, message in [
        (["plan", "--from-sigma", "1.2", "--dataset-size", "1000", "--epochs", "5"], "sigma^2 > 2"),
        (["plan", "--from-sigma", "10", "--dataset-size", "0", "--epochs", "5"], "expected an integer >= 1"),
        (
            ["plan", "--from-sigma", "10", "--dataset-size", "1000", "--epochs", "0"],
            "--epochs must be a number > 0",
        ),
        (["plan", "--epsilon", "1", "--dataset-size", "1000", "--epochs", "5"], "give --epsilon and --delta"),
    ]:
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_closed_form_is_never_below_the_pld_epsilon():
    # Property test over random valid plans: the closed form is a (looser) upper bound of the tight accountant.
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(12):
        n = int(rng.integers(10_000, 100_000))
        k = float(rng.uniform(2, 60))
        eps = float(rng.uniform(0.05, 2.0))
        try:
            plan = plan_proactive(eps, 1 / n, n, k)
        except AccountingError:  # no certified batch size for this draw
            continue
        ledger = dpsgd_ledger(plan["noise_multiplier"], plan["s_max"] / n, plan["T_min"], dataset_size=n)
        assert epsilon(ledger, 1 / n, "proactive").epsilon >= epsilon(ledger, 1 / n, "pld").epsilon
        checked += 1
    assert checked >= 8  # the property was checked on most draws, not skipped


def test_proactive_accountant_on_ledgers():
    n, sigma = 10_000, 19.29962
    ledger = dpsgd_ledger(sigma, 26 / n, 1924, dataset_size=n)
    report = epsilon(ledger, 1e-4, "proactive")
    assert report.certified and report.details["theorem"] == "Thm B.4"
    assert report.epsilon == pytest.approx(eps_from_sigma(sigma, 1e-4))  # (35) binds: T is above T_min
    # Far fewer rounds with huge batches: (34) raises eps until (33)/(32) fail, and it refuses.
    with pytest.raises(AccountingError, match="Thm B.4 cannot certify"):
        epsilon(dpsgd_ledger(sigma, 0.5, 10, dataset_size=n), 1e-4, "proactive")
    with pytest.raises(AccountingError, match="Poisson-sampled Gaussian"):
        epsilon(dpsgd_ledger(sigma, 1.0, 10, sampling="full"), 1e-4, "proactive")
    with pytest.raises(AccountingError, match="data set size"):
        epsilon(dpsgd_ledger(sigma, 0.01, 10), 1e-4, "proactive")


def test_increasing_batch_sizes_have_theta_one_plus_p_and_are_certified():
    n, sigma, steps = 10_000, 19.29962, 4000
    for p in (0.0, 1.0, 2.0):
        sizes = increasing_sample_sizes(13, steps, p, n)
        assert sizes.mean() == pytest.approx(13)
        assert sizes.max() / sizes.mean() == pytest.approx(1 + p, rel=2e-3)
    sizes = increasing_sample_sizes(13, 250, 1.0, n)  # 250 distinct steps: theta = 500/251
    ledger = Ledger()
    for s in sizes:
        ledger.record(
            gaussian_step_event(sigma, "poisson", sampling_rate=s / n),
            step_facts("poisson", s / n, dataset_size=n),
        )
    report = epsilon(ledger, 1e-4, "proactive")
    assert report.details["theta"] == pytest.approx(500 / 251, rel=1e-9)
    assert report.epsilon >= epsilon(ledger, 1e-4, "pld").epsilon


def test_b4_certification_is_the_smallest_eps_meeting_all_conditions():
    n, sigma, delta = 10_000, 19.29962, 1e-4
    sizes = SampleSizes.constant(40, 1250, n)  # fewer rounds than T_min at eps(35): (34) binds
    eps, report = certify_theorem_b4(sigma, delta, sizes)
    assert report.holds and eps > eps_from_sigma(sigma, delta)
    assert not check_theorem_b4(eps * 0.999, delta, sigma, sizes).holds


def test_full_calculator_grows_the_batch_with_the_budget():
    n, phase = 10_000, 50_000
    small = dp_calculator_full(n, phase, eps_target=0.1, s_limit=600)
    large = dp_calculator_full(n, phase, eps_target=0.3, s_limit=600)
    assert 1 <= small["s"] < large["s"]
    assert small["epsilon"] <= 0.1 and large["epsilon"] <= 0.3
    for r in (small, large):
        sizes = SampleSizes.constant(r["s"], math.ceil(phase / r["s"]), n)
        assert check_theorem_b4(r["epsilon"], 1 / n, r["noise_multiplier"], sizes).holds
    # A later phase with a smaller sigma, earlier rounds treated as if they used it (App. E): still accepted
    # only within the target.
    later = dp_calculator_full(
        n,
        phase,
        eps_target=0.5,
        previous=[(small["s"], round(phase / small["s"]))],
        sigma=small["noise_multiplier"] * 0.8,
        s_limit=600,
    )
    assert later["epsilon"] <= 0.5 and later["theta"] >= 1


def test_plan_cli_side_by_side_and_json(capsys):
    assert (
        main(
            [
                "plan",
                "--epsilon",
                "0.05",
                "--delta",
                "1e-4",
                "--dataset-size",
                "10000",
                "--epochs",
                "5",
                "--accountant",
                "all",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    by = {p["accountant"]: p for p in out["plans"]}
    assert set(by) == {"proactive", "rdp", "pld", "gdp"}
    assert out["tightest"] == "pld" and out["s_max"] == by["pld"]["s_max"]
    assert by["proactive"]["s_max"] < by["rdp"]["s_max"] <= by["pld"]["s_max"]
    assert not by["gdp"]["certified"]
    for key in ("epsilon", "noise_multiplier", "gamma", "T_min", "s_max"):
        assert key in by["proactive"]
    assert (
        main(
            [
                "plan",
                "--from-sigma",
                "19.29962",
                "--dataset-size",
                "10000",
                "--epochs",
                "5",
                "--gamma",
                "paper",
                "--json",
            ]
        )
        == 0
    )
    d4 = json.loads(capsys.readouterr().out)
    assert (d4["s_max"], d4["s_max_asym"]) == (26, 198)
    for key in ("epsilon", "noise_multiplier", "gamma", "T_min", "s_max", "T_min_asym", "s_max_asym"):
        assert key in d4


def test_train_runs_exactly_the_plan(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--epsilon",
                "2",
                "--delta",
                "1e-5",
                "--dataset-size",
                "1600",
                "--epochs",
                "2",
                "--accountant",
                "rdp",
                "--json",
            ]
        )
        == 0
    )
    plan_path.write_text(capsys.readouterr().out)
    plan = json.loads(plan_path.read_text())
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[data]\nname = "synthetic"\n[model]\nname = "logistic"\n[privacy]\ntarget_epsilon = 9.0\n'
    )
    assert (
        main(
            [
                "train",
                "--config",
                str(cfg),
                "--plan",
                str(plan_path),
                "--out",
                str(tmp_path / "run"),
                "--no-progress",
                "--json",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == plan["T_min"] and summary["noise_multiplier"] == plan["noise_multiplier"]
    assert summary["sampling_rate"] == pytest.approx(plan["s_max"] / 1600)
    assert summary["epsilon"] == pytest.approx(plan["epsilon"]) and summary["epsilon"] <= 2.0


def test_utility_graph_cli(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[data]\nname = "synthetic"\noptions = { n = 400, dim = 8 }\n[model]\nname = "logistic"\n'
        "[privacy]\nnoise_multiplier = 1.0\n[training]\nsteps = 40\nbatch_size = 32\nlearning_rate = 0.5\n"
    )
    out = tmp_path / "ug"
    with warnings.catch_warnings(record=True) as caught:  # (the graph says it is not private: no warning besides)
        warnings.simplefilter("always")
        code = main(
            [
                "utility-graph",
                "--config",
                str(cfg),
                "--clips",
                "0.5,1",
                "--sigmas",
                "0,2,50",
                "--draws",
                "2",
                "--out",
                str(out),
                "--json",
            ]
        )
    assert code == 0 and not [w for w in caught if issubclass(w.category, NotPrivateWarning)]
    data = json.loads(capsys.readouterr().out)
    assert set(data["largest_sigma"]) == {"0.5", "1.0"}
    assert (out / "utility_graph.png").stat().st_size > 1000
    # w* is trained on the data without noise: every output says so itself (shared alone, a file must not look private)
    assert data["private"] is False and "without noise" in data["not_private_because"][0]
    assert json.loads((out / "utility_graph.json").read_text()) == data
    assert b"NOT private" in (out / "utility_graph.png").read_bytes()
    assert main(["utility-graph", "--config", str(cfg), "--clips", "0,1", "--sigmas", "0,1"]) == 2
    assert "clips" in capsys.readouterr().err


def test_reproduce_cli_rejects_unknown_names(capsys):
    assert main(["reproduce", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
