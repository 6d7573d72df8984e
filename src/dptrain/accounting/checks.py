"""The rules for the numbers every accountant reads, each defined once and used at every edge (config, CLI,
Python API, ledger), so that a value accepted in one place is never refused in another."""

from __future__ import annotations

import math

from dptrain.errors import AccountingError


def check_delta(delta: float, key: str = "delta") -> float:
    if isinstance(delta, bool) or not (isinstance(delta, int | float) and 0 < delta < 1):
        raise AccountingError(f"{key} must be in (0, 1), got {delta!r}")
    return float(delta)


def check_delta_for_size(delta: float, n: int, key: str = "delta") -> float:
    """delta < 1/n for a data set of n examples: a mechanism that releases one example, chosen at random, whole is
    (0, 1/n)-DP, so a delta of 1/n or more certifies nothing about any one person."""
    delta = check_delta(delta, key)
    if n >= 1 and delta * n >= 1:
        raise AccountingError(
            f"{key} must be below 1/n = {1 / n:.3g} for a data set of n = {n} examples, got {delta:g}: releasing one "
            "random example whole is (0, 1/n)-DP, so such a delta certifies nothing (1/n^2 or smaller is usual)"
        )
    return delta


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
