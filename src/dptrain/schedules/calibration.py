"""Calibration of a noise schedule to a privacy budget: the one scale c that makes sigma_t = c * s_t spend exactly
the budget under an accountant (:mod:`dptrain.schedules.spend`), never more, and the calibrated :class:`Schedule`.

Calibration is Brent's method on log c (closed forms for zcdp and exact), then a step up until the accountant itself
says the schedule is within budget, so a returned schedule never exceeds its budget. The spend, as the accountant
computes it, matches the target to 1e-9 relative for zcdp, exact and rdp (all continuous in c). For pld the search
runs on dptrain's coarse pld grid, then one Newton step on its fine grid, whose epsilon moves in small jumps with c:
the match is ~1e-7 typically, at worst the gap between the two grids (~3e-4 relative).

The zCDP scale is the closed form of "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR
2021 submission), Lemma 4.1's normalisation; the exact one solves the mu-GDP conversion (Dong, Roth & Su 2022).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import optimize, special

from dptrain.accounting.gdp import gdp_delta
from dptrain.errors import AccountingError, ConfigError
from dptrain.schedules.bounds_constants import R_from_rho
from dptrain.schedules.budget import Budget, _rho_of
from dptrain.schedules.params import _integer, _log_sigmas, check_kind
from dptrain.schedules.shapes import _describe, _log_shape, _normalised, _quantised
from dptrain.schedules.spend import (
    RDP_INTEGER_ORDERS,
    RDP_PATIENCE,
    _budget_terms,
    _needs_epsilon,
    _pld_epsilon,
    _pld_ledger,
    _Rdp,
    _rho_spent,
    _spent_epsilon,
    _within,
    _zcdp_target,
)

#: pld: the first step (in ln c, doubled) when stepping a schedule up into its budget (each try is a PLD).
PLD_STEP = 1e-7
#: pld: a Newton step that lands above the budget by at most this (relative) is stepped up from, not dropped.
PLD_NEWTON_SLACK = 1e-5


def _solve_log_scale(
    spend: Callable[[float], float], target: float, log_c: float, step: float = 0.5, xtol: float = 1e-13
) -> float:
    """The log c where the non-increasing spend(log c) crosses ``target`` (Brent's method after a bracket search
    from ``log_c`` in steps growing 1.5x)."""
    seen: dict[float, float] = {}

    def gap(lc: float) -> float:
        if lc not in seen:
            seen[lc] = min(spend(lc), 1e6) - target
        return seen[lc]

    lo = hi = log_c
    if gap(hi) > 0:
        while gap(hi) > 0:
            lo, hi, step = hi, hi + step, step * 1.5
            if step > 1e4:
                raise AccountingError(f"no noise scale meets epsilon={target:g} (searched up to e^{hi:.4g})")
    else:
        while gap(lo) <= 0:
            hi, lo, step = lo, lo - step, step * 1.5
            if step > 1e4:
                return hi  # any scale meets this budget; keep the smallest one tried
    return float(optimize.brentq(gap, lo, hi, xtol=xtol, rtol=4 * np.finfo(float).eps))


def _step_up(log_c: float, ok: Callable[[float], bool], step: float = 1e-15) -> float:
    """Brent lands within tolerance on either side of the root: raise log c until the accountant itself agrees."""
    step *= max(1.0, abs(log_c))
    while not ok(log_c):
        log_c += step
        step *= 2
    return log_c


@dataclass(frozen=True, eq=False)
class Schedule:
    """A calibrated noise schedule: sigmas[t-1] = scale * shape_t for steps t = 1..T."""

    kind: str
    #: the noise multipliers sigma_1..sigma_T (read-only)
    sigmas: np.ndarray
    #: the common factor c (the shape is normalised to max 1, so c is the largest sigma)
    scale: float
    accountant: str
    budget: Budget
    sampling_rate: float
    #: zCDP spent, sum_t 1/(2 sigma_t^2), without amplification by sampling (the paper's R is twice this)
    rho: float
    #: epsilon spent at ``delta`` under ``accountant`` (None for a zCDP budget given without delta)
    epsilon: float | None
    delta: float | None
    params: Mapping[str, Any] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def T(self) -> int:  # noqa: N802
        return int(self.sigmas.size)

    @property
    def R(self) -> float:  # noqa: N802
        return R_from_rho(self.rho)

    @property
    def shape(self) -> np.ndarray:
        return self.sigmas / self.scale

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multipliers": [float(s) for s in self.sigmas],
            "scale": self.scale,
            "accountant": self.accountant,
            "sampling_rate": self.sampling_rate,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "rho": self.rho,
            "R": self.R,
            "budget": self.budget.to_json(),
            "params": {k: _json_value(v) for k, v in self.params.items()},
            "details": dict(self.details),
        }


def _json_value(v: Any) -> Any:
    if isinstance(v, np.ndarray | list | tuple):
        return [float(x) for x in np.asarray(v, dtype=float).reshape(-1)]
    if isinstance(v, np.integer | np.floating):
        return v.item()
    return v


def _calibrate(
    kind: str,
    log_s: np.ndarray,
    budget: Budget,
    accountant: str,
    q: float,
    params: Mapping[str, Any],
    details: dict[str, Any],
) -> Schedule:
    # zCDP: sum_t 1/(2 c^2 s_t^2) = rho, so c = sqrt(sum_t s_t^-2 / (2 rho)) (Dynamic Noise Influence, Lemma 4.1's
    # normalisation); also the starting point of every other search.
    log_sum_u = float(special.logsumexp(-2.0 * log_s))
    if accountant == "zcdp" or (accountant == "exact" and budget.epsilon is None):
        log_c = 0.5 * (log_sum_u - math.log(2.0 * _zcdp_target(budget)))
    elif accountant == "exact":
        # The steps compose into mu-GDP, mu = sqrt(sum_t sigma_t^-2) = sqrt(sum_t s_t^-2) / c (Dong, Roth & Su 2022,
        # Cor. 3.3); mu* solves delta(epsilon; mu) = delta, and c = sqrt(sum s^-2) / mu*.
        eps, delta = budget.epsilon, budget.delta
        # delta(epsilon; mu) increases with mu, so it decreases with v = -ln mu: solve for v.
        v = _solve_log_scale(lambda v: gdp_delta(eps, math.exp(-v)), delta, 0.0, xtol=1e-15)
        log_c = 0.5 * log_sum_u + v
    elif accountant == "rdp":
        _needs_epsilon(budget, accountant)
        rdp, target, delta = _Rdp(log_s, q), budget.epsilon, budget.delta
        # epsilon(c) = min over orders of epsilon_a(c) <= target iff c >= min over orders of c_a, where c_a solves
        # epsilon_a(c_a) = target: solve each order (warm-started at the last), upward, until RDP_PATIENCE orders in
        # a row do no better than the best (c_a is unimodal in practice; any order's c_a is certified anyway).
        log_c = 0.5 * (log_sum_u - math.log(2.0 * _rho_of(target, delta)))
        # An order whose conversion term alone, ln(1 - 1/a) - ln(delta a)/(a - 1), is above the target meets it only
        # where the RDP is below delta^2 (dp_accounting's KL branch): at absurd noise. Such orders are skipped.
        orders = [
            a for a in RDP_INTEGER_ORDERS if math.log1p(-1 / a) - math.log(delta * a) / (a - 1) < target
        ]
        best, order, worse = math.inf, RDP_INTEGER_ORDERS[0], 0
        for alpha in orders or RDP_INTEGER_ORDERS:
            log_c = _solve_log_scale(
                lambda lc, a=alpha: rdp.order_epsilon(a, lc, delta), target, log_c, step=0.05, xtol=1e-13
            )
            if log_c < best:
                best, order, worse = log_c, alpha, 0
            else:
                worse += 1
                if worse >= RDP_PATIENCE:
                    break
        log_c = _step_up(best, lambda lc: rdp.order_epsilon(order, lc, delta) <= target)
        details["rdp_search_order"] = order
        if rdp.lattice_step is not None:
            # The final test bounds each step on a lattice fixed in sigma (not in the shape, as the search did), so
            # that prefixes of the run are never charged more than the run: settle on it at the same order.
            def at_order(lc: float, a: int = order) -> float:
                return _Rdp(log_s + lc, q).order_epsilon(a, 0.0, budget.delta)

            log_c = _solve_log_scale(at_order, budget.epsilon, log_c, step=1e-6)
            log_c = _step_up(log_c, lambda lc: at_order(lc) <= budget.epsilon)
    else:  # pld: dptrain's pld at its search grid from rdp's answer, then one Newton step on its own grid
        _needs_epsilon(budget, accountant)
        target, delta = budget.epsilon, budget.delta
        _pld_ledger(log_s, 0.0, q)  # refuses too many levels before any work
        log_c = math.log(_calibrate(kind, log_s, budget, "rdp", q, params, {}).scale)

        def coarse(lc: float) -> float:
            return _pld_epsilon(log_s, lc, q, delta, search=True)

        def fine(lc: float) -> float:
            return _pld_epsilon(log_s, lc, q, delta)

        log_c = _solve_log_scale(coarse, target, log_c, step=0.01, xtol=1e-10)
        f0, h = fine(log_c), 1e-4
        slope = (coarse(log_c + h) - coarse(log_c - h)) / (2 * h)
        if f0 != target and slope < 0:
            guess = log_c - (f0 - target) / slope
            f1 = fine(guess)
            if f1 <= target or f1 - target <= PLD_NEWTON_SLACK * target or f0 > target:
                log_c = guess
        log_c = _step_up(log_c, lambda lc: fine(lc) <= target, PLD_STEP)
    # The final test reads the noise multipliers as returned, exactly as step_allowed will read them.
    hint = details.get("rdp_search_order")

    def as_returned(lc: float) -> np.ndarray:
        return np.log(np.exp(log_s + lc))

    log_c = _step_up(log_c, lambda lc: _within(as_returned(lc), 0.0, budget, accountant, q, hint))
    sigmas = np.exp(log_s + log_c)
    sigmas.setflags(write=False)
    log_sigmas = np.log(sigmas)
    eps = None
    if budget.delta is not None:
        eps, more = _spent_epsilon(log_sigmas, 0.0, budget.delta, accountant, q, hint)
        details.update(more)
    return Schedule(
        kind=kind,
        sigmas=sigmas,
        scale=math.exp(log_c),
        accountant=accountant,
        budget=budget,
        sampling_rate=q,
        rho=_rho_spent(log_sigmas, 0.0),
        epsilon=eps,
        delta=budget.delta,
        params=dict(params),
        details=details,
    )


def _calibrate_levels(
    kind: str,
    log_s: np.ndarray,
    levels: Any,
    budget: Budget,
    accountant: str,
    q: float,
    params: Mapping[str, Any],
) -> Schedule:
    """:func:`_calibrate`, after quantising the shape to ``levels`` geometric levels when given."""
    details: dict[str, Any] = {}
    if levels is not None:
        log_s = _quantised(log_s, levels)
        details["levels"] = int(levels)
    return _calibrate(kind, log_s, budget, accountant, q, params, details)


def calibrate_shape(
    shape: Sequence[float],
    *,
    rho: float | None = None,
    R: float | None = None,  # noqa: N803
    epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "zcdp",
    sampling_rate: float = 1.0,
    levels: int | None = None,
    kind: str = "custom",
) -> Schedule:
    """Scale a positive shape s_t (t = 1..T) by the one factor c that makes sigma_t = c s_t spend exactly the budget
    under ``accountant`` (see :mod:`dptrain.schedules.spend`; never more). ``levels``: first round the shape, in log
    space, to that many geometric levels (a staircase: what ``pld`` needs for a decaying shape)."""
    accountant, budget, q = _budget_terms(accountant, rho, R, epsilon, delta, sampling_rate)
    log_s = _log_sigmas(shape, "shape")
    if log_s.size < 1:
        raise ConfigError("shape must hold T >= 1 positive numbers, got none")
    log_s = _normalised(log_s, f"the shape ({kind})")
    return _calibrate_levels(kind, log_s, levels, budget, accountant, q, {})


def calibrate_schedule(
    kind: str,
    T: int,  # noqa: N803
    *,
    rho: float | None = None,
    R: float | None = None,  # noqa: N803
    epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "zcdp",
    sampling_rate: float = 1.0,
    levels: int | None = None,
    **params: Any,
) -> Schedule:
    """The schedule of ``kind`` (parameters: :func:`schedule_shape`) for T steps, scaled to spend exactly the budget
    (one of ``rho``, ``R`` = 2 rho, or ``epsilon`` with ``delta``) under ``accountant`` (``zcdp``, ``exact``,
    ``rdp``, ``pld``) for Poisson sampling at ``sampling_rate`` (1: full batch). ``levels``: quantise the shape to
    that many geometric levels first (see :func:`calibrate_shape`)."""
    kind, T = check_kind(kind), _integer("T", T)
    accountant, budget, q = _budget_terms(accountant, rho, R, epsilon, delta, sampling_rate)
    log_s = _normalised(_log_shape(kind, T, params), _describe(kind, T, params))
    return _calibrate_levels(kind, log_s, levels, budget, accountant, q, params)
