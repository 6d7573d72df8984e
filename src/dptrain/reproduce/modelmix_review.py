"""Numerical soundness review of the one-step privacy analysis in Xiao, Wan & Devadas, "Differentially Private Deep
Learning with ModelMix".

The setting (per-example sensitivity s = 1, one coordinate). One step releases w_k = mix - eta (G + N)/B, where
coordinate j of ``mix`` is uniform on a segment of width >= tau (secret uniform weights) and N is Gaussian. For a
neighbour whose gradient sum is shifted by v in R^d, the output law is the product over coordinates of
P_{v_j} = N(v_j, z^2) * U[-w/2, w/2] (z: noise multiplier, w = tau B / (eta C): the uniform width in units of the
sensitivity). Its density, in closed form and in log space,

    p_0(o) = (1/w) [Phi((o + w/2)/z) - Phi((o - w/2)/z)],   p_v(o) = p_0(o - v),

is evaluated with ``scipy.special.log_ndtr`` at |o| (p_0 is even); w = 0 is the Gaussian N(0, z^2), kept as a
control: for it every claim below holds with equality or is a classical fact. L_v = dP_v/dP_0 and, with Poisson
sampling at rate q, the per-step Renyi divergences in the paper's ("forward") and the reverse direction are

    D_a((1-q) P_0 + q P_v || P_0) = 1/(a-1) log E_{P_0}[((1-q) + q L_v)^a],
    D_a(P_0 || (1-q) P_0 + q P_v) = 1/(a-1) log E_{P_0}[((1-q) + q L_v)^(1-a)],

both of the form E_{P_0}[phi(L_v)] with phi convex. Hence a convex-order statement X <=_cx Y between likelihood
ratios (E f(X) <= E f(Y) for every convex f; for mean-one non-negative variables equivalent to
E(X - t)^+ <= E(Y - t)^+ for all t) bounds every such divergence, in both directions and for every q, at once, and
also every hockey-stick divergence (PLD / f-DP accounting).

``review(quick=False)`` returns plain JSON-able data: a self-check of the numerics (``law``) and the checks

(A) direction: forward vs reverse per-step RDP for one-hot v (a table; where reverse > forward the library must
    certify the maximum of the two, this is reported, not failed). For q = 1 the two are equal exactly (p_0 is
    even), which is a control of the quadrature.
(B) width monotonicity: L_v at width w' is <=_cx L_v at width w for w' in [w, 2w] (and the per-step RDP values
    are not larger). Why [w, 2w] suffices: with m = floor(w'/w), U[0, w'] is the uniform mixture of m shifted
    copies of U[0, w'/m], and w'/m lies in [w, 2w). So (P_0, P_v) at width w' is the pair at width w'/m followed by
    a shift chosen uniformly among m known values and then forgotten; the experiment that reveals the shift index
    has the likelihood-ratio law of width w'/m, and forgetting it is a garbling, which can only lower the
    likelihood ratio in convex order (Blackwell). Hence L^(w') <=_cx L^(w'/m) <=_cx L^(w) given the [w, 2w]
    statement, for any w' >= w. This settles the paper's "width >= tau, unequal per coordinate" (its point (ii)):
    each coordinate's factor is dominated by the width-w factor and convex order is preserved under products of
    independent non-negative factors. The grid check is numerical evidence at 8 widths, not a proof for all w'.
(C) one-hot reduction by 2-D merging: L_a(o1) L_b(o2) <=_cx L_c(o) for a^2 + b^2 = c^2 (o1, o2 iid P_0). If it held
    for all a, b, induction would merge any v into a one-hot of the same norm (multiplying both sides by an
    independent non-negative factor preserves convex order) and (D) would handle norms below 1.
(D) monotone in the norm: L_c <=_cx L_c' for c <= c'.
(E) p-hot reduction under ||v||_inf <= 1/sqrt(p): for a^2 + b^2 = a'^2 + b'^2 in the box [0, 1/sqrt(p)]^2 with
    max(a', b') >= max(a, b), L_a L_b <=_cx L_a' L_b' (checked along chains from the equal to the most unequal pair;
    convex order is transitive).
(F) the paper's own argument: g(x) = log E_{P_0}[L_sqrt(x)^k] convex in x on [0, 1] for integer k in 2..8 (second
    differences). With g(0) = 0, convexity gives superadditivity g(a^2) + g(b^2) <= g(a^2 + b^2), hence
    E[L_v^k] <= E[L_||v|| e_1^k] coordinate-wise, and the binomial expansion of ((1-q) + q L)^k has non-negative
    coefficients, so integer orders of the forward direction are covered for every q. ``F_real`` (an extension)
    runs the same test at the non-integer orders of (A), which covers q = 1 only.
(C_rdp) an extension: the pairwise RDP values E[phi(L_a L_b)] <= E[phi(L_c)] for the (C) pairs, forward and reverse.
    It is a necessary condition; for q < 1 it does not propagate by induction (phi is not multiplicative).

How the numbers are computed. log L_v(o) = log p_0(o - v) - log p_0(o) is non-decreasing in o because p_0 is
log-concave (a convolution of log-concave densities), so {L_v > s} = {o > o_s} with o_s the root of
log L_v = log s, and

    E(L_v - s)^+ = P_v(O > o_s) - s P_0(O > o_s),   E(s - L_v)^+ = s P_0(O <= o_s) - P_v(O <= o_s),

with the survival function in closed form, P_0(O > x) = (z/w) [G((x - w/2)/z) - G((x + w/2)/z)], G(y) = E(Z - y)^+
(the Gaussian stop-loss function; evaluated with ``erfcx`` and an asymptotic series for y >= 20). Calls are
compared for t >= 1 and puts for t < 1 (equivalent, since E L = 1 on both sides, and better conditioned). The
expression is stationary in o_s (o_s maximises P_v(O > o) - s P_0(O > o)), so a root error enters to second
order. In two dimensions E(L_a L_b - t)^+ = int p_0(o2) [L_b(o2) P_a(O > o1*) - t P_0(O > o1*)] do2 with
log L_a(o1*) = log t - log L_b(o2): a one-dimensional integral, by composite Gauss-Legendre (10 nodes) on panels
of width 2z around the edges of the densities, refined geometrically towards the point where log L_b(o2) = log t
(there the integrand has a cusp: the law of L_a has a near-atom at 1 when w >> z). Renyi moments are trapezoid sums
of the analytic integrand in log space (for values near 1, of the integrand minus its two exactly-known leading
terms). The product law in (C) and
(E) is not obtained by discretizing the law of log L_a on a grid and convolving: that approximation has errors of
order 1e-4 (grid step squared), which would leave the Gaussian control (where both sides are equal) unresolved at
the 1e-9 tolerance; the inner expectation here is exact and only the outer integral is a quadrature (verified
against adaptive quadrature, and by the a <-> b symmetry, to ~1e-13).

Numerical error. Every value comes with an error estimate: the change when the quadrature step is halved, plus
a floating-point floor (relative 1e-12 of the terms before cancellation, which the ``law`` check verifies against
``scipy.integrate.quad``), plus the Gaussian tail beyond the integration range. A comparison lhs <= rhs at one point
is counted as holding when lhs - rhs <= 1e-9 max(|lhs|, |rhs|) + 1e-12, as a violation when lhs - rhs exceeds that
tolerance by more than the combined error estimate, and otherwise as "within numerical error". Note the absolute
1e-12 makes comparisons of values below it vacuous (deep tails at large t for small shifts; counted separately).

Results of the full review (z in {0.3633, 0.5, 1, 2}, w in {0, 0.5, 1, 3.75, 7.5, 15, 30}, q in {0.02, 0.04, 1},
orders 1.25..32; no point within numerical error: the error estimates, relative to values >= 1e-9, stay below
1.4e-5 in (C), 2e-8 in (E), 1.1e-7 in D_rdp and 1e-9 elsewhere, far below the margins that decide the checks):
(B), (D), (F) and the extensions hold; the forward direction dominates the reverse one for
one-hot v everywhere on the grid (smallest gap 0.6%, z = 2, q = 0.02, a = 1.25); (C) and (E) fail in convex order
for every w > 0 on the grid and never for the Gaussian control. The failures sit around t = 1 (total variation):
with separated edges E(L_c - 1)^+ = c/w, while two coordinates leak through two edges, about (a + b)/w - ab/w^2
(e.g. z = 0.3633, w = 30, a = b = 0.25/sqrt 2: 0.01162 against 0.00833, 28% of the larger value); the excess shrinks
with w/z (2.6e-6 relative at z = 2, w = 0.5) but does not vanish. Hence hockey-stick (PLD / f-DP) accounting cannot
use the one-hot or p-hot pair; integer-order forward RDP can (the paper's binomial argument with (F), which also
gives the p-hot reduction, since the sum of g(v_j^2) is Schur-convex), and so can q = 1 at every order (F_real);
non-integer orders at q < 1 and the reverse direction are not covered by any argument here (C_rdp only shows the
pairwise values are ordered).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from scipy import integrate, special

__all__ = [
    "ORDERS",
    "Q_GRID",
    "W_GRID",
    "Z_GRID",
    "Law",
    "compare",
    "convexity_margins",
    "hockey_1d",
    "hockey_2d",
    "review",
    "rdp_1d",
    "rdp_2d",
]

Z_GRID = (0.3, 0.3633, 0.5, 1.0, 2.0, 4.0, 8.0)
W_GRID = (0.0, 0.5, 1.0, 3.75, 7.5, 15.0, 30.0, 60.0, 120.0, 250.0)
Q_GRID = (0.02, 0.04, 1.0)
ORDERS = (1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0)
#: the integer orders the modelmix accountant certifies (its CERTIFIED_ORDERS) must all be checked here
INTEGER_MOMENTS = (*range(2, 33), 40, 48, 56, 64)

REL_TOL = 1e-9
ABS_TOL = 1e-12
FP_REL = 1e-12  # floating-point floor, relative to the terms before cancellation (verified by the law check)
TAIL_K = 9.0  # hockey-stick integrals cover +-9 z around the density edges: P(|Z| > 9) = 2.3e-19
RDP_K = 12.0  # Renyi integrals cover +-12 z beyond the tilted peaks
GL_N = 10
_KINK_RATIO = 0.15  # geometric grading towards the kink: panel widths shrink by this factor ...
_KINK_LEVELS = 8  # ... this many times on each side
_GL_X, _GL_W = np.polynomial.legendre.leggauss(GL_N)
_LN2 = math.log(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_QUANTILE_LEVELS = (1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)
_MAX_LISTED = 5  # violations / within-error points listed per check


# ----------------------------------------------------------------------------------------------------------------
# one coordinate: N(0, z^2) * U[-w/2, w/2]
# ----------------------------------------------------------------------------------------------------------------


def _log1mexp(d: np.ndarray) -> np.ndarray:
    """log(1 - e^d) for d <= 0, to absolute accuracy ~1e-16 (all that the log-densities need)."""
    with np.errstate(divide="ignore"):
        return np.log(-np.expm1(d))


def _log_stoploss(y: np.ndarray) -> np.ndarray:
    """log G(y), G(y) = E(Z - y)^+ = phi(y) - y Q(y) for a standard normal Z (G' = -Q)."""
    y = np.asarray(y, dtype=float)
    out = np.empty_like(y)
    neg = y < 0
    mid = (y >= 0) & (y < 20)
    big = y >= 20
    yn = y[neg]
    with np.errstate(under="ignore"):
        out[neg] = np.log(np.exp(-0.5 * yn * yn - _LOG_SQRT_2PI) - yn * special.ndtr(-yn))
    ym = y[mid]
    # 1 - y m(y), m the Mills ratio Q/phi; relative error <= 1e-16 (1 + y^2) < 1e-13 on [0, 20)
    r = 1.0 - ym * math.sqrt(math.pi / 2) * special.erfcx(ym / math.sqrt(2.0))
    out[mid] = -0.5 * ym * ym - _LOG_SQRT_2PI + np.log(r)
    yb = y[big]
    # asymptotic series 1 - y m(y) = sum_k (-1)^(k+1) (2k-1)!! / y^(2k); at y >= 20 16 terms are exact to 1e-16
    inv2 = 1.0 / (yb * yb)
    s = np.zeros_like(yb)
    term = np.ones_like(yb)
    for k in range(1, 17):
        term = term * (2 * k - 1) * inv2 if k > 1 else inv2
        s += term if k % 2 else -term
    out[big] = -0.5 * yb * yb - _LOG_SQRT_2PI + np.log(s)
    return out


class Law:
    """One coordinate's output law P_0 = N(0, z^2) * U[-w/2, w/2] in units of the sensitivity (w = 0: Gaussian),
    with shifted copies P_v (density p_0(o - v)) and the likelihood ratio L_v = p_v / p_0."""

    def __init__(self, z: float, w: float):
        if z <= 0 or w < 0:
            raise ValueError(f"need z > 0 and w >= 0, got z={z}, w={w}")
        self.z = float(z)
        self.w = float(w)
        self._inv: dict[float, tuple] = {}
        self._quantiles: dict[tuple, np.ndarray] = {}

    # densities ---------------------------------------------------------------------------------------------
    def logpdf(self, o: np.ndarray) -> np.ndarray:
        """log p_0(o)."""
        o = np.asarray(o, dtype=float)
        z, w = self.z, self.w
        if w == 0:
            return -0.5 * (o / z) ** 2 - math.log(z) - _LOG_SQRT_2PI
        x = np.abs(o)
        lb = special.log_ndtr((0.5 * w - x) / z)
        la = special.log_ndtr((-0.5 * w - x) / z)
        return lb + _log1mexp(la - lb) - math.log(w)

    def logpdf_grad(self, o: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(log p_0(o), d/do log p_0(o))."""
        o = np.asarray(o, dtype=float)
        z, w = self.z, self.w
        if w == 0:
            return -0.5 * (o / z) ** 2 - math.log(z) - _LOG_SQRT_2PI, -o / (z * z)
        x = np.abs(o)
        a = (x + 0.5 * w) / z
        b = (x - 0.5 * w) / z
        lb = special.log_ndtr(-b)
        la = special.log_ndtr(-a)
        logdiff = lb + _log1mexp(la - lb)  # log(Phi(a) - Phi(b))
        with np.errstate(divide="ignore"):
            lognum = -0.5 * b * b - _LOG_SQRT_2PI + np.log(-np.expm1(-w * x / (z * z)))  # log(phi(b) - phi(a))
        grad = -np.sign(o) * np.exp(lognum - logdiff) / z
        return logdiff - math.log(w), grad

    def logsf(self, x: np.ndarray) -> np.ndarray:
        """log P_0(O > x)."""
        x = np.asarray(x, dtype=float)
        z, w = self.z, self.w
        if w == 0:
            return special.log_ndtr(-x / z)
        ax = np.abs(x)
        lgb = _log_stoploss((ax - 0.5 * w) / z)
        lga = _log_stoploss((ax + 0.5 * w) / z)
        ls = math.log(z / w) + lgb + _log1mexp(lga - lgb)  # log P_0(O > |x|) <= log 1/2
        return np.where(x >= 0, ls, np.log1p(-np.exp(ls)))

    def logcdf(self, x: np.ndarray) -> np.ndarray:
        return self.logsf(-np.asarray(x, dtype=float))

    def quantile(self, levels: np.ndarray) -> np.ndarray:
        """x with P_0(O <= x) = level (bisection on the closed-form cdf)."""
        key = tuple(np.asarray(levels, dtype=float).ravel().tolist())
        if key in self._quantiles:
            return self._quantiles[key]
        lv = np.log(np.asarray(levels, dtype=float))
        span = 0.5 * self.w + 40 * self.z
        lo = np.full(lv.shape, -span)
        hi = np.full(lv.shape, span)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            below = self.logcdf(mid) < lv
            lo = np.where(below, mid, lo)
            hi = np.where(below, hi, mid)
        self._quantiles[key] = 0.5 * (lo + hi)
        return self._quantiles[key]

    # likelihood ratio ------------------------------------------------------------------------------------------
    def ell(self, o: np.ndarray, v: float) -> np.ndarray:
        """log L_v(o) = log p_0(o - v) - log p_0(o)."""
        o = np.asarray(o, dtype=float)
        return self.logpdf(o - v) - self.logpdf(o)

    def _table(self, v: float):
        key = float(v)
        if key not in self._inv:
            z, w = self.z, self.w
            dz = z / 40
            # wide enough that |log L_v| reaches ~80 at both ends (log L_v ~ v (o - w/2) / z^2 in the tails)
            span = 0.5 * w + min(max(60 * z, 80 * z * z / abs(v)), 5000 * z) + 2 * abs(v) + 2
            o = np.arange(-span, span + dz, dz)
            h1, g1 = self.logpdf_grad(o - v)
            h0, g0 = self.logpdf_grad(o)
            lv = np.maximum.accumulate(h1 - h0)  # exact values are non-decreasing (log-concavity)
            self._inv[key] = (o, lv, np.maximum(g1 - g0, 0.0), dz)
        return self._inv[key]

    def ell_inv(self, u: np.ndarray, v: float) -> np.ndarray:
        """The o with log L_v(o) = u (v > 0). Inside the table (step z/40, |log L_v| <= ~80): the root of the cubic
        Hermite interpolant of log L_v (interpolation error <= (z/40)^4/384 max|d^4 log L_v|, a root error of
        order 1e-9 z, which enters the hockey-stick values to second order); outside: linear extrapolation and
        Newton steps on the exact function, which is asymptotically linear there."""
        if v <= 0:
            raise ValueError("ell_inv needs v > 0")
        u = np.asarray(u, dtype=float)
        shape = u.shape
        u = u.ravel()
        o_tab, l_tab, d_tab, dz = self._table(v)
        n = len(o_tab)
        idx = np.searchsorted(l_tab, u)
        inside = (idx > 0) & (idx < n)
        i0 = np.clip(idx - 1, 0, n - 2)
        l0, l1 = l_tab[i0], l_tab[i0 + 1]
        m0, m1 = d_tab[i0] * dz, d_tab[i0 + 1] * dz
        gap = l1 - l0
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.clip(np.where(gap > 0, (u - l0) / gap, 0.5), 0.0, 1.0)
        for _ in range(3):  # Newton on the cubic H(s) = u, s in [0, 1]
            s2 = s * s
            s3 = s2 * s
            hval = (2 * s3 - 3 * s2 + 1) * l0 + (s3 - 2 * s2 + s) * m0 + (3 * s2 - 2 * s3) * l1 + (s3 - s2) * m1
            hder = (6 * s2 - 6 * s) * (l0 - l1) + (3 * s2 - 4 * s + 1) * m0 + (3 * s2 - 2 * s) * m1
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.where(hder > 0, (u - hval) / hder, 0.0)
            s = np.clip(s + np.where(np.isfinite(step), step, 0.0), 0.0, 1.0)
        o = o_tab[i0] + s * dz
        out = ~inside
        if out.any():
            uu = u[out]
            left = idx[out] == 0
            edge = np.where(left, 0, n - 1)
            slope = np.maximum(d_tab[edge], 1e-300)
            oo = o_tab[edge] + (uu - l_tab[edge]) / slope
            lob = np.where(left, -np.inf, o_tab[-1])
            hib = np.where(left, o_tab[0], np.inf)
            for _ in range(4):
                h1, g1 = self.logpdf_grad(oo - v)
                h0, g0 = self.logpdf_grad(oo)
                d = g1 - g0
                with np.errstate(divide="ignore", invalid="ignore"):
                    step = np.where(d > 0, -(h1 - h0 - uu) / d, 0.0)
                oo = np.clip(oo + np.where(np.isfinite(step), step, 0.0), lob, hib)
            o[out] = oo
        return o.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# hockey-stick values E(L - t)^+ (t >= 1) and E(t - L)^+ (t < 1)
# ----------------------------------------------------------------------------------------------------------------


def hockey_1d(law: Law, v: float, ts: np.ndarray, form: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """E_{P_0}(L_v - t)^+ for t >= 1 and E_{P_0}(t - L_v)^+ for t < 1 (``form`` "call" / "put" forces one);
    returns (values, error estimates). Closed form at the root o_t of log L_v = log t."""
    ts = np.asarray(ts, dtype=float)
    lt = np.log(ts)
    sign = _form_sign(ts, form)
    if v == 0:  # L = 1
        vals = np.where(sign > 0, np.maximum(1.0 - ts, 0.0), np.maximum(ts - 1.0, 0.0))
        return vals, np.zeros_like(vals)
    o = law.ell_inv(lt, v)
    h0, g0 = law.logpdf_grad(o)
    h1, g1 = law.logpdf_grad(o - v)
    resid = h1 - h0 - lt
    l1 = law.logsf(sign * o)
    l2 = law.logsf(sign * (o - v))
    log_scale = np.where(sign > 0, l2, lt + l1)
    d = np.where(sign > 0, lt + l1 - l2, l2 - l1 - lt)
    vals = np.exp(log_scale) * -np.expm1(np.minimum(d, 0.0))
    slope = np.maximum(g1 - g0, 1e-300)
    dz = law.z / 40
    # second-order effect of the root residual: p_0(o) t |r| min(|r| / slope, table step)
    root_err = np.exp(h0 + lt) * np.abs(resid) * np.minimum(np.abs(resid) / slope, dz)
    errs = FP_REL * np.exp(log_scale) + root_err
    return vals, errs


def _form_sign(ts: np.ndarray, form: str) -> np.ndarray:
    if form == "auto":
        return np.where(ts >= 1.0, 1.0, -1.0)
    if form in ("call", "put"):
        return np.full(ts.shape, 1.0 if form == "call" else -1.0)
    raise ValueError(f"form must be auto, call or put, got {form!r}")


def _integrand_2d(law: Law, a: float, lt: np.ndarray, sign: np.ndarray, h0: np.ndarray, hb: np.ndarray):
    """Integrand of the outer o2 integral and its scale (the larger term before cancellation)."""
    u = lt - (hb - h0)  # log L_a(o1*) at the boundary
    o1 = law.ell_inv(u, a)
    l1 = law.logsf(sign * o1)
    l2 = law.logsf(sign * (o1 - a))
    log_scale = np.where(sign > 0, hb + l2, lt + h0 + l1)
    d = np.where(sign > 0, u + l1 - l2, l2 - l1 - u)
    scale = np.exp(log_scale)
    return scale * -np.expm1(np.minimum(d, 0.0)), scale


def _gl_on(bp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Legendre nodes and weights on the panels between consecutive breakpoints (last axis)."""
    left, right = bp[..., :-1], bp[..., 1:]
    half = 0.5 * (right - left)
    mid = 0.5 * (right + left)
    return mid[..., None] + half[..., None] * _GL_X, half[..., None] * _GL_W


def _halve(bp: np.ndarray) -> np.ndarray:
    """Breakpoints with every panel split in two (last axis)."""
    mids = 0.5 * (bp[..., 1:] + bp[..., :-1])
    out = np.empty(bp.shape[:-1] + (2 * bp.shape[-1] - 1,))
    out[..., 0::2] = bp
    out[..., 1::2] = mids
    return out


def _panel_sum(law: Law, a: float, b: float, bp: np.ndarray, lt: np.ndarray, sign: np.ndarray, kink: np.ndarray,
               halve: bool):
    """Composite Gauss-Legendre over the panels ``bp`` (halved if ``halve``), except in a window of radius 2z
    around each t's kink, which is refined geometrically towards the kink from both sides (hp-refinement: when
    w >> z the law of L_a has a near-atom at 1 and its stop-loss function behaves like |u| sqrt(log 1/|u|) there);
    the panels the window overlaps are replaced by the window and the two remainders."""
    if halve:
        bp = _halve(bp)
    x, wt = _gl_on(bp)
    h0 = law.logpdf(x)
    hb = law.logpdf(x - b)
    f, s = _integrand_2d(law, a, lt[:, None, None], sign[:, None, None], h0[None], hb[None])
    val = (f * wt[None]).sum(-1)
    scl = (s * wt[None]).sum(-1)
    lo, hi = bp[0], bp[-1]
    r = 2.0 * law.z
    wl = np.maximum(kink - r, lo)
    wr = np.minimum(kink + r, hi)
    overlap = (bp[None, :-1] < wr[:, None]) & (bp[None, 1:] > wl[:, None])
    overlap |= (bp[None, :-1] <= kink[:, None]) & (bp[None, 1:] >= kink[:, None])
    val[overlap] = 0.0
    scl[overlap] = 0.0
    first = np.argmax(overlap, axis=1)
    last = len(bp) - 2 - np.argmax(overlap[:, ::-1], axis=1)
    p_left, p_right = bp[first], bp[last + 1]
    g = _KINK_RATIO ** np.arange(_KINK_LEVELS + 1)
    left_pts = kink[:, None] - (kink - wl)[:, None] * g[None, :]
    right_pts = kink[:, None] + (wr - kink)[:, None] * g[None, ::-1]
    kb = np.concatenate([p_left[:, None], left_pts, kink[:, None], right_pts, p_right[:, None]], 1)
    if halve:
        kb = _halve(kb)
    x2, w2 = _gl_on(kb)
    f2, s2 = _integrand_2d(law, a, lt[:, None, None], sign[:, None, None], law.logpdf(x2), law.logpdf(x2 - b))
    return val.sum(1) + (f2 * w2).sum((1, 2)), scl.sum(1) + (s2 * w2).sum((1, 2))


def hockey_2d(
    law: Law, a: float, b: float, ts: np.ndarray, form: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """E(L_a(o1) L_b(o2) - t)^+ (t >= 1) / E(t - L_a L_b)^+ (t < 1), o1, o2 iid P_0: (values, error estimates).
    Error: change when every panel is halved + floating-point floor + the tail beyond +-9 z (each integrand is
    at most max(p_b, t p_0), whose mass there is below 2 Q(9) (1 + t))."""
    ts = np.asarray(ts, dtype=float)
    if a <= 0 or b <= 0:
        return hockey_1d(law, max(a, b, 0.0), ts, form)
    lt = np.log(ts)
    sign = _form_sign(ts, form)
    z, w = law.z, law.w
    edges = [0.0, b] if w == 0 else [-0.5 * w, -0.5 * w + b, 0.5 * w, 0.5 * w + b]
    lo, hi = min(edges) - TAIL_K * z, max(edges) + TAIL_K * z
    pts = [lo, hi]
    for e in edges:
        pts.extend(np.linspace(e - TAIL_K * z, e + TAIL_K * z, int(TAIL_K) + 1))
    bp = np.unique(np.clip(np.array(pts), lo, hi))
    bp = bp[np.concatenate([[True], np.diff(bp) > 1e-9 * z])]
    kink = np.clip(law.ell_inv(lt, b), lo, hi)
    coarse, _ = _panel_sum(law, a, b, bp, lt, sign, kink, halve=False)
    fine, scale = _panel_sum(law, a, b, bp, lt, sign, kink, halve=True)
    tail = 2.0 * special.ndtr(-TAIL_K) * (1.0 + ts)
    return fine, np.abs(fine - coarse) + FP_REL * scale + tail


# ----------------------------------------------------------------------------------------------------------------
# Renyi divergences
# ----------------------------------------------------------------------------------------------------------------


def _binom_series_minus_linear(beta: float, x: np.ndarray, terms: int = 16) -> np.ndarray:
    """(1 + x)^beta - 1 - beta x for |x| < 0.05 by its series (16 terms: truncation below 1e-16 relative)."""
    out = np.zeros_like(x)
    c = beta
    p = x.copy()
    for k in range(2, terms + 1):
        c = c * (beta - k + 1) / k
        p = p * x
        out += c * p
    return out


def _log_moment(h0: np.ndarray, hv: np.ndarray, lw: np.ndarray, q: float, beta: float, ends: np.ndarray,
                near_one: bool = True):
    """(log E_{P_0}[((1-q) + q L)^beta], log-integrand at the ``ends`` nodes) as a weighted sum over nodes with
    log p_0 = h0, log p_v = hv and log weights lw. With ``near_one``, values near 1 are summed as
    p_0 [(1 + x)^beta - 1 - beta x], x = q (L - 1), whose dropped terms integrate to exactly 1 and 0."""
    ell = hv - h0
    la = ell if q == 1.0 else np.logaddexp(math.log1p(-q), math.log(q) + ell)  # log((1-q) + q L)
    li = beta * la + h0
    end = float(np.max(li[ends]))
    y = li + lw
    top = float(np.max(y))
    log_i = top + math.log(float(np.sum(np.exp(y - top))))
    if log_i > 0.05 or not near_one:
        return log_i, end
    x = np.expm1(la)
    small = np.abs(x) < 0.05
    terms = np.empty_like(x)
    terms[small] = np.exp(h0[small]) * _binom_series_minus_linear(beta, x[small])
    big = ~small
    e0 = np.exp(h0[big])
    terms[big] = np.exp(li[big]) - e0 - beta * q * (np.exp(hv[big]) - e0)
    return float(np.log1p(np.sum(terms * np.exp(lw)))), end


def _rdp_from_nodes(h0, hv, lw, ends, orders, qs, decay, near_one=True):
    fw = np.empty((len(orders), len(qs)))
    rv = np.empty_like(fw)
    tf = np.empty_like(fw)
    tr = np.empty_like(fw)
    for i, a in enumerate(orders):
        for j, q in enumerate(qs):
            li, end = _log_moment(h0, hv, lw, q, a, ends, near_one)
            fw[i, j] = li / (a - 1)
            tf[i, j] = math.exp(min(end - li, 700.0)) * decay / (a - 1)
            li, end = _log_moment(h0, hv, lw, q, 1 - a, ends, near_one)
            rv[i, j] = li / (a - 1)
            tr[i, j] = math.exp(min(end - li, 700.0)) * decay / (a - 1)
    return fw, rv, tf, tr


def _rdp_result(coarse, fine, orders, log_abs_err=1e-15):
    (fc, rc, _, _), (ff, rf, tf, tr) = coarse, fine
    a1 = np.array(orders, dtype=float)[:, None] - 1
    # floating point: ~1e-14 relative in the moment sums, log_abs_err absolute in their logs
    fp_f = 1e-14 * np.abs(ff) + log_abs_err / a1
    fp_r = 1e-14 * np.abs(rf) + log_abs_err / a1
    return {
        "forward": ff,
        "reverse": rf,
        "err_forward": np.abs(ff - fc) + tf + fp_f,
        "err_reverse": np.abs(rf - rc) + tr + fp_r,
    }


def rdp_1d(
    law: Law, v: float, orders: tuple[float, ...], qs: tuple[float, ...], span_order: float | None = None
) -> dict[str, np.ndarray]:
    """Per-step RDP of the subsampled one-coordinate mechanism with shift v > 0: arrays (len(orders), len(qs)) of
    the forward and reverse values and error estimates (trapezoid at steps z/8 and z/16, the change between the
    two, plus a tail bound: the integrand at the ends of the range, which covers the tilted peaks by 12 z, times
    2z, relative to the integral, plus floating point)."""
    z, w = law.z, law.w
    amax = max(orders) if span_order is None else span_order
    lo = -0.5 * w - amax * v - RDP_K * z - v
    hi = 0.5 * w + (amax + 1) * v + RDP_K * z
    out = []
    for div in (8, 16):
        n = int(math.ceil((hi - lo) / (z / div))) + 1
        o = np.linspace(lo, hi, n)
        lw = np.full(n, math.log(o[1] - o[0]))
        lw[[0, -1]] -= _LN2
        out.append(_rdp_from_nodes(law.logpdf(o), law.logpdf(o - v), lw, np.array([0, n - 1]), orders, qs, 2 * z))
    return _rdp_result(out[0], out[1], orders)


def rdp_2d(
    law: Law, a: float, b: float, orders: tuple[float, ...], qs: tuple[float, ...]
) -> dict[str, np.ndarray]:
    """Per-step RDP for the two-coordinate shift (a, b): E_{P_0 x P_0}[((1-q) + q L_a L_b)^beta] by a tensor
    trapezoid in log space (steps z/4 and z/8; the change and the tail bound along the boundary as in
    :func:`rdp_1d`; the log of the sum of n^2 terms is taken as exact to 1e-14 absolute)."""
    z, w = law.z, law.w
    amax = max(orders)
    c = math.hypot(a, b)
    lo = -0.5 * w - amax * c - RDP_K * z - c
    hi = 0.5 * w + (amax + 1) * c + RDP_K * z
    out = []
    for div in (4, 8):
        n = int(math.ceil((hi - lo) / (z / div))) + 1
        o = np.linspace(lo, hi, n)
        lw1 = np.full(n, math.log(o[1] - o[0]))
        lw1[[0, -1]] -= _LN2
        h0 = law.logpdf(o)
        h0_2 = (h0[:, None] + h0[None, :]).ravel()
        hv_2 = (law.logpdf(o - a)[:, None] + law.logpdf(o - b)[None, :]).ravel()
        lw_2 = (lw1[:, None] + lw1[None, :]).ravel()
        edge = np.zeros((n, n), dtype=bool)
        edge[[0, -1], :] = True
        edge[:, [0, -1]] = True
        ends = np.flatnonzero(edge.ravel())
        # the boundary is 4 (hi - lo) long: scale the one-dimensional tail bound by it
        out.append(_rdp_from_nodes(h0_2, hv_2, lw_2, ends, orders, qs, 2 * z * 4 * (hi - lo), near_one=False))
    return _rdp_result(out[0], out[1], orders, log_abs_err=1e-14)


# ----------------------------------------------------------------------------------------------------------------
# comparisons and their bookkeeping
# ----------------------------------------------------------------------------------------------------------------


def compare(lhs: np.ndarray, rhs: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Status of the claims lhs <= rhs, elementwise: 0 holds (lhs - rhs <= 1e-9 max(|lhs|, |rhs|) + 1e-12),
    1 within numerical error (exceeds the tolerance by no more than the error estimate ``err``), 2 violated."""
    lhs, rhs, err = (np.asarray(x, dtype=float) for x in (lhs, rhs, err))
    margin = lhs - rhs
    tol = REL_TOL * np.maximum(np.abs(lhs), np.abs(rhs)) + ABS_TOL
    status = np.where(margin <= tol, 0, np.where(margin - err <= tol, 1, 2))
    return np.where(np.isfinite(margin) & np.isfinite(err), status, 2)


def convexity_margins(x: np.ndarray, g: np.ndarray, err: np.ndarray):
    """For convexity of g on the uniform grid x: the comparisons 2 g_i <= g_{i-1} + g_{i+1} as (x_i, lhs, rhs,
    err) for the interior points."""
    g = np.asarray(g, dtype=float)
    err = np.asarray(err, dtype=float)
    return x[1:-1], 2 * g[1:-1], g[:-2] + g[2:], 2 * err[1:-1] + err[:-2] + err[2:]


def _clean(v: Any) -> Any:
    """Plain JSON-able values (floats, ints, strings, bools, lists, dicts)."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, np.ndarray):
        return [_clean(x) for x in v.tolist()]
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else repr(f)
    return v


class _Tally:
    """Accumulates the comparisons of one check."""

    def __init__(self, name: str, claim: str, parameters: dict, note: str = ""):
        self.name, self.claim, self.parameters, self.note = name, claim, parameters, note
        self.checked = 0
        self.counts = [0, 0, 0]
        self.worst: dict[str, dict] = {}
        self.listed: dict[int, list[dict]] = {1: [], 2: []}
        self.failing: dict[str, dict] = {}
        self.max_err_rel = 0.0
        self.vacuous = 0

    def add(self, where: dict, xname: str, xs, lhs, rhs, err) -> None:
        xs, lhs, rhs, err = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (xs, lhs, rhs, err))
        status = compare(lhs, rhs, err)
        margin = lhs - rhs
        scale = np.maximum(np.maximum(np.abs(lhs), np.abs(rhs)), ABS_TOL)
        rel = margin / scale
        self.checked += len(xs)
        for k in range(3):
            self.counts[k] += int(np.sum(status == k))
        informative = scale >= 1e3 * ABS_TOL
        self.vacuous += int(np.sum(np.maximum(np.abs(lhs), np.abs(rhs)) < ABS_TOL))
        if informative.any():
            self.max_err_rel = max(self.max_err_rel, float(np.max(err[informative] / scale[informative])))

        def point(i: int) -> dict:
            return {**where, xname: xs[i], "lhs": lhs[i], "rhs": rhs[i], "margin": margin[i],
                    "relative_margin": rel[i], "error_estimate": err[i]}

        # the worst point: largest relative margin among the informative points (a value >= 1e-12), if any
        pool = np.where(np.isfinite(rel), rel, np.inf)  # a non-finite margin is the worst
        if np.any(scale > ABS_TOL):
            pool = np.where(scale > ABS_TOL, pool, -np.inf)
        i = int(np.argmax(pool))
        for key in ("all", "gaussian_control" if where.get("w") == 0 else "w_positive"):
            if key not in self.worst or rel[i] > self.worst[key]["relative_margin"]:
                self.worst[key] = point(i)
        for k in (1, 2):
            idx = np.flatnonzero(status == k)
            if len(idx):
                top = idx[np.argsort(-rel[idx])][:_MAX_LISTED]
                self.listed[k] = sorted(self.listed[k] + [point(j) for j in top],
                                        key=lambda p: -p["relative_margin"])[:_MAX_LISTED]
        bad = status == 2
        if bad.any():
            key = repr(sorted(where.items()))
            entry = self.failing.setdefault(key, {**where, "violations": 0, "max_relative_margin": -np.inf})
            entry["violations"] += int(bad.sum())
            entry["max_relative_margin"] = max(entry["max_relative_margin"], float(np.max(rel[bad])))

    def result(self) -> dict:
        status = "fails" if self.counts[2] else ("within numerical error" if self.counts[1] else "holds")
        w = self.worst.get("all", {})
        return _clean({
            "name": self.name,
            "claim": self.claim,
            "parameters": self.parameters,
            "checked": self.checked,
            "worst_margin": w.get("margin", 0.0),
            "worst_relative_margin": w.get("relative_margin", 0.0),
            "worst_at": w,
            "worst_at_w_positive": self.worst.get("w_positive"),
            "worst_at_gaussian_control": self.worst.get("gaussian_control"),
            "holds": status == "holds",
            "status": status,
            "violation_count": self.counts[2],
            "violations": self.listed[2],
            "within_numerical_error_count": self.counts[1],
            "within_numerical_error": self.listed[1],
            "failing_parameters": sorted(self.failing.values(), key=lambda e: -e["max_relative_margin"]),
            "max_relative_error_estimate": self.max_err_rel,
            "vacuous_count": self.vacuous,
            "note": self.note,
        })


# ----------------------------------------------------------------------------------------------------------------
# the review
# ----------------------------------------------------------------------------------------------------------------


def _config(quick: bool) -> dict:
    if quick:
        return {
            "z": (0.5, 2.0), "w": (0.0, 7.5), "q": (0.02, 1.0), "orders": (1.5, 2.0, 8.0), "n_log": 40,
            "b_steps": (4, 8), "b_shifts": (1.0,),
            "c_pairs": ((1.0, math.pi / 4), (0.5, math.pi / 8)),
            "c_rdp_pairs": ((1.0, math.pi / 4),), "c_rdp_orders": (1.25, 2.0),
            "d_norms": (0.25, 0.5, 0.75, 1.0),
            "e_ps": (25,), "e_chain_points": 2,
            "f_points": 11, "f_moments": (2, 4, 8), "f_real_orders": (1.25, 1.5),
        }
    return {
        "z": Z_GRID, "w": W_GRID, "q": Q_GRID, "orders": ORDERS, "n_log": 200,
        "b_steps": tuple(range(1, 9)), "b_shifts": (0.1, 0.5, 1.0),
        "c_pairs": ((1.0, math.pi / 4), (1.0, math.pi / 8), (1.0, math.pi / 16), (0.5, math.pi / 4),
                    (0.5, math.pi / 8), (0.25, math.pi / 4)),
        "c_rdp_pairs": ((1.0, math.pi / 4), (1.0, math.pi / 8)), "c_rdp_orders": (1.25, 1.5, 2.0),
        "d_norms": tuple(round(0.05 * k, 10) for k in range(1, 21)),
        "e_ps": (25, 100), "e_chain_points": 3,
        "f_points": 41, "f_moments": INTEGER_MOMENTS, "f_real_orders": ORDERS,
    }


def _t_grid(law: Law, c: float, n_log: int) -> np.ndarray:
    """t values: n_log log-spaced in [1e-3, 1e3], 1, and the quantiles of L_c under P_0 and under P_c."""
    lv = np.array(_QUANTILE_LEVELS)
    o = law.quantile(np.concatenate([lv, 1 - lv]))
    tq = np.exp(law.ell(np.concatenate([o, o + c]), c))
    tq = tq[np.isfinite(tq) & (tq > 1e-300) & (tq < 1e300)]
    return np.unique(np.concatenate([np.logspace(-3, 3, n_log), tq, [1.0]]))


def _e_chains(p: int, points: int) -> list[tuple[float, list[float]]]:
    """(m, angles from the equal pair to the most unequal one in the box [0, 1/sqrt(p)]^2) for a^2 + b^2 = m."""
    chains = []
    for mult in (1.0, 1.5):
        m = mult / p
        theta_min = 0.0 if mult <= 1.0 else math.acos(1.0 / math.sqrt(mult))
        chains.append((m, list(np.linspace(math.pi / 4, theta_min, points))))
    return chains


def _unit(z: float, w: float, cfg: dict) -> dict:
    """Every comparison for one (z, w)."""
    t_start = time.perf_counter()
    law = Law(z, w)
    rec: list[tuple] = []
    orders, qs, n_log = cfg["orders"], cfg["q"], cfg["n_log"]

    def add(check, where, xname, xs, lhs, rhs, err):
        rec.append((check, {"z": z, "w": w, **where}, xname, np.asarray(xs), np.asarray(lhs), np.asarray(rhs),
                    np.asarray(err)))

    # self-check of the numerics
    lawm = _law_measures(law, orders)

    # (A) direction, one-hot v = e_1
    r1 = rdp_1d(law, 1.0, orders, qs)
    table = []
    for i, a in enumerate(orders):
        for j, q in enumerate(qs):
            table.append([z, w, q, a, r1["forward"][i, j], r1["reverse"][i, j], r1["err_forward"][i, j],
                          r1["err_reverse"][i, j]])
        add("A", {"alpha": a}, "q", qs, r1["reverse"][i], r1["forward"][i], r1["err_forward"][i] + r1["err_reverse"][i])

    # (B) width monotonicity
    if w > 0:
        for j in cfg["b_steps"]:
            w2 = w * (1 + j / 8)
            law2 = Law(z, w2)
            for v in cfg["b_shifts"]:
                ts = _t_grid(law, v, n_log)
                lv, le = hockey_1d(law2, v, ts)
                rv_, re_ = hockey_1d(law, v, ts)
                add("B", {"w_prime": w2, "v": v}, "t", ts, lv, rv_, le + re_)
            r2 = rdp_1d(law2, 1.0, orders, qs)
            for i, a in enumerate(orders):
                for d in ("forward", "reverse"):
                    add("B_rdp", {"w_prime": w2, "alpha": a, "direction": d}, "q", qs, r2[d][i], r1[d][i],
                        r2["err_" + d][i] + r1["err_" + d][i])

    # (C) one-hot merging, and (C_rdp) its pairwise RDP values
    for c, th in cfg["c_pairs"]:
        a, b = c * math.cos(th), c * math.sin(th)
        ts = _t_grid(law, c, n_log)
        lv, le = hockey_2d(law, a, b, ts)
        rv_, re_ = hockey_1d(law, c, ts)
        add("C", {"c": c, "a": a, "b": b}, "t", ts, lv, rv_, le + re_)
    small = cfg["c_rdp_orders"]
    for c, th in cfg["c_rdp_pairs"]:
        a, b = c * math.cos(th), c * math.sin(th)
        r2 = rdp_2d(law, a, b, small, qs)
        rc = rdp_1d(law, c, small, qs)
        for i, al in enumerate(small):
            for d in ("forward", "reverse"):
                add("C_rdp", {"c": c, "a": a, "b": b, "alpha": al, "direction": d}, "q", qs, r2[d][i], rc[d][i],
                    r2["err_" + d][i] + rc["err_" + d][i])

    # (D) monotone in the norm
    cs = cfg["d_norms"]
    rdps = {c: rdp_1d(law, c, orders, qs) for c in cs}
    for c, c2 in zip(cs[:-1], cs[1:], strict=True):
        ts = _t_grid(law, c2, n_log)
        lv, le = hockey_1d(law, c, ts)
        rv_, re_ = hockey_1d(law, c2, ts)
        add("D", {"c": c, "c_prime": c2}, "t", ts, lv, rv_, le + re_)
        for i, a in enumerate(orders):
            for d in ("forward", "reverse"):
                add("D_rdp", {"c": c, "c_prime": c2, "alpha": a, "direction": d}, "q", qs, rdps[c][d][i],
                    rdps[c2][d][i], rdps[c]["err_" + d][i] + rdps[c2]["err_" + d][i])

    # (E) p-hot: more unequal pairs dominate, within the box
    for p in cfg["e_ps"]:
        for m, thetas in _e_chains(p, cfg["e_chain_points"]):
            ts = _t_grid(law, math.sqrt(m), n_log)
            vals = []
            for th in thetas:
                a, b = math.sqrt(m) * math.cos(th), math.sqrt(m) * math.sin(th)
                if b < 1e-12 * a:
                    b = 0.0
                vals.append((a, b, *hockey_2d(law, a, b, ts)))
            for (a, b, lv, le), (a2, b2, rv_, re_) in zip(vals[:-1], vals[1:], strict=True):
                add("E", {"p": p, "m_times_p": m * p, "a": a, "b": b, "a_prime": a2, "b_prime": b2}, "t", ts,
                    lv, rv_, le + re_)

    # (F) convexity of log E[L_sqrt(x)^k] in x, integer k; F_real: the orders of (A)
    xs = np.linspace(0.0, 1.0, cfg["f_points"])
    for name, ks in (("F", tuple(float(k) for k in cfg["f_moments"])), ("F_real", tuple(cfg["f_real_orders"]))):
        g = np.zeros((len(ks), len(xs)))
        ge = np.zeros_like(g)
        for i, x in enumerate(xs[1:], start=1):
            r = rdp_1d(law, math.sqrt(x), ks, (1.0,), span_order=max(ks))
            g[:, i] = r["forward"][:, 0] * (np.array(ks) - 1)
            ge[:, i] = r["err_forward"][:, 0] * (np.array(ks) - 1)
        for i, k in enumerate(ks):
            x_in, lhs, rhs, err = convexity_margins(xs, g[i], ge[i])
            add(name, {"k": k}, "x", x_in, lhs, rhs, err)

    return {"z": z, "w": w, "records": rec, "table": table, "law": lawm, "seconds": time.perf_counter() - t_start}


def _law_measures(law: Law, orders) -> list[tuple[str, float, float]]:
    """(quantity, measured, threshold) for the numerics of one (z, w)."""
    z, w = law.z, law.w
    out = []
    o = np.arange(-0.5 * w - 16 * z, 0.5 * w + 16 * z + z / 32, z / 32)
    h0 = law.logpdf(o)
    p0 = np.exp(h0)
    out.append(("|int p_0 - 1|", abs(np.trapezoid(p0, o) - 1), 1e-12))
    o1 = np.arange(-0.5 * w - 16 * z - 1, 0.5 * w + 16 * z + 1 + z / 32, z / 32)
    ell1 = law.ell(o1, 1.0)
    out.append(("|E_P0[L_1] - 1|", abs(np.trapezoid(np.exp(law.logpdf(o1) + ell1), o1) - 1), 1e-12))
    var = z * z + w * w / 12
    out.append(("|E_P0[O^2] / (z^2 + w^2/12) - 1|", abs(np.trapezoid(o * o * p0, o) / var - 1), 1e-11))
    steps = np.diff(ell1)
    out.append(("log L_1 non-decreasing: max(-step) / (1 + max|log L_1|)",
                max(0.0, float(-steps.min())) / (1 + np.abs(ell1).max()), 1e-13))
    d2 = h0[:-2] - 2 * h0[1:-1] + h0[2:]
    out.append(("log p_0 concave: max second difference / (1 + max|log p_0|)",
                max(0.0, float(d2.max())) / (1 + np.abs(h0).max()), 1e-13))
    # survival function against adaptive quadrature of the density
    xs = [-0.5 * w - 2 * z, -0.3 * z, 0.0, 0.7 * z, 0.5 * w, 0.5 * w + 3 * z, 0.5 * w + 10 * z]
    worst = 0.0
    for x in xs:
        ref = integrate.quad(lambda t: math.exp(float(law.logpdf(t))), x, x + w + 40 * z, epsabs=0,
                             epsrel=1e-13, limit=400)[0]
        worst = max(worst, abs(math.exp(float(law.logsf(x))) / ref - 1))
    out.append(("survival function vs quad, max relative error", worst, 1e-10))
    # hockey-stick closed form against adaptive quadrature
    worst = 0.0
    for t in (0.05, 0.5, 1.0, 2.0, 20.0):
        val = float(hockey_1d(law, 1.0, np.array([t]))[0][0])
        ot = float(law.ell_inv(np.array([math.log(t)]), 1.0)[0])
        span = w + 40 * z + 10
        if t >= 1:
            def f(u, t=t):
                return max(math.exp(float(law.logpdf(u - 1.0))) - t * math.exp(float(law.logpdf(u))), 0.0)
            ref = integrate.quad(f, ot, ot + span, epsabs=0, epsrel=1e-13, limit=400)[0]
        else:
            def f(u, t=t):
                return max(t * math.exp(float(law.logpdf(u))) - math.exp(float(law.logpdf(u - 1.0))), 0.0)
            ref = integrate.quad(f, ot - span, ot, epsabs=0, epsrel=1e-13, limit=400)[0]
        worst = max(worst, abs(val / ref - 1))
    out.append(("E(L_1 - t)^+ closed form vs quad, max relative error", worst, 1e-9))
    u = np.linspace(-40, 40, 801)
    res = max(float(np.max(np.abs(law.ell(law.ell_inv(u, v), v) - u))) for v in (0.1, 1.0))
    out.append(("root of log L_v = u: max residual (enters values to second order)", res, 1e-6))
    r = rdp_1d(law, 1.0, orders, (1.0,))
    out.append(("q = 1: |forward / reverse - 1| (equal since p_0 is even)",
                float(np.max(np.abs(r["forward"][:, 0] / r["reverse"][:, 0] - 1))), 1e-10))
    return [(name, float(val), float(thr)) for name, val, thr in out]


_CLAIMS = {
    "A": ("A_direction", "reverse per-step RDP <= forward per-step RDP (one-hot v = e_1): the paper accounts only the "
          "forward direction D_a((1-q) P_0 + q P_v || P_0)",
          "a violation here is a finding, not a numerical failure: where the reverse direction is larger the "
          "library must certify max(forward, reverse)"),
    "B": ("B_width_convex_order", "L_v at width w' <=_cx L_v at width w for w' in (w, 2w] (hence for all w' >= w, "
          "by the garbling argument in the module docstring)", ""),
    "B_rdp": ("B_width_rdp", "per-step RDP (both directions, one-hot v = e_1) at width w' <= at width w, "
              "w' in (w, 2w]", ""),
    "C": ("C_one_hot_merge_convex_order", "L_a L_b <=_cx L_c for a^2 + b^2 = c^2 (o1, o2 iid P_0)", ""),
    "C_rdp": ("C_one_hot_merge_rdp_pairwise", "extension: per-step RDP of the shift (a, b) <= that of (c, 0), "
              "c^2 = a^2 + b^2, both directions",
              "necessary for the one-hot reduction; for q < 1 it does not propagate by induction (not multiplicative)"),
    "D": ("D_norm_convex_order", "L_c <=_cx L_c' for c <= c'", ""),
    "D_rdp": ("D_norm_rdp", "per-step RDP (both directions) non-decreasing in the norm c of a one-hot shift", ""),
    "E": ("E_p_hot_schur_convex_order", "L_a L_b <=_cx L_a' L_b' for a^2 + b^2 = a'^2 + b'^2 in [0, 1/sqrt(p)]^2 "
          "with max(a', b') >= max(a, b) (adjacent points of chains from the equal pair to the most unequal one)",
          ""),
    "F": ("F_integer_moments_convexity", "g(x) = log E_P0[L_sqrt(x)^k] is convex on [0, 1] for k = 2..8 (the "
          "paper's argument; second differences 2 g(x_i) <= g(x_i-1) + g(x_i+1))", ""),
    "F_real": ("F_real_orders_convexity", "extension: the same for the orders of (A), integer or not (covers q = 1 "
               "for every order)", ""),
}


def review(quick: bool = False, workers: int | None = None) -> dict:
    """Run every check over the parameter grid (``quick``: a subset, seconds) and return plain JSON-able data:
    ``checks`` (a list of {name, claim, parameters, checked, worst_margin, holds, violations, ...}; the first is
    the self-check of the numerics, ``law``), ``direction_table`` (forward / reverse per-step RDP) and
    ``summary``. ``workers`` processes share the (z, w) grid (default: 1 in quick mode, else up to 2)."""
    cfg = _config(quick)
    t0 = time.perf_counter()
    units = sorted(((z, w) for z in cfg["z"] for w in cfg["w"]), key=lambda u: (-u[1] / u[0], u))
    if workers is None:
        workers = 1 if quick else max(1, min(2, os.cpu_count() or 1))
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            outs = list(ex.map(_unit, [u[0] for u in units], [u[1] for u in units], [cfg] * len(units)))
    else:
        outs = [_unit(z, w, cfg) for z, w in units]
    outs.sort(key=lambda r: (r["z"], r["w"]))

    params = {"z": cfg["z"], "w": cfg["w"], "q": cfg["q"], "orders": cfg["orders"]}
    specific = {
        "A": {}, "B": {"w_prime_over_w": [1 + j / 8 for j in cfg["b_steps"]], "v": cfg["b_shifts"],
                       "t": f"{cfg['n_log']} log-spaced in [1e-3, 1e3], 1, and 30 quantiles of L_v"},
        "B_rdp": {"w_prime_over_w": [1 + j / 8 for j in cfg["b_steps"]], "v": 1.0},
        "C": {"pairs_c_theta": cfg["c_pairs"], "t": f"{cfg['n_log']} log-spaced, 1, quantiles of L_c"},
        "C_rdp": {"pairs_c_theta": cfg["c_rdp_pairs"], "orders": cfg["c_rdp_orders"]},
        "D": {"c": cfg["d_norms"]}, "D_rdp": {"c": cfg["d_norms"]},
        "E": {"p": cfg["e_ps"], "m_times_p": (1.0, 1.5), "chain_points": cfg["e_chain_points"]},
        "F": {"x_points": cfg["f_points"], "k": cfg["f_moments"], "q": 1.0},
        "F_real": {"x_points": cfg["f_points"], "orders": cfg["f_real_orders"], "q": 1.0},
    }
    tallies = {key: _Tally(name, claim, {**params, **specific[key]}, note) for key, (name, claim, note) in
               _CLAIMS.items()}
    for out in outs:
        for check, where, xname, xs, lhs, rhs, err in out["records"]:
            tallies[check].add(where, xname, xs, lhs, rhs, err)

    # the numerics' self-check
    law_rows: dict[str, dict] = {}
    for out in outs:
        for name, val, thr in out["law"]:
            row = law_rows.setdefault(name, {"quantity": name, "worst": 0.0, "threshold": thr, "at": None})
            if val >= row["worst"]:
                row.update(worst=val, at={"z": out["z"], "w": out["w"]})
    ratios = [r["worst"] / r["threshold"] for r in law_rows.values()]
    law_check = _clean({
        "name": "law",
        "claim": "the one-coordinate numerics are right: p_0 integrates to 1, E_P0[L] = 1, the variance is "
                 "z^2 + w^2/12, log L is non-decreasing and log p_0 concave on a grid, the closed-form survival "
                 "function and E(L - t)^+ agree with adaptive quadrature, roots are exact, and forward = reverse "
                 "at q = 1",
        "parameters": params,
        "checked": len(law_rows) * len(outs),
        "worst_margin": max(ratios),
        "worst_relative_margin": max(ratios),
        "worst_at": max(law_rows.values(), key=lambda r: r["worst"] / r["threshold"]),
        "holds": all(x <= 1 for x in ratios),
        "status": "holds" if all(x <= 1 for x in ratios) else "fails",
        "violations": [r for r in law_rows.values() if r["worst"] > r["threshold"]][:_MAX_LISTED],
        "measures": list(law_rows.values()),
        "note": "worst_margin is the largest ratio of a measured deviation to its threshold (<= 1 holds)",
    })
    checks = [law_check] + [t.result() for t in tallies.values()]
    table = [row for out in outs for row in out["table"]]
    cols = ["z", "w", "q", "alpha", "forward", "reverse", "err_forward", "err_reverse"]
    exceed = [dict(zip(cols, row, strict=True)) for row in table
              if compare(row[5], row[4], row[6] + row[7]) == 2]
    return _clean({
        "paper": 'Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix"',
        "quick": quick,
        "tolerance": {"relative": REL_TOL, "absolute": ABS_TOL},
        "checks": checks,
        "direction_table": {"columns": cols, "rows": table, "reverse_exceeds_forward": exceed},
        "summary": {c["name"]: {"status": c["status"], "worst_relative_margin": c["worst_relative_margin"],
                                "violations": c.get("violation_count", len(c["violations"]))} for c in checks},
        "seconds": time.perf_counter() - t0,
        "unit_seconds": {f"z={o['z']},w={o['w']}": o["seconds"] for o in outs},
    })
