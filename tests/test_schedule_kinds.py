"""Noise schedules of "On Dynamic Noise Influence in Differential Private Learning" and their calibration to a
budget: every kind spends exactly its budget (checked independently of the module), the paper's kinds are Lemma 4.1
of their influences (the formulas themselves are tested in test_schedule_bounds.py), long runs, the exact-vs-zCDP
claim, subsampled accounting, errors."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special

from dptrain.accounting import Ledger, epsilon, gaussian_step_event, step_facts
from dptrain.errors import AccountingError, ConfigError
from dptrain.schedules import bounds as B
from dptrain.schedules import kinds as K

RNG = np.random.default_rng(20210)
Q_RANDOM = RNG.uniform(0.05, 3.0, size=60)

#: One parameter set per kind (and form); T = 60 throughout.
CASES = [
    ("uniform", {}),
    ("influence", {"influence": Q_RANDOM}),
    ("gd-optimal", {"kappa": 10}),
    ("gd-optimal", {"gamma": 0.5}),
    ("gd-optimal", {"kappa": 4, "eta": 0.5}),
    ("momentum", {"beta": 0.9, "gamma": 0.99}),
    ("momentum", {"beta": 0.5, "kappa": 20, "eta0": 2.0}),
    ("momentum", {"beta": 0.5, "gamma": 0.9, "form": "two-exponential"}),
    ("momentum", {"beta": 0.5, "gamma": 0.9, "form": "two-exponential", "c1": 3.0, "c2": 0.2}),
    ("exponential", {"rate": 0.05}),
    ("time", {}),
    ("step", {"factor": 0.7, "period": 7}),
    ("polynomial", {"power": 2, "final": 0.2}),
]
IDS = [f"{k}-{i}" for i, (k, _) in enumerate(CASES)]


def gaussian_delta(eps: float, mu: float) -> float:
    """delta(eps) of mu-GDP (Dong, Roth & Su, Cor. 2.13), straight from scipy."""
    return float(special.ndtr(-eps / mu + mu / 2) - math.exp(eps) * special.ndtr(-eps / mu - mu / 2))


def gaussian_epsilon(mu: float, delta: float) -> float:
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, 100.0, xtol=1e-15, rtol=1e-15)


# --- budgets ---------------------------------------------------------------------------------------------------


def test_budgets_in_rho_R_or_epsilon_delta():
    assert K.make_budget(R=0.3927).rho == pytest.approx(0.19635) and K.make_budget(rho=0.1).R == 0.2
    # App. D: (4, 1e-8)-DP is spent as R = 0.3927 under the zCDP accountant
    s = K.calibrate_schedule("gd-optimal", 50, epsilon=4.0, delta=1e-8, accountant="zcdp", kappa=10)
    assert np.sum(s.sigmas**-2.0) == pytest.approx(0.3927, abs=1e-4) and s.epsilon == pytest.approx(
        4.0, rel=1e-12
    )


def test_uniform_matches_theorem_4_2():
    for T in (10, 50, 100):
        s = K.calibrate_schedule("uniform", T, R=0.3927)
        np.testing.assert_allclose(s.sigmas, math.sqrt(T / 0.3927), rtol=1e-12)
    assert K.calibrate_schedule("uniform", 10, R=0.3927).sigmas[0] == pytest.approx(5.046, abs=1e-3)


# --- every kind spends exactly its budget --------------------------------------------------------------------------


@pytest.mark.parametrize("kind,params", CASES, ids=IDS)
def test_every_kind_spends_its_zcdp_budget_exactly(kind, params):
    s = K.calibrate_schedule(kind, 60, R=0.3927, **params)
    spent = np.sum(s.sigmas**-2.0)  # the paper's R: sum of sigma_t^-2
    assert spent == pytest.approx(0.3927, rel=1e-9)
    assert math.fsum(s.sigmas**-2.0) <= 0.3927
    assert s.sigmas.shape == (60,) and np.all(s.sigmas > 0)
    np.testing.assert_allclose(s.sigmas / s.scale, K.schedule_shape(kind, 60, **params), rtol=1e-12)


@pytest.mark.parametrize("kind,params", CASES, ids=IDS)
def test_every_kind_spends_its_epsilon_delta_budget_exactly(kind, params):
    eps, delta = 1.5, 1e-6
    s = K.calibrate_schedule(kind, 60, epsilon=eps, delta=delta, accountant="exact", **params)
    mu = math.sqrt(np.sum(s.sigmas**-2.0))  # full-batch Gaussian steps compose into one mu-GDP mechanism
    assert gaussian_epsilon(mu, delta) == pytest.approx(eps, rel=1e-9)
    assert gaussian_delta(eps, mu) <= delta * (1 + 1e-9)
    # dp_accounting's exact Gaussian hockey-stick divergence at the composed noise multiplier 1/mu.
    assert GaussianPrivacyLoss(1 / mu).get_delta_for_epsilon(eps) == pytest.approx(delta, rel=1e-6)
    assert s.epsilon == pytest.approx(eps, rel=1e-9) and s.epsilon <= eps
    # The zCDP accountant at the same budget: sum 1/(2 sigma^2) = rho(eps, delta).
    z = K.calibrate_schedule(kind, 60, epsilon=eps, delta=delta, accountant="zcdp", **params)
    assert np.sum(z.sigmas**-2.0) == pytest.approx(B.R_from_eps_delta(eps, delta), rel=1e-9)
    np.testing.assert_allclose(z.sigmas / z.scale, s.sigmas / s.scale, rtol=1e-12)  # one common factor


@pytest.mark.parametrize("kind,params", [("uniform", {}), ("gd-optimal", {"kappa": 10}), ("step", {})])
def test_exact_accounting_needs_about_18_percent_less_noise_at_2_and_1e_6(kind, params):
    z = K.calibrate_schedule(kind, 100, epsilon=2.0, delta=1e-6, accountant="zcdp", **params)
    e = K.calibrate_schedule(kind, 100, epsilon=2.0, delta=1e-6, accountant="exact", **params)
    # What the zCDP-calibrated run really spends (exact composition of its Gaussian steps): about 1.6 of 2.
    spent = gaussian_epsilon(math.sqrt(np.sum(z.sigmas**-2.0)), 1e-6)
    assert spent == pytest.approx(1.6106, abs=1e-3)
    assert K.spent_epsilon(z.sigmas, 1e-6, "exact") == pytest.approx(spent, rel=1e-9)
    ratio = e.sigmas / z.sigmas
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-12)
    assert 1 - ratio[0] == pytest.approx(0.18, abs=0.002)


def test_a_zcdp_budget_under_exact_spends_rho():
    s = K.calibrate_schedule("gd-optimal", 40, rho=0.1, accountant="exact", kappa=5)
    assert 0.5 * np.sum(s.sigmas**-2.0) == pytest.approx(0.1, rel=1e-12) and s.epsilon is None
    s = K.calibrate_schedule("uniform", 40, rho=0.1, delta=1e-5, accountant="exact")
    assert s.epsilon == pytest.approx(gaussian_epsilon(math.sqrt(0.2), 1e-5), rel=1e-9)
    assert s.rho == pytest.approx(0.1, rel=1e-12) and s.R == pytest.approx(0.2, rel=1e-12)


# --- the paper's kinds: Lemma 4.1 of their influences ------------------------------------------------------------

#: Each paper kind with the influence (from bounds) that Lemma 4.1 turns into its schedule, T = 60.
PAPER_CASES = [
    ("influence", {"influence": Q_RANDOM}, Q_RANDOM),
    ("gd-optimal", {"kappa": 10}, B.gd_influence(60, 0.9)),
    ("gd-optimal", {"kappa": 4, "eta": 0.5}, B.gd_influence(60, B.gamma_from_kappa(4, 0.5))),
    ("momentum", {"beta": 0.9, "gamma": 0.99}, B.momentum_influence(60, 0.9, 0.99)),
    ("momentum", {"beta": 0.5, "kappa": 20, "eta0": 2.0}, B.momentum_influence(60, 0.5, 0.9)),
    (
        "momentum",
        {"beta": 0.5, "gamma": 0.9, "form": "two-exponential", "c1": 3.0, "c2": 0.2},
        B.momentum_influence_two_exp(60, 0.5, 0.9, c1=3.0, c2=0.2),
    ),
]


@pytest.mark.parametrize(
    "kind,params,q", PAPER_CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PAPER_CASES)]
)
def test_paper_kinds_calibrate_to_lemma_4_1_of_their_influence(kind, params, q):
    R = 0.3927
    np.testing.assert_allclose(K.schedule_shape(kind, 60, **params), (q / q.min()) ** -0.25, rtol=1e-11)
    s = K.calibrate_schedule(kind, 60, R=R, **params)
    np.testing.assert_allclose(s.sigmas, B.optimal_allocation(q, R).sigma, rtol=1e-9)


def test_gd_optimal_is_theorem_4_3_and_decreases():
    T, R, kappa = 50, 0.3927, 10
    s = K.calibrate_schedule("gd-optimal", T, R=R, kappa=kappa)
    np.testing.assert_allclose(s.sigmas, B.gd_optimal_sigma(T, R, kappa=kappa), rtol=1e-9)  # eq. 7
    g = K.calibrate_schedule("gd-optimal", T, R=R, gamma=0.9)
    np.testing.assert_allclose(g.sigmas, s.sigmas, rtol=1e-12)
    assert np.all(np.diff(s.sigmas) < 0)  # the noise decreases
    # another step size: gamma = 1 - eta (2 - eta)/kappa, sigma_{t+1}/sigma_t = gamma^(1/4)
    h = K.schedule_shape("gd-optimal", T, kappa=4, eta=0.5)
    np.testing.assert_allclose(h[1:] / h[:-1], (1 - 0.75 / 4) ** 0.25, rtol=1e-12)


def test_momentum_schedule_rises_while_t_hat_is_not_reached():
    # T = 100 <= T-hat = 230: the first step has the largest influence and the last the smallest, so the schedule
    # starts lowest and ends highest (Sec. 4.2's "increasing" schedule); T = 300: least noise at t = 26.
    s = K.schedule_shape("momentum", 100, beta=0.9, gamma=0.99)
    assert int(np.argmin(s)) == 0 and s[-1] == 1.0
    assert int(np.argmax(K.schedule_shape("momentum", 300, beta=0.9, gamma=0.99))) + 1 == 26


def test_paper_kinds_reach_runs_whose_influences_underflow():
    # gamma^(T-1) = e^-804 is below the smallest double, but the schedule spans only gamma^(-T/4) = e^201
    T, gamma = 80_000, 0.99
    assert B.gd_influence(T, gamma)[0] == 0.0
    s = K.calibrate_schedule("gd-optimal", T, R=0.3927, gamma=gamma)
    np.testing.assert_allclose(s.sigmas[1:] / s.sigmas[:-1], gamma**0.25, rtol=1e-9)
    assert math.fsum(s.sigmas**-2.0) == pytest.approx(0.3927, rel=1e-9)
    m = K.schedule_shape("momentum", T, beta=0.9, gamma=gamma)
    assert np.all(np.isfinite(m) & (m > 0)) and m.max() == 1.0


# --- baselines (not from the paper) --------------------------------------------------------------------------------


def test_baseline_shapes():
    i = np.arange(40)
    np.testing.assert_allclose(K.schedule_shape("exponential", 40, rate=0.1), np.exp(-0.1 * i), rtol=1e-12)
    np.testing.assert_allclose(K.schedule_shape("time", 40, rate=0.3), 1 / (1 + 0.3 * i), rtol=1e-12)
    np.testing.assert_allclose(
        K.schedule_shape("step", 40, factor=0.5, period=10), 0.5 ** (i // 10), rtol=1e-12
    )
    poly = (1 - 0.25) * (1 - np.minimum(i, 30) / 30) ** 3 + 0.25
    np.testing.assert_allclose(
        K.schedule_shape("polynomial", 40, power=3, final=0.25, period=30), poly, rtol=1e-12
    )
    for kind in ("exponential", "time", "polynomial"):  # defaults: the noise falls tenfold over the run
        s = K.schedule_shape(kind, 40)
        assert s[0] == 1 and s[-1] == pytest.approx(0.1, rel=1e-12) and np.all(np.diff(s) < 0)
    assert set(K.BASELINE_KINDS) == {"exponential", "time", "step", "polynomial"}


# --- subsampled accounting -----------------------------------------------------------------------------------------


def test_rdp_calibration_matches_dp_accounting():
    q, delta = 0.05, 1e-5
    s = K.calibrate_schedule(
        "step", 120, epsilon=3.0, delta=delta, accountant="rdp", sampling_rate=q, period=60
    )
    assert s.epsilon == pytest.approx(3.0, rel=1e-9) and s.epsilon <= 3.0
    levels, counts = np.unique(s.sigmas, return_counts=True)
    assert levels.size == 2
    event = dpa.ComposedDpEvent(
        [
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(float(v))), int(n))
            for v, n in zip(levels, counts, strict=True)
        ]
    )
    orders = [a for a in K.RDP_INTEGER_ORDERS if a <= 64]
    acc = rdp_privacy_accountant.RdpAccountant(orders)
    acc.compose(event)
    eps, order = acc.get_epsilon_and_optimal_order(delta)
    assert eps == pytest.approx(3.0, rel=1e-9) and order == s.details["optimal_order"]
    # dptrain's rdp accountant (it adds fractional orders) certifies the same schedule within the budget.
    ledger = Ledger()
    for v, n in zip(levels, counts, strict=True):
        ledger.record(
            gaussian_step_event(float(v), "poisson", sampling_rate=q), step_facts("poisson", q), int(n)
        )
    assert epsilon(ledger, delta, "rdp").epsilon <= 3.0


def test_a_100k_step_decaying_schedule_calibrates_under_rdp_in_seconds():
    q, delta, T = 0.01, 1e-5, 100_000
    s = K.calibrate_schedule("exponential", T, epsilon=2.0, delta=delta, accountant="rdp", sampling_rate=q)
    assert s.epsilon <= 2.0 and s.epsilon == pytest.approx(2.0, rel=1e-6)
    assert s.sigmas[-1] / s.sigmas[0] == pytest.approx(0.1, rel=1e-9)
    # Sandwich with dp_accounting at the optimal order: rounding every sigma down (up) to one of 1000 levels can only
    # raise (lower) the RDP at that order, hence its epsilon.
    order = s.details["optimal_order"]
    grid = np.geomspace(s.sigmas.min(), s.sigmas.max(), 1000)

    def eps_of(sigmas):
        levels, counts = np.unique(sigmas, return_counts=True)
        acc = rdp_privacy_accountant.RdpAccountant([order])
        for v, n in zip(levels, counts, strict=True):
            acc.compose(
                dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(float(v))), int(n))
            )
        return acc.get_epsilon(delta)

    j = np.clip(np.searchsorted(grid, s.sigmas, side="right") - 1, 0, 998)
    upper, lower = eps_of(grid[j]), eps_of(grid[j + 1])
    assert lower <= s.epsilon <= upper and upper / lower < 1.01


def test_pld_calibration_matches_dp_accounting():
    q, delta, T = 0.2, 1e-5, 10
    s = K.calibrate_schedule("uniform", T, epsilon=1.0, delta=delta, accountant="pld", sampling_rate=q)
    assert s.epsilon <= 1.0 and s.epsilon == pytest.approx(1.0, rel=1e-4)
    acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(float(s.sigmas[0]))), T)
    )
    assert acc.get_epsilon(delta) == pytest.approx(s.epsilon, rel=1e-9)
    # Without sampling the pld accountant is the (pessimistically discretized) exact Gaussian.
    p = K.calibrate_schedule("gd-optimal", 50, epsilon=2.0, delta=delta, accountant="pld", kappa=10)
    e = K.calibrate_schedule("gd-optimal", 50, epsilon=2.0, delta=delta, accountant="exact", kappa=10)
    assert p.epsilon <= 2.0
    np.testing.assert_allclose(p.sigmas, e.sigmas, rtol=1e-3)
    assert np.all(p.sigmas >= e.sigmas * (1 - 1e-9))


def test_pld_refuses_many_levels_unless_quantised():
    with pytest.raises(ConfigError, match="at most 16 distinct noise levels, got 50.*levels"):
        K.calibrate_schedule("exponential", 50, epsilon=2.0, delta=1e-5, accountant="pld", sampling_rate=0.05)
    s = K.calibrate_schedule("exponential", 50, epsilon=2.0, delta=1e-5, accountant="zcdp", levels=4)
    assert np.unique(s.sigmas).size == 4
    np.testing.assert_allclose(
        np.unique(np.log(s.sigmas)), np.log(s.scale) + np.linspace(-math.log(10), 0, 4)
    )


# --- the engine's budget check --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "accountant,q", [("zcdp", 1.0), ("exact", 1.0), ("rdp", 0.02)], ids=["zcdp", "exact", "rdp"]
)
def test_step_allowed_follows_a_calibrated_schedule_and_stops_at_the_budget(accountant, q):
    budget = {"epsilon": 2.0, "delta": 1e-5}
    s = K.calibrate_schedule("gd-optimal", 30, accountant=accountant, sampling_rate=q, kappa=20, **budget)
    sig = list(s.sigmas)
    for t in range(30):
        assert K.step_allowed(sig[:t], sig[t], accountant=accountant, sampling_rate=q, **budget)
    assert not K.step_allowed(sig[:-1], sig[-1] * 0.99, accountant=accountant, sampling_rate=q, **budget)
    assert not K.step_allowed(sig, 1e3, accountant=accountant, sampling_rate=q, **budget)


def test_calibrate_shape_scales_any_positive_shape():
    shape = RNG.uniform(0.5, 4.0, size=25)
    s = K.calibrate_shape(shape, epsilon=1.0, delta=1e-5, accountant="exact")
    np.testing.assert_allclose(s.sigmas / s.sigmas[0], shape / shape[0], rtol=1e-12)
    assert gaussian_epsilon(math.sqrt(np.sum(s.sigmas**-2.0)), 1e-5) == pytest.approx(1.0, rel=1e-9)


def test_to_json():
    s = K.calibrate_schedule(
        "influence", 5, epsilon=1.0, delta=1e-6, accountant="exact", influence=[1, 2, 3, 4, 5]
    )
    d = json.loads(json.dumps(s.to_json()))
    assert {"noise_multipliers", "epsilon", "delta", "accountant", "rho", "R"} <= set(d)
    assert d["noise_multipliers"] == [float(x) for x in s.sigmas] and len(d["noise_multipliers"]) == 5
    assert d["accountant"] == "exact" and d["R"] == pytest.approx(2 * d["rho"])
    assert d["params"]["influence"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError):
        s.sigmas[0] = 1.0  # read-only


# --- errors --------------------------------------------------------------------------------------------------------

BUDGET = {"R": 0.4}


@pytest.mark.parametrize(
    "kind,T,params,error,message",
    [
        ("uniform", 0, {}, ConfigError, r"T must be an integer >= 1, got 0"),
        ("nope", 10, {}, ConfigError, r"schedule kind must be one of uniform, .*, got 'nope'"),
        ("gd-optimal", 10, {"gamma": 1.0}, ConfigError, r"gamma=1.0 is invalid; accepted: .*\[0, 1\)"),
        ("gd-optimal", 10, {"gamma": -0.1}, ConfigError, r"gamma=-0.1 is invalid; accepted: .*\[0, 1\)"),
        ("gd-optimal", 10, {"gamma": 0.0}, ConfigError, r"gamma must be in \(0, 1\) for gd-optimal"),
        ("gd-optimal", 10, {"kappa": 0.5}, ConfigError, r"kappa=0.5 is invalid; accepted: .*>= 1"),
        ("gd-optimal", 10, {"kappa": math.inf}, ConfigError, r"kappa=inf is invalid; accepted: .*>= 1"),
        (
            "gd-optimal",
            10,
            {"kappa": 4, "eta": 2.0},
            ConfigError,
            r"eta=2.0 is invalid; accepted: .*\(0, 2\)",
        ),
        ("gd-optimal", 10, {"gamma": True}, ConfigError, r"gamma=True is not a number"),
        ("gd-optimal", 10, {}, ConfigError, r"needs gamma .* or kappa"),
        ("gd-optimal", 10, {"gamma": 0.9, "kappa": 10}, ConfigError, r"gamma .* or kappa .*not both"),
        ("gd-optimal", 100000, {"gamma": 0.5}, ConfigError, r"spans a noise ratio .* above 1e\+100"),
        ("influence", 3, {"influence": [1.0, 0.0, 2.0]}, ConfigError, r"influence\[1\]=0.0"),
        ("influence", 3, {"influence": [1.0, math.nan, 2.0]}, ConfigError, r"influence\[1\]=nan"),
        ("influence", 3, {"influence": [1.0, 2.0]}, ConfigError, r"influence must hold T=3 .*shape \(2,\)"),
        ("influence", 3, {}, ConfigError, r"needs influence"),
        ("momentum", 10, {"gamma": 0.9}, ConfigError, r"needs beta"),
        (
            "momentum",
            10,
            {"beta": 1.0, "gamma": 0.9},
            ConfigError,
            r"beta=1.0 is invalid; accepted: a momentum coefficient in \[0, 1\)",
        ),
        ("momentum", 10, {"beta": 0.9, "kappa": 10}, ConfigError, r"needs eta0"),
        (
            "momentum",
            10,
            {"beta": 0.9, "kappa": 10, "eta0": 11},
            ConfigError,
            r"eta0=11.0 is invalid; accepted: .*\(0, 10\]",
        ),
        (
            "momentum",
            10,
            {"beta": 0.5, "gamma": 0.9, "form": "two-exponential", "c2": 0.0},
            ConfigError,
            r"c2=0.0 is invalid; accepted: a finite number > 0",
        ),
        ("momentum", 10, {"beta": 0.9, "gamma": 0.5, "form": "x"}, ConfigError, r"form must be one of"),
        (
            "momentum",
            10,
            {"beta": 0.9, "gamma": 0.5, "form": "two-exponential"},
            ConfigError,
            r"beta=0.9 >= gamma=0.5; accepted: beta < gamma",
        ),
        ("exponential", 10, {"decay": 0.1}, ConfigError, r"unknown parameter 'decay' .*accepted: rate"),
        ("step", 10, {"period": 0}, ConfigError, r"period must be an integer >= 1, got 0"),
        ("time", 10, {"rate": -1.0}, ConfigError, r"rate must be a finite number >= 0, got -1.0"),
    ],
)
def test_config_errors(kind, T, params, error, message):
    with pytest.raises(error, match=message) as info:
        K.calibrate_schedule(kind, T, **BUDGET, **params)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"rho": 0.0}, AccountingError, r"rho must be a finite number > 0, got 0.0"),
        ({"R": -1}, AccountingError, r"R must be a finite number > 0, got -1"),
        ({"epsilon": 2.0}, AccountingError, r"epsilon=2.0 needs a delta"),
        ({"epsilon": 2.0, "delta": 1.0}, AccountingError, r"delta must be in \(0, 1\), got 1.0"),
        (
            {"rho": 0.1, "epsilon": 1.0, "delta": 1e-5},
            AccountingError,
            r"exactly one of rho .*rho=0.1, epsilon=1.0",
        ),
        ({}, AccountingError, r"exactly one of .*got none"),
        (
            {"rho": 0.1, "accountant": "rdp", "sampling_rate": 0.1},
            AccountingError,
            r"'rdp' needs an \(epsilon, delta\)",
        ),
        (
            {"R": 0.4, "accountant": "moments"},
            ConfigError,
            r"accountant must be one of zcdp, exact, rdp, pld",
        ),
        (
            {"R": 0.4, "accountant": "exact", "sampling_rate": 0.1},
            ConfigError,
            r"'exact' covers full-batch steps",
        ),
        (
            {"R": 0.4, "sampling_rate": 0.0},
            ConfigError,
            r"sampling_rate must be a number in \(0, 1\], got 0.0",
        ),
        ({"R": 0.4, "levels": 0}, ConfigError, r"levels must be an integer >= 1, got 0"),
    ],
)
def test_budget_and_accountant_errors(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        K.calibrate_schedule("uniform", 10, **kwargs)
    assert "\n" not in str(info.value)


def test_step_allowed_errors():
    with pytest.raises(ConfigError, match=r"next_sigma must be finite numbers > 0, got next_sigma\[0\]=0.0"):
        K.step_allowed([1.0], 0.0, R=0.4)
    with pytest.raises(ConfigError, match=r"used must be finite numbers > 0, got used\[1\]=-1.0"):
        K.step_allowed([1.0, -1.0], 1.0, R=0.4)
