"""The scale of a training run's noise schedule: the smallest c such that steps with sigma_t = c s_t meet a budget.

The engine (:func:`dptrain.engine.api.make_private_with_epsilon` with a ``noise_schedule``) asks this module. The generic
calibration (:func:`dptrain.accounting.calibrate`) would be correct but slow here: a decaying schedule has up to T
distinct noise levels, and each accountant call on such a ledger costs ~60 ms per level (rdp) or ~0.4 s (pld). So:

1. the shape's own calibration (:func:`dptrain.schedules.calibration.calibrate_shape`, vectorised, milliseconds)
   gives the scale, under the kinds' accountant matching the ledger accountant that will certify the run: ``exact``
   for the ``gdp`` accountant (full-batch Gaussian steps compose exactly, Dong, Roth & Su 2022, Cor. 3.3), ``rdp``
   for ``rdp``, ``pld`` for ``pld``;
2. the run's ledger at that scale is then certified by the ledger accountant itself, and the scale stepped up until
   it agrees. What is returned is always certified by the accountant the run reports.

``auto`` picks ``gdp`` for full-batch steps (exact), ``pld`` for Poisson-sampled ones with at most
:data:`~dptrain.schedules.spend.PLD_MAX_LEVELS` distinct levels, ``rdp`` beyond. ``method="zcdp"`` is the paper's
calibration (Dynamic Noise Influence, Lemma 4.1 / Thm 4.3: sum_t 1/(2 sigma_t^2) = rho, rho from (epsilon, delta) by
Lemma B.3): it spends less than the budget under any tight accountant; the run is still certified (and its budget
enforced) by the ledger accountant.

A constant schedule, a run that already holds releases (a preprocessing stage's), or an accountant outside the three
above go through the generic calibration, started from the shape's scale.

No torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from dptrain.accounting import AUTO, Calibration, Ledger, calibrate, certified_epsilon
from dptrain.accounting.calibration import calibrate_noise
from dptrain.errors import AccountingError, ConfigError, NoFiniteEpsilon
from dptrain.schedules.calibration import calibrate_shape
from dptrain.schedules.spend import PLD_MAX_LEVELS

#: Ledger accountant -> the kinds' accountant that computes the same spend on a shape.
KINDS_ACCOUNTANT = {"gdp": "exact", "rdp": "rdp", "pld": "pld"}
#: How a schedule's scale may be calibrated: the tightest certifying accountant, or the paper's zCDP.
METHODS = ("tightest", "zcdp")


def schedule_accountant(accountant: str, sampling_rate: float, levels: int) -> str:
    """The ledger accountant that certifies a schedule: ``accountant`` itself unless ``auto`` (see the module doc)."""
    if accountant != AUTO:
        return accountant
    if sampling_rate >= 1:
        return "gdp"
    return "pld" if levels <= PLD_MAX_LEVELS else "rdp"


def calibrate_scale(
    target_epsilon: float,
    delta: float,
    ledger_for_scale: Callable[[float], Ledger],
    shape: Sequence[float],
    sampling_rate: float,
    *,
    accountant: str = AUTO,
    method: str = "tightest",
    sampling: str = "poisson",
) -> Calibration:
    """The smallest scale c (the noise multiplier of the run; sigma_t = c shape[t]) with which the accountant certifies
    ``ledger_for_scale(c)`` (the run's ledger after its planned steps) within (target_epsilon, delta). ``shape``: the
    planned steps' s_t; ``sampling_rate``: their Poisson rate (1 for full batches)."""
    if method not in METHODS:
        raise ConfigError(f"schedule calibration must be one of {', '.join(METHODS)}, got {method!r}")
    levels = len(set(shape))
    plain = sampling in ("poisson", "full") and not ledger_for_scale(1.0).releases > len(shape)
    if method == "tightest" and (levels == 1 or not plain):
        if levels == 1:
            return calibrate(target_epsilon, delta, ledger_for_scale, accountant)
        name = schedule_accountant(accountant, sampling_rate, levels)
        start = _shape_scale(shape, target_epsilon, delta, sampling_rate, "rdp" if sampling_rate < 1 else "exact")
        return Calibration(
            calibrate_noise(target_epsilon, delta, ledger_for_scale, name, start=start), name
        )
    name = schedule_accountant(accountant, sampling_rate, levels)
    if method == "zcdp":
        scale = _shape_scale(shape, target_epsilon, delta, sampling_rate, "zcdp")
    elif name in KINDS_ACCOUNTANT and plain:
        if name == "gdp" and sampling_rate < 1:
            raise AccountingError(
                "the gdp accountant does not certify Poisson-sampled steps (its answer is a central-limit "
                "approximation); use rdp or pld"
            )
        scale = _shape_scale(shape, target_epsilon, delta, sampling_rate, KINDS_ACCOUNTANT[name])
    else:  # another accountant: the generic search, from the rdp scale
        start = _shape_scale(shape, target_epsilon, delta, sampling_rate, "rdp" if sampling_rate < 1 else "exact")
        return Calibration(calibrate_noise(target_epsilon, delta, ledger_for_scale, name, start=start), name)
    return Calibration(_certified(scale, target_epsilon, delta, ledger_for_scale, name, method), name)


def _shape_scale(shape, target_epsilon: float, delta: float, sampling_rate: float, kinds_accountant: str) -> float:
    return calibrate_shape(
        shape,
        epsilon=target_epsilon,
        delta=delta,
        accountant=kinds_accountant,
        sampling_rate=min(1.0, sampling_rate) if kinds_accountant in ("rdp", "pld") else 1.0,
    ).scale / max(shape)


def _certified(scale: float, target_epsilon: float, delta: float, ledger_for_scale, accountant: str, method: str):
    """``scale``, stepped up until ``accountant`` certifies the ledger within budget (the shape's calibration and the
    ledger's accountant compute the same spend up to rounding; the paper's zCDP spends less)."""

    def spend(c: float) -> float:
        try:
            return certified_epsilon(ledger_for_scale(c), delta, accountant).epsilon
        except NoFiniteEpsilon:
            return math.inf

    step = scale * 1e-12
    for _ in range(200):
        if spend(scale) <= target_epsilon:
            return scale
        if method == "zcdp":
            raise AccountingError(
                f"the paper's zCDP calibration of this schedule spends more than epsilon={target_epsilon} under the "
                f"{accountant} accountant; calibrate it with method 'tightest'"
            )
        scale += step
        step *= 2
    raise AccountingError(f"the {accountant} accountant does not certify this schedule at any scale tried")


__all__ = ["METHODS", "calibrate_scale", "schedule_accountant"]
