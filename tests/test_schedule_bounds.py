"""Utility bounds of "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021
submission), checked against the numbers the paper prints, against numbers derived from its equations, and
against brute-force minimisation computed here independently of the module."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize

from dptrain.errors import ConfigError
from dptrain.schedules import bounds as B

# kappa and alpha values for the property checks (kappa = 1 is the gamma = 0 edge)
KAPPAS = (1.0, 1.5, 2.0, 5.0, 10.0, 30.0, 100.0, 1000.0)
ALPHAS = (1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
TMAX = 20000


# ----------------------------------------------------------------------------------------------------------------
# formulas written out here, independently of the module


def eq21_all(kappa: float, alpha: float) -> np.ndarray:
    """Eq. 21 of the paper for T = 0..TMAX, from the sum R sum_t alpha gamma^(T-t) sigma_t^2 with sigma_t^2 = T/R."""
    gamma = 1 - 1 / kappa
    T = np.arange(TMAX + 1, dtype=float)
    geo = np.concatenate(
        [[0.0], np.cumsum(np.power(gamma, np.arange(TMAX, dtype=float)))]
    )  # sum_{s<T} gamma^s
    return np.power(gamma, T) + alpha * T * geo


def dyn_all(kappa: float, alpha: float) -> np.ndarray:
    """ERUB of Lemma 4.1's schedule for q_t = alpha gamma^(T-t), T = 0..TMAX: gamma^T + (sum_t sqrt(q_t))^2."""
    gamma = 1 - 1 / kappa
    T = np.arange(TMAX + 1, dtype=float)
    root = np.concatenate([[0.0], np.cumsum(np.power(math.sqrt(gamma), np.arange(TMAX, dtype=float)))])
    return np.power(gamma, T) + alpha * root**2


def unrolled_gd_bound(sigma, *, D, G, M, mu, N, gap) -> float:
    """The proof of Thm 4.1, step by step with eta = 1/M:
    e_{t+1} = (1 - mu/M) e_t + (M/2) (G sigma_t / (M N))^2 D, e_1 = gap; returns e_{T+1}/gap."""
    e = gap
    for s in sigma:
        e = (1 - mu / M) * e + 0.5 * M * (G * s / (M * N)) ** 2 * D
    return e / gap


def brute_momentum_influence(T, beta, gamma) -> np.ndarray:
    """The weight of sigma_i^2 in U3 (Thm 4.4, eq. 13), summed term by term."""
    q = np.zeros(T)
    for t in range(1, T + 1):
        a = gamma ** (T - t) * (1 - beta) ** 2 / (1 - beta**t) ** 2
        for i in range(1, t + 1):
            q[i - 1] += a * beta ** (2 * (t - i))
    return q


def u3_double_sum(sigma, beta, gamma) -> float:
    """Eq. 13 of the paper as printed, as a double loop."""
    T = len(sigma)
    total = 0.0
    for t in range(1, T + 1):
        inner = sum(beta ** (2 * (t - i)) * sigma[i - 1] ** 2 for i in range(1, t + 1))
        total += gamma ** (T - t) * ((1 - beta) / (1 - beta**t)) ** 2 * inner
    return total


# ----------------------------------------------------------------------------------------------------------------
# budget conversion (Thm 3.1, Lemma B.3)


def test_eps_delta_to_budget_matches_appendix_d():
    # App. D: (4, 1e-8)-DP <- 0.1963-zCDP, R = 0.3927
    R = B.R_from_eps_delta(4.0, 1e-8)
    assert B.rho_from_R(R) == pytest.approx(0.19635, abs=5e-6)
    assert R == pytest.approx(0.39270, abs=5e-6)
    rho = R / 2
    assert rho + 2 * math.sqrt(rho * math.log(1e8)) == pytest.approx(4.0, rel=1e-12)
    assert B.eps_from_R(R, 1e-8) == pytest.approx(4.0, rel=1e-12)
    assert B.R_from_rho(0.25) == 0.5
    # Independently: the smaller root of rho + 2 sqrt(rho L) = eps (the printed "+" root is the other one).
    L = math.log(1e8)
    assert rho == pytest.approx(optimize.brentq(lambda r: r + 2 * math.sqrt(r * L) - 4.0, 0, 4), rel=1e-12)
    for eps, delta in [(0.1, 1e-5), (2.0, 1e-6), (8.0, 1e-10)]:
        assert B.eps_from_R(B.R_from_eps_delta(eps, delta), delta) == pytest.approx(eps, rel=1e-12)


def test_uniform_sigma_from_constant_influence():
    # constant influence -> uniform schedule sigma_t = sqrt(T/R), R = 0.3927
    for T, expected in ((10, 5.046), (50, 11.284), (100, 15.958)):
        alloc = B.optimal_allocation(np.full(T, 0.7), 0.3927)
        np.testing.assert_allclose(alloc.sigma, expected, atol=5e-4)
        np.testing.assert_allclose(alloc.shares, 1 / T)


# ----------------------------------------------------------------------------------------------------------------
# Theorem 4.1 and the constants of Eq. 2


def test_erub_gd_equals_the_unrolled_proof_recursion():
    rng = np.random.default_rng(0)
    D, G, M, mu, N, gap, R = 60, 4.0, 3.0, 0.2, 1000, 2.5, 0.3927
    alpha = B.alpha_constant(D=D, G=G, M=M, N=N, R=R, initial_gap=gap)
    kappa = M / mu
    for T in (1, 7, 40):
        shares = rng.dirichlet(np.ones(T))
        sigma = 1 / np.sqrt(shares * R)
        expected = unrolled_gd_bound(sigma, D=D, G=G, M=M, mu=mu, N=N, gap=gap)
        assert B.erub_gd(sigma, R, kappa, alpha) == pytest.approx(expected, rel=1e-12)
        assert B.erub_gd_from_shares(shares, kappa, alpha) == pytest.approx(expected, rel=1e-12)


def test_gamma_from_kappa_and_step_size():
    # Eq. 2 (eta = 1): gamma = 1 - 1/kappa; the proof of Thm 4.1 contracts by 1 - 2 mu eta_t (1 - M eta_t / 2)
    M, mu = 3.0, 0.2
    for eta in (1.0, 0.5, 1.5):
        assert B.gamma_from_kappa(M / mu, eta) == pytest.approx(
            1 - 2 * mu * (eta / M) * (1 - eta / 2), rel=1e-14
        )
    assert B.gamma_from_kappa(10) == 1 - 1 / 10
    assert B.gamma_from_kappa(4, 0.5) == pytest.approx(1 - 0.75 / 4, rel=1e-15)
    assert B.gamma_from_kappa(1.0) == 0.0
    assert B.kappa_from_gamma(B.gamma_from_kappa(7.0)) == pytest.approx(7.0, rel=1e-14)
    # Thm 4.4: momentum with step eta0/(2M) contracts by 1 - eta0/kappa
    assert B.momentum_gamma(20, 2.0) == pytest.approx(0.9, rel=1e-15)
    assert B.momentum_gamma(4.0, 4.0) == 0.0


def test_gd_influence_grows_with_t():
    q = B.gd_influence(30, 0.9, 1e-3)
    assert np.all(np.diff(q) > 0)
    np.testing.assert_allclose(q[1:] / q[:-1], 1 / 0.9)
    assert q[-1] == pytest.approx(1e-3)
    np.testing.assert_allclose(B.gd_influence(30, 0.9), q / 1e-3, rtol=1e-15)  # alpha defaults to 1
    np.testing.assert_array_equal(B.gd_influence(3, 0.0), [0.0, 0.0, 1.0])  # gamma = 0: 0^0 = 1


def test_erub_gd_of_uniform_and_optimal_schedules_match_the_closed_forms():
    R = 0.3927
    for kappa, alpha in ((10.0, 1e-3), (2.0, 0.05), (100.0, 1e-4)):
        for T in (1, 5, 24, 60):
            uniform = np.full(T, math.sqrt(T / R))
            assert B.erub_gd(uniform, R, kappa, alpha) == pytest.approx(
                B.erub_uniform(T, kappa, alpha), rel=1e-12
            )
            dyn = B.gd_optimal_sigma(T, R, kappa=kappa)
            assert B.erub_gd(dyn, R, kappa, alpha) == pytest.approx(
                B.erub_dynamic(T, kappa, alpha), rel=1e-12
            )


# ----------------------------------------------------------------------------------------------------------------
# Lemma 4.1


@pytest.mark.parametrize("seed", range(4))
def test_lemma41_allocation_is_optimal_against_a_numerical_minimiser(seed):
    rng = np.random.default_rng(seed)
    T = 6
    q = rng.lognormal(sigma=1.5, size=T)
    R = 0.3927
    alloc = B.optimal_allocation(q, R)

    def objective(z):  # R sum q sigma^2 with shares w = softmax(z), 1/sigma^2 = w R
        w = np.exp(z - z.max())
        w /= w.sum()
        return float(np.sum(q / w))

    res = optimize.minimize(objective, np.zeros(T), method="BFGS", options={"gtol": 1e-10})
    w_num = np.exp(res.x - res.x.max())
    w_num /= w_num.sum()
    assert res.fun >= alloc.bound * (1 - 1e-9)
    assert res.fun == pytest.approx(alloc.bound, rel=1e-7)
    np.testing.assert_allclose(alloc.shares, w_num, atol=1e-4)
    # random feasible schedules never do better
    for w in rng.dirichlet(np.ones(T), size=200):
        assert B.noise_term(q, 1 / np.sqrt(w * R), R) >= alloc.bound * (1 - 1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_lemma41_budget_objective_and_gap(seed):
    rng = np.random.default_rng(10 + seed)
    T = int(rng.integers(2, 50))
    q = rng.exponential(size=T) + 1e-3
    R = 0.3927
    alloc = B.optimal_allocation(q, R)
    assert np.sum(1 / alloc.sigma**2) == pytest.approx(R, rel=1e-12)
    assert np.sum(alloc.step_rho) == pytest.approx(R / 2, rel=1e-12)
    assert B.noise_term(q, alloc.sigma, R) == pytest.approx(np.sum(np.sqrt(q)) ** 2, rel=1e-12)
    assert alloc.bound == pytest.approx(np.sum(np.sqrt(q)) ** 2, rel=1e-12)
    # Eq. 25: uniform minus optimal = T^2 Var_t[sqrt(q_t)]
    uniform = B.noise_term(q, np.full(T, math.sqrt(T / R)), R)
    assert uniform == pytest.approx(T * np.sum(q), rel=1e-12)
    assert uniform - alloc.bound == pytest.approx(T**2 * np.var(np.sqrt(q)), rel=1e-9)
    # share proportional to sqrt(q_t)
    np.testing.assert_allclose(alloc.shares / np.sqrt(q), alloc.shares[0] / math.sqrt(q[0]))


def test_lemma41_is_scale_free_for_tiny_and_huge_influences():
    q = np.array([1.0, 4.0, 9.0])
    for scale in (1e-300, 1e300):
        alloc = B.optimal_allocation(q * scale, 2.0)
        np.testing.assert_allclose(alloc.shares, [1 / 6, 2 / 6, 3 / 6])
        assert alloc.bound == pytest.approx(36 * scale, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------------
# Theorem 4.3: the GD-optimal schedule


def test_gd_optimal_sigma_decays_exponentially_with_ratio_gamma_quarter():
    R = 0.3927
    sigma = B.gd_optimal_sigma(40, R, kappa=10.0)
    np.testing.assert_allclose(sigma[1:] / sigma[:-1], 0.97400, atol=5e-6)
    np.testing.assert_allclose(sigma[1:] / sigma[:-1], 0.9**0.25, rtol=1e-12)
    assert np.sum(1 / sigma**2) == pytest.approx(R, rel=1e-12)
    np.testing.assert_allclose(sigma, B.gd_optimal_sigma(40, R, gamma=0.9), rtol=1e-12)
    lemma = B.optimal_allocation(B.gd_influence(40, 0.9, 3e-3), R).sigma
    np.testing.assert_allclose(sigma, lemma, rtol=1e-10)
    # eq. 7 written out
    T, gamma, t = 40, 0.9, np.arange(1, 41)
    eq7 = (1 / R) * gamma ** ((t - T) / 2) * (1 - gamma ** (T / 2)) / (1 - math.sqrt(gamma))
    np.testing.assert_allclose(sigma**2, eq7, rtol=1e-12)


@pytest.mark.parametrize(
    "kappa, alpha, T_uni, erub_uni, T_cont, erub_dyn, T_dyn, erub_dyn_int",
    [
        (10, 1e-3, 21, 0.2964, 24.491, 0.2752, 24, 0.2753),
        (100, 1e-4, 44, 0.7999, 44.605, 0.7992, 45, 0.7992),
        (5, 1e-2, 6, 0.4835, 6.712, 0.4729, 7, 0.4733),
        (2, 1e-3, 8, 0.0198, 12.879, 0.0115, 13, 0.0115),
    ],
)
def test_regression_table(kappa, alpha, T_uni, erub_uni, T_cont, erub_dyn, T_dyn, erub_dyn_int):
    s = B.bound_summary(kappa, alpha)
    assert s["T_uniform"] == T_uni
    assert s["erub_uniform"] == pytest.approx(erub_uni, abs=5e-5)
    assert s["T_dynamic_continuous"] == pytest.approx(T_cont, abs=5e-4)
    assert s["erub_dynamic"] == pytest.approx(erub_dyn, abs=5e-5)
    assert s["T_dynamic"] == T_dyn
    assert B.dynamic_T_argmin(kappa, alpha) == (T_dyn, pytest.approx(erub_dyn_int, abs=5e-5))


def test_eq26_matches_its_log_gamma_form_and_is_the_continuous_minimum():
    for kappa in (1.5, 10.0, 300.0):
        for alpha in (1e-4, 1e-2, 1.0):
            gamma = 1 - 1 / kappa
            T, erub = B.dynamic_T_continuous(kappa, alpha)
            c = (1 - math.sqrt(gamma)) ** 2
            assert T == pytest.approx(2 * math.log(alpha / (alpha + c)) / math.log(gamma), rel=1e-9)
            a = alpha / c
            assert erub == pytest.approx(a / (1 + a), rel=1e-9)
            assert B.erub_dynamic(T, kappa, alpha) == pytest.approx(erub, rel=1e-9)
            res = optimize.minimize_scalar(
                B.erub_dynamic,
                args=(kappa, alpha),
                bounds=(0, 50 * T + 10),
                method="bounded",
                options={"xatol": 1e-10},
            )
            assert res.fun >= erub * (1 - 1e-9)


def test_summary_keys_and_types():
    s = B.bound_summary(10.0, 1e-3)
    assert set(s) == {
        "T_uniform",
        "erub_uniform",
        "T_uniform_paper",
        "erub_uniform_paper",
        "T_dynamic_continuous",
        "erub_dynamic",
        "T_dynamic",
    }
    assert type(s["T_uniform"]) is int and type(s["T_dynamic"]) is int
    assert all(type(s[k]) is float for k in s if k not in ("T_uniform", "T_dynamic"))


# ----------------------------------------------------------------------------------------------------------------
# brute-force properties over a (kappa, alpha) grid


def test_integer_argmins_match_brute_force_and_dynamic_is_never_above_uniform():
    for kappa in KAPPAS:
        for alpha in ALPHAS:
            uni, dyn = eq21_all(kappa, alpha), dyn_all(kappa, alpha)
            tu, td = int(np.argmin(uni)), int(np.argmin(dyn))
            assert tu < TMAX and td < TMAX
            s = B.bound_summary(kappa, alpha)
            # the module's T is the brute-force argmin (up to exact ties, e.g. kappa=1000, alpha=1e-3:
            # ERUB_dyn(0) = 1 = gamma + alpha = ERUB_dyn(1), where rounding may pick either)
            assert uni[s["T_uniform"]] <= uni[tu] * (1 + 1e-12), (kappa, alpha)
            assert s["T_uniform"] == tu or uni[s["T_uniform"]] == pytest.approx(uni[tu], rel=1e-12)
            assert s["erub_uniform"] == pytest.approx(uni[tu], rel=1e-9, abs=1e-15)
            assert dyn[s["T_dynamic"]] <= dyn[td] * (1 + 1e-12), (kappa, alpha)
            assert s["T_dynamic"] == td or dyn[s["T_dynamic"]] == pytest.approx(dyn[td], rel=1e-12)
            # the closed-form (eq. 26) optimum is a neighbour of the integer argmin (kappa = 1: its limit 0
            # is not, since gamma^T jumps from 1 to 0 between T = 0 and T = 1)
            if kappa > 1:
                T_cont = s["T_dynamic_continuous"]
                assert math.floor(T_cont) <= s["T_dynamic"] <= math.ceil(T_cont), (kappa, alpha)
            # dynamic never above uniform: continuous min <= integer min (dyn) <= integer min (uni)
            assert s["erub_dynamic"] <= dyn[td] * (1 + 1e-12) <= uni[tu] * (1 + 1e-12), (kappa, alpha)
            # and pointwise in integer T (Cauchy-Schwarz)
            T = np.arange(1, 200)
            assert np.all(dyn[T] <= uni[T] * (1 + 1e-12))
            assert np.all(
                [
                    B.erub_dynamic(t, kappa, alpha) <= B.erub_uniform(t, kappa, alpha) * (1 + 1e-12)
                    for t in (1, 3, 17, 150)
                ]
            )


def test_theta_rate_of_the_dynamic_bound():
    # (1 - sqrt(gamma))^-1 in [kappa, 2 kappa], hence a/(1+a) in [1, 4] x kappa^2 alpha / (1 + kappa^2 alpha) (eq. 8)
    for kappa in KAPPAS:
        gamma = B.gamma_from_kappa(kappa)
        inv = 1 / (1 - math.sqrt(gamma))
        assert kappa * (1 - 1e-12) <= inv <= 2 * kappa
        for alpha in ALPHAS:
            _, erub = B.dynamic_T_continuous(kappa, alpha)
            rate = kappa**2 * alpha / (1 + kappa**2 * alpha)
            assert rate * (1 - 1e-12) <= erub <= 4 * rate
    _, erub = B.dynamic_T_continuous(10, 1e-3)
    assert erub / (100 * 1e-3 / (1 + 100 * 1e-3)) == pytest.approx(3.03, abs=0.005)


def test_paper_closed_form_for_the_uniform_schedule():
    # Eq. 23/24 at kappa = 10, alpha = 1e-3: T = 44.294, ERUB 0.4482, versus the true minimiser T = 21 (0.2964)
    T, erub = B.uniform_T_paper(10, 1e-3)
    assert T == pytest.approx(44.294, abs=5e-4)
    assert erub == pytest.approx(0.4482, abs=5e-5)
    assert B.erub_uniform(T, 10, 1e-3) == pytest.approx(erub, rel=1e-12)  # eq. 24 is eq. 21 at eq. 23's T
    assert B.uniform_T_argmin(10, 1e-3)[0] == 21
    # the rate of eq. 5 it tracks: kappa^2/(kappa + 1/alpha) ln(1 + 1/(kappa alpha))
    assert 100 / (10 + 1000) * math.log(1 + 1 / (10 * 1e-3)) == pytest.approx(0.4569, abs=5e-5)
    # Eq. 23's T tends to 1/alpha (not to 0) as kappa grows; kappa = 1000, alpha = 0.01 gives ERUB 87.6 > 1
    assert B.uniform_T_paper(1e7, 0.01)[0] == pytest.approx(100, rel=1e-3)
    assert B.uniform_T_paper(1000, 0.01)[1] == pytest.approx(87.6, abs=0.05)
    assert B.uniform_T_argmin(1000, 0.01) == (0, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# momentum


def test_T_hat_values_and_lemma_b7():
    assert B.momentum_T_hat(0.9, 0.99) == 230
    assert B.momentum_T_hat(0.5, 0.9) == 7
    assert B.momentum_T_hat(0.9, 0.999) == 2302
    for beta, gamma in ((0.9, 0.99), (0.5, 0.9), (0.3, 0.95), (0.99, 0.999), (0.5, 0.3)):  # last: T_hat = 1
        T_hat = B.momentum_T_hat(beta, gamma)
        t = np.arange(1, 3 * T_hat + 10)
        ok = gamma ** (t - 1) * (1 + 1e-12) >= (1 - beta) / (1 - beta**t)
        assert ok[:T_hat].all() and not ok[T_hat:].any()


def test_u3_and_exact_momentum_influence():
    rng = np.random.default_rng(3)
    for T, beta, gamma in ((1, 0.9, 0.99), (12, 0.9, 0.99), (30, 0.5, 0.8), (25, 0.0, 0.9), (100, 0.9, 0.99)):
        sigma = rng.uniform(1, 20, size=T)
        u3 = u3_double_sum(sigma, beta, gamma)
        assert B.momentum_U3(sigma, beta, gamma) == pytest.approx(u3, rel=1e-12)
        q = B.momentum_influence(T, beta, gamma)
        assert np.sum(q * sigma**2) == pytest.approx(u3, rel=1e-12)
        np.testing.assert_allclose(q, brute_momentum_influence(T, beta, gamma), rtol=1e-11)
    # beta = 0: the GD influence gamma^(T-t)
    np.testing.assert_allclose(B.momentum_influence(25, 0.0, 0.9), B.gd_influence(25, 0.9), rtol=1e-12)


def test_momentum_influence_phases():
    beta, gamma = 0.9, 0.99  # T_hat = 230
    T_hat = B.momentum_T_hat(beta, gamma)
    # T = 100: q_1 = 0.535, q_T = 0.010 (the smallest)
    q = B.momentum_influence(100, beta, gamma)
    assert q[0] == pytest.approx(0.535, abs=5e-4)
    assert q[-1] == pytest.approx(0.010, abs=5e-4)
    assert np.argmin(q) == 99
    # not monotone in between: it dips near t = 26, rises again, and falls over the last ~15 steps
    assert int(np.argmin(q[:80])) + 1 == 26 and np.all(np.diff(q[85:]) < 0)
    for T in (10, 30, 50, 100, T_hat):
        q = B.momentum_influence(T, beta, gamma)
        bound = B.momentum_influence_two_exp(T, beta, gamma)
        # the paper's Thm 4.6 influence decreases in t for T <= T_hat ...
        assert np.all(np.diff(bound) < 0)
        # ... bounds the exact one, whose largest entry is the first step: the preferred schedule rises
        assert np.all(q <= bound)
        assert np.argmax(q) == 0
        # the Lemma 4.1 schedule for it gives the least noise to the first step
        sigma = B.optimal_allocation(q, 0.3927).sigma
        assert np.argmin(sigma) == 0
    for T in (10, 30):  # short runs: the exact influence itself decreases
        assert np.all(np.diff(B.momentum_influence(T, beta, gamma)) < 0)
    # T > T_hat: U-shaped, minimum at t = 26; the paper's form switches to an increasing exponential after T_hat
    for T in (300, 600):
        q = B.momentum_influence(T, beta, gamma)
        assert np.argmin(q) + 1 == 26
        assert q[0] > q[25] < q[-2]
        bound = B.momentum_influence_two_exp(T, beta, gamma)
        assert np.all(q <= bound)
        assert np.all(np.diff(bound[:T_hat]) < 0) and np.all(np.diff(bound[T_hat:]) > 0)


def test_two_exponential_influence_with_user_constants():
    T, beta, gamma = 300, 0.9, 0.99
    T_hat = B.momentum_T_hat(beta, gamma)
    q = B.momentum_influence_two_exp(T, beta, gamma, c1=2.0, c2=3.0)
    t = np.arange(1, T + 1)
    expected = np.where(t <= T_hat, 2.0 * gamma ** (T + t), gamma ** (T_hat - 1) * 3.0 * gamma ** (T - t))
    np.testing.assert_allclose(q, expected, rtol=1e-12)
    # the default c1 = 2 / (gamma (gamma - beta^2)) (Thm 4.6 proof, App. C.2)
    default = B.momentum_influence_two_exp(T, beta, gamma)
    c1 = 2 / (gamma * (gamma - beta**2))
    np.testing.assert_allclose(default[:T_hat], c1 * gamma ** (T + t[:T_hat]), rtol=1e-11)
    # the default c2 is tight for the proof's late-phase term at t = T_hat + 1
    late = gamma ** (2 * (T_hat - 1)) * (gamma ** (T + 1 - t) - beta ** (2 * (T + 1 - t))) / (gamma - beta**2)
    assert np.all(late[T_hat:] <= default[T_hat:] * (1 + 1e-12))
    assert late[T_hat] / default[T_hat] > 0.99


def test_log_space_influences_reach_runs_whose_influences_underflow():
    T, beta, gamma = 80_000, 0.9, 0.99  # gamma^(T-1) = e^-804: below the smallest double
    t = np.arange(1, T + 1)
    assert B.gd_influence(T, gamma)[0] == 0.0
    log_gd = B.log_gd_influence(T, gamma)
    np.testing.assert_allclose(log_gd, (T - t) * math.log(gamma), rtol=1e-13)
    # the momentum recursion q_i = w_i + beta^2 q_{i+1} holds in log space all along
    log_q = B.log_momentum_influence(T, beta, gamma)
    log_w = (T - t) * math.log(gamma) + 2 * np.log((1 - beta) / (1 - beta**t))
    # (to 1e-11 in ln q: the vectorised form sums terms scaled by beta^(2t), whose logs reach -17000 here)
    recursion = np.logaddexp(log_w[:-1], 2 * math.log(beta) + log_q[1:])
    np.testing.assert_allclose(log_q[:-1], recursion, rtol=0, atol=1e-11)
    assert log_q[-1] == pytest.approx(log_w[-1], rel=1e-12) and np.all(np.isfinite(log_q))
    log_two = B.log_momentum_influence_two_exp(T, beta, gamma, c1=2.0, c2=3.0)
    T_hat = B.momentum_T_hat(beta, gamma)
    assert log_two[0] == pytest.approx(math.log(2.0) + (T + 1) * math.log(gamma), rel=1e-13)
    assert log_two[-1] == pytest.approx((T_hat - 1) * math.log(gamma) + math.log(3.0), rel=1e-13)
    # Lemma 4.1 in log space: shares proportional to sqrt(q_t), summing to 1
    log_shares = B.optimal_log_shares(log_gd)
    np.testing.assert_allclose(np.diff(log_shares), -0.5 * math.log(gamma), rtol=1e-9)
    assert math.fsum(np.exp(log_shares)) == pytest.approx(1.0, rel=1e-12)
    # and the same as the linear allocation where that is in range
    q = B.momentum_influence(300, beta, gamma)
    np.testing.assert_allclose(
        np.exp(B.optimal_log_shares(np.log(q))), B.optimal_allocation(q, 1.0).shares, rtol=1e-12
    )


def test_uniform_momentum_noise_is_at_most_the_gd_noise():
    R, beta, gamma = 0.3927, 0.9, 0.99
    T_hat = B.momentum_T_hat(beta, gamma)
    for T in (1, 50, 230, 300):
        s2 = T / R
        t = np.arange(1, T + 1)
        u3 = B.momentum_U3(np.full(T, math.sqrt(s2)), beta, gamma)
        identity = s2 * np.sum(gamma ** (T - t) * (1 - beta) / (1 - beta**t) * (1 + beta**t) / (1 + beta))
        relaxed = s2 * np.sum(gamma ** (T - t) * (1 - beta) / (1 - beta**t))
        gd = s2 * np.sum(gamma ** (T - t))
        assert u3 == pytest.approx(identity, rel=1e-12)
        assert u3 <= relaxed <= gd
        # Thm 4.5 proof: U3 <= (T/R) gamma^(T-1) (min{T, T_hat} + max{(gamma^-(T - T_hat) - 1)/(1 - gamma), 0})
        thm45 = s2 * gamma ** (T - 1) * (min(T, T_hat) + max((gamma ** -(T - T_hat) - 1) / (1 - gamma), 0))
        assert relaxed <= thm45 * (1 + 1e-12)


def test_eta0_bound_is_the_root_of_zeta():
    beta, gamma = 0.9, 0.99
    eta0 = B.momentum_eta0_max(beta, gamma)
    assert eta0 == pytest.approx(0.003014, abs=5e-7)  # not the "0.98/M" of the text

    def zeta(e):
        return 1 - beta * gamma * e**2 / ((gamma - beta) ** 2 * (1 - beta) ** 3) - e / 4

    assert zeta(eta0) == pytest.approx(0, abs=1e-12)
    assert zeta(eta0 * 1.01) < 0 < zeta(eta0 * 0.99)
    # erub_momentum enforces it (gamma = 1 - eta0/kappa)
    with pytest.raises(ConfigError, match="eta0"):
        B.erub_momentum(np.full(10, 10.0), 0.3927, 10.0, 1e-3, 0.9, 0.5)


def test_erub_momentum_matches_eq11_terms():
    kappa, alpha, beta, eta0, R = 50.0, 1e-3, 0.5, 0.01, 0.3927
    gamma = 1 - eta0 / kappa
    sigma = B.optimal_allocation(B.momentum_influence(40, beta, gamma), R).sigma
    value = B.erub_momentum(sigma, R, kappa, alpha, beta, eta0)
    assert value == pytest.approx(
        gamma**40 + 2 * R * eta0 * alpha * u3_double_sum(sigma, beta, gamma), rel=1e-12
    )
    # the Lemma 4.1 schedule beats the uniform one on this bound
    assert value < B.erub_momentum(np.full(40, math.sqrt(40 / R)), R, kappa, alpha, beta, eta0)


# ----------------------------------------------------------------------------------------------------------------
# errors and imports


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: B.gd_influence(0, 0.9, 1e-3), "T=0"),
        (lambda: B.gd_influence(2.5, 0.9, 1e-3), "T=2.5"),
        (lambda: B.gd_influence(5, 10.0), "gamma=10.0"),
        (lambda: B.gd_influence(5, True), "gamma=True"),
        (lambda: B.log_gd_influence(5, "0.5"), "gamma='0.5'"),
        (lambda: B.gamma_from_kappa(4.0, 2.0), "eta=2.0"),
        (lambda: B.gamma_from_kappa(0.5), "kappa=0.5"),
        (lambda: B.momentum_gamma(10.0, 11.0), "eta0=11.0"),
        (lambda: B.momentum_gamma(10.0, 0.0), "eta0=0.0"),
        (lambda: B.optimal_log_shares([0.0, math.inf]), "log_q[1]=inf"),
        (lambda: B.log_momentum_influence(5, 1.0, 0.5), "beta=1.0"),
        (lambda: B.erub_uniform(-1, 10.0, 1e-3), "T=-1"),
        (lambda: B.bound_summary(0.5, 1e-3), "kappa=0.5"),
        (lambda: B.bound_summary(math.inf, 1e-3), "kappa=inf"),
        (lambda: B.bound_summary(math.nan, 1e-3), "kappa=nan"),
        (lambda: B.bound_summary(10.0, 0.0), "alpha=0.0"),
        (lambda: B.bound_summary(10.0, -1.0), "alpha=-1.0"),
        (lambda: B.kappa_from_gamma(1.0), "gamma=1.0"),
        (lambda: B.momentum_T_hat(0.9, -0.1), "gamma=-0.1"),
        (lambda: B.momentum_T_hat(1.0, 0.5), "beta=1.0"),
        (lambda: B.optimal_allocation([1.0, 0.0, 2.0], 1.0), "q[1]=0.0"),
        (lambda: B.optimal_allocation([1.0, math.nan], 1.0), "q[1]=nan"),
        (lambda: B.optimal_allocation([1.0, -2.0], 1.0), "q[1]=-2.0"),
        (lambda: B.optimal_allocation([1.0, 2.0], 0.0), "R=0.0"),
        (lambda: B.erub_gd([1.0, 1.0], 1.0, 10.0, 1e-3), "R=1.0"),
        (lambda: B.erub_gd_from_shares([0.6, 0.6], 10.0, 1e-3), "shares"),
        (lambda: B.gd_optimal_sigma(10, 1.0), "kappa or gamma"),
        (lambda: B.gd_optimal_sigma(10, 1.0, kappa=1.0), "kappa=1.0"),
        (lambda: B.momentum_eta0_max(0.9, 0.9), "beta=0.9"),
        (lambda: B.momentum_influence_two_exp(10, 0.99, 0.9), "beta=0.99"),
        (lambda: B.momentum_influence_two_exp(10, 0.5, 0.9, c2=0.0), "c2=0.0"),
        (lambda: B.log_momentum_influence_two_exp(10, 0.5, 0.9, c1=-1.0), "c1=-1.0"),
        (lambda: B.R_from_eps_delta(4.0, 1.5), "delta=1.5"),
    ],
)
def test_bad_input_raises_config_error_with_a_one_line_message(call, needle):
    with pytest.raises(ConfigError) as info:
        call()
    msg = str(info.value)
    assert needle in msg and "accepted" in msg and "\n" not in msg


def test_kappa_one_edge():
    # gamma = 0: one step reaches the optimum, ERUB(T >= 1) = alpha T (uniform) and alpha (dynamic)
    assert B.uniform_T_argmin(1.0, 0.2) == (1, pytest.approx(0.2))
    assert B.dynamic_T_argmin(1.0, 0.2) == (1, pytest.approx(0.2))
    assert B.uniform_T_argmin(1.0, 2.0) == (0, 1.0)
    assert B.momentum_T_hat(0.9, 0.0) == 1
