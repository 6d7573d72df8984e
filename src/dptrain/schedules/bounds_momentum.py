"""The noise influence and utility bound of private gradient descent with bias-corrected momentum in "On Dynamic
Noise Influence in Differential Private Learning" (anonymous ICLR 2021 submission; "Dynamic Noise Influence"): the
noise term U3 and the ERUB (Thm 4.4), its exact per-step influence (our re-indexing of U3), the phase threshold
T_hat (Lemma B.7) and the paper's two-exponential influence bound (Thms 4.5-4.6). Readings of garbled prints are
listed in :mod:`dptrain.schedules.bounds`. numpy only."""

from __future__ import annotations

import math

import numpy as np

from dptrain.accounting.calibration import bisect_largest
from dptrain.errors import ConfigError
from dptrain.schedules.bounds_constants import momentum_gamma
from dptrain.schedules.bounds_inputs import (
    _beta,
    _check_budget,
    _gamma,
    _kappa,
    _log_pow,
    _positive,
    _pow,
    _steps,
    _vector,
)


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
    return bisect_largest(holds, lo, hi)


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
