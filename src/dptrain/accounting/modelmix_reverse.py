"""A bound on the reverse ordering of a Poisson-subsampled pair from power moments (ours), for the ``modelmix``
accountant (Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix"; docs/modelmix.md).

The reverse ordering of one subsampled step is D_a(P_0 || (1-q) P_0 + q P_v) = 1/(a-1) log E_P0[f(L)] with
f(L) = ((1-q) + q L)^(1-a) and L = L_v the likelihood ratio of the shift v. The paper bounds only the other ordering,
and its one-hot worst case does not hold for this one (docs/modelmix.md, "Soundness review"). What is known for
EVERY admissible shift v (the accountant computes the numbers):

- E_P0[L] = 1;
- E_P0[L^lam] >= beta_lam for lam in (0, 1) (:data:`HELLINGER_POWERS`): log E_P0[L_v^lam] is a sum over the
  coordinates of h(v_j), h(s) = log E_P0[L_s^lam] <= 0, so with kappa = sup_{0 < s <= s_max} -h(s)/s^2 and
  ||v||_2 <= 1, E_P0[L_v^lam] >= exp(-kappa) = beta_lam (no worst-case-shift argument needed);
- E_P0[L^2] <= A_2, the second moment at the one-hot (p-hot) shift (the paper's App. C convexity argument).

Weak duality (ours): for every h(L) = c0 + c1 L - sum_lam m_lam L^lam + b L^2 with m, b >= 0 and h >= f on [0, inf),
E f(L) <= c0 + c1 - sum m_lam beta_lam + b A_2. :func:`log_reverse_moment_bound` picks (c0, c1, m, b) by a linear
program on a grid, then makes h >= f hold on the whole half-line by raising c0 by a proven margin (a second-derivative
bound between grid points, monotonicity beyond the grid), so the result is a bound whatever the solver returned.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize

#: the fractional powers lam whose moments E[L^lam] are bounded below (L = t^4 makes them t, t^2, t^3)
HELLINGER_POWERS = (0.25, 0.5, 0.75)

_T_MAX = 6.0  # the grid covers t = L^(1/4) in [0, 6], L <= 1296; beyond it h is checked to be non-decreasing
_T_GRID = np.unique(np.concatenate([np.linspace(0.0, 1.5, 1201), np.linspace(1.5, _T_MAX, 601)]))  # verification
_T_START = np.union1d(_T_GRID[::12], [1.0])  # the program starts on every 12th point and L = 1, and adds
# the most violated points of the verification grid
_ROUNDS = 6
_REFINE = 16  # the verification splits every grid interval in 16


def _f(t: np.ndarray, q: float, a: float) -> np.ndarray:
    return np.exp((1.0 - a) * np.log1p(q * (t**4 - 1.0)))


def _h(t: np.ndarray, coef: np.ndarray) -> np.ndarray:
    c0, c1, m1, m2, m3, b = coef
    return c0 + c1 * t**4 - m1 * t - m2 * t**2 - m3 * t**3 + b * t**8


_FINE = np.append(_T_GRID[:-1, None] + np.diff(_T_GRID)[:, None] * np.arange(_REFINE) / _REFINE, _T_MAX)
_LO, _HI, _D = _FINE[:-1], _FINE[1:], np.diff(_FINE)
_LO4, _HI2, _HI6 = _LO**4, _HI**2, _HI**6


def _margin(coef: np.ndarray, q: float, a: float) -> float | None:
    """How much c0 must rise for h >= f on [0, inf) (>= 0), or None when h may fall below f beyond the grid."""
    c0, c1, m1, m2, m3, b = coef
    t, hi, d = _FINE, _HI, _D
    g = _h(t, coef) - _f(t, q, a)
    y_lo = 1.0 + q * (_LO4 - 1.0)  # (1-q) + q L is increasing in t: its smallest value on the interval
    # |h''| and |f''| on [lo, hi] (increasing factors at hi, decreasing ones at lo)
    h2 = 12 * abs(c1) * _HI2 + 2 * m2 + 6 * m3 * hi + 56 * b * _HI6
    y_pow = np.exp(-a * np.log(y_lo))  # y_lo^-a
    f2 = (a - 1) * (a * 16 * q * q * _HI6 * y_pow / y_lo + 12 * q * _HI2 * y_pow)
    # g >= min(g(lo), g(hi)) - max|g''| d^2 / 8 on each interval; 1e-12 covers rounding in g
    need = float(np.max((h2 + f2) * d * d / 8 - np.minimum(g[:-1], g[1:]))) + 1e-12
    need = max(need, 0.0)
    # beyond the grid f decreases, so h - f stays >= its value at t_max if h is non-decreasing there:
    # h'(L) = c1 + 2 b L - sum m_lam lam L^(lam - 1) >= its value at L_max for L >= L_max
    big_l = _T_MAX**4
    slope = c1 + 2 * b * big_l - sum(m * lam * big_l ** (lam - 1) for m, lam in zip((m1, m2, m3), HELLINGER_POWERS,
                                                                                   strict=True))
    return need if slope >= 0 else None


def log_reverse_moment_bound(q: float, a: float, log_betas: tuple[float, ...], chi2: float) -> float:
    """An upper bound on log E_P0[((1-q) + q L)^(1-a)] over all laws of L >= 0 with E L = 1,
    E L^lam >= exp(log_betas[i]) for lam = HELLINGER_POWERS[i], and E L^2 <= 1 + chi2 (module docstring). Returns
    +inf when the linear program gives no certifiable answer (the caller then uses another bound)."""
    if not (0 < q < 1) or a <= 1:
        raise ValueError("needs 0 < q < 1 and a > 1")
    betas = np.exp(np.asarray(log_betas, dtype=float))
    # variables c0, c1 (free), m1, m2, m3, b (>= 0); h(t) >= f(t) on the points t (cutting planes: start on a
    # coarse grid, add the points of the verification grid where h falls furthest below f, solve again)
    cost = np.array([1.0, 1.0, -betas[0], -betas[1], -betas[2], 1.0 + chi2])
    bounds = [(None, None), (None, None), (0, None), (0, None), (0, None), (0, None)]
    if not math.isfinite(chi2):
        cost[5], bounds[5] = 0.0, (0, 0)
    f_all = _f(_T_GRID, q, a)
    t = _T_START
    for _ in range(_ROUNDS):
        a_ub = -np.column_stack([np.ones_like(t), t**4, -t, -(t**2), -(t**3), t**8])
        res = optimize.linprog(cost, A_ub=a_ub, b_ub=-_f(t, q, a), bounds=bounds, method="highs")
        if res.status != 0:
            return math.inf
        gap = _h(_T_GRID, res.x) - f_all
        worst = np.argsort(gap)[:24]
        if gap[worst[0]] >= -1e-3 * max(res.fun - 1.0, 1e-12):  # the margin below then costs <= 0.1% of it
            break
        t = np.unique(np.concatenate([t, _T_GRID[worst[gap[worst] < 0]]]))
    coef = np.maximum(res.x, [-np.inf, -np.inf, 0, 0, 0, 0])
    need = _margin(coef, q, a)
    if need is None:
        return math.inf
    value = coef[0] + need + coef[1] - float(np.dot(coef[2:5], betas)) + (coef[5] * (1.0 + chi2) if coef[5] else 0.0)
    return math.log(value) if value > 0 else math.inf
