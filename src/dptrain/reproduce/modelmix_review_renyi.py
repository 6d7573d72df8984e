"""Renyi divergences of the Poisson-subsampled one- and two-coordinate ModelMix pair, both orderings, for the
numerical soundness review (:mod:`dptrain.reproduce.modelmix_review`) of Xiao, Wan & Devadas, "Differentially Private
Deep Learning with ModelMix":

    forward  D_a((1-q) P_0 + q P_v || P_0) = 1/(a-1) log E_P0[((1-q) + q L_v)^a]        (the paper's Thm 4.1)
    reverse  D_a(P_0 || (1-q) P_0 + q P_v) = 1/(a-1) log E_P0[((1-q) + q L_v)^(1-a)]    (ours: the other ordering)

by trapezoid sums in log space at two steps, with error estimates (the change between the steps, a tail bound and a
floating-point floor).
"""

from __future__ import annotations

import math

import numpy as np

from dptrain.reproduce.modelmix_review_law import Law

RDP_K = 12.0  # Renyi integrals cover +-12 z beyond the tilted peaks
_LN2 = math.log(2.0)


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


def _trapezoid(lo: float, hi: float, step: float) -> tuple[np.ndarray, np.ndarray]:
    """Nodes of a uniform grid on [lo, hi] of step at most ``step``, and the trapezoid rule's log weights."""
    n = int(math.ceil((hi - lo) / step)) + 1
    o = np.linspace(lo, hi, n)
    lw = np.full(n, math.log(o[1] - o[0]))
    lw[[0, -1]] -= _LN2
    return o, lw


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
        o, lw = _trapezoid(lo, hi, z / div)
        n = len(o)
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
        o, lw1 = _trapezoid(lo, hi, z / div)
        n = len(o)
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


def log_power_moments(law: Law, s: float, lams: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(log E_P0[L_s^lam] for lam in ``lams``, error estimates), lam in (0, 1): trapezoid sums in log space at steps
    z/16 and z/32 over the support +-12 z, each divided by the same rule's integral of p_0 (which cancels most of
    its error); the error estimate is the change between the two steps plus 1e-14."""
    z, w = law.z, law.w
    lo, hi = -0.5 * w - RDP_K * z - s, 0.5 * w + RDP_K * z + s
    out = []
    for div in (16, 32):
        o = np.linspace(lo, hi, int(math.ceil((hi - lo) / (z / div))) + 1)
        h0 = law.logpdf(o)
        ell = law.logpdf(o - s) - h0
        y = h0[None, :] + np.asarray(lams)[:, None] * ell[None, :]
        top = y.max(axis=1, keepdims=True)
        log_i = top[:, 0] + np.log(np.exp(y - top).sum(axis=1))
        t0 = h0.max()
        out.append(log_i - (t0 + math.log(np.exp(h0 - t0).sum())))
    return out[1], np.abs(out[1] - out[0]) + 1e-14


def fisher_information(law: Law) -> float:
    """int p_0'^2 / p_0 = E_P0[(d/do log p_0)^2] by the trapezoid rule at step z/32 over the support +-12 z."""
    z, w = law.z, law.w
    o = np.arange(-0.5 * w - RDP_K * z, 0.5 * w + RDP_K * z + z / 32, z / 32)
    h0, g0 = law.logpdf_grad(o)
    return float(np.trapezoid(np.exp(h0) * g0 * g0, o))
