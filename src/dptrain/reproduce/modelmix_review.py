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
(F) the paper's own argument: g(x) = log E_{P_0}[L_sqrt(x)^k] convex in x on [0, 1] for the integer k the
    accountant certifies, 2, ..., 32, 40, 48, 56, 64 (second differences; the quick review: 2, 4, 8). With g(0) = 0, convexity gives superadditivity g(a^2) + g(b^2) <= g(a^2 + b^2), hence
    E[L_v^k] <= E[L_||v|| e_1^k] coordinate-wise, and the binomial expansion of ((1-q) + q L)^k has non-negative
    coefficients, so integer orders of the forward direction are covered for every q. ``F_real`` (an extension)
    runs the same test at the non-integer orders of (A), which covers q = 1 only.
(C_rdp) an extension: the pairwise RDP values E[phi(L_a L_b)] <= E[phi(L_c)] for the (C) pairs, forward and reverse,
    at q in {0.02, 0.04, 0.1, 0.2, 0.3, 0.4, 0.5, 1}. It is a necessary condition for the one-hot worst case. It would
    propagate to every shift by induction only if it held at every q' in (0, 1]: conditioning on the other
    coordinates, ((1-q) + q t L)^beta = ((1-q) + q t)^beta ((1-q') + q' L)^beta with q' = q t / ((1-q) + q t), and t
    (their likelihood ratio) takes every positive value.
(H) ours, what the accountant's bound on the reverse ordering (accounting/modelmix_reverse.py) takes as a supremum:
    kappa(s) = -log E_P0[L_s^lam] / s^2 (lam in {1/4, 1/2, 3/4}) is at most max(kappa(0+), kappa(s_max)) for
    0 < s <= s_max, kappa(0+) = lam (1 - lam) I / 2 with I the Fisher information of p_0 (checked at 24 shifts).

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

Results of the full review as of its last recorded run (docs/reproduction/modelmix/: z in {0.3, 0.3633, 0.5, 1, 2,
4, 8}, w in {0, 0.5, ..., 250}, q in {0.02, 0.04, 1}, orders 1.25..32; the q grid now also has 0.1, ..., 0.5, see
below; no point within numerical error: the error estimates, relative to values >= 1e-9, stay below
1.4e-5 in (C), 2e-8 in (E), 1.1e-7 in D_rdp and 1e-9 elsewhere, far below the margins that decide the checks):
(B), (D), (F) and the extensions hold; the forward direction dominates the reverse one for
one-hot v everywhere on the grid (smallest gap 0.6%, z = 2, q = 0.02, a = 1.25); (C) and (E) fail in convex order
for every w > 0 on the grid and never for the Gaussian control. The failures sit around t = 1 (total variation):
with separated edges E(L_c - 1)^+ = c/w, while two coordinates leak through two edges, about (a + b)/w - ab/w^2
(e.g. z = 0.3633, w = 30, a = b = 0.25/sqrt 2: 0.01162 against 0.00833, 28% of the larger value); the excess shrinks
with w/z (2.6e-6 relative at z = 2, w = 0.5) but does not vanish. Hence hockey-stick (PLD / f-DP) accounting cannot
use the one-hot or p-hot pair; integer-order forward RDP can (the paper's binomial argument with (F), which also
gives the p-hot reduction, since the sum of g(v_j^2) is Schur-convex), and so can q = 1 at every order (F_real);
non-integer orders at q < 1 and the reverse direction are not covered by any argument here. On the extended q grid
C_rdp fails for the reverse ordering: the split shift exceeds the one-hot shift at q 0.1 to 0.5 (+22% at z = 0.3,
w = 15, q = 0.3, order 3; docs/modelmix.md has the table), and already at q = 0.02 at order 8 (+7%); a shift spread
over many coordinates (its limit is the Gaussian pair of noise 1/sqrt(I)) gives more still. So the one-hot reverse
value is no bound anywhere with w > 0; the accountant bounds that ordering through (H) instead.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from scipy import integrate

from dptrain.reproduce.modelmix_review_hockey import hockey_1d, hockey_2d
from dptrain.reproduce.modelmix_review_law import Law
from dptrain.reproduce.modelmix_review_renyi import fisher_information, log_power_moments, rdp_1d, rdp_2d
from dptrain.reproduce.modelmix_review_tally import (
    ABS_TOL,
    MAX_LISTED,
    REL_TOL,
    Tally,
    clean,
    compare,
    convexity_margins,
)

__all__ = [
    "ORDERS",
    "Q_GRID",
    "W_GRID",
    "Z_GRID",
    "ABS_TOL",
    "REL_TOL",
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
Q_GRID = (0.02, 0.04, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0)
ORDERS = (1.25, 1.5, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0)
#: the integer orders the modelmix accountant certifies (its CERTIFIED_ORDERS) must all be checked here
INTEGER_MOMENTS = (*range(2, 33), 40, 48, 56, 64)

_QUANTILE_LEVELS = (1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)


# ----------------------------------------------------------------------------------------------------------------
# the review
# ----------------------------------------------------------------------------------------------------------------


def _config(quick: bool) -> dict:
    if quick:
        return {
            "z": (0.5, 2.0), "w": (0.0, 7.5), "q": (0.02, 0.3, 1.0), "orders": (1.5, 2.0, 8.0), "n_log": 40,
            "b_steps": (4, 8), "b_shifts": (1.0,),
            "c_pairs": ((1.0, math.pi / 4), (0.5, math.pi / 8)),
            "c_rdp_pairs": ((1.0, math.pi / 4),), "c_rdp_orders": (1.25, 2.0),
            "d_norms": (0.25, 0.5, 0.75, 1.0),
            "e_ps": (25,), "e_chain_points": 2,
            "f_points": 11, "f_moments": (2, 4, 8), "f_real_orders": (1.25, 1.5),
            "h_powers": (0.5,), "h_points": 6,
        }
    return {
        "z": Z_GRID, "w": W_GRID, "q": Q_GRID, "orders": ORDERS, "n_log": 200,
        "b_steps": tuple(range(1, 9)), "b_shifts": (0.1, 0.2, 0.5, 1.0),
        "c_pairs": ((1.0, math.pi / 4), (1.0, math.pi / 8), (1.0, math.pi / 16), (0.5, math.pi / 4),
                    (0.5, math.pi / 8), (0.25, math.pi / 4)),
        "c_rdp_pairs": ((1.0, math.pi / 4), (1.0, math.pi / 8)), "c_rdp_orders": (1.25, 1.5, 2.0, 3.0, 8.0),
        "d_norms": tuple(round(0.05 * k, 10) for k in range(1, 21)),
        "e_ps": (25, 100), "e_chain_points": 3,
        "f_points": 41, "f_moments": INTEGER_MOMENTS, "f_real_orders": ORDERS,
        "h_powers": (0.25, 0.5, 0.75), "h_points": 24,
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

    # (H) the sup the reverse-ordering bound takes: kappa(s) <= max(kappa(0+), kappa(s_max)) for s <= s_max
    lams = np.asarray(cfg["h_powers"])
    ss = np.arange(1, cfg["h_points"] + 1) / cfg["h_points"]
    vals = [log_power_moments(law, s, tuple(lams)) for s in ss]
    kap = np.array([-v for v, _ in vals]) / ss[:, None] ** 2
    kerr = np.array([e for _, e in vals]) / ss[:, None] ** 2
    limit = lams * (1 - lams) * fisher_information(law) / 2
    for i, lam in enumerate(lams):
        for j, s_max in enumerate(ss):
            rhs = max(limit[i], kap[j, i])
            add("H", {"lam": float(lam), "s_max": float(s_max)}, "s", ss[: j + 1], kap[: j + 1, i],
                np.full(j + 1, rhs), kerr[: j + 1, i] + kerr[j, i] + 1e-12 * rhs)

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
              "necessary for the one-hot reduction; it propagates to every shift only if it holds at every q' in "
              "(0, 1] (module docstring); it fails for the reverse ordering, so the one-hot reverse value is no bound"),
    "D": ("D_norm_convex_order", "L_c <=_cx L_c' for c <= c'", ""),
    "D_rdp": ("D_norm_rdp", "per-step RDP (both directions) non-decreasing in the norm c of a one-hot shift", ""),
    "E": ("E_p_hot_schur_convex_order", "L_a L_b <=_cx L_a' L_b' for a^2 + b^2 = a'^2 + b'^2 in [0, 1/sqrt(p)]^2 "
          "with max(a', b') >= max(a, b) (adjacent points of chains from the equal pair to the most unequal one)",
          ""),
    "F": ("F_integer_moments_convexity", "g(x) = log E_P0[L_sqrt(x)^k] is convex on [0, 1] for the integer k "
          "listed (the paper's argument; second differences 2 g(x_i) <= g(x_i-1) + g(x_i+1))", ""),
    "F_real": ("F_real_orders_convexity", "extension: the same for the orders of (A), integer or not (covers q = 1 "
               "for every order)", ""),
    "H": ("H_power_moment_kappa", "ours: kappa(s) = -log E_P0[L_s^lam] / s^2 <= max(lam (1 - lam) I / 2, kappa(s_max)) "
          "for 0 < s <= s_max (I the Fisher information of p_0): the sup the reverse-ordering bound takes", ""),
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
        "H": {"lam": cfg["h_powers"], "s": f"k / {cfg['h_points']}, k = 1..{cfg['h_points']}"},
    }
    tallies = {key: Tally(name, claim, {**params, **specific[key]}, note) for key, (name, claim, note) in
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
    law_check = clean({
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
        "violations": [r for r in law_rows.values() if r["worst"] > r["threshold"]][:MAX_LISTED],
        "measures": list(law_rows.values()),
        "note": "worst_margin is the largest ratio of a measured deviation to its threshold (<= 1 holds)",
    })
    checks = [law_check] + [t.result() for t in tallies.values()]
    table = [row for out in outs for row in out["table"]]
    cols = ["z", "w", "q", "alpha", "forward", "reverse", "err_forward", "err_reverse"]
    exceed = [dict(zip(cols, row, strict=True)) for row in table
              if compare(row[5], row[4], row[6] + row[7]) == 2]
    return clean({
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
