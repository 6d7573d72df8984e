"""The ``modelmix`` accountant: DP-SGD whose update mixes the last two iterates with secret uniform weights.

Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix": each step releases
``w_k = mix - eta (G + N) / B`` where coordinate j of ``mix`` is uniform on a segment of width at least
``tau`` between the two previous (released) iterates. Divided by eta and in units of the per-example bound
``C / B``, one coordinate of a step's output is the shift (the neighbour's gradient, at most 1), plus
Gaussian noise of std ``z`` (the noise multiplier), plus a uniform of width ``w = (tau / eta) B / C``:

    P_v = N(v, z^2) * U[-w/2, w/2]          (Thm 4.1; "*" is convolution)

The paper bounds one Poisson-subsampled step by ``D_a((1 - q) P_0 + q P_1 || P_0)`` (Thm 4.1, its one-hot worst
case; Cor. 4.1: with per-coordinate bound ``1/sqrt(p)`` the worst case is p coordinates shifted by
``1/sqrt(p)``, so ``A_k`` enters to the power p), composes steps in RDP and converts with its Thm 2.2.

What this module computes, per step and per order a (numpy/scipy only):

- **forward** ("the paper's direction") ``1/(a-1) log E_P0[((1-q) + q L)^a]``, L the likelihood ratio of the
  worst shift: for p = 1 by direct quadrature of the log-space integrand at any real a > 1; for p > 1 by Cor.
  4.1's binomial form at integer orders, ``log sum_k C(a,k) (1-q)^(a-k) q^k A_k^p`` with
  ``A_k = E_P0[L_{1/sqrt p}^k]`` (corrected: the printed formula divides by 1 - a and drops the factor T).
- **reverse** ``1/(a-1) log E_P0[((1-q) + q L)^(1-a)]``, the other ordering of a neighbouring pair, which the
  paper does not bound for N * U (it cites a theorem proven for pure Gaussians): at the one-hot shift by
  quadrature (reported as ``epsilon_reverse_one_hot_not_a_bound``: the one-hot shift is not the worst case of this
  ordering), and for every admissible shift by :func:`reverse_rdp_bound` (certified: the smallest of a trivial, a
  second-moment and a power-moment bound, :mod:`dptrain.accounting.modelmix_reverse`).

What is certified (docs/modelmix.md, "Soundness review"): the paper's worst-case argument (App. C: log A_k is
convex in the squared shift, so a one-hot or p-hot shift maximises every integer moment) holds for integer
moments, and our numerical review found the one-hot / p-hot shift is NOT the worst case in general (in convex
order, e.g. for fractional orders or hockey-stick divergences). So the certificate uses the forward direction at
integer orders (CERTIFIED_ORDERS) and the reverse through bounds valid for every shift (:func:`reverse_rdp_bound`);
the paper's fractional-order numbers and the exact one-hot reverse are reported beside it, not certified.

The densities are closed form (App. D.1): ``p_0(o) = (Phi((o + w/2)/z) - Phi((o - w/2)/z)) / w``, evaluated in
log space with ``log_ndtr``. Integrals use the trapezoid rule on a uniform grid of step z/40 over the whole
support of the (tilted) integrand, in log space (logsumexp): the integrands are smooth at scale z, where this
rule converges faster than any power of the step (checked against adaptive quadrature in the tests).

Epsilon: RDP composed over steps (tau phases add, App. E), converted with the improved conversion of Canonne,
Kamath & Steinke / Asoodeh et al. (dp_accounting's ``compute_epsilon``), minimised over the orders. The paper's own
number (forward only, its Thm 2.2 conversion ``T RDP(a) + log(1/delta)/(a-1)``) is reported beside it.

The soundness review (what survives of the paper's proof, what is certified and on which range) is
docs/modelmix.md; :data:`CERTIFIED_RANGE` is the parameter range it checked numerically.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

from dptrain.accounting.base import PrivacyReport, epsilon, register_accountant
from dptrain.accounting.checks import check_delta, check_noise_multiplier
from dptrain.accounting.ledger import (
    TRAINING_MECHANISMS,
    Ledger,
    gaussian_step_event,
    step_facts,
)
from dptrain.accounting.modelmix_reverse import HELLINGER_POWERS, log_reverse_moment_bound
from dptrain.accounting.standard import check_noise, finite_epsilon, refuse_search
from dptrain.errors import AccountingError, ConfigError

#: Fractional and integer orders for p = 1 (direct quadrature). Any set of orders gives a valid bound; a denser
#: one a tighter bound. Dense near 1: in the large-epsilon regime of the paper's Fig. 3 the optimum is below 2.
FRACTIONAL_ORDERS = tuple(
    float(a)
    for a in np.round(
        np.concatenate(
            [
                np.arange(1.01, 2.0, 0.01),
                np.arange(2.0, 5.0, 0.05),
                np.arange(5.0, 12.0, 0.25),
                np.arange(12, 65, 1.0),
                [72, 80, 96, 112, 128, 160, 192, 256],
            ]
        ),
        4,
    )
)
#: Integer orders for p > 1 (Cor. 4.1's binomial form needs integers).
INTEGER_ORDERS = tuple(float(a) for a in [*range(2, 65), 72, 80, 96, 112, 128, 160, 192, 256])
#: The orders at which the forward direction is certified: integers whose moment E[L^k] the soundness review
#: checked to be convex in the squared shift (the paper's App. C argument, valid for integer moments only).
CERTIFIED_ORDERS = tuple(float(a) for a in [*range(2, 33), 40, 48, 56, 64])

#: Where the numerical soundness review (docs/modelmix.md) checked what the certificate relies on (the integer
#: moments' worst case is one-hot / p-hot, the divergence does not grow with the uniform width): noise multiplier
#: z, width over sensitivity w (grid: z in {0.3, 0.3633, 0.5, 1, 2, 4, 8}, w in {0, 0.5, ..., 250}). A phase above
#: it is accounted at a dominating phase inside it (:func:`reviewed_phase`); below it (z < 0.3) the accountant still
#: answers, but with ``certified: false``.
CERTIFIED_RANGE = {"noise_multiplier": (0.3, 8.0), "width": (0.0, 250.0)}

_STEPS_PER_Z = 40  # grid step z / 40
_TAILS = 40.0  # the grid reaches 40 z beyond the support's edges: p_0 is below e^-800 there
#: The most points a quadrature grid may have (a width w or an order thousands of times z past the reviewed range
#: would ask for terabytes): beyond, refused in one line.
MAX_GRID_POINTS = 20_000_000


def log_density(o: np.ndarray, z: float, w: float) -> np.ndarray:
    """log p_0(o) of N(0, z^2) * U[-w/2, w/2] (App. D.1), stable in the tails (symmetric: evaluated at |o|)."""
    o = np.abs(np.asarray(o, dtype=np.float64))
    if w == 0:
        return -0.5 * (o / z) ** 2 - math.log(z) - 0.5 * math.log(2 * math.pi)
    a, b = (o - w / 2) / z, (o + w / 2) / z
    log_qa, log_qb = special.log_ndtr(-a), special.log_ndtr(-b)  # upper tails Q(a) >= Q(b)
    return log_qa + np.log(-np.expm1(log_qb - log_qa)) - math.log(w)


@functools.lru_cache(maxsize=256)
def _grid(z: float, w: float, shift: float, reach: float) -> tuple[np.ndarray, np.ndarray, float]:
    """(log p_0, log L) on the uniform grid covering [-w/2 - 40z - shift, w/2 + reach + 40z], and its step."""
    h = z / _STEPS_PER_Z
    lo, hi = -w / 2 - _TAILS * z - shift, w / 2 + reach + _TAILS * z
    points = math.ceil((hi - lo) / h) + 1
    if points > MAX_GRID_POINTS:
        raise AccountingError(
            f"the ModelMix accountant's quadrature for noise multiplier {z:g} and width over sensitivity {w:g} would "
            f"take {points:.3g} grid points (at most {MAX_GRID_POINTS:g}): the width (tau/eta) B / C is far beyond "
            f"the reviewed range {CERTIFIED_RANGE['width']}; lower tau or the batch size"
        )
    o = lo + h * np.arange(points)
    log_p0 = log_density(o, z, w)
    return log_p0, log_density(o - shift, z, w) - log_p0, h


def _log_integral(log_integrand: np.ndarray, h: float) -> np.ndarray:
    """log of the trapezoid rule (the end points are negligible) along the last axis."""
    return special.logsumexp(log_integrand, axis=-1) + math.log(h)


def _log_mixture_moment(q: float, log_l: np.ndarray, power: np.ndarray) -> np.ndarray:
    """log ((1 - q) + q L)^power, broadcasting orders (rows) against grid points (columns)."""
    if q == 1:
        return power[:, None] * log_l[None, :]
    base = np.logaddexp(math.log1p(-q), math.log(q) + log_l)
    return power[:, None] * base[None, :]


@functools.lru_cache(maxsize=1024)
def _direct_rdp(q: float, z: float, w: float, orders: tuple[float, ...], direction: str) -> np.ndarray:
    """Per-step RDP, one-hot shift 1, by direct quadrature at any real orders > 1."""
    a = np.asarray(orders)
    reach = 1.0 + (float(a.max()) if direction == "forward" else 0.0)
    log_p0, log_l, h = _grid(z, w, 1.0, reach)
    power = a if direction == "forward" else 1.0 - a
    out = np.empty(len(a))
    for block in _blocks(a):  # chunks of orders, each on the part of the grid its integrands reach
        n = _points_for(a[block].max() if direction == "forward" else 0.0, 1.0, z, w, h, len(log_p0))
        out[block] = _log_integral(log_p0[None, :n] + _log_mixture_moment(q, log_l[:n], power[block]), h)
    return np.maximum(out, 0.0) / (a - 1.0)


def _blocks(orders: np.ndarray, size: int = 16) -> list[np.ndarray]:
    """Indices of the orders in chunks of ``size``, ascending (bounded memory, short grids for small orders)."""
    idx = np.argsort(orders)
    return [idx[i : i + size] for i in range(0, len(idx), size)]


def _points_for(order: float, shift: float, z: float, w: float, h: float, total: int) -> int:
    """Grid points (from the left end) that the integrand of ``order`` needs: the tilted measure p_0 L^a sits
    within about a x shift of the support's right edge, and the grid reaches 40 z beyond that."""
    hi = w / 2 + shift * (order + 1) + _TAILS * z
    lo = -w / 2 - _TAILS * z - shift
    return min(total, int(math.ceil((hi - lo) / h)) + 1)


@functools.lru_cache(maxsize=1024)
def _log_moments(z: float, w: float, shift: float, kmax: int) -> np.ndarray:
    """log A_k = log E_P0[L^k] for k = 0..kmax, L the likelihood ratio of a shift ``shift`` (A_0 = A_1 = 1)."""
    log_p0, log_l, h = _grid(z, w, shift, shift * (kmax + 1))
    k = np.arange(kmax + 1, dtype=np.float64)
    out = np.empty(kmax + 1)
    for block in _blocks(k):
        n = _points_for(k[block].max(), shift, z, w, h, len(log_p0))
        out[block] = _log_integral(log_p0[None, :n] + k[block, None] * log_l[None, :n], h)
    out[:2] = 0.0
    return out


@functools.lru_cache(maxsize=1024)
def _binomial_rdp(q: float, z: float, w: float, p: int, orders: tuple[float, ...]) -> np.ndarray:
    """Per-step RDP at integer orders by Cor. 4.1 (corrected): p coordinates shifted by 1/sqrt(p)."""
    kmax = int(max(orders))
    log_a = p * _log_moments(z, w, 1.0 / math.sqrt(p), kmax)
    out = []
    for a in orders:
        n = int(a)
        k = np.arange(n + 1)
        log_binom = special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)
        if q == 1:
            terms = log_a[n : n + 1]
        else:
            terms = log_binom + (n - k) * math.log1p(-q) + k * math.log(q) + log_a[: n + 1]
        out.append(max(float(special.logsumexp(terms)), 0.0) / (n - 1))
    return np.asarray(out)


def step_rdp(
    sampling_rate: float,
    noise_multiplier: float,
    width: float,
    orders: tuple[float, ...] | None = None,
    *,
    linf_p: int = 1,
    direction: str = "forward",
) -> np.ndarray:
    """Per-step RDP of one Poisson-subsampled ModelMix step at ``orders``.

    ``width`` is the uniform width over the per-example sensitivity, (tau / eta) B / C; ``direction`` is
    "forward" (D((1-q) P0 + q P1 || P0), the paper's) or "reverse" (D(P0 || (1-q) P0 + q P1)). For
    ``linf_p`` > 1 the forward direction takes integer orders only (Cor. 4.1) and the reverse is the one-hot
    (p = 1) value (reported only, not a bound: :func:`reverse_rdp_bound` is the certified reverse). Default orders:
    FRACTIONAL_ORDERS for p = 1 and for the reverse, INTEGER_ORDERS for the forward direction with p > 1."""
    q, z, w, p = _check(sampling_rate, noise_multiplier, width, linf_p)
    if direction not in ("forward", "reverse"):
        raise AccountingError(f"direction must be forward or reverse, got {direction!r}")
    binomial = direction == "forward" and p > 1
    if orders is None:
        orders = INTEGER_ORDERS if binomial else FRACTIONAL_ORDERS
    orders = tuple(float(a) for a in orders)
    if any(not a > 1 for a in orders):
        raise AccountingError("Renyi orders must be > 1")
    if binomial:
        if any(a != int(a) for a in orders):
            raise AccountingError("with linf_p > 1 the forward direction takes integer orders (Cor. 4.1)")
        return _binomial_rdp(q, z, w, p, orders)
    return _direct_rdp(q, z, w, orders, direction)


def _check(q: float, z: float, w: float, p: int) -> tuple[float, float, float, int]:
    if isinstance(q, bool) or not (isinstance(q, int | float) and 0 < q <= 1):
        raise AccountingError(f"the sampling rate must be in (0, 1], got {q!r}")
    z = check_noise_multiplier(z)
    if isinstance(w, bool) or not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
        raise AccountingError(f"the uniform width (tau/eta) B / C must be a finite number >= 0, got {w!r}")
    if isinstance(p, bool) or not (isinstance(p, int) and p >= 1):
        raise AccountingError(f"linf_p must be an integer >= 1, got {p!r}")
    return float(q), z, float(w), int(p)


# --- phases, epsilon ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """``steps`` identical ModelMix steps."""

    steps: int
    sampling_rate: float
    noise_multiplier: float
    width: float  # (tau / eta) B / C
    linf_p: int = 1


def _classic_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """The paper's Thm 2.2 (Mironov 2017, Prop. 3): min_a RDP(a) + log(1/delta)/(a - 1)."""
    eps = rdp + math.log(1 / delta) / (orders - 1)
    i = int(np.argmin(eps))
    return float(eps[i]), float(orders[i])


def _improved_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    eps, order = rdp_privacy_accountant.compute_epsilon(list(orders), list(rdp), delta)
    return float(eps), float(order)


def _composed(phases: list[Phase], direction: str) -> tuple[np.ndarray, np.ndarray]:
    """(orders, total RDP) of the phases in one direction. p > 1 anywhere: the forward direction at integer orders."""
    binomial = direction == "forward" and any(ph.linf_p > 1 for ph in phases)
    orders = INTEGER_ORDERS if binomial else FRACTIONAL_ORDERS
    total = np.zeros(len(orders))
    for ph in phases:
        total += ph.steps * step_rdp(
            ph.sampling_rate, ph.noise_multiplier, ph.width, orders, linf_p=ph.linf_p, direction=direction
        )
    return np.asarray(orders), total


def reverse_taylor_bound(sampling_rate: float, noise_multiplier: float, width: float, orders, linf_p: int = 1):
    """A per-step bound on the reverse ordering D_a(P_0 || (1-q) P_0 + q P_v) for EVERY admissible shift v, at any
    real order a > 1 (ours). With y = (1-q) + q L >= 1 - q and f(y) = y^(1-a): f has a negative third derivative, so
    its second derivative on [1-q, inf) is at most a(a-1)(1-q)^(-a-1), and Taylor's theorem around 1 (E[y] = 1) gives
    E f(y) <= 1 + a(a-1)/2 (1-q)^(-a-1) q^2 (E_P0[L_v^2] - 1). E[L_v^2] is largest at the one-hot (p-hot) shift:
    the integer moment k = 2, which the paper's convexity argument (App. C) covers. Defined for q < 1."""
    q, z, w, p = _check(sampling_rate, noise_multiplier, width, linf_p)
    a = np.asarray(orders, dtype=np.float64)
    chi2 = math.expm1(p * _log_moments(z, w, 1.0 / math.sqrt(p), 2)[2])
    log_term = np.log1p(0.5 * a * (a - 1) * np.exp((-a - 1) * math.log1p(-q)) * q * q * chi2)
    return log_term / (a - 1)


#: the orders at which the power-moment bound on the reverse ordering is computed (a linear program each); the
#: other orders of FRACTIONAL_ORDERS use the Taylor and the trivial bounds only
REVERSE_LP_ORDERS = (1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0)
_KAPPA_POINTS = 16  # kappa: the largest -h(s)/s^2 at s = s_max k / 16, k = 1..16, and at s -> 0


def fisher_information(z: float, w: float) -> float:
    """I = int p_0'^2 / p_0 of N(0, z^2) * U[-w/2, w/2] (ours), with p_0'(o) = (phi((o + w/2)/z) - phi((o - w/2)/z))
    / (w z): the limit of -2 log E_P0[L_s^lam] / (lam (1 - lam) s^2) as s -> 0. 1/z^2 at w = 0."""
    if w == 0:
        return 1.0 / (z * z)
    h = z / _STEPS_PER_Z
    o = h * np.arange(int(math.ceil((w / 2 + _TAILS * z) / h)) + 1)  # o >= 0; the integrand is even
    b = (o - w / 2) / z
    with np.errstate(divide="ignore"):
        log_dp = -0.5 * b * b - 0.5 * math.log(2 * math.pi) + np.log(-np.expm1(-o * w / (z * z))) - math.log(w * z)
    log_f = 2 * log_dp - log_density(o, z, w)
    log_f[0] = -np.inf  # p_0'(0) = 0
    return float(2 * np.exp(_log_integral(log_f, h)))


@functools.lru_cache(maxsize=256)
def hellinger_log_betas(z: float, w: float, linf_p: int = 1) -> tuple[float, ...]:
    """Lower bounds log beta_lam on log E_P0[L_v^lam], lam in HELLINGER_POWERS, for every shift v with ||v||_2 <= 1
    and ||v||_inf <= 1/sqrt(p) (ours): log E[L_v^lam] = sum_j h(v_j) with h(s) = log E_P0[L_s^lam] <= 0 (product
    law, h even since p_0 is), so sum_j h(v_j) >= -kappa sum_j v_j^2 >= -kappa, kappa = sup over 0 < s <= 1/sqrt(p)
    of -h(s)/s^2. Taken as the largest of its limit at s -> 0 (lam (1 - lam) I / 2, I the Fisher information) and 16
    values up to 1/sqrt(p); the soundness review checks that -h(s)/s^2 is monotone in s, so that this is the sup."""
    s_max = 1.0 / math.sqrt(linf_p)
    lams = np.asarray(HELLINGER_POWERS)
    kappa = lams * (1 - lams) * fisher_information(z, w) / 2
    for k in range(1, _KAPPA_POINTS + 1):
        s = s_max * k / _KAPPA_POINTS
        log_p0, log_l, h = _grid(z, w, s, s)
        n = _points_for(1.0, s, z, w, h, len(log_p0))
        norm = _log_integral(log_p0[:n], h)  # the rule's own integral of p_0 (1 up to ~1e-15): cancels its error
        h_s = _log_integral(log_p0[None, :n] + lams[:, None] * log_l[None, :n], h) - norm
        kappa = np.maximum(kappa, -h_s / (s * s))
    return tuple(float(-x * (1 + 1e-9) - 1e-12) for x in kappa)


def reverse_rdp_bound(sampling_rate: float, noise_multiplier: float, width: float, orders, linf_p: int = 1):
    """The certified per-step bound on the reverse ordering D_a(P_0 || (1-q) P_0 + q P_v), valid for EVERY admissible
    shift v, at each order: the smallest of three bounds (each proven for every shift; ours):

    - trivial: p_0 / ((1-q) p_0 + q p_v) <= 1/(1-q), so the divergence is at most log(1/(1-q)) at every order;
    - :func:`reverse_taylor_bound` (second moment, any real order);
    - the power-moment bound (:mod:`dptrain.accounting.modelmix_reverse`: E L = 1, E L^lam >= beta_lam from
      :func:`hellinger_log_betas`, E L^2 <= the one-hot / p-hot second moment) at the orders in REVERSE_LP_ORDERS.

    At q = 1 the two orderings are equal (the pair is symmetric), so the forward value is returned (None for p > 1:
    use the forward direction). The one-hot shift is NOT the worst case of this ordering (docs/modelmix.md), so the
    exact one-hot value (``step_rdp(..., direction="reverse")``) is not a bound."""
    q, z, w, p = _check(sampling_rate, noise_multiplier, width, linf_p)
    a = np.asarray(orders, dtype=np.float64)
    if q == 1:
        return step_rdp(q, z, w, tuple(a), linf_p=p) if p == 1 else None
    return np.asarray(_reverse_certified(q, z, w, p, tuple(float(x) for x in a)))


@functools.lru_cache(maxsize=1024)
def _reverse_certified(q: float, z: float, w: float, p: int, orders: tuple[float, ...]) -> tuple[float, ...]:
    a = np.asarray(orders)
    out = np.minimum(reverse_taylor_bound(q, z, w, a, p), -math.log1p(-q))
    log_betas = hellinger_log_betas(z, w, p)
    chi2 = math.expm1(p * _log_moments(z, w, 1.0 / math.sqrt(p), 2)[2])
    lp_orders = set(REVERSE_LP_ORDERS)
    for i, order in enumerate(orders):
        if order in lp_orders:
            out[i] = min(out[i], max(log_reverse_moment_bound(q, order, log_betas, chi2), 0.0) / (order - 1))
    return tuple(float(x) for x in out)


def modelmix_epsilon(phases: list[Phase], delta: float) -> dict[str, Any]:
    """Epsilon at ``delta`` of a run made of ``phases``.

    Certified (``epsilon``): the larger of the two orderings of a neighbouring pair, each composed over the steps
    and converted on its own: the paper's direction at CERTIFIED_ORDERS (integers), the reverse by
    :func:`reverse_rdp_bound`. Reported beside it, not certified: the paper's direction at fractional orders for
    p = 1 (``epsilon_paper_direction``), the exact reverse ordering at the one-hot shift
    (``epsilon_reverse_one_hot_not_a_bound``, p = 1 only: a split shift gives more, so it is no bound), both with
    the same conversion, and the paper's own method (its direction, fractional orders for p = 1, its Thm 2.2
    conversion: ``epsilon_paper_method``). docs/modelmix.md says why only the first is certified."""
    delta = check_delta(delta)
    out: dict[str, Any] = {}
    certified_orders = np.asarray(CERTIFIED_ORDERS)
    forward = np.zeros(len(certified_orders))
    reverse = np.zeros(len(FRACTIONAL_ORDERS))
    symmetric = False
    reviewed = [reviewed_phase(ph) for ph in phases]
    for ph in reviewed:
        forward += ph.steps * step_rdp(
            ph.sampling_rate, ph.noise_multiplier, ph.width, CERTIFIED_ORDERS, linf_p=ph.linf_p
        )
        bound = reverse_rdp_bound(ph.sampling_rate, ph.noise_multiplier, ph.width, FRACTIONAL_ORDERS, ph.linf_p)
        if bound is None:
            symmetric = True
        else:
            reverse += ph.steps * bound
    out["forward"] = _improved_epsilon(certified_orders, forward, delta)
    out["reverse_bound"] = _improved_epsilon(np.asarray(FRACTIONAL_ORDERS), reverse, delta)
    if symmetric:  # full batches with p > 1: the orderings coincide; certify by the forward direction alone
        out["reverse_bound"] = (max(out["reverse_bound"][0], out["forward"][0]), out["forward"][1])
    one_hot = all(ph.linf_p == 1 for ph in phases)  # the one-hot shift is admissible (no l-infinity bound)
    for direction in ("forward", "reverse") if one_hot else ("forward",):
        orders, total = _composed(phases, direction)
        out[f"{direction}_reported"] = _improved_epsilon(orders, total, delta)
        if direction == "forward":
            out["paper"] = _classic_epsilon(orders, total, delta)
    binding = "forward" if out["forward"][0] >= out["reverse_bound"][0] else "reverse"
    chosen = out["forward"] if binding == "forward" else out["reverse_bound"]
    return {
        "epsilon": chosen[0],
        "optimal_order": chosen[1],
        "binding_direction": binding,
        "epsilon_forward_certified": out["forward"][0],
        "epsilon_reverse_certified": out["reverse_bound"][0],
        "epsilon_paper_direction": out["forward_reported"][0],
        # the exact reverse at the one-hot shift (p = 1): NOT a bound, split shifts give more (docs/modelmix.md)
        "epsilon_reverse_one_hot_not_a_bound": out["reverse_reported"][0] if one_hot else None,
        "epsilon_paper_method": out["paper"][0],
        "paper_method_order": out["paper"][1],
        "in_certified_range": all(_in_range(ph) for ph in reviewed),
        "accounted_as": [
            {"noise_multiplier": r.noise_multiplier, "width_over_sensitivity": r.width}
            for r in reviewed
        ]
        if reviewed != list(phases)
        else None,
    }


def _in_range(ph: Phase) -> bool:
    (z0, z1), (w0, w1) = CERTIFIED_RANGE["noise_multiplier"], CERTIFIED_RANGE["width"]
    return z0 <= ph.noise_multiplier <= z1 and w0 <= ph.width <= w1


def reviewed_phase(ph: Phase) -> Phase:
    """A phase inside CERTIFIED_RANGE whose divergences (every order, both orderings) are at least ``ph``'s, where
    one is proven; else ``ph`` itself (then outside the range: not certified). Two dominations, both garblings
    (Blackwell: post-processing the pair by a data-independent kernel cannot raise any f- or Renyi divergence):

    - width: U[0, w] is a mixture of m equal shifted copies of U[0, w/m] for every integer m, so the pair at width
      w is the pair at width w/m with the copy's (data-independent) index forgotten: D(w) <= D(w/m). With m =
      floor(w / w_max), w/m is in [w_max, 2 w_max), and there the review's width monotonicity (its check B: L at
      width w' in (w, 2w] is below L at width w in convex order, checked at w = 250, w' up to 500) gives
      D(w/m) <= D(w_max). A width above the range is accounted at w_max = 250 (e.g. 409.6 as 250, not 204.8);
    - noise: N(0, z^2) is N(0, z0^2) plus independent N(0, z^2 - z0^2), noise the releaser could add itself, so
      D(z) <= D(z0) for z0 <= z. A noise multiplier above the range is accounted at its top (loose, but proven).

    Below the range (z < 0.3) nothing is proven: the phase is returned unchanged."""
    (_, z_max), (_, w_max) = CERTIFIED_RANGE["noise_multiplier"], CERTIFIED_RANGE["width"]
    z, w = ph.noise_multiplier, ph.width
    w = min(w, w_max)
    z = min(z, z_max)
    if (z, w) == (ph.noise_multiplier, ph.width):
        return ph
    return Phase(ph.steps, ph.sampling_rate, z, w, ph.linf_p)


# --- ledgers ------------------------------------------------------------------------------------------------


def tau_phases(tau: float | list) -> list[tuple[float, float]]:
    """``tau`` (a multiple of the learning rate) as [(tau_over_lr, fraction of the run), ...] summing to 1: a number
    is one phase; a list of [tau_over_lr, fraction] pairs is taken in order; a list of numbers is equal phases."""
    if isinstance(tau, bool):
        raise ConfigError(f"tau must be a number >= 0 or a list of [tau, fraction] pairs, got {tau!r}")
    if isinstance(tau, int | float):
        pairs = [(tau, 1.0)]
    elif isinstance(tau, list | tuple) and tau and all(isinstance(t, int | float) for t in tau):
        pairs = [(t, 1.0 / len(tau)) for t in tau]
    elif isinstance(tau, list | tuple) and tau and all(isinstance(t, list | tuple) and len(t) == 2 for t in tau):
        pairs = [(t[0], t[1]) for t in tau]
    else:
        raise ConfigError(f"tau must be a number >= 0 or a list of [tau, fraction] pairs, got {tau!r}")
    for t, f in pairs:
        if isinstance(t, bool) or not (isinstance(t, int | float) and math.isfinite(t) and t >= 0):
            raise ConfigError(f"tau must be >= 0 (a multiple of the learning rate), got {t!r}")
        if isinstance(f, bool) or not (isinstance(f, int | float) and 0 < f <= 1):
            raise ConfigError(f"a tau phase's fraction of the run must be in (0, 1], got {f!r}")
    if abs(sum(f for _, f in pairs) - 1) > 1e-9:
        raise ConfigError(f"the fractions of the tau phases must add up to 1, got {sum(f for _, f in pairs):g}")
    return [(float(t), float(f)) for t, f in pairs]


def phase_lengths(phases: list[tuple[float, float]], total_steps: int) -> list[int]:
    """Steps of each phase for a run of ``total_steps``: phase i ends at round(total x cumulative fraction). The one
    rule the update stage and the accountant's ledgers share."""
    ends, acc = [], 0.0
    for _, f in phases:
        acc += f
        ends.append(round(total_steps * acc))
    ends[-1] = total_steps
    starts = [0, *ends[:-1]]
    return [e - s for s, e in zip(starts, ends, strict=True)]


def tau_at(phases: list[tuple[float, float]], total_steps: int, step: int) -> float:
    """tau / eta at step ``step`` (0-based) of a run of ``total_steps`` (the last phase continues past the end)."""
    end = 0
    for (t, _), n in zip(phases, phase_lengths(phases, total_steps), strict=True):
        end += n
        if step < end:
            return t
    return phases[-1][0]


def modelmix_facts(tau_over_lr: float, batch_size: float, linf_p: int) -> dict[str, Any]:
    """The facts a ModelMix step adds to DP-SGD's (the clip norm is already one of those)."""
    return {"update": "modelmix", "tau_over_lr": float(tau_over_lr), "batch_size": float(batch_size),
            "linf_p": int(linf_p)}


def modelmix_ledger(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    *,
    tau: float | list,
    batch_size: float,
    clip_norm: float,
    linf_p: int = 1,
) -> Ledger:
    """A ledger of ``steps`` ModelMix steps in tau phases (what ``dptrain account --accountant modelmix``, calibration
    and the reproductions reason about); the same facts the engine records."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise AccountingError(f"steps must be an integer >= 0, got {steps!r}")
    phases = tau_phases(tau)
    ledger = Ledger()
    event = gaussian_step_event(noise_multiplier, "poisson", sampling_rate=sampling_rate)
    facts = step_facts("poisson", sampling_rate, clip_norm=clip_norm)
    for (t, _), n in zip(phases, phase_lengths(phases, steps), strict=True):
        if n:
            ledger.record(event, {**facts, **modelmix_facts(t, batch_size, linf_p)}, n)
    return ledger


def phases_from_ledger(ledger: Ledger) -> list[Phase]:
    """The ModelMix phases of a ledger; refuses a ledger with anything else (AccountingError saying what)."""
    if ledger.neighboring != "add_or_remove_one":
        raise AccountingError(
            "the modelmix accountant covers add/remove-one adjacency (Poisson sampling) only; this ledger is "
            f"{ledger.neighboring}"
        )
    phases = []
    for e in ledger.entries:
        f = e.facts
        if f.get("mechanism") not in TRAINING_MECHANISMS or f.get("update") != "modelmix":
            what = f.get("update") or f.get("mechanism", "?")
            raise AccountingError(
                f"the modelmix accountant covers ModelMix training steps only; this ledger also records {what!r} "
                "releases (use rdp or pld, or train with training.update = \"modelmix\")"
            )
        missing = [k for k in ("tau_over_lr", "batch_size", "clip_norm") if k not in f]
        if missing:
            raise AccountingError(f"the ledger's ModelMix steps lack the facts {', '.join(missing)}")
        ev = e.event
        if isinstance(ev, dpa.PoissonSampledDpEvent) and isinstance(ev.event, dpa.GaussianDpEvent):
            q, z = float(ev.sampling_probability), float(ev.event.noise_multiplier)
        elif isinstance(ev, dpa.GaussianDpEvent) and f.get("sampling") == "full":
            q, z = 1.0, float(ev.noise_multiplier)
        else:
            raise AccountingError(
                f"the modelmix accountant covers Poisson-sampled or full-batch Gaussian steps, not "
                f"{type(ev).__name__} with sampling {f.get('sampling')!r}"
            )
        width = float(f["tau_over_lr"]) * float(f["batch_size"]) / float(f["clip_norm"])
        phases.append(Phase(e.count, q, z, width, int(f.get("linf_p", 1))))  # no l-inf bound recorded: p = 1
    if not phases:
        raise AccountingError("the ledger records no ModelMix step")
    return phases


NOT_CERTIFIED = (
    "a noise multiplier below {z_min:g} ({z}): outside the range where the soundness review checked the paper's "
    "worst-case reductions numerically (docs/modelmix.md)"
)


class ModelMixAccountant:
    name = "modelmix"
    description = (
        "ModelMix (Xiao, Wan & Devadas): RDP of N * U mixtures, both orderings (integer orders, second-moment "
        "reverse bound), certified on the reviewed range"
    )
    facts_used = ("mechanism", "sampling", "update", "tau_over_lr", "batch_size", "clip_norm", "linf_p")

    def __init__(self, with_dpsgd: bool = True):
        self.with_dpsgd = with_dpsgd

    def for_search(self) -> ModelMixAccountant:
        """Calibration's search: the same epsilon without the plain DP-SGD epsilon beside it (an rdp computation,
        as long as the modelmix one)."""
        return ModelMixAccountant(with_dpsgd=False)

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        refuse_search(ledger, self.name)
        phases = phases_from_ledger(ledger)
        check_noise(ledger, self.name)
        r = modelmix_epsilon(phases, delta)
        eps = finite_epsilon(r.pop("epsilon"), self.name)
        try:
            r["epsilon_dpsgd"] = epsilon(ledger, delta, "rdp").epsilon if self.with_dpsgd else None
        except AccountingError as e:
            r["epsilon_dpsgd"] = None
            r["epsilon_dpsgd_refused"] = str(e)
        r["phases"] = [
            {"steps": ph.steps, "sampling_rate": ph.sampling_rate, "noise_multiplier": ph.noise_multiplier,
             "width_over_sensitivity": ph.width, "linf_p": ph.linf_p}
            for ph in phases
        ]
        certified = r.pop("in_certified_range")
        if not certified:
            zs = sorted({ph.noise_multiplier for ph in phases})
            r["note"] = NOT_CERTIFIED.format(z_min=CERTIFIED_RANGE["noise_multiplier"][0], z=zs)
        return PrivacyReport(eps, delta, self.name, certified, r)


register_accountant(ModelMixAccountant())
