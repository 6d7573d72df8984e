"""Hockey-stick values E(L - t)^+ and E(t - L)^+ of one and two coordinates, for the numerical soundness review
(:mod:`dptrain.reproduce.modelmix_review`) of Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix".

One coordinate: closed form at the root of log L_v = log t (log L_v is non-decreasing since p_0 is log-concave).
Two coordinates: the inner expectation in closed form, the outer integral by composite Gauss-Legendre refined
towards the kink (the module docstring of :mod:`dptrain.reproduce.modelmix_review` gives the error analysis). Ours.
"""

from __future__ import annotations

import numpy as np
from scipy import special

from dptrain.reproduce.modelmix_review_law import Law

FP_REL = 1e-12  # floating-point floor, relative to the terms before cancellation (verified by the law check)
TAIL_K = 9.0  # hockey-stick integrals cover +-9 z around the density edges: P(|Z| > 9) = 2.3e-19
GL_N = 10
_KINK_RATIO = 0.15  # geometric grading towards the kink: panel widths shrink by this factor ...
_KINK_LEVELS = 8  # ... this many times on each side
_GL_X, _GL_W = np.polynomial.legendre.leggauss(GL_N)


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
