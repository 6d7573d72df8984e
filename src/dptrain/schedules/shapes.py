"""Noise schedule shapes s_t (t = 1..T): sigma_t = c * s_t, the shape times one common scale c (calibrated by
:mod:`dptrain.schedules.calibration`). The paper is "On Dynamic Noise Influence in Differential Private Learning"
(anonymous ICLR 2021 submission), cited below as "Dynamic Noise Influence".

Shapes (the names are the config's ``[schedule] kind``):

- ``uniform``: s_t = 1 (Dynamic Noise Influence, Thm 4.2: sigma_t^2 = T/R).
- ``influence``: Lemma 4.1 for a given positive influence q_t: sigma_t^2 proportional to 1/sqrt(q_t), i.e. step t
  gets the budget share rho_t / rho = sqrt(q_t) / sum_s sqrt(q_s) (under zCDP a step costs 1/(2 sigma_t^2)).
- ``gd-optimal``: Thm 4.3, eq. 7: Lemma 4.1 with the gradient-descent influence q_t = alpha gamma^(T-t) (Thm 4.1,
  eq. 3), i.e. sigma_t^2 = (1/R) gamma^((t-T)/2) (1 - gamma^(T/2)) / (1 - sqrt(gamma)): an exact exponential decay,
  sigma_{t+1} / sigma_t = gamma^(1/4) < 1 (the noise DEcreases over the run).
- ``momentum``: Lemma 4.1 with the influence of momentum steps (Sec. 4.2), in one of two forms:
  ``reindexed`` (default; derived here, not printed in the paper): the exact per-step weight of sigma_i^2 in the
  noise term U3 of Thm 4.4 (eq. 13), q_i = sum_{t >= i} gamma^(T-t) ((1-beta)/(1-beta^t))^2 beta^(2(t-i));
  ``two-exponential``: Thm 4.6's q_t = c1 gamma^(T+t) for t <= T-hat, gamma^(T-hat - 1) c2 gamma^(T-t) after, with
  T-hat of Lemma B.7.
- Baselines that are NOT from this paper (it only mentions them; the forms are those of Yu et al. 2019,
  "Differentially Private Model Publishing for Deep Learning"): ``exponential``, ``time``, ``step``,
  ``polynomial``. Their steps are counted from 0 here (i = t - 1), so the first step has the initial noise.

The paper's formulas (influences, T-hat, Lemma 4.1's allocation, gamma from kappa, the budget conversions) live in
:mod:`dptrain.schedules.bounds`; the shapes here are built from their log-space forms, so long runs stay in range.
Numpy and dptrain.schedules.bounds only: no torch, no scipy.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.errors import ConfigError
from dptrain.schedules.bounds_constants import gamma_from_kappa, momentum_gamma
from dptrain.schedules.bounds_gd import log_gd_influence, optimal_log_shares
from dptrain.schedules.bounds_momentum import log_momentum_influence, log_momentum_influence_two_exp
from dptrain.schedules.names import KIND_PARAMS, MOMENTUM_FORMS
from dptrain.schedules.params import _integer, _log_sigmas, _number, check_kind

#: Largest sigma_max / sigma_min a schedule may span. Beyond it the noisiest steps carry no signal and the noise
#: multipliers leave the range the accountants compute in.
RANGE_MAX = 1e100


def _gamma(kind: str, params: Mapping[str, Any], gd: bool) -> Any:
    gamma, kappa = params.get("gamma"), params.get("kappa")
    if (gamma is None) == (kappa is None):
        both = "not both" if gamma is not None else "got neither"
        raise ConfigError(f"schedule kind {kind!r} needs gamma (in [0, 1)) or kappa (>= 1), {both}")
    if gamma is not None:
        other = "eta" if gd else "eta0"
        if params.get(other) is not None:
            raise ConfigError(
                f"{other} is used only with kappa (it sets gamma from kappa); got gamma and {other}"
            )
        return gamma  # checked (bounds._gamma) by the influence it goes into
    if gd:
        eta = params.get("eta")
        return gamma_from_kappa(kappa, 1.0 if eta is None else eta)
    if params.get("eta0") is None:
        raise ConfigError("schedule kind 'momentum' with kappa needs eta0 (gamma = 1 - eta0/kappa), got none")
    return momentum_gamma(kappa, params["eta0"])


def _influence_log_shape(log_q: np.ndarray) -> np.ndarray:
    """ln s_t for the influences ln q_t: Dynamic Noise Influence, Lemma 4.1 (eq. 6) gives step t the budget share
    1/(sigma_t^2 R), so s_t = share_t^(-1/2) (proportional to q_t^(-1/4))."""
    return -0.5 * optimal_log_shares(log_q)


def _log_shape(kind: str, T: int, params: Mapping[str, Any]) -> np.ndarray:
    """ln s_t (unnormalised) for t = 1..T."""
    unknown = sorted(set(params) - set(KIND_PARAMS[kind]))
    if unknown:
        accepted = ", ".join(KIND_PARAMS[kind]) or "none"
        raise ConfigError(
            f"unknown parameter {unknown[0]!r} for schedule kind {kind!r}; accepted: {accepted}"
        )
    i = np.arange(T, dtype=float)  # steps done before step t (t - 1)
    last = max(T - 1, 1)
    if kind == "uniform":
        return np.zeros(T)
    if kind == "influence":
        q = params.get("influence")
        if q is None:
            raise ConfigError(
                "schedule kind 'influence' needs influence (T positive finite numbers), got none"
            )
        try:
            q = np.asarray(q, dtype=float)
        except (TypeError, ValueError):
            raise ConfigError(
                f"influence must be a sequence of T={T} positive finite numbers, got {q!r}"
            ) from None
        if q.shape != (T,):
            raise ConfigError(f"influence must hold T={T} positive finite numbers, got shape {q.shape}")
        bad = np.flatnonzero(~(np.isfinite(q) & (q > 0)))
        if bad.size:
            raise ConfigError(
                f"influence must hold positive finite numbers, got influence[{bad[0]}]={float(q[bad[0]])!r} "
                f"(step {bad[0] + 1})"
            )
        return _influence_log_shape(np.log(q))
    if kind == "gd-optimal":
        gamma = _gamma(kind, params, gd=True)
        log_q = log_gd_influence(T, gamma)
        if gamma == 0.0 and T > 1:
            raise ConfigError(
                f"gamma must be in (0, 1) for gd-optimal with T={T} > 1, got gamma=0 (kappa=1 gives it): it puts the "
                "whole budget on the last step (Thm 4.3)"
            )
        return _influence_log_shape(log_q)
    if kind == "momentum":
        beta = params.get("beta")
        if beta is None:
            raise ConfigError("schedule kind 'momentum' needs beta (the momentum, in [0, 1)), got none")
        gamma = _gamma(kind, params, gd=False)
        form = params.get("form", "reindexed")
        if form not in MOMENTUM_FORMS:
            raise ConfigError(f"momentum form must be one of {', '.join(MOMENTUM_FORMS)}, got {form!r}")
        if form == "reindexed":
            if params.get("c1") is not None or params.get("c2") is not None:
                raise ConfigError(
                    "c1, c2 belong to momentum form 'two-exponential', got them with form 'reindexed'"
                )
            return _influence_log_shape(log_momentum_influence(T, beta, gamma))
        c1, c2 = params.get("c1"), params.get("c2")
        return _influence_log_shape(log_momentum_influence_two_exp(T, beta, gamma, c1=c1, c2=c2))
    if kind == "exponential":
        rate = params.get("rate")
        rate = (
            math.log(10.0) / last
            if rate is None
            else _number("rate", rate, "a finite number", lambda r: True)
        )
        return -rate * i
    if kind == "time":
        rate = params.get("rate")
        rate = 9.0 / last if rate is None else _number("rate", rate, "a finite number >= 0", lambda r: r >= 0)
        return -np.log1p(rate * i)
    if kind == "step":
        factor = _number("factor", params.get("factor", 0.5), "a finite number > 0", lambda f: f > 0)
        period = params.get("period")
        period = max(1, math.ceil(T / 4)) if period is None else _integer("period", period)
        return np.floor(i / period) * math.log(factor)
    # polynomial
    power = _number("power", params.get("power", 1.0), "a finite number > 0", lambda p: p > 0)
    final = _number(
        "final", params.get("final", 0.1), "a finite number > 0 (sigma_end / sigma_0)", lambda f: f > 0
    )
    period = params.get("period")
    period = last if period is None else _integer("period", period)
    return np.log((1.0 - final) * (1.0 - np.minimum(i, period) / period) ** power + final)


def _normalised(log_s: np.ndarray, what: str) -> np.ndarray:
    """ln s_t - max ln s: s in (0, 1], refused when its range is above RANGE_MAX (or not finite)."""
    top = np.max(log_s)
    with np.errstate(invalid="ignore"):
        log_s = log_s - top
    lo = float(np.min(log_s))
    if not (math.isfinite(top) and lo >= -math.log(RANGE_MAX)):
        span = f"e^{-lo:.4g}" if math.isfinite(lo) else "infinite"
        raise ConfigError(
            f"{what} spans a noise ratio sigma_max/sigma_min of {span}, above {RANGE_MAX:g}: its noisiest steps would "
            "carry no signal; use fewer steps or a flatter schedule"
        )
    return log_s


def _describe(kind: str, T: int, params: Mapping[str, Any]) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items() if k != "influence")
    return f"schedule kind {kind!r} (T={T}{', ' + shown if shown else ''})"


def schedule_shape(kind: str, T: int, **params: Any) -> np.ndarray:
    """The shape s_t, t = 1..T (positive, largest value 1) of a schedule kind; sigma_t = c s_t. Parameters:

    - ``uniform``: none.
    - ``influence``: ``influence`` (T positive numbers q_t): s_t = q_t^(-1/4) (Dynamic Noise Influence, Lemma 4.1).
    - ``gd-optimal``: ``gamma`` in [0, 1), or ``kappa`` >= 1 (and ``eta``, the step size times M, default 1:
      gamma = 1 - eta (2 - eta)/kappa): s_t = gamma^((t-1)/4) (Thm 4.3, eq. 7).
    - ``momentum``: ``beta`` in [0, 1); ``gamma``, or ``kappa`` and ``eta0`` (gamma = 1 - eta0/kappa, Thm 4.4);
      ``form`` ``reindexed`` (default) or ``two-exponential`` (Thm 4.6, with ``c1``, ``c2``).
    - NOT from the paper (Yu et al. 2019 decays; i = t - 1): ``exponential``: e^(-rate i), default rate ln(10)/(T-1);
      ``time``: 1/(1 + rate i), default rate 9/(T-1) (both: the noise falls tenfold over the run); ``step``:
      factor^floor(i/period), defaults factor 0.5, period ceil(T/4); ``polynomial``:
      (1 - final)(1 - min(i, period)/period)^power + final, defaults power 1, final 0.1, period T-1.
    """
    kind, T = check_kind(kind), _integer("T", T)
    return np.exp(_normalised(_log_shape(kind, T, params), _describe(kind, T, params)))


def read_influence(path: str, key: str = "influence") -> np.ndarray:
    """The numbers of an influence file: ``.npy`` (one array), else text with numbers separated by commas,
    semicolons, spaces or lines (``#`` starts a comment). Checked for count and sign by the schedule."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: no such file: {path}")
    if not p.is_file():
        raise ConfigError(f"{key}: not a file: {path}")
    if p.suffix.lower() == ".npy":
        try:
            values = np.load(p, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{key}: {path} is not a readable .npy file of numbers ({why})") from None
        if not np.issubdtype(values.dtype, np.number) or np.issubdtype(values.dtype, np.complexfloating):
            raise ConfigError(f"{key}: {path} holds {values.dtype} values, not real numbers")
        return np.squeeze(values).astype(float)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not a text file (or a .npy file)") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        for word in re.split(r"[,;\s]+", line.split("#", 1)[0].strip()):
            if not word:
                continue
            try:
                values.append(float(word))
            except ValueError:
                raise ConfigError(f"{key}: {path} line {number}: {word!r} is not a number") from None
    return np.asarray(values, dtype=float)


def quantised_shape(shape: Sequence[float], levels: int) -> np.ndarray:
    """``shape`` rounded, in log space, to ``levels`` geometric levels between its smallest and largest values (a
    staircase: a compact ledger, and what ``pld`` needs for a decaying shape). Largest value 1."""
    return np.exp(_quantised(_normalised(_log_sigmas(shape, "shape"), "the shape"), levels))


def _quantised(log_s: np.ndarray, levels: Any) -> np.ndarray:
    """The shape rounded (in log space) to ``levels`` geometric levels between its smallest and largest values."""
    levels = _integer("levels", levels)
    lo, hi = float(np.min(log_s)), float(np.max(log_s))
    if hi == lo:
        return log_s
    grid = np.linspace(lo, hi, levels) if levels > 1 else np.array([lo])
    idx = np.rint((log_s - lo) / (hi - lo) * (levels - 1)).astype(int)
    return grid[idx]
