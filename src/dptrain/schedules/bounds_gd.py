"""The expected-risk upper bound (ERUB) of private gradient descent in "On Dynamic Noise Influence in Differential
Private Learning" (anonymous ICLR 2021 submission; "Dynamic Noise Influence"), and the schedules it makes optimal:
the influence q_t = alpha gamma^(T - t) and the ERUB of a schedule (Thm 4.1), the uniform schedule and its best T
(Thm 4.2), the optimal allocation of the budget for any influence (Lemma 4.1) and the GD-optimal schedule and its
best T (Thm 4.3). numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dptrain.errors import ConfigError
from dptrain.schedules.bounds_constants import gamma_from_kappa
from dptrain.schedules.bounds_inputs import (
    _BUDGET_RTOL,
    _check_budget,
    _gamma,
    _kappa,
    _log_pow,
    _positive,
    _pow,
    _real_steps,
    _steps,
    _vector,
)


def _gamma_parts(kappa: float) -> tuple[float, float, float]:
    """(gamma, ln(1/gamma), 1 - sqrt(gamma)) for gamma = 1 - 1/kappa, computed without cancellation.
    ln(1/gamma) is inf at kappa = 1."""
    gamma = gamma_from_kappa(kappa)
    log_inv = -math.log1p(-1.0 / kappa) if kappa > 1 else math.inf
    one_minus_sqrt = (1.0 / kappa) / (1.0 + math.sqrt(gamma))  # 1 - sqrt(g) = (1 - g) / (1 + sqrt(g))
    return gamma, log_inv, one_minus_sqrt


# ----------------------------------------------------------------------------------------------------------------
# gradient descent: Theorem 4.1


def log_gd_influence(T: int, gamma: float) -> np.ndarray:
    """ln(q_t / alpha) = (T - t) ln gamma, t = 1..T: :func:`gd_influence` in log space, finite for any T
    (Dynamic Noise Influence, Thm 4.1 eq. 3). gamma = 0 gives 0 at t = T and -inf before."""
    T = _steps(T)
    gamma = _gamma(gamma)
    return _log_pow(gamma, np.arange(T - 1, -1, -1, dtype=float))


def gd_influence(T: int, gamma: float, alpha: float = 1.0) -> np.ndarray:
    """Noise influence q_t = alpha gamma^(T - t), t = 1..T, of PGD (Dynamic Noise Influence, Thm 4.1 eq. 3; the paper
    has eta = 1/M and gamma = 1 - 1/kappa, see :func:`gamma_from_kappa` for other step sizes). It grows
    exponentially with t, so late noise matters most. alpha = 1 gives the shape q_t / alpha."""
    alpha = _positive("alpha", alpha)
    with np.errstate(under="ignore"):
        return alpha * np.exp(log_gd_influence(T, gamma))


def noise_term(q, sigma, R: float) -> float:
    """The weighted noise sum R sum_t q_t sigma_t^2 of the ERUB (Dynamic Noise Influence, Thm 4.1 eq. 3 and
    Lemma 4.1 eq. 6). q: influences (> 0); sigma: noise multipliers sigma_t (> 0); R: the paper's budget."""
    q = _vector("q", q)
    sigma = _vector("sigma", sigma)
    if q.shape != sigma.shape:
        raise ConfigError(f"sigma has {sigma.size} steps but q has {q.size}; accepted: one sigma_t per q_t")
    return float(_positive("R", R) * np.sum(q * sigma * sigma))


def erub_gd(sigma, R: float, kappa: float, alpha: float) -> float:
    """ERUB of PGD with eta = 1/M and the noise schedule sigma_1..sigma_T
    (Dynamic Noise Influence, Thm 4.1 eq. 3)::

        ERUB = gamma^T + R sum_t q_t sigma_t^2,    q_t = alpha gamma^(T - t).

    sigma: the noise multipliers (of G/N), length T >= 1. R: the paper's budget (R = 2 rho), the one in alpha.
    The schedule must satisfy sum_t 1/sigma_t^2 <= R (Alg. 1); otherwise ConfigError is raised.
    """
    sigma = _vector("sigma", sigma)
    R = _positive("R", R)
    _check_budget(sigma, R)
    gamma = gamma_from_kappa(kappa)
    q = gd_influence(sigma.size, gamma, alpha)
    return _pow(gamma, sigma.size) + R * float(np.sum(q * sigma * sigma))


def erub_gd_from_shares(shares, kappa: float, alpha: float) -> float:
    """ERUB of PGD when step t spends the fraction shares[t] of the budget, i.e. 1/sigma_t^2 = shares_t R
    (Dynamic Noise Influence, Thm 4.1 eq. 3 with R sigma_t^2 = 1/shares_t)::

        ERUB = gamma^T + alpha sum_t gamma^(T - t) / shares_t.

    It does not depend on R. shares: positive, summing to at most 1.
    """
    w = _vector("shares", shares)
    total = float(np.sum(w))
    if total > 1 + _BUDGET_RTOL:
        raise ConfigError(f"shares sum to {total:.6g}; accepted: positive shares summing to at most 1")
    gamma = gamma_from_kappa(kappa)
    q = gd_influence(w.size, gamma, alpha)
    return _pow(gamma, w.size) + float(np.sum(q / w))


# ----------------------------------------------------------------------------------------------------------------
# uniform schedule: Theorem 4.2


def erub_uniform(T: float, kappa: float, alpha: float) -> float:
    """ERUB of the uniform schedule sigma_t^2 = T/R as a function of T (Dynamic Noise Influence, Thm 4.2 proof,
    eq. 21)::

        ERUB_uni(T) = gamma^T + alpha kappa (1 - gamma^T) T.

    Accepts any real T >= 0 (T = 0 means not training: ERUB = 1). The closed form is meaningful for integer T.
    """
    T = _real_steps(T)
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    g = _pow(gamma_from_kappa(kappa), T)
    return g + alpha * kappa * (1.0 - g) * T


def _best_integer(f, candidates) -> tuple[int, float]:
    """Smallest-T integer minimiser of f over the candidates (ties go to the smaller T)."""
    best = None
    for t in sorted({int(c) for c in candidates if c >= 0}):
        v = f(t)
        if best is None or v < best[1]:
            best = (t, v)
    return best


def uniform_T_argmin(kappa: float, alpha: float) -> tuple[int, float]:
    """Integer T >= 0 minimising Eq. 21 of Dynamic Noise Influence (Thm 4.2 proof) and its ERUB.

    Exact: with u = alpha kappa and L = ln(1/gamma), ERUB_uni is convex on [0, 1/u + 2/L] (its second derivative
    is gamma^T L (L (1 - uT) + 2u)) and exceeds ERUB_uni(0) = 1 for T > 1/u. So the real minimiser is the
    unique root of the derivative in (0, 1/u), found by bisection, and the integer minimiser is one of its two
    integer neighbours. T = 0 (ERUB 1) is returned when no step count helps. Ties go to the smaller T.
    """
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    gamma, L, _ = _gamma_parts(kappa)
    u = alpha * kappa

    def f(t):
        return erub_uniform(t, kappa, alpha)

    if math.isinf(L):  # kappa = 1, gamma = 0: ERUB_uni(T) = alpha T for T >= 1
        return _best_integer(f, (0, 1))

    def fprime(t):  # d/dT [gamma^T (1 - uT) + uT]
        return u - math.exp(-L * t) * (L * (1 - u * t) + u)

    lo, hi = 0.0, 1.0 / u  # fprime(0) = -L < 0 and fprime(1/u) = u (1 - gamma^(1/u)) > 0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if fprime(mid) < 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    r = math.floor(lo)
    return _best_integer(f, (0, r - 1, r, r + 1, r + 2))


def uniform_T_paper(kappa: float, alpha: float) -> tuple[float, float]:
    """The paper's closed-form T for the uniform schedule and its ERUB (Dynamic Noise Influence, Thm 4.2 proof,
    eqs. 23-24)::

        T = ln(1 + ln(1/gamma)/alpha) / ln(1/gamma),
        ERUB = [1 + kappa ln(1 + ln(1/gamma)/alpha)] / (1 + ln(1/gamma)/alpha)   (= eq. 21 at this T).

    This is a rate device, not the minimiser of eq. 21 (see :func:`uniform_T_argmin`). T is real and unrounded. At
    kappa = 1 (gamma = 0) both are returned as their limits kappa -> 1+, which are T = 0 and ERUB = 0. That value
    is an artefact of evaluating eq. 21 at non-integer T.
    """
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    _, L, _ = _gamma_parts(kappa)
    if math.isinf(L):
        return 0.0, 0.0
    x = L / alpha
    lx = math.log1p(x)
    return lx / L, (1.0 + kappa * lx) / (1.0 + x)


# ----------------------------------------------------------------------------------------------------------------
# Lemma 4.1: optimal allocation for any influence


@dataclass(frozen=True)
class Allocation:
    """Budget allocation minimising R sum_t q_t sigma_t^2 subject to sum_t 1/sigma_t^2 = R
    (Dynamic Noise Influence, Lemma 4.1 eq. 6).

    shares: fraction of the budget spent at step t, sqrt(q_t) / sum_s sqrt(q_s); it sums to 1.
    sigma: noise multipliers sigma_t with sigma_t^2 = sum_s sqrt(q_s) / (R sqrt(q_t)), i.e. 1/sigma_t^2 = shares_t R.
    step_rho: zCDP cost of step t, 1/(2 sigma_t^2) = shares_t R / 2; it sums to rho = R/2.
    bound: the minimum (sum_t sqrt(q_t))^2 of R sum_t q_t sigma_t^2 (it does not depend on R).
    """

    shares: np.ndarray
    sigma: np.ndarray
    step_rho: np.ndarray
    bound: float


def _lemma_4_1(log_q: np.ndarray) -> tuple[np.ndarray, float]:
    """(ln r_t, s) with r_t = sqrt(q_t / max_u q_u) and s = sum_t r_t, from ln q_t: step t's share of the budget is
    r_t / s (Dynamic Noise Influence, Lemma 4.1). Scaled by the largest q_t, so no q_t range overflows s."""
    log_r = 0.5 * (log_q - np.max(log_q))
    return log_r, float(np.sum(np.exp(log_r)))


def optimal_log_shares(log_q) -> np.ndarray:
    """Lemma 4.1 in log space (Dynamic Noise Influence, eq. 6): ln of step t's share of the budget,
    ln(sqrt(q_t) / sum_s sqrt(q_s)), from the log influences ln q_t, t = 1..T. Any finite ln q_t (long runs whose
    q_t leave the floating-point range). The noise follows from 1/sigma_t^2 = shares_t R, so sigma_t is proportional
    to q_t^(-1/4). See :func:`optimal_allocation`."""
    log_r, s = _lemma_4_1(_vector("log_q", log_q, positive=False))
    return log_r - math.log(s)


def optimal_allocation(q, R: float) -> Allocation:
    """Optimal noise schedule for influences q_1..q_T > 0 under the paper's budget R = 2 rho
    (Dynamic Noise Influence, Lemma 4.1 eq. 6; Cauchy-Schwarz). It is unique: step t's share of the budget is
    proportional to sqrt(q_t). The minimum of R sum_t q_t sigma_t^2 is (sum_t sqrt(q_t))^2. The uniform schedule
    gives T sum_t q_t, which is larger by T^2 Var_t[sqrt(q_t)] (eq. 25; the print's "Var[q_t]" should read
    sqrt(q_t))."""
    q = _vector("q", q)
    R = _positive("R", R)
    log_r, s = _lemma_4_1(np.log(q))
    shares = np.exp(log_r) / s
    sigma = np.sqrt(1.0 / (R * shares))
    bound = float(np.max(q)) * s * s
    return Allocation(shares=shares, sigma=sigma, step_rho=shares * (R / 2.0), bound=bound)


def gd_optimal_sigma(
    T: int, R: float, *, kappa: float | None = None, gamma: float | None = None
) -> np.ndarray:
    """The ERUB-optimal schedule of PGD for T steps (Dynamic Noise Influence, Thm 4.3 eq. 7, Lemma 4.1 applied to
    q_t = alpha gamma^(T - t))::

        sigma_t^2 = (1/R) gamma^((t - T)/2) (1 - gamma^(T/2)) / (1 - sqrt(gamma)),     t = 1..T.

    It is an exact exponential decay: sigma_{t+1}/sigma_t = gamma^(1/4). It does not depend on alpha, and
    sum_t 1/sigma_t^2 = R. Give exactly one of kappa (> 1) or gamma (in (0, 1)). gamma = 0 (kappa = 1) is refused
    because it would put the whole budget on the last step.
    """
    if (kappa is None) == (gamma is None):
        raise ConfigError("give exactly one of kappa or gamma; accepted: kappa > 1 or gamma in (0, 1)")
    if gamma is None:
        k = _kappa(kappa)
        if k == 1:
            raise ConfigError(
                f"kappa={kappa!r} is invalid here; accepted: kappa > 1 (kappa = 1 spends all on step T)"
            )
        g, _, one_minus_sqrt = _gamma_parts(k)
    else:
        g = _gamma(gamma)
        if g == 0:
            raise ConfigError(
                f"gamma={gamma!r} is invalid here; accepted: gamma in (0, 1) (0 spends all on step T)"
            )
        one_minus_sqrt = (1.0 - g) / (1.0 + math.sqrt(g))
    T = _steps(T)
    R = _positive("R", R)
    t = np.arange(1, T + 1, dtype=float)
    lg = math.log(g)
    # (1 - gamma^(T/2)) / (1 - sqrt(gamma)) = sum_{s=0}^{T-1} gamma^(s/2), computed as -expm1 / (1 - sqrt(gamma))
    geo = -math.expm1(0.5 * T * lg) / one_minus_sqrt
    sigma2 = np.exp(0.5 * (t - T) * lg) * geo / R
    return np.sqrt(sigma2)


# ----------------------------------------------------------------------------------------------------------------
# dynamic (GD-optimal) schedule: Theorem 4.3


def erub_dynamic(T: float, kappa: float, alpha: float) -> float:
    """ERUB of PGD with the optimal schedule of :func:`gd_optimal_sigma`, as a function of T
    (Dynamic Noise Influence, Thm 4.3 proof)::

        ERUB_dyn(T) = gamma^T + alpha ((1 - gamma^(T/2)) / (1 - sqrt(gamma)))^2.

    Accepts any real T >= 0 (T = 0: ERUB = 1). For integer T >= 1 it equals :func:`erub_gd` of that schedule and
    never exceeds :func:`erub_uniform` (Cauchy-Schwarz).
    """
    T = _real_steps(T)
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    gamma, _, one_minus_sqrt = _gamma_parts(kappa)
    s = _pow(gamma, T / 2.0)
    return s * s + alpha * ((1.0 - s) / one_minus_sqrt) ** 2


def dynamic_T_continuous(kappa: float, alpha: float) -> tuple[float, float]:
    """Exact continuous minimiser of ERUB_dyn(T) and the minimum (Dynamic Noise Influence, Thm 4.3 proof eq. 26)::

        T* = 2 log_gamma(alpha / (alpha + (1 - sqrt(gamma))^2)) = (2 / ln(1/gamma)) ln(1 + (1 - sqrt(gamma))^2 / alpha),
        ERUB_min = a / (1 + a),    a = alpha / (1 - sqrt(gamma))^2.

    Since kappa <= 1/(1 - sqrt(gamma)) <= 2 kappa, ERUB_min = Theta(kappa^2 alpha / (1 + kappa^2 alpha)) (eq. 8).
    At kappa = 1 (gamma = 0) the limits kappa -> 1+ are returned: T* = 0 and alpha / (1 + alpha).
    """
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    _, L, one_minus_sqrt = _gamma_parts(kappa)
    c = one_minus_sqrt**2
    a = alpha / c
    T = 0.0 if math.isinf(L) else 2.0 * math.log1p(c / alpha) / L
    return T, a / (1.0 + a)


def dynamic_T_argmin(kappa: float, alpha: float) -> tuple[int, float]:
    """Integer T >= 0 minimising ERUB_dyn(T) and its ERUB (Dynamic Noise Influence, Thm 4.3).

    Exact: ERUB_dyn is s^2 + a (1 - s)^2 in s = gamma^(T/2), which decreases in T. So ERUB_dyn is unimodal in T,
    and the integer minimiser is the floor or the ceiling of eq. 26's T*. Ties go to the smaller T. At kappa = 1 it
    is T = 1 (ERUB alpha) when alpha < 1, else T = 0 (ERUB 1).
    """
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    T_star, _ = dynamic_T_continuous(kappa, alpha)

    def f(t):
        return erub_dynamic(t, kappa, alpha)

    if T_star == 0.0:
        return _best_integer(f, (0, 1))
    return _best_integer(f, (0, math.floor(T_star), math.ceil(T_star)))


def bound_summary(kappa: float, alpha: float) -> dict[str, float | int]:
    """Optimal step counts and ERUBs of PGD (eta = 1/M) for given kappa = M/mu and alpha (Dynamic Noise Influence,
    Eq. 2). These two constants are the only inputs of the GD bounds.

    Keys:
    - T_uniform, erub_uniform: integer argmin of eq. 21 (uniform sigma_t^2 = T/R) and its ERUB.
    - T_uniform_paper, erub_uniform_paper: the paper's closed form, eqs. 23-24 (real T, not the minimiser).
    - T_dynamic_continuous, erub_dynamic: eq. 26's exact continuous minimiser and a/(1+a) (Thm 4.3).
    - T_dynamic: the integer argmin of ERUB_dyn (floor or ceiling of T_dynamic_continuous).
    """
    T_u, e_u = uniform_T_argmin(kappa, alpha)
    T_up, e_up = uniform_T_paper(kappa, alpha)
    T_dc, e_d = dynamic_T_continuous(kappa, alpha)
    T_d, _ = dynamic_T_argmin(kappa, alpha)
    return {
        "T_uniform": int(T_u),
        "erub_uniform": float(e_u),
        "T_uniform_paper": float(T_up),
        "erub_uniform_paper": float(e_up),
        "T_dynamic_continuous": float(T_dc),
        "erub_dynamic": float(e_d),
        "T_dynamic": int(T_d),
    }
