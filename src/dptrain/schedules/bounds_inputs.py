"""The input checks shared by the utility bounds of "On Dynamic Noise Influence in Differential Private Learning"
(anonymous ICLR 2021 submission; "Dynamic Noise Influence"): each raises ConfigError with a one-line message naming
the parameter, the value and what is accepted. Also gamma**x with 0**0 = 1, which the bounds take at gamma = 0
(kappa = 1), and the check that a schedule stays within the paper's budget R (Alg. 1). numpy only."""

from __future__ import annotations

import math

import numpy as np

from dptrain.errors import ConfigError

_BUDGET_RTOL = 1e-9  # a schedule may overspend R by this relative amount (floating-point sums)


def _real(name: str, x) -> float:
    if isinstance(x, bool | str | bytes):
        raise ConfigError(f"{name}={x!r} is not a number; accepted: a finite real number")
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={x!r} is not a number; accepted: a finite real number") from None
    return v


def _positive(name: str, x) -> float:
    v = _real(name, x)
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{name}={x!r} is invalid; accepted: a finite number > 0")
    return v


def _kappa(kappa) -> float:
    v = _real("kappa", kappa)
    if not (math.isfinite(v) and v >= 1):
        raise ConfigError(f"kappa={kappa!r} is invalid; accepted: a finite number >= 1 (kappa = M/mu)")
    return v


def _gamma(gamma) -> float:
    v = _real("gamma", gamma)
    if not (0 <= v < 1):
        raise ConfigError(f"gamma={gamma!r} is invalid; accepted: a number in [0, 1) (gamma = 1 - 1/kappa)")
    return v


def _beta(beta) -> float:
    v = _real("beta", beta)
    if not (0 <= v < 1):
        raise ConfigError(f"beta={beta!r} is invalid; accepted: a momentum coefficient in [0, 1)")
    return v


def _steps(T) -> int:
    """T as a Python int >= 1 (integral floats accepted)."""
    if isinstance(T, bool):
        raise ConfigError(f"T={T!r} is invalid; accepted: an integer number of steps >= 1")
    v = _real("T", T)
    if not (math.isfinite(v) and v >= 1 and v == int(v)):
        raise ConfigError(f"T={T!r} is invalid; accepted: an integer number of steps >= 1")
    return int(v)


def _real_steps(T) -> float:
    v = _real("T", T)
    if not (math.isfinite(v) and v >= 0):
        raise ConfigError(f"T={T!r} is invalid; accepted: a finite number of steps >= 0")
    return v


def _vector(name: str, v, positive: bool = True) -> np.ndarray:
    """A non-empty 1-D array of finite floats, all > 0 when ``positive`` (else logarithms: any finite number)."""
    accepted = "finite numbers > 0" if positive else "finite numbers"
    try:
        a = np.asarray(v, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} is not numeric; accepted: a 1-D sequence of {accepted}") from None
    if a.ndim != 1 or a.size == 0:
        raise ConfigError(f"{name} has shape {a.shape}; accepted: a non-empty 1-D sequence of {accepted}")
    bad = ~(np.isfinite(a) & (a > 0)) if positive else ~np.isfinite(a)
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(
            f"{name}[{i}]={float(a[i])!r} (t={i + 1}) is invalid; accepted: {accepted} in every entry"
        )
    return a


def _log_pow(gamma: float, x):
    """ln gamma**x (elementwise for an array x >= 0) with 0**0 = 1 and 0**x = 0 for x > 0 (ln: 0 and -inf)."""
    if gamma == 0.0:
        return np.where(np.asarray(x) == 0, 0.0, -np.inf)
    return x * math.log(gamma)


def _pow(gamma: float, x: float) -> float:
    """gamma**x with 0**0 = 1 and 0**x = 0 for x > 0."""
    return math.exp(float(_log_pow(gamma, x)))


def _check_budget(sigma: np.ndarray, R: float) -> None:
    spent = float(np.sum(1.0 / (sigma * sigma)))
    if spent > R * (1 + _BUDGET_RTOL):
        raise ConfigError(
            f"sigma spends sum 1/sigma_t^2 = {spent:.6g} > R={R!r}; accepted: schedules within the budget "
            "(Dynamic Noise Influence, Alg. 1)"
        )
