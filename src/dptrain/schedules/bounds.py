"""Utility bounds of "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021
submission; cited below as "Dynamic Noise Influence"): the expected-risk upper bound (ERUB) of private gradient
descent (PGD) under a per-step noise schedule sigma_t, the step count T that minimises it, and the optimal
allocation of a privacy budget over the steps, and the influences q_t those rest on. numpy only (no torch, no scipy).
This module is the one place where the paper's formulas live: :mod:`dptrain.schedules.kinds` builds its schedule
shapes from the influences and the allocation here.

Setting (Dynamic Noise Influence, Sec. 3 and Eq. 1). Per-sample losses are G-Lipschitz, the empirical loss f is
M-smooth and satisfies the Polyak-Lojasiewicz condition with constant mu. Step t releases
``g_t = grad_t + sigma_t * G * nu_t / N`` with ``nu_t ~ N(0, I_D)``, so ``sigma_t`` multiplies the sensitivity G/N of
the mean gradient. The quantities used throughout are (Dynamic Noise Influence, Eq. 2)::

    kappa = M / mu >= 1,    gamma = 1 - 1/kappa in [0, 1),
    alpha = D G^2 / (2 R M N^2 (f(theta_1) - f(theta*)))          (dimensionless, > 0)

ERUB is the bound on E f(theta_{T+1}) - f(theta*) divided by the initial gap f(theta_1) - f(theta*): 1 means
"no better than not training". Everything "optimal" here minimises this *upper bound*, not the true loss.

The ERUB functions take kappa and use the paper's step size eta = 1/M (gamma = 1 - 1/kappa). The influences take
gamma itself, so they serve any step size: :func:`gamma_from_kappa` gives gamma for the step eta/M, and
:func:`momentum_gamma` gives the momentum contraction of Thm 4.4. Each influence has a log-space form
(``log_gd_influence``, ``log_momentum_influence``, ``log_momentum_influence_two_exp``, and :func:`optimal_log_shares`
for Lemma 4.1) for long runs, where gamma^(T - t) leaves the floating-point range. The linear forms are their
exponentials.

Budget convention (Dynamic Noise Influence, Thm 3.1 and Lemma B.2). The paper's budget ``R`` charges step t
``1/sigma_t^2`` and requires ``sum_t 1/sigma_t^2 <= R``. A Gaussian release with multiplier sigma is
``1/(2 sigma^2)``-zCDP, so a run that spends R is ``rho``-zCDP with **R = 2 rho**. Every function here takes the
paper's ``R``; use :func:`R_from_rho` / :func:`rho_from_R` or :func:`R_from_eps_delta` to convert.
:func:`R_from_eps_delta` inverts the paper's Lemma B.3 with the minus root. The paper prints "+", which is the
wrong root: only "-" reproduces its own numbers, (epsilon, delta) = (4, 1e-8) -> rho = 0.1963 and R = 0.3927 (App. D).

Readings and choices where the paper's print is garbled or uncertain (each is a keyword parameter or is
documented where it is used):

- Thm 4.6 constant c1 defaults to ``2 / (gamma (gamma - beta^2))``. This is rebuilt from a garbled print of
  the proof in App. C.2.
- Thm 4.6 constant c2 is printed only as "some positive constant" plus a garbled formula. It defaults to
  ``gamma^T_hat / (gamma - beta^2)``. This is our derived reading: the smallest constant for which the main-text form
  ``gamma^(T_hat - 1) c2 gamma^(T - t)`` bounds the proof's term
  ``gamma^(2(T_hat - 1)) (gamma^(T + 1 - t) - beta^(2(T + 1 - t))) / (gamma - beta^2)`` for all t > T_hat.
- Thm 4.4 prints "beta = gamma" as an assumption. It is read as beta != gamma (Thm 4.6 assumes beta < gamma).
  The momentum step size is read as eta_t = eta0 / (2M) with contraction gamma = 1 - eta0/kappa. Both are
  rebuilt from a garbled print.
- Lemma 4.1 / Eq. 25: the gap between the uniform and the optimal noise term is ``T^2 Var_t[sqrt(q_t)]``. This
  uses the population variance of sqrt(q_t), as the lemma's wording and the algebra require. The printed
  "Var[q_t]" is a typo.
- Eq. 7 also prints T in a garbled "2 kappa ln(1 + ...)" form. That form is only an upper bound on T. The exact
  continuous minimiser of Eq. 26 is used instead.

Known inconsistencies in the paper, not reproduced: Eq. 23's T tends to 1/alpha (not to 0) as kappa -> infinity.
Eq. 23 is a rate device, not the minimiser of Eq. 21 (kappa=10, alpha=1e-3: T = 44.29, ERUB 0.448, while the
integer argmin is T = 21 with ERUB 0.296). Both are returned. The example "beta = 0.9, gamma = 0.99 gives eta0 <=
0.98/M" under Thm 4.4 contradicts the printed condition, which gives eta0 <= 0.003014 (:func:`momentum_eta0_max`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dptrain.errors import ConfigError

__all__ = [
    "Allocation",
    "R_from_eps_delta",
    "R_from_rho",
    "alpha_constant",
    "bound_summary",
    "dynamic_T_argmin",
    "dynamic_T_continuous",
    "eps_from_R",
    "erub_dynamic",
    "erub_gd",
    "erub_gd_from_shares",
    "erub_momentum",
    "erub_uniform",
    "gamma_from_kappa",
    "gd_influence",
    "gd_optimal_sigma",
    "kappa_from_gamma",
    "log_gd_influence",
    "log_momentum_influence",
    "log_momentum_influence_two_exp",
    "momentum_T_hat",
    "momentum_U3",
    "momentum_eta0_max",
    "momentum_gamma",
    "momentum_influence",
    "momentum_influence_two_exp",
    "noise_term",
    "optimal_allocation",
    "optimal_log_shares",
    "rho_from_R",
    "uniform_T_argmin",
    "uniform_T_paper",
]

_BUDGET_RTOL = 1e-9  # a schedule may overspend R by this relative amount (floating-point sums)


# ----------------------------------------------------------------------------------------------------------------
# input checks (each raises ConfigError with a one-line message naming the parameter, the value and what is accepted)


def _real(name: str, x) -> float:
    if isinstance(x, bool | str | bytes):
        raise ConfigError(f"{name}={x!r} is not a number; accepted: a finite real number")
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={x!r} is not a number; accepted: a finite real number") from None
    return v


def _positive(name: str, x) -> float:
    v = _real(name, x)
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{name}={x!r} is invalid; accepted: a finite number > 0")
    return v


def _kappa(kappa) -> float:
    v = _real("kappa", kappa)
    if not (math.isfinite(v) and v >= 1):
        raise ConfigError(f"kappa={kappa!r} is invalid; accepted: a finite number >= 1 (kappa = M/mu)")
    return v


def _gamma(gamma) -> float:
    v = _real("gamma", gamma)
    if not (0 <= v < 1):
        raise ConfigError(f"gamma={gamma!r} is invalid; accepted: a number in [0, 1) (gamma = 1 - 1/kappa)")
    return v


def _beta(beta) -> float:
    v = _real("beta", beta)
    if not (0 <= v < 1):
        raise ConfigError(f"beta={beta!r} is invalid; accepted: a momentum coefficient in [0, 1)")
    return v


def _steps(T) -> int:
    """T as a Python int >= 1 (integral floats accepted)."""
    if isinstance(T, bool):
        raise ConfigError(f"T={T!r} is invalid; accepted: an integer number of steps >= 1")
    v = _real("T", T)
    if not (math.isfinite(v) and v >= 1 and v == int(v)):
        raise ConfigError(f"T={T!r} is invalid; accepted: an integer number of steps >= 1")
    return int(v)


def _real_steps(T) -> float:
    v = _real("T", T)
    if not (math.isfinite(v) and v >= 0):
        raise ConfigError(f"T={T!r} is invalid; accepted: a finite number of steps >= 0")
    return v


def _vector(name: str, v, positive: bool = True) -> np.ndarray:
    """A non-empty 1-D array of finite floats, all > 0 when ``positive`` (else logarithms: any finite number)."""
    accepted = "finite numbers > 0" if positive else "finite numbers"
    try:
        a = np.asarray(v, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} is not numeric; accepted: a 1-D sequence of {accepted}") from None
    if a.ndim != 1 or a.size == 0:
        raise ConfigError(f"{name} has shape {a.shape}; accepted: a non-empty 1-D sequence of {accepted}")
    bad = ~(np.isfinite(a) & (a > 0)) if positive else ~np.isfinite(a)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(
            f"{name}[{i}]={float(a[i])!r} (t={i + 1}) is invalid; accepted: {accepted} in every entry"
        )
    return a


def _gamma_parts(kappa: float) -> tuple[float, float, float]:
    """(gamma, ln(1/gamma), 1 - sqrt(gamma)) for gamma = 1 - 1/kappa, computed without cancellation.
    ln(1/gamma) is inf at kappa = 1."""
    gamma = gamma_from_kappa(kappa)
    log_inv = -math.log1p(-1.0 / kappa) if kappa > 1 else math.inf
    one_minus_sqrt = (1.0 / kappa) / (1.0 + math.sqrt(gamma))  # 1 - sqrt(g) = (1 - g) / (1 + sqrt(g))
    return gamma, log_inv, one_minus_sqrt


def _log_pow(gamma: float, x):
    """ln gamma**x (elementwise for an array x >= 0) with 0**0 = 1 and 0**x = 0 for x > 0 (ln: 0 and -inf)."""
    if gamma == 0.0:
        return np.where(np.asarray(x) == 0, 0.0, -np.inf)
    return x * math.log(gamma)


def _pow(gamma: float, x: float) -> float:
    """gamma**x with 0**0 = 1 and 0**x = 0 for x > 0."""
    return math.exp(float(_log_pow(gamma, x)))


# ----------------------------------------------------------------------------------------------------------------
# constants and budget conversions


def gamma_from_kappa(kappa: float, eta: float = 1.0) -> float:
    """gamma of gradient descent with step size eta/M on an M-smooth, mu-PL loss, kappa = M/mu:
    gamma = 1 - eta (2 - eta)/kappa, in [0, 1). It is the per-step contraction 1 - 2 mu eta_t (1 - M eta_t / 2) of the
    proof of Dynamic Noise Influence, Thm 4.1 (App. C.1), at eta_t = eta/M (derived here). The paper takes eta = 1,
    which gives its gamma = 1 - 1/kappa (Eq. 2); eta in (0, 2)."""
    kappa = _kappa(kappa)
    eta = _real("eta", eta)
    if not 0 < eta < 2:
        raise ConfigError(f"eta={eta!r} is invalid; accepted: a number in (0, 2) (the step size times M)")
    return max(0.0, 1.0 - eta * (2.0 - eta) / kappa)  # eta (2 - eta) <= 1: never below 0 but for rounding


def kappa_from_gamma(gamma: float) -> float:
    """kappa = 1/(1 - gamma) >= 1, the inverse of gamma = 1 - 1/kappa (Dynamic Noise Influence, Eq. 2; eta = 1)."""
    return 1.0 / (1.0 - _gamma(gamma))


def momentum_gamma(kappa: float, eta0: float) -> float:
    """gamma of gradient descent with bias-corrected momentum and step size eta0/(2M): gamma = 1 - eta0/kappa, in
    [0, 1) for eta0 in (0, kappa] (Dynamic Noise Influence, Thm 4.4; rebuilt from a garbled print of its proof)."""
    kappa = _kappa(kappa)
    eta0 = _real("eta0", eta0)
    if not 0 < eta0 <= kappa:
        raise ConfigError(f"eta0={eta0!r} is invalid; accepted: a number in (0, kappa] = (0, {kappa:g}]")
    return max(0.0, 1.0 - eta0 / kappa)


def alpha_constant(*, D: float, G: float, M: float, N: float, R: float, initial_gap: float) -> float:
    """alpha = D G^2 / (2 R M N^2 (f(theta_1) - f(theta*))) (Dynamic Noise Influence, Eq. 2).

    D: parameter dimension; G: per-sample Lipschitz constant (the clip norm when gradients are clipped);
    M: smoothness of the empirical loss; N: number of samples (the batch size n for private SGD, Sec. 4.3,
    with R replaced by R/p^2); R: the paper's budget (R = 2 rho); initial_gap: f(theta_1) - f(theta*) > 0.
    """
    D, G, M, N, R = (_positive(k, v) for k, v in (("D", D), ("G", G), ("M", M), ("N", N), ("R", R)))
    gap = _positive("initial_gap", initial_gap)
    return D * G * G / (2.0 * R * M * N * N * gap)


def R_from_rho(rho: float) -> float:
    """The paper's budget R for a rho-zCDP guarantee: R = 2 rho (Dynamic Noise Influence, Thm 3.1)."""
    return 2.0 * _positive("rho", rho)


def rho_from_R(R: float) -> float:
    """The zCDP parameter of a run that spends the paper's budget R: rho = R/2 (Dynamic Noise Influence, Thm 3.1)."""
    return _positive("R", R) / 2.0


def _delta(delta) -> float:
    v = _real("delta", delta)
    if not (0 < v < 1):
        raise ConfigError(f"delta={delta!r} is invalid; accepted: a number in (0, 1)")
    return v


def R_from_eps_delta(eps: float, delta: float) -> float:
    """The paper's budget R = 2 rho for the largest rho with rho + 2 sqrt(rho ln(1/delta)) <= eps
    (Dynamic Noise Influence, Lemma B.3, solved for rho with the minus root: rho = eps + 2L - 2 sqrt(L (eps + L)),
    L = ln(1/delta); the printed "+" root is a typo). (4, 1e-8) gives rho = 0.1963, R = 0.3927 as in App. D."""
    eps = _positive("eps", eps)
    L = -math.log(_delta(delta))
    # eps + 2L - 2 sqrt(L (eps + L)) = eps^2 / (eps + 2L + 2 sqrt(L (eps + L))), without cancellation
    rho = eps * eps / (eps + 2 * L + 2 * math.sqrt(L * (eps + L)))
    return 2.0 * rho


def eps_from_R(R: float, delta: float) -> float:
    """epsilon of the (epsilon, delta)-DP guarantee implied by spending the paper's budget R (rho = R/2):
    eps = rho + 2 sqrt(rho ln(1/delta)) (Dynamic Noise Influence, Lemma B.3)."""
    rho = _positive("R", R) / 2.0
    return rho + 2.0 * math.sqrt(rho * -math.log(_delta(delta)))


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


def _check_budget(sigma: np.ndarray, R: float) -> None:
    spent = float(np.sum(1.0 / (sigma * sigma)))
    if spent > R * (1 + _BUDGET_RTOL):
        raise ConfigError(
            f"sigma spends sum 1/sigma_t^2 = {spent:.6g} > R={R!r}; accepted: schedules within the budget "
            "(Dynamic Noise Influence, Alg. 1)"
        )


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


# ----------------------------------------------------------------------------------------------------------------
# momentum: Theorems 4.4-4.6, Lemma B.7


def _bias_factor(T: int, beta: float) -> np.ndarray:
    """(1 - beta) / (1 - beta^t), t = 1..T (the Adam-style bias correction of Dynamic Noise Influence, Eq. 10)."""
    t = np.arange(1, T + 1, dtype=float)
    with np.errstate(under="ignore"):
        return (1.0 - beta) / -np.expm1(t * math.log(beta)) if beta > 0 else np.ones(T)


def momentum_U3(sigma, beta: float, gamma: float) -> float:
    """Noise-variance term of PGD with bias-corrected momentum (Dynamic Noise Influence, Thm 4.4 eq. 13)::

        U3(sigma, T) = sum_{t=1}^T gamma^(T - t) (1 - beta)^2 / (1 - beta^t)^2 sum_{i=1}^t beta^(2(t - i)) sigma_i^2.

    sigma: noise multipliers sigma_1..sigma_T; beta in [0, 1); gamma in [0, 1) (gamma = 1 - eta0/kappa in Thm 4.4).
    Equals sum_i q_i sigma_i^2 with q from :func:`momentum_influence`.
    """
    sigma = _vector("sigma", sigma)
    beta = _beta(beta)
    gamma = _gamma(gamma)
    T = sigma.size
    b = _bias_factor(T, beta)
    b2 = beta * beta
    total, inner = 0.0, 0.0
    for t in range(T):  # inner_t = sum_{i<=t} beta^(2(t-i)) sigma_i^2 = beta^2 inner_{t-1} + sigma_t^2
        inner = b2 * inner + sigma[t] ** 2
        total = gamma * total + b[t] ** 2 * inner  # Horner form of sum_t gamma^(T-t) (...)
    return float(total)


def log_momentum_influence(T: int, beta: float, gamma: float) -> np.ndarray:
    """ln q_i of :func:`momentum_influence`, finite for any T (Dynamic Noise Influence, Thm 4.4 eq. 13, re-indexed)."""
    T = _steps(T)
    beta = _beta(beta)
    gamma = _gamma(gamma)
    t = np.arange(1, T + 1, dtype=float)
    log_w = _log_pow(gamma, T - t) + 2.0 * np.log(_bias_factor(T, beta))  # ln gamma^(T-t) b_t^2
    if beta == 0.0:
        return log_w
    lb = 2.0 * math.log(beta)
    # q_i = w_i + beta^2 q_{i+1} = beta^(-2i) sum_{t >= i} w_t beta^(2t): a reversed cumulative log-sum-exp.
    tail = np.logaddexp.accumulate((log_w + lb * t)[::-1])[::-1]
    return tail - lb * t


def momentum_influence(T: int, beta: float, gamma: float) -> np.ndarray:
    """Exact per-step noise influence of momentum PGD, obtained by re-indexing U3 (Dynamic Noise Influence,
    Thm 4.4 eq. 13). This is our derivation. It is not printed in the paper, but it is an identity, not a bound::

        q_i = sum_{t=i}^T gamma^(T - t) ((1 - beta)/(1 - beta^t))^2 beta^(2(t - i)),    so  U3 = sum_i q_i sigma_i^2.

    The ERUB of Thm 4.4 (without its non-positive momentum-effect term) is gamma^T + 2 eta0 alpha R sum_i q_i sigma_i^2.
    It never exceeds the paper's bound :func:`momentum_influence_two_exp`, whose first phase (t <= T_hat,
    Lemma B.7) decreases in t: early noise matters most, so the preferred schedule rises (Sec. 4.2). The exact
    influence is less regular than that bound. Example: beta = 0.9, gamma = 0.99 (T_hat = 230). For every
    T <= T_hat, step 1 has the largest influence. It decreases monotonically only for T <= 49. Longer runs dip
    near t = 26 and bump up before the last steps. From T = 205 on, its minimum sits near t = 26 (U-shape).
    beta = 0 gives the GD influence gamma^(T - i). Computed as the exponential of :func:`log_momentum_influence`.
    """
    with np.errstate(under="ignore"):
        return np.exp(log_momentum_influence(T, beta, gamma))


def momentum_T_hat(beta: float, gamma: float) -> int:
    """Phase threshold T_hat = max t such that gamma^(t - 1) >= (1 - beta)/(1 - beta^t)
    (Dynamic Noise Influence, Lemma B.7, Thms 4.5-4.6). The inequality holds exactly for t = 1..T_hat:
    h(t) = gamma^(t-1)(1 - beta^t) starts at 1 - beta, rises, then falls. So a bisection on the first failure is
    exact. Example: beta = 0.9, gamma = 0.99 gives T_hat = 230.
    """
    beta = _beta(beta)
    gamma = _gamma(gamma)
    if gamma == 0.0 or beta == 0.0:
        return 1  # gamma^(t-1) (1 - beta^t) < 1 - beta for every t >= 2

    lg, lb = math.log(gamma), math.log1p(-beta)

    def holds(t: int) -> bool:
        return (t - 1) * lg + math.log(-math.expm1(t * math.log(beta))) >= lb

    lo = 1  # holds(1) is an equality
    hi = int(math.floor(1 + lb / lg)) + 1  # beyond 1 + ln(1-beta)/ln(gamma), gamma^(t-1) < 1 - beta
    while holds(hi):  # defensive; cannot happen by the bound above
        hi *= 2
    while hi - lo > 1:  # invariant: holds(lo), not holds(hi)
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo


def momentum_eta0_max(beta: float, gamma: float) -> float:
    """Largest eta0 allowed by Thm 4.4 of Dynamic Noise Influence (step size eta_t = eta0/(2M))::

        eta0 <= 8 / (sqrt(1 + 64 beta gamma (gamma - beta)^-2 (1 - beta)^-3) + 1),

    which is exactly the condition zeta = 1 - beta gamma eta0^2 / ((gamma - beta)^2 (1 - beta)^3) - eta0/4 >= 0
    (eq. 12; rebuilt from a garbled print). beta = 0.9, gamma = 0.99 gives 0.003014. The paper's text says
    "0.98/M", which contradicts its own condition. Requires beta != gamma (the print says "beta = gamma").
    """
    beta = _beta(beta)
    gamma = _gamma(gamma)
    if beta == gamma:
        raise ConfigError(f"beta={beta!r} equals gamma; accepted: beta != gamma (Thm 4.4)")
    A = beta * gamma / ((gamma - beta) ** 2 * (1 - beta) ** 3)
    return 8.0 / (math.sqrt(1.0 + 64.0 * A) + 1.0)


def log_momentum_influence_two_exp(
    T: int, beta: float, gamma: float, *, c1: float | None = None, c2: float | None = None
) -> np.ndarray:
    """ln q_t of :func:`momentum_influence_two_exp`, finite for any T (Dynamic Noise Influence, Thm 4.6)."""
    T = _steps(T)
    beta = _beta(beta)
    gamma = _gamma(gamma)
    if not beta < gamma:
        raise ConfigError(f"beta={beta!r} >= gamma={gamma!r}; accepted: beta < gamma (Thm 4.6)")
    T_hat = momentum_T_hat(beta, gamma)
    lg = math.log(gamma)  # gamma > beta >= 0
    log_gap = math.log(gamma - beta * beta)  # gamma - beta^2 > gamma - beta > 0
    log_c1 = math.log(2.0 / gamma) - log_gap if c1 is None else math.log(_positive("c1", c1))
    log_c2 = T_hat * lg - log_gap if c2 is None else math.log(_positive("c2", c2))
    t = np.arange(1, T + 1, dtype=float)
    early = log_c1 + (T + t) * lg
    late = (T_hat - 1) * lg + log_c2 + (T - t) * lg
    return np.where(t <= T_hat, early, late)


def momentum_influence_two_exp(
    T: int, beta: float, gamma: float, *, c1: float | None = None, c2: float | None = None
) -> np.ndarray:
    """The paper's two-exponential influence bound for momentum PGD (Dynamic Noise Influence, Thm 4.6)::

        q_t = c1 gamma^(T + t) [t <= T_hat] + gamma^(T_hat - 1) c2 gamma^(T - t) [t > T_hat],     t = 1..T,

    with T_hat from :func:`momentum_T_hat`. It needs beta < gamma. Defaults:

    - c1 = 2 / (gamma (gamma - beta^2)), rebuilt from a garbled print of the proof.
    - c2 = gamma^T_hat / (gamma - beta^2). The print is garbled ("some positive constant"). This default is our
      derived reading: the smallest c2 for which this form bounds the proof's term
      gamma^(2(T_hat - 1)) (gamma^(T + 1 - t) - beta^(2(T + 1 - t))) / (gamma - beta^2).

    Pass your own c1, c2 (> 0) to use other constants, for example ones fitted by grid search as in Sec. 5
    ("momexpinfl"). Computed as the exponential of :func:`log_momentum_influence_two_exp`.
    """
    with np.errstate(under="ignore"):
        return np.exp(log_momentum_influence_two_exp(T, beta, gamma, c1=c1, c2=c2))


def erub_momentum(sigma, R: float, kappa: float, alpha: float, beta: float, eta0: float) -> float:
    """ERUB of PGD with bias-corrected momentum, step eta_t = eta0/(2M) (Dynamic Noise Influence, Thm 4.4 eq. 11)::

        ERUB <= gamma^T + 2 R eta0 alpha U3(sigma, T),    gamma = 1 - eta0/kappa,

    without the non-positive momentum-effect term, which has a garbled coefficient and only helps. Requires
    0 < eta0 < kappa, beta != gamma, eta0 <= :func:`momentum_eta0_max` (zeta >= 0), and sum 1/sigma_t^2 <= R.
    Step size and gamma are rebuilt from a garbled print.
    """
    sigma = _vector("sigma", sigma)
    R = _positive("R", R)
    kappa = _kappa(kappa)
    alpha = _positive("alpha", alpha)
    beta = _beta(beta)
    eta0 = _positive("eta0", eta0)
    if not eta0 < kappa:
        raise ConfigError(f"eta0={eta0!r} >= kappa={kappa!r}; accepted: 0 < eta0 < kappa (Thm 4.4)")
    gamma = momentum_gamma(kappa, eta0)
    limit = momentum_eta0_max(beta, gamma)
    if eta0 > limit:
        raise ConfigError(
            f"eta0={eta0!r} is above the Thm 4.4 limit {limit:.6g} for beta={beta}, gamma=1-eta0/kappa={gamma:.6g}; "
            "accepted: eta0 <= 8/(sqrt(1 + 64 beta gamma (gamma-beta)^-2 (1-beta)^-3) + 1)"
        )
    _check_budget(sigma, R)
    return _pow(gamma, sigma.size) + 2.0 * R * eta0 * alpha * momentum_U3(sigma, beta, gamma)
