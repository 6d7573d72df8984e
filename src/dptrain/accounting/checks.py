"""The rules for the numbers every accountant reads, each defined once and used at every edge (config, CLI,
Python API, ledger), so that a value accepted in one place is never refused in another."""

from __future__ import annotations

import math

from dptrain.errors import AccountingError


def check_delta(delta: float, key: str = "delta") -> float:
    if isinstance(delta, bool) or not (isinstance(delta, int | float) and 0 < delta < 1):
        raise AccountingError(f"{key} must be in (0, 1), got {delta!r}")
    return float(delta)


def check_noise_multiplier(value: float, key: str = "noise multiplier") -> float:
    """The one rule for a Gaussian release's noise multiplier, checked at every edge (config, CLI, Python API,
    ledger): a finite number > 0. Zero would release the gradient itself, which no accountant certifies."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value > 0 and math.isfinite(value))
    ):
        raise AccountingError(
            f"{key} must be a finite number > 0 (without noise no accountant can certify a release), got {value!r}"
        )
    return float(value)


def check_epsilon(epsilon: float, key: str = "epsilon") -> float:
    if isinstance(epsilon, bool) or not (
        isinstance(epsilon, int | float) and epsilon > 0 and math.isfinite(epsilon)
    ):
        raise AccountingError(f"{key} must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)
