"""The checks of a schedule's parameters shared by its shapes, accountants and calibration: numbers, integers, the
kind and accountant names (:mod:`dptrain.schedules.names`), and noise multipliers (finite, > 0; read in log space)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dptrain.errors import ConfigError
from dptrain.schedules.names import ACCOUNTANTS, KINDS


def _number(key: str, value: Any, accepted: str, ok: Callable[[float], bool]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ConfigError(f"{key} must be {accepted}, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and ok(v)):
        raise ConfigError(f"{key} must be {accepted}, got {value!r}")
    return v


def _integer(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ConfigError(f"schedule kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def check_accountant(accountant: Any) -> str:
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"schedule accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    return accountant


def _log_sigmas(sigmas: Any, key: str = "sigmas") -> np.ndarray:
    s = np.asarray(sigmas, dtype=float).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(s) & (s > 0)))
    if bad.size:
        raise ConfigError(f"{key} must be finite numbers > 0, got {key}[{bad[0]}]={float(s[bad[0]])!r}")
    return np.log(s)
