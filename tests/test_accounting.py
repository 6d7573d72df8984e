"""Accounting: reference values, refusals, ledger persistence, calibration and budget inversion."""

import json
import math

import dp_accounting as dpa
import pytest

from dptrain.accounting import (
    Ledger,
    accountant_names,
    calibrate_dpsgd_noise,
    certified_epsilon,
    dpsgd_ledger,
    epsilon,
    gaussian_step_event,
    max_releases,
    step_facts,
)
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon, mu_poisson_clt, mu_uniform_clt
from dptrain.errors import AccountingError, DataError

Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14062, 1e-5


def test_registry_has_standard_accountants_in_order():
    assert accountant_names()[:3] == ("rdp", "pld", "gdp")
    with pytest.raises(AccountingError, match="unknown accountant 'nope'; accepted: rdp, pld, gdp"):
        epsilon(Ledger(), DELTA, "nope")


def test_reference_values_from_dp_accounting():
    # The issue's reference point (Abadi et al.'s MNIST setting): RDP ~2.5966, PLD ~2.38.
    ledger = dpsgd_ledger(SIGMA, Q, STEPS)
    assert epsilon(ledger, DELTA, "rdp").epsilon == pytest.approx(2.5966, abs=5e-4)
    assert epsilon(ledger, DELTA, "pld").epsilon == pytest.approx(2.38, abs=0.01)


@pytest.mark.parametrize(
    "sigma,q,steps", [(1.1, Q, STEPS), (30.0, 0.01, 100), (100.0, 1.0, 1), (300.0, 0.1, 10), (0.8, 0.01, 1000)]
)
def test_rdp_tries_the_large_orders_only_where_they_can_win(sigma, q, steps):
    # dptrain's rdp skips orders above 768 unless the optimum is near them: its epsilon equals dp_accounting's
    # over every order (the large-sigma cases have their optimum among the large orders)
    from dp_accounting.rdp import RdpAccountant

    from dptrain.accounting.standard import RDP_ORDERS

    acc = RdpAccountant(RDP_ORDERS)
    acc.compose(dpa.GaussianDpEvent(sigma) if q == 1 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)),
                steps)
    full, order = acc.get_epsilon_and_optimal_order(DELTA)
    ledger = dpsgd_ledger(sigma, q, steps, sampling="full" if q == 1 else "poisson")
    assert epsilon(ledger, DELTA, "rdp").epsilon == pytest.approx(full, rel=1e-12)


def test_pld_is_tighter_than_rdp_and_gdp_is_flagged_approximate():
    ledger = dpsgd_ledger(SIGMA, Q, STEPS)
    rdp, pld, gdp = (epsilon(ledger, DELTA, a) for a in ("rdp", "pld", "gdp"))
    assert pld.epsilon < rdp.epsilon
    assert rdp.certified and pld.certified and not gdp.certified
    with pytest.raises(AccountingError, match="only an approximation"):
        certified_epsilon(ledger, DELTA, "gdp")


def test_gdp_full_batch_is_exact_and_agrees_with_pld():
    # T full-batch Gaussian steps: exactly (sqrt(T)/sigma)-GDP; PLD of the Gaussian is exact up to its
    # pessimistic discretization, so the two agree closely and PLD is never below.
    ledger = dpsgd_ledger(20.0, 1.0, 50, sampling="full")
    gdp, pld = epsilon(ledger, DELTA, "gdp"), epsilon(ledger, DELTA, "pld")
    assert gdp.certified
    assert gdp.details["mu"] == pytest.approx(math.sqrt(50) / 20.0)
    assert pld.epsilon == pytest.approx(gdp.epsilon, rel=2e-3)
    assert pld.epsilon >= gdp.epsilon - 1e-9


def test_gdp_delta_matches_direct_formula_and_inverts():
    # Dong-Roth-Su Cor. 2.13 evaluated directly (no log-space tricks) at moderate values.
    from scipy.stats import norm

    mu, eps = 0.8, 1.3
    direct = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    assert gdp_delta(eps, mu) == pytest.approx(direct, rel=1e-10)
    assert gdp_epsilon(mu, direct) == pytest.approx(eps, rel=1e-8)


@pytest.mark.parametrize(
    "sigma,n,k,s,uniform,poisson",
    [
        # van Dijk et al., "Proactive DP", Tables 9-11, f-DP epsilon at T_min: uniform-sampling CLT (eq. 64/65),
        # and its Poisson-sampling variant (our own computation, not in the paper). delta = 1/N, T = kN/s.
        (19.29962, 1e4, 5, 26, 0.0105, 0.0103),
        (12.10881, 6e4, 6, 288, 0.0389, 0.0375),
        (6.572, 5e4, 7, 406, 0.1132, 0.1062),
    ],
)
def test_gdp_clt_reproduces_seed_002_tables(sigma, n, k, s, uniform, poisson):
    steps = k * n / s
    assert gdp_epsilon(mu_uniform_clt(sigma, s / n, steps), 1 / n) == pytest.approx(uniform, abs=1e-4)
    assert gdp_epsilon(mu_poisson_clt(sigma, s / n, steps), 1 / n) == pytest.approx(poisson, abs=1e-4)


def test_accountants_refuse_what_they_cannot_certify():
    # Fixed-size sampling without replacement is defined under replace-one adjacency; dp_accounting's
    # RDP and PLD do not cover it under add/remove, and must refuse rather than return a number.
    ledger = Ledger()
    event = gaussian_step_event(1.0, "fixed_size_without_replacement", dataset_size=1000, batch_size=10)
    ledger.record(event, step_facts("fixed_size_without_replacement", 0.01), 100)
    for name in ("rdp", "pld"):
        with pytest.raises(AccountingError, match=f"the {name} accountant cannot certify this ledger"):
            epsilon(ledger, DELTA, name)
    # Under replace-one adjacency rdp certifies it; pld refuses, and says what it covers without claiming this ledger
    # (the attacker row of such a run quotes this refusal as why there is no bound)
    fixed = Ledger(neighboring="replace_one")
    fixed.record(event, step_facts("fixed_size_without_replacement", 0.01), 100)
    assert epsilon(fixed, DELTA, "rdp").certified
    with pytest.raises(AccountingError, match="the pld accountant cannot certify this ledger") as e:
        epsilon(fixed, DELTA, "pld")
    covers = str(e.value).split("; it covers")[1]
    assert "replace-one" not in covers and "use rdp" in covers
    # A Laplace release is outside the gdp accountant's vocabulary.
    lap = Ledger()
    lap.record(dpa.LaplaceDpEvent(1.0), {"mechanism": "laplace"})
    with pytest.raises(AccountingError, match="gdp accountant cannot interpret LaplaceDpEvent"):
        epsilon(lap, DELTA, "gdp")


def test_bad_delta_and_noise_are_refused():
    ledger = dpsgd_ledger(1.0, 0.01, 10)
    for bad in (0, 1, 1.5, -1e-5, float("nan")):
        with pytest.raises(AccountingError, match="delta must be in"):
            epsilon(ledger, bad)
    with pytest.raises(AccountingError, match="noise multiplier must be"):
        dpsgd_ledger(-1.0, 0.01, 10)
    with pytest.raises(AccountingError, match="sampling rate must be in"):
        dpsgd_ledger(1.0, 1.5, 10)


def test_ledger_merges_identical_steps_and_round_trips_json(tmp_path):
    ledger = Ledger()
    e1, f1 = gaussian_step_event(1.0, "poisson", sampling_rate=0.01), step_facts("poisson", 0.01)
    e2, f2 = gaussian_step_event(2.0, "poisson", sampling_rate=0.01), step_facts("poisson", 0.01)
    for _ in range(5):
        ledger.record(e1, f1)
    ledger.record(e2, f2, count=3)
    ledger.record(e1, f1)
    assert [e.count for e in ledger.entries] == [5, 3, 1] and ledger.releases == 9
    path = tmp_path / "ledger.json"
    ledger.save(path)
    loaded = Ledger.load(path)
    assert loaded.dp_event() == ledger.dp_event()
    assert epsilon(loaded, DELTA).epsilon == epsilon(ledger, DELTA).epsilon
    # The composed event is dp_accounting's own vocabulary.
    assert isinstance(ledger.dp_event(), dpa.ComposedDpEvent)


def test_corrupt_ledger_file_is_a_clear_error(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text(
        '{"format": "dptrain-ledger/1", "entries": [{"event": {"type": "os.system"}, "count": 1}]}'
    )
    with pytest.raises(DataError, match="ledger.json is corrupt"):
        Ledger.load(path)
    path.write_text(json.dumps({"format": "dptrain-ledger/1", "entries": []})[:-5])
    with pytest.raises(DataError, match="ledger.json is corrupt"):
        Ledger.load(path)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_round_trips(accountant):
    q, steps, target = 0.01, 500, 1.5
    sigma = calibrate_dpsgd_noise(target, DELTA, q, steps, accountant)
    spent = epsilon(dpsgd_ledger(sigma, q, steps), DELTA, accountant).epsilon
    assert spent <= target
    assert spent == pytest.approx(target, rel=1e-3)
    # Smallest: a noise 0.5% lower exceeds the budget.
    assert epsilon(dpsgd_ledger(sigma * 0.995, q, steps), DELTA, accountant).epsilon > target


def test_calibration_recovers_known_sigma():
    eps = epsilon(dpsgd_ledger(SIGMA, Q, STEPS), DELTA, "rdp").epsilon
    assert calibrate_dpsgd_noise(eps, DELTA, Q, STEPS, "rdp") == pytest.approx(SIGMA, rel=1e-5)


def test_calibration_refuses_unreachable_budget():
    with pytest.raises(AccountingError, match="cannot be met"):
        calibrate_dpsgd_noise(1e-9, DELTA, 1.0, 10**6, "rdp", sampling="full")


def test_max_releases_is_the_exact_boundary():
    q, sigma, target = 0.02, 1.0, 2.0
    event = gaussian_step_event(sigma, "poisson", sampling_rate=q)
    facts = step_facts("poisson", q)
    start = dpsgd_ledger(sigma, q, 10)
    n = max_releases(lambda m: start.extended(event, facts, m), target, DELTA, "rdp")
    assert epsilon(start.extended(event, facts, n), DELTA, "rdp").epsilon <= target
    assert epsilon(start.extended(event, facts, n + 1), DELTA, "rdp").epsilon > target
    # A ledger already over budget allows nothing.
    over = dpsgd_ledger(sigma, q, 10**5)
    assert max_releases(lambda m: over.extended(event, facts, m), target, DELTA) == 0


def test_reports_are_memoized_by_what_the_accountant_reads():
    """epsilon() caches reports by ledger content; facts an accountant does not read (rdp/pld read none) do not
    split the cache, while a different event does not hit it."""
    import dptrain.accounting.base as base
    from dptrain.accounting import Ledger, epsilon, gaussian_step_event

    def ledger(sigma, clip):
        event = gaussian_step_event(sigma, "poisson", sampling_rate=0.01)
        return Ledger().extended(event, {"mechanism": "dpsgd", "clip_norm": clip}, 500)

    a, b, c = ledger(1.3, 1.0), ledger(1.3, 7.0), ledger(1.31, 1.0)  # b: same events, another fact
    first = epsilon(a, 1e-5, "pld")
    assert epsilon(b, 1e-5, "pld") is first
    assert epsilon(c, 1e-5, "pld").epsilon < first.epsilon
    assert base._content_key(a, None) != base._content_key(b, None)  # accountants that read facts see them


def test_the_vectorised_gaussian_pld_is_dp_accountings_bit_for_bit():
    """dptrain builds each Gaussian release's PLD with a vectorised privacy loss (standard._VectorizedGaussianLoss):
    the PMFs must be exactly dp_accounting's, for add/remove and replace-one, with and without sampling."""
    import dp_accounting as dpa
    import numpy as np
    from dp_accounting.pld import privacy_loss_distribution

    from dptrain.accounting.standard import _gaussian_pld

    cases = [(0.59, 0.004, "a"), (1.1, 0.5, "a"), (0.3, 1e-5, "a"), (2.0, 1.0, "a"), (0.8, 1.0, "r")]
    for std, q, adj in cases:
        rel = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if adj == "a" else dpa.NeighboringRelation.REPLACE_ONE
        ours = _gaussian_pld(std, q, 1e-3, rel)
        theirs = privacy_loss_distribution.from_gaussian_mechanism(
            std, value_discretization_interval=1e-3, sampling_prob=q, neighboring_relation=rel
        )
        for a, b in ((ours._pmf_remove, theirs._pmf_remove), (ours._pmf_add, theirs._pmf_add)):
            a, b = a.to_dense_pmf(), b.to_dense_pmf()
            assert a._lower_loss == b._lower_loss and np.array_equal(a._probs, b._probs), (std, q, adj)
            assert a._infinity_mass == b._infinity_mass


def test_truncation_bounds_are_dp_accountings():
    """The size prediction's Chernoff bounds (standard._self_convolve_bounds) equal dp_accounting's own."""
    import numpy as np
    from dp_accounting.pld import common

    from dptrain.accounting import standard

    rng = np.random.default_rng(0)
    for n, count in ((100, 10), (3000, 234), (9000, 14062), (300, 1)):
        p = rng.random(n)
        p /= p.sum() * 1.0001
        ours, theirs = standard._self_convolve_bounds(p, count), common.compute_self_convolve_bounds(p, count, 1e-15)
        assert abs(ours[0] - theirs[0]) <= 1 and abs(ours[1] - theirs[1]) <= 1  # a size prediction: +-1 point


def test_self_composition_matches_dp_accountings():
    """standard._self_composed (our truncation bounds, widened by one point) gives dp_accounting's self-composition:
    the same losses where dp_accounting keeps them, the same probabilities to rounding, a superset of its support,
    and the same epsilon."""
    import numpy as np

    from dptrain.accounting import standard

    for std, q, count, relation in ((0.59, 256 / 60000, 234, "add_or_remove_one"), (1.1, 0.01, 1000, "replace_one"), (2.0, 0.3, 3, "add_or_remove_one")):
        step = standard._gaussian_step(std, q, 1e-3, standard.NEIGHBORING[relation])
        ours, theirs = standard._self_composed(step, count), step.self_compose(count)
        for a, b in ((ours._pmf_remove, theirs._pmf_remove), (ours._pmf_add, theirs._pmf_add)):
            offset = b._lower_loss - a._lower_loss
            assert 0 <= offset <= 1 and a.size - offset >= b.size
            assert np.allclose(a._probs[offset : offset + b.size], b._probs, rtol=1e-9, atol=1e-300)
            assert a._infinity_mass == b._infinity_mass
        assert abs(ours.get_epsilon_for_delta(1e-5) - theirs.get_epsilon_for_delta(1e-5)) < 1e-12
