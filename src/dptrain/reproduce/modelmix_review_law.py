"""One coordinate of a ModelMix step, for the numerical soundness review (:mod:`dptrain.reproduce.modelmix_review`)
of Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix".

P_0 = N(0, z^2) * U[-w/2, w/2] in units of the sensitivity (App. D.1 of the paper gives the density
p_0(o) = (1/w) [Phi((o + w/2)/z) - Phi((o - w/2)/z)]), its shifted copies P_v, the likelihood ratio L_v = p_v / p_0,
its inverse, and the closed-form survival function P_0(O > x) = (z/w) [G((x - w/2)/z) - G((x + w/2)/z)] with G the
Gaussian stop-loss function (ours: the integral of the density in closed form).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


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
