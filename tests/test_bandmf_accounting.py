"""BandMF in the ledger (dptrain.accounting.bandmf_ledger, bandmf_sensitivity): pld and rdp certify exactly the
equivalent DP-SGD event ceil(T/b) x PoissonSampled(min(1, b q), Gaussian(sigma)) (b not dividing T, a ledger built
across a stop and resume, other releases before it, b = 1), every other accountant refuses, malformed entries are
refused, and calibration and budgets work on it."""

import math

import dp_accounting as dpa
import numpy as np
import pytest

from dptrain.accounting import (
    Ledger,
    TrialCount,
    accountant_names,
    bandmf_ledger,
    bandmf_sensitivity,
    bandmf_step,
    bandmf_step_index,
    calibrate,
    calibrate_dpsgd_noise,
    dpsgd_ledger,
    epsilon,
    max_releases,
    optimal_coefficients,
    participation_sensitivity,
    register_accountant,
    search_report,
)
from dptrain.accounting import base as accounting_base
from dptrain.accounting.bandmf_sensitivity import column_norms, worst_group_participations
from dptrain.accounting.ledger import LedgerEntry, training_steps
from dptrain.errors import AccountingError

DELTA, SIGMA, Q = 1e-5, 2.0, 0.02  # sigma 2: pld's grids are small, the tests fast


def _coefficients(bands: int) -> np.ndarray:
    return optimal_coefficients(64, bands)


def _equivalent(sigma: float, q: float, steps: int, bands: int) -> Ledger:
    """The DP-SGD ledger BandMF must be certified as, written out independently of bandmf_ledger."""
    rate = min(1.0, bands * q)
    return dpsgd_ledger(sigma, rate, math.ceil(steps / bands), "poisson" if rate < 1 else "full")


@pytest.mark.parametrize("steps,bands", [(96, 4), (100, 8), (10, 3), (7, 16)])
def test_pld_and_rdp_certify_the_equivalent_dpsgd_event(steps, bands):
    # (100, 8), (10, 3): b does not divide T, the worst group takes part ceil(T/b) = 13 and 4 times; (7, 16): b q > 1
    # (group rate 1, unsampled Gaussians) and fewer steps than bands
    q = Q if bands * Q <= 1 else 0.1
    ledger = bandmf_ledger(SIGMA, q, steps, _coefficients(bands) if bands <= 8 else np.eye(bands)[0])
    assert ledger.releases == steps and len(ledger.entries) == 1  # one entry, count = steps
    equivalent = _equivalent(SIGMA, q, steps, bands)
    assert ledger.dp_event() == equivalent.dp_event()
    for name in ("pld", "rdp"):
        assert epsilon(ledger, DELTA, name).epsilon == epsilon(equivalent, DELTA, name).epsilon


def test_never_all_t_steps_nor_fewer_than_the_worst_groups_participations():
    eps = epsilon(bandmf_ledger(SIGMA, Q, 100, _coefficients(8)), DELTA, "pld").epsilon
    assert eps < epsilon(dpsgd_ledger(SIGMA, 8 * Q, 100), DELTA, "pld").epsilon  # b times too many compositions
    assert eps > epsilon(dpsgd_ledger(SIGMA, 8 * Q, 12), DELTA, "pld").epsilon  # floor(T/b): group 0 takes part 13 times


def test_one_band_is_dpsgd_exactly():
    ledger, dpsgd = bandmf_ledger(1.1, Q, 300, [1.0]), dpsgd_ledger(1.1, Q, 300)
    assert ledger.dp_event() == dpsgd.dp_event()
    for name in ("pld", "rdp"):
        assert epsilon(ledger, DELTA, name).epsilon == epsilon(dpsgd, DELTA, name).epsilon


def test_a_run_stopped_and_resumed_is_one_run(tmp_path):
    c, bands, steps = _coefficients(8), 8, 100
    event, facts = bandmf_step(SIGMA, Q, c, clip_norm=1.0, dataset_size=5000)
    ledger, groups = Ledger(), []
    for _ in range(37):
        groups.append(bandmf_step_index(ledger, event, facts) % bands)
        ledger.record(event, facts)
    ledger.save(tmp_path / "ledger.json")
    resumed = Ledger.load(tmp_path / "ledger.json")
    assert bandmf_step_index(resumed, event, facts) == 37  # the next step is step 37 of the run: group 5
    for _ in range(steps - 37):
        groups.append(bandmf_step_index(resumed, event, facts) % bands)
        resumed.record(*bandmf_step(SIGMA, Q, c, clip_norm=1.0, dataset_size=5000))
    assert groups == [t % bands for t in range(steps)]
    assert resumed.to_dict() == bandmf_ledger(SIGMA, Q, steps, c, clip_norm=1.0, dataset_size=5000).to_dict()
    assert training_steps(resumed) == steps
    for name in ("pld", "rdp"):
        assert epsilon(resumed, DELTA, name).epsilon == epsilon(_equivalent(SIGMA, Q, steps, bands), DELTA, name).epsilon


def test_other_releases_before_and_between_runs():
    c = _coefficients(4)
    mean = (dpa.GaussianDpEvent(5.0), {"mechanism": "private_mean", "noise_multiplier": 5.0, "delta": 1e-6})
    ledger = Ledger()
    ledger.record(*mean)  # DPSGD-F's private feature mean, then the training run
    event, facts = bandmf_step(SIGMA, Q, c)
    ledger.record(event, facts, 50)
    reference = Ledger()
    reference.record(*mean)
    for e in _equivalent(SIGMA, Q, 50, 4).entries:
        reference.record(e.event, e.facts, e.count)
    for name in ("pld", "rdp", "composition"):  # composition: the mean at its own delta, the training phase by pld
        assert epsilon(ledger, DELTA, name).epsilon == pytest.approx(epsilon(reference, DELTA, name).epsilon, rel=1e-12)
    # a release between two stretches of steps starts a new entry: a new run (group cycle and noise history
    # restarted, bandmf_step_index = 0), the two runs composed
    ledger.record(dpa.GaussianDpEvent(20.0), {"mechanism": "evaluation"})
    assert bandmf_step_index(ledger, event, facts) == 0
    ledger.record(event, facts, 50)
    assert [e.compositions for e in ledger.entries] == [1, 13, 1, 13]


def test_every_other_accountant_refuses_in_one_line():
    ledger = bandmf_ledger(SIGMA, Q, 100, _coefficients(8))
    covering = {"rdp", "pld", "composition"}
    assert {"gdp", "proactive", "last_iterate", "modelmix", "filter"} <= set(accountant_names()) - covering
    for name in set(accountant_names()) - covering:
        with pytest.raises(AccountingError, match=f"the {name} accountant cannot certify banded matrix") as info:
            epsilon(ledger, DELTA, name)
        assert "\n" not in str(info.value)
    with pytest.raises(AccountingError, match="preprocessing phases"):  # composition: nothing to compose without them
        epsilon(ledger, DELTA, "composition")
    assert epsilon(ledger, DELTA).accountant == "pld"  # auto: the tightest that certifies it

    class Naive:  # an accountant registered later that reads counts as releases: refused before it reads anything
        name, description, facts_used = "naive_test", "counts every step", ()

        def report(self, ledger, delta):
            raise AssertionError("a BandMF ledger reached an accountant that does not declare covers_bandmf")

    register_accountant(Naive())
    try:
        with pytest.raises(AccountingError, match="the naive_test accountant cannot certify banded matrix"):
            epsilon(ledger, DELTA, "naive_test")
    finally:
        accounting_base._REGISTRY.pop("naive_test")


def test_a_search_over_bandmf_trials_is_the_search_over_the_equivalent_event():
    trials = TrialCount.named(10, "geometric")
    bandmf = search_report(bandmf_ledger(SIGMA, Q, 100, _coefficients(4)), trials, DELTA, "rdp")
    assert bandmf.search.epsilon == search_report(_equivalent(SIGMA, Q, 100, 4), trials, DELTA, "rdp").search.epsilon


def test_malformed_bandmf_entries_are_refused():
    c = _coefficients(4)
    event, facts = bandmf_step(SIGMA, Q, c)

    def ledger_with(event=event, neighboring="add_or_remove_one", **changes):
        return Ledger([LedgerEntry(event, 40, {**facts, **changes})], neighboring)

    cases = [
        # the overall rate q recorded instead of the group rate b q: 4 times too little sampling would be certified
        (ledger_with(dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(SIGMA))), "group rate"),
        (ledger_with(coefficients=[1.0, 1.0, 0.0, 0.0]), "unit L2 norm"),
        (ledger_with(bands=2), "as many coefficients as groups"),  # 4 bands over 2 groups: overlapping blocks
        (ledger_with(bands=0), "bands, an integer >= 1"),
        (ledger_with(sampling="poisson"), "cyclic_poisson"),
        (ledger_with(neighboring="replace_one"), "add/remove-one adjacency"),
    ]
    for ledger, match in cases:
        for name in ("pld", "rdp"):
            with pytest.raises(AccountingError, match=match) as info:
                epsilon(ledger, DELTA, name)
            assert "\n" not in str(info.value)
    for bad, match in [
        (lambda: bandmf_step(SIGMA, Q, 2 * c), "unit L2 norm"),
        (lambda: bandmf_step(SIGMA, 0.0, c), r"sampling rate must be a number in \(0, 1\]"),
        (lambda: bandmf_step(0.0, Q, c), "noise multiplier must be a finite number > 0"),
        (lambda: bandmf_step(SIGMA, Q, c, bands=2), "set from its arguments"),
        (lambda: bandmf_ledger(SIGMA, Q, -1, c), "steps must be an integer >= 0"),
    ]:
        with pytest.raises(AccountingError, match=match):
            bad()


def test_calibration_and_budgets_work_on_bandmf_ledgers():
    c, bands, steps = _coefficients(4), 4, 200
    cal = calibrate(1.0, DELTA, lambda s: bandmf_ledger(s, Q, steps, c))
    assert cal.accountant == "pld" and set(cal.refused) >= {"gdp", "proactive", "modelmix"}
    assert cal.noise_multiplier == pytest.approx(
        calibrate_dpsgd_noise(1.0, DELTA, bands * Q, math.ceil(steps / bands), "pld"), rel=1e-5
    )
    # the most steps a budget allows: the worst group's K participations are K b steps
    k = max_releases(lambda n: dpsgd_ledger(2.0, bands * Q, n), 1.0, DELTA, "pld")
    assert max_releases(lambda n: bandmf_ledger(2.0, Q, n, c), 1.0, DELTA, "pld") == k * bands


def test_sensitivity_is_the_largest_participating_column_and_refuses_overlaps():
    c = _coefficients(4)
    assert bandmf_sensitivity(100, 4, c) == pytest.approx(1.0, abs=1e-14)
    assert bandmf_sensitivity(2, 4, c) == pytest.approx(np.linalg.norm(c[:2]))  # T < b: truncated columns
    assert bandmf_sensitivity(100, 8, c) == pytest.approx(1.0, abs=1e-14)  # fewer bands than groups: fine
    assert column_norms(c, 6) == pytest.approx([1, 1, 1, np.linalg.norm(c[:3]), np.linalg.norm(c[:2]), c[0]])
    assert participation_sensitivity(c, 10, [1, 5, 9]) == pytest.approx(1.0)
    assert participation_sensitivity(c, 10, [8]) == pytest.approx(np.linalg.norm(c[:2]))
    assert worst_group_participations(100, 8) == 13 and worst_group_participations(96, 8) == 12
    for bad, match in [
        (lambda: bandmf_sensitivity(100, 2, c), "C has 4 bands but cyclic participation every 2 steps"),
        (lambda: participation_sensitivity(c, 10, [0, 3]), "participations at steps 0 and 3 are 3 apart"),
        (lambda: participation_sensitivity(c, 10, [0, 10]), r"steps in \[0, 10\)"),
    ]:
        with pytest.raises(AccountingError, match=match) as info:
            bad()
        assert "\n" not in str(info.value)
