"""Accountants at the edges: noise too small for a finite epsilon, and PLDs too large for memory.

Every accountant either returns a certified number or refuses in one line (AccountingError); none may crash,
exhaust memory or return a number that is not an upper bound.
"""

import json
import math
import os
import resource
import subprocess
import sys

import pytest

from dptrain.accounting import dpsgd_ledger, epsilon
from dptrain.accounting.standard import EPSILON_MAX, PLD_INTERVAL, PldAccountant
from dptrain.cli import main
from dptrain.errors import AccountingError

DELTA = 1e-5
TOO_SMALL = "the noise is too small for a finite epsilon"
ACCOUNTANTS = ("rdp", "pld", "gdp", "proactive")


def account(sigma, q, steps, accountant, *extra):
    return main(
        [
            "account",
            "--noise-multiplier",
            str(sigma),
            "--sampling-rate",
            str(q),
            "--steps",
            str(steps),
            "--delta",
            str(DELTA),
            "--accountant",
            accountant,
            *extra,
        ]
    )


# --- noise too small ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_absurdly_small_noise_is_one_line_refusal_from_every_accountant(accountant, capsys):
    with pytest.raises(AccountingError, match=TOO_SMALL):
        epsilon(dpsgd_ledger(1e-9, 0.01, 100), DELTA, accountant)
    assert account(1e-9, 0.01, 100, accountant) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dptrain: error: {TOO_SMALL}") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("sigma", [1e-300, 1e-160, 1e-5])
@pytest.mark.parametrize("sampling", ["poisson", "full"])
def test_far_too_small_noise_never_gives_a_number(sigma, sampling):
    # At sigma = 1e-160 dp_accounting's RDP overflows to epsilon = 0; at 1e-300 it divides by zero.
    for name in ("rdp", "pld", "gdp"):
        with pytest.raises(AccountingError, match=TOO_SMALL):
            epsilon(dpsgd_ledger(sigma, 0.01 if sampling == "poisson" else 1.0, 100, sampling), DELTA, name)


def test_absurdly_large_noise_is_a_number_or_one_line_refusal():
    for name in ("rdp", "pld", "gdp"):
        for sigma, q in [(1e300, 1e-9), (1e300, 0.5), (1e100, 0.01)]:
            try:
                assert epsilon(dpsgd_ledger(sigma, q, 10**6), DELTA, name).epsilon == pytest.approx(
                    0, abs=1e-6
                )
            except AccountingError as e:
                assert "\n" not in str(e)


def test_account_all_lists_the_refusals(capsys):
    assert account(1e-9, 0.01, 100, "all", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["epsilon"] is None and out["all"] == []
    for name in ACCOUNTANTS:
        assert out["refused"][name].startswith(TOO_SMALL)


@pytest.mark.parametrize("sigma", [1e-3, 1e-2, 1e6])
def test_small_and_huge_noise_give_a_valid_number_or_a_refusal(sigma, capsys):
    q, steps = 0.01, 100
    found = {}
    for name in ("rdp", "pld", "gdp"):
        try:
            found[name] = epsilon(dpsgd_ledger(sigma, q, steps), DELTA, name).epsilon
        except AccountingError as e:
            assert "\n" not in str(e)
    for eps in found.values():
        assert 0 <= eps <= EPSILON_MAX
    if sigma < 1:
        # A valid lower bound (the other examples contributing 0): the event "some output is >= 1/2" has
        # probability >= (1 - (1 - q)^T) Phi(1/(2 sigma)) with the example and <= T Phi(-1/(2 sigma)) without it.
        phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
        present = (1 - (1 - q) ** steps) * phi(0.5 / sigma)
        log_absent = max(math.log(steps) + math.log(phi(-0.5 / sigma) or 1e-300), -700)
        lower = math.log(present - DELTA) - log_absent
        for eps in found.values():
            assert eps >= lower
    else:
        assert found["rdp"] == pytest.approx(0, abs=1e-6) and found["pld"] == pytest.approx(0, abs=1e-6)
    assert account(sigma, q, steps, "all") == 0  # never a traceback
    capsys.readouterr()


def test_calibration_treats_the_refusal_as_infinite_epsilon():
    # A loose budget makes calibration probe small noise multipliers: the refusals read as epsilon = infinity.
    from dptrain.accounting import calibrate_dpsgd_noise

    sigma = calibrate_dpsgd_noise(500.0, DELTA, 0.01, 100, "rdp")
    assert epsilon(dpsgd_ledger(sigma, 0.01, 100), DELTA, "rdp").epsilon <= 500.0
    # A budget above the cap an infinite epsilon was read as (1e6) used to leave the root search no sign change.
    sigma = calibrate_dpsgd_noise(1e7, DELTA, 0.01, 100, "rdp")
    assert epsilon(dpsgd_ledger(sigma, 0.01, 100), DELTA, "rdp").epsilon <= 1e7


# --- the PLD's size -----------------------------------------------------------------------------------------


def test_ordinary_ledgers_keep_the_1e_4_interval_and_their_numbers():
    # docs/cli.md: pld for Abadi et al.'s MNIST setting is 2.3817 at the interval 1e-4.
    report = epsilon(dpsgd_ledger(1.1, 0.0042666666666666667, 14062), DELTA, "pld")
    assert report.epsilon == pytest.approx(2.3817, abs=5e-5)
    assert report.details["discretization"] == PLD_INTERVAL
    # Up to 10^6 steps: what dp_accounting says at today's interval, to 1e-11. (Our self-composition keeps one more
    # point at each end than dp_accounting's truncation and may take another FFT length: the two differ by the FFT's
    # rounding, not always on the same side: 28.906374457711 ours against 28.906374457746 theirs on one AMD EPYC,
    # 1.2e-12 apart.)
    import dp_accounting as dpa
    from dp_accounting.pld import pld_privacy_accountant

    ledger = dpsgd_ledger(1.1, 0.004, 10**6)
    direct = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    direct.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.004, dpa.GaussianDpEvent(1.1)), 10**6))
    report = epsilon(ledger, DELTA, "pld")
    theirs = direct.get_epsilon(DELTA)
    assert report.details["discretization"] == PLD_INTERVAL and report.epsilon == pytest.approx(theirs, rel=1e-11)


def test_a_coarser_interval_is_looser_never_below():
    ledger = dpsgd_ledger(1.1, 0.004, 5000)
    fine = PldAccountant().report(ledger, DELTA)
    coarse = PldAccountant(value_discretization_interval=1e-2).report(ledger, DELTA)
    assert coarse.details["discretization"] == 1e-2
    assert fine.epsilon <= coarse.epsilon <= epsilon(ledger, DELTA, "rdp").epsilon * 1.5


def test_long_runs_get_a_coarser_interval_and_stay_below_rdp():
    ledger = dpsgd_ledger(1.1, 0.004, 10**9)
    pld, rdp = epsilon(ledger, DELTA, "pld"), epsilon(ledger, DELTA, "rdp")
    assert 1e-4 < pld.details["discretization"] <= 1e-2 and pld.epsilon <= rdp.epsilon
    # Poisson sampling with a tiny rate: the composed PMF (19e6 points at 1e-4) is what sets the interval.
    assert epsilon(dpsgd_ledger(0.3, 1e-9, 10**9), DELTA, "pld").details["discretization"] > PLD_INTERVAL


def test_unaffordable_pld_refuses_in_one_line_pointing_to_rdp():
    for ledger in (dpsgd_ledger(1.1, 0.004, 10**12), dpsgd_ledger(1e-3, 0.01, 100)):
        with pytest.raises(AccountingError, match="pld accountant cannot compose .*; use rdp$"):
            epsilon(ledger, DELTA, "pld")


def test_long_runs_of_tiny_steps_compose_quickly():
    # One step of sigma = 5, q = 0.001 spans 72 points of 1e-4, which dp_accounting keeps sparse and, composing it
    # 10^7 times, first computed 72**(10^7) as an integer (about a minute); densified, it takes a second.
    ledger = dpsgd_ledger(5.0, 0.001, 10**7)
    report = epsilon(ledger, DELTA, "pld")
    assert report.details["discretization"] == PLD_INTERVAL
    assert report.epsilon <= epsilon(ledger, DELTA, "rdp").epsilon


@pytest.mark.slow
def test_a_billion_steps_fit_in_2_gb_of_address_space():
    """The reviewer's command needed about 6.5 GB; under a 2 GB address-space limit it must finish (0) or refuse
    (2) (within the subprocess timeout)."""
    limit = 2 * 2**30

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    argv = [sys.executable, "-m", "dptrain.cli", "account", "--noise-multiplier", "1.1", "--sampling-rate"]
    argv += ["0.004", "--steps", str(10**9), "--delta", "1e-5", "--accountant", "all", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(argv, preexec_fn=cap_memory, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode in (0, 2), proc.stderr[-2000:]
    assert "MemoryError" not in proc.stderr and "Traceback" not in proc.stderr
    if proc.returncode == 0:
        out = json.loads(proc.stdout)
        pld = next(r for r in out["all"] if r["accountant"] == "pld")
        assert pld["discretization"] > PLD_INTERVAL
