"""Noise schedules sigma_t (t = 1..T) and their calibration to a privacy budget.

The paper is "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021 submission),
cited below as "Dynamic Noise Influence". Its private gradient descent adds noise ``G sigma_t nu_t / N`` at step t,
and a schedule is the sequence sigma_1..sigma_T. Every schedule here is ``sigma_t = c * s_t``: an unnormalised
positive shape s_t (the kind) times ONE common scale c, chosen so that the whole run spends exactly the budget.

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

Budgets: zCDP ``rho``, the paper's ``R`` (= 2 rho: it charges a step 1/sigma^2, Thm 3.1), or ``(epsilon,
delta)``, converted by Lemma B.3 with the root that reproduces the paper's own example ((4, 1e-8) -> rho = 0.1963,
R = 0.3927; :func:`dptrain.schedules.bounds.R_from_eps_delta` and :func:`~dptrain.schedules.bounds.eps_from_R`).

Accountants (what "spends the budget" means):

- ``zcdp`` (the paper's): sum_t 1/(2 sigma_t^2) = rho, closed form. With Poisson sampling it claims no
  amplification (still a valid bound, just loose).
- ``exact``: full-batch Gaussian steps compose exactly into one Gaussian mechanism, mu-GDP with
  mu^2 = sum_t sigma_t^-2 (Dong, Roth & Su 2022), converted exactly to (epsilon, delta). Certified and tight.
  Refused for subsampled steps (it would not be exact).
- ``rdp``: Renyi DP of Poisson-subsampled Gaussian steps (Mironov, Talwar & Zhang 2019) at the integer orders of
  dptrain's rdp accountant, by the binomial expansion dp_accounting uses for integer orders, vectorised over the
  distinct noise levels (dp_accounting costs ~0.3 s per distinct sigma, too slow for decaying schedules). Up to
  RDP_MAX_NODES distinct levels the sum is exact; beyond, each step's RDP is bounded by the chord between two points
  of a fixed geometric lattice in sigma^-2 (ln A_alpha is convex in 1/sigma^2, so the chord is an upper bound:
  certified, ~1e-7 relative looser on a 10x decay). dptrain's own rdp accountant also tries fractional orders, so
  on the same schedule it reports at most this epsilon (up to ~1% less at large budgets, epsilon ~ 8, whose best
  order lies between 2 and 3; the same at moderate budgets).
- ``pld``: dptrain's pld accountant (dp_accounting PLDs, pessimistic discretization) on a ledger with one entry
  per distinct noise level; at most PLD_MAX_LEVELS levels (see ``levels`` to quantise a shape).

Calibration is Brent's method on log c (closed forms for zcdp and exact), then a step up until the accountant itself
says the schedule is within budget, so a returned schedule never exceeds its budget. The spend, as the accountant
computes it, matches the target to 1e-9 relative for zcdp, exact and rdp (all continuous in c). For pld the search
runs on dptrain's coarse pld grid, then one Newton step on its fine grid, whose epsilon moves in small jumps with c:
the match is ~1e-7 typically, at worst the gap between the two grids (~3e-4 relative).

Numpy, scipy, dp_accounting, dptrain.accounting and dptrain.schedules.bounds only: no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special

from dptrain.accounting.base import epsilon as ledger_epsilon
from dptrain.accounting.checks import check_delta
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.ledger import Ledger, gaussian_step_event, step_facts
from dptrain.accounting.standard import RDP_ORDERS, PldAccountant, quiet_absl
from dptrain.errors import AccountingError, ConfigError, NoFiniteEpsilon
from dptrain.schedules.bounds import (
    R_from_eps_delta,
    R_from_rho,
    eps_from_R,
    gamma_from_kappa,
    log_gd_influence,
    log_momentum_influence,
    log_momentum_influence_two_exp,
    momentum_gamma,
    optimal_log_shares,
    rho_from_R,
)

# (the names live in a light module: the config validator and the CLI parser read them without scipy)
from dptrain.schedules.names import ACCOUNTANTS, BASELINE_KINDS, KIND_PARAMS, KINDS, MOMENTUM_FORMS

#: Largest sigma_max / sigma_min a schedule may span. Beyond it the noisiest steps carry no signal and the noise
#: multipliers leave the range the accountants compute in.
RANGE_MAX = 1e100
#: rdp: up to this many distinct noise levels are summed exactly; beyond, chord bounds on a lattice.
RDP_MAX_NODES = 2048
#: rdp: the finest lattice spacing in ln(sigma^-2) for chord bounds (doubled until RDP_MAX_NODES suffice).
RDP_LATTICE_STEP = 2.0**-10
#: rdp: the orders (integer orders of dptrain's rdp accountant; the binomial expansion is exact for them).
RDP_INTEGER_ORDERS = tuple(int(a) for a in RDP_ORDERS if a >= 2 and float(a).is_integer())
#: rdp: order scans (calibration, reported epsilon) stop after this many orders in a row worse than the best one.
RDP_PATIENCE = 6
#: pld: the first step (in ln c, doubled) when stepping a schedule up into its budget (each try is a PLD).
PLD_STEP = 1e-7
#: pld: a Newton step that lands above the budget by at most this (relative) is stepped up from, not dropped.
PLD_NEWTON_SLACK = 1e-5
#: pld: at most this many distinct noise levels (each is a PLD to build and compose, ~1 s each).
PLD_MAX_LEVELS = 16


# --- budgets ---------------------------------------------------------------------------------------------------


def _positive(key: str, value: Any) -> float:
    """A budget number (rho, R, epsilon): a finite number > 0, else AccountingError."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise AccountingError(f"{key} must be a finite number > 0, got {value!r}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise AccountingError(f"{key} must be a finite number > 0, got {value!r}")
    return v


def _epsilon_of(rho: float, delta: float) -> float:
    """Epsilon at delta of a rho-zCDP run (Dynamic Noise Influence, Lemma B.3, via the paper's R = 2 rho)."""
    return eps_from_R(R_from_rho(rho), delta)


def _rho_of(epsilon: float, delta: float) -> float:
    """The largest rho whose Lemma B.3 conversion gives (epsilon, delta) (via the paper's R = 2 rho)."""
    return rho_from_R(R_from_eps_delta(epsilon, delta))


@dataclass(frozen=True)
class Budget:
    """A privacy budget: zCDP ``rho`` (the paper's R = 2 rho), or ``(epsilon, delta)``. ``delta`` may come with a
    zCDP budget too: the target stays rho, and spent epsilons are reported at that delta."""

    rho: float | None = None
    epsilon: float | None = None
    delta: float | None = None

    @property
    def R(self) -> float | None:  # noqa: N802  (the paper's name)
        return None if self.rho is None else R_from_rho(self.rho)

    def to_json(self) -> dict[str, Any]:
        return {"rho": self.rho, "R": self.R, "epsilon": self.epsilon, "delta": self.delta}


def make_budget(
    *,
    rho: float | None = None,
    R: float | None = None,  # noqa: N803  (the paper's name)
    epsilon: float | None = None,
    delta: float | None = None,
) -> Budget:
    """A :class:`Budget` from exactly one of ``rho`` (zCDP), ``R`` (= 2 rho, Dynamic Noise Influence, Thm 3.1) or
    ``epsilon`` (with ``delta``)."""
    given = [k for k, v in (("rho", rho), ("R", R), ("epsilon", epsilon)) if v is not None]
    if len(given) != 1:
        got = ", ".join(
            f"{k}={v!r}" for k, v in (("rho", rho), ("R", R), ("epsilon", epsilon)) if v is not None
        )
        raise AccountingError(
            f"budget: give exactly one of rho (zCDP), R (= 2 rho) or epsilon (with delta), got {got or 'none'}"
        )
    d = None if delta is None else check_delta(delta)
    if epsilon is not None:
        if d is None:
            raise AccountingError(f"budget: epsilon={epsilon!r} needs a delta in (0, 1), got delta=None")
        return Budget(epsilon=_positive("epsilon", epsilon), delta=d)
    r = _positive("rho", rho) if rho is not None else rho_from_R(_positive("R", R))
    return Budget(rho=r, delta=d)


# --- parameters --------------------------------------------------------------------------------------------------


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


# --- shapes ------------------------------------------------------------------------------------------------------


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


# --- accountants: the spend of sigmas = c * s --------------------------------------------------------------------


def _rdp_orders_log_w(alpha: int, q: float) -> np.ndarray:
    """ln of the Binomial(alpha, q) weights for k = 2..alpha."""
    k = np.arange(2, alpha + 1, dtype=float)
    return (
        special.gammaln(alpha + 1.0)
        - special.gammaln(k + 1.0)
        - special.gammaln(alpha - k + 1.0)
        + k * math.log(q)
        + (alpha - k) * math.log1p(-q)
    )


class _Rdp:
    """RDP of Poisson-subsampled Gaussian steps with noise multipliers sigma_t = e^(log_c) s_t, at integer orders.

    Per step and integer order alpha (Mironov, Talwar & Zhang 2019, Sec. 3.3; dp_accounting's _compute_log_a_int):
    A_alpha = sum_k C(alpha, k) (1-q)^(alpha-k) q^k e^(k(k-1) x), x = 1/(2 sigma^2), RDP = ln(A_alpha)/(alpha-1),
    computed as ln(1 + sum_{k>=2} w_k expm1(k(k-1) x)) (exact for tiny x, where ln A is mostly cancellation).
    ln A_alpha is a log-sum-exp of affine functions of x, hence convex in x = u/(2c^2), u = s^-2: between two
    lattice points in u the chord is an upper bound. Nodes are the distinct u (exact sum) when there are at most
    RDP_MAX_NODES of them, else the lattice u = e^(j h), h = RDP_LATTICE_STEP 2^m with the smallest m that needs
    at most RDP_MAX_NODES nodes. Coarser lattices give larger bounds (convexity), so a prefix of a run is never
    charged more than the whole run."""

    def __init__(self, log_s: np.ndarray, q: float):
        self.q = q
        log_u, counts = np.unique(-2.0 * np.asarray(log_s, dtype=float), return_counts=True)
        if log_u.size <= RDP_MAX_NODES:
            self.log_nodes, self.weights, self.lattice_step = log_u, counts.astype(float), None
        else:
            h = RDP_LATTICE_STEP
            while True:
                j = np.floor(log_u / h)
                nodes = np.union1d(j, j + 1)
                if nodes.size <= RDP_MAX_NODES:
                    break
                h *= 2
            lo = np.exp(j * h)
            lam = np.clip((np.exp(log_u) - lo) / (np.exp((j + 1) * h) - lo), 0.0, 1.0)
            idx = np.searchsorted(nodes, j)
            w = np.bincount(idx, counts * (1 - lam), nodes.size) + np.bincount(
                idx + 1, counts * lam, nodes.size
            )
            keep = w > 0
            self.log_nodes, self.weights, self.lattice_step = nodes[keep] * h, w[keep], h
        self._log_w: dict[int, np.ndarray] = {}

    def rdp(self, alpha: int, log_c: float) -> float:
        """Total RDP at integer order alpha >= 2."""
        with np.errstate(over="ignore"):
            x = 0.5 * np.exp(self.log_nodes - 2.0 * log_c)
        if self.q == 1.0:
            return float(alpha * np.dot(self.weights, x))
        log_w = self._log_w.get(alpha)
        if log_w is None:
            log_w = self._log_w[alpha] = _rdp_orders_log_w(alpha, self.q)
        kk = np.arange(2, alpha + 1, dtype=float)
        kk = kk * (kk - 1)
        out = np.empty(x.size)
        rows = max(1, 2_000_000 // alpha)
        with np.errstate(over="ignore", divide="ignore"):
            for a in range(0, x.size, rows):
                y = x[a : a + rows, None] * kk[None, :]
                terms = log_w[None, :] + y + np.log(-np.expm1(-y))
                top = np.max(terms, axis=1)
                safe = np.where(np.isfinite(top), top, 0.0)
                log_s = np.log(np.sum(np.exp(terms - safe[:, None]), axis=1)) + safe
                out[a : a + rows] = np.logaddexp(0.0, np.where(np.isfinite(top), log_s, top))
        return float(np.dot(self.weights, out)) / (alpha - 1)

    def order_epsilon(self, alpha: int, log_c: float, delta: float) -> float:
        r = self.rdp(alpha, log_c)
        if not math.isfinite(r):
            return math.inf
        with quiet_absl():
            return float(rdp_privacy_accountant.compute_epsilon([alpha], [r], delta)[0])

    def epsilon(self, log_c: float, delta: float, hint: int | None = None) -> tuple[float, int]:
        """(epsilon, order): the best order of an upward scan that stops RDP_PATIENCE orders past its best, and the
        order ``hint`` (any order's epsilon is a valid bound; the scan only looks for the tightest)."""
        best, best_order, worse = math.inf, RDP_INTEGER_ORDERS[0], 0
        if hint is not None:
            best, best_order = self.order_epsilon(hint, log_c, delta), hint
        for alpha in RDP_INTEGER_ORDERS:
            if alpha == hint:
                continue
            e = self.order_epsilon(alpha, log_c, delta)
            if e < best:
                best, best_order, worse = e, alpha, 0
            elif alpha > best_order:
                worse += 1
                if worse >= RDP_PATIENCE:
                    break
        return best, best_order

    def within(self, log_c: float, delta: float, target: float, hint: int | None = None) -> bool:
        """Whether some order certifies epsilon <= target (all orders are tried before answering no)."""
        if hint is not None and self.order_epsilon(hint, log_c, delta) <= target:
            return True
        return any(self.order_epsilon(a, log_c, delta) <= target for a in RDP_INTEGER_ORDERS if a != hint)


def _levels(log_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.unique(np.asarray(log_s, dtype=float), return_counts=True)


def _pld_ledger(log_s: np.ndarray, log_c: float, q: float) -> Ledger:
    """A dptrain ledger of the schedule: one entry per distinct noise level (composition does not depend on the
    order), or, without sampling, the one Gaussian release all the steps compose into exactly."""
    ledger = Ledger()
    if q == 1.0:
        sigma = math.exp(log_c) / math.sqrt(math.fsum(np.exp(-2.0 * np.asarray(log_s))))
        ledger.record(gaussian_step_event(sigma, "full"), step_facts("full"))
        return ledger
    values, counts = _levels(log_s)
    if values.size > PLD_MAX_LEVELS:
        raise ConfigError(
            f"accountant 'pld' composes at most {PLD_MAX_LEVELS} distinct noise levels, got {values.size}: "
            f"quantise the schedule (levels <= {PLD_MAX_LEVELS}) or use accountant 'rdp'"
        )
    for v, n in zip(values, counts, strict=True):
        sigma = math.exp(log_c + v)
        ledger.record(
            gaussian_step_event(sigma, "poisson", sampling_rate=q), step_facts("poisson", q), int(n)
        )
    return ledger


def _pld_epsilon(log_s: np.ndarray, log_c: float, q: float, delta: float, search: bool = False) -> float:
    ledger = _pld_ledger(log_s, log_c, q)
    try:
        if search:
            return PldAccountant().for_search().report(ledger, delta).epsilon
        return ledger_epsilon(ledger, delta, "pld").epsilon
    except NoFiniteEpsilon:
        return math.inf


def _sampling_rate(q: Any, accountant: str) -> float:
    q = _number("sampling_rate", q, "a number in (0, 1]", lambda v: 0 < v <= 1)
    if accountant == "exact" and q < 1:
        raise ConfigError(
            f"accountant 'exact' covers full-batch steps only (sampling_rate 1), got sampling_rate={q:g}: "
            "subsampled Gaussian steps do not compose into one Gaussian; use 'rdp' or 'pld'"
        )
    return q


def _zcdp_target(budget: Budget) -> float:
    return budget.rho if budget.rho is not None else _rho_of(budget.epsilon, budget.delta)


def _rho_spent(log_s: np.ndarray, log_c: float) -> float:
    """sum_t 1/(2 sigma_t^2), correctly rounded (math.fsum: independent of the order of the steps)."""
    return 0.5 * math.fsum(np.exp(-2.0 * (np.asarray(log_s, dtype=float) + log_c)))


def _needs_epsilon(budget: Budget, accountant: str) -> None:
    if budget.epsilon is None:
        raise AccountingError(
            f"accountant {accountant!r} needs an (epsilon, delta) budget, got zCDP rho={budget.rho:g}; if "
            "(eps_from_R(2 rho, delta), delta) is the guarantee you want, give that"
        )


def _within(log_s: np.ndarray, log_c: float, budget: Budget, accountant: str, q: float, hint=None) -> bool:
    """Whether sigmas = e^log_c s spend at most the budget under the accountant (the one test everything uses)."""
    if accountant == "zcdp" or (accountant == "exact" and budget.epsilon is None):
        rho = _rho_spent(log_s, log_c)
        if budget.epsilon is not None and _epsilon_of(rho, budget.delta) > budget.epsilon:
            return False  # (the conversion back may round one ulp above the budget)
        return rho <= _zcdp_target(budget)
    _needs_epsilon(budget, accountant)
    if accountant == "exact":
        mu = math.sqrt(2.0 * _rho_spent(log_s, log_c))
        return (
            gdp_delta(budget.epsilon, mu) <= budget.delta and gdp_epsilon(mu, budget.delta) <= budget.epsilon
        )
    if accountant == "rdp":
        return _Rdp(np.asarray(log_s) + log_c, q).within(0.0, budget.delta, budget.epsilon, hint)
    return _pld_epsilon(log_s, log_c, q, budget.delta) <= budget.epsilon


def _spent_epsilon(
    log_s: np.ndarray, log_c: float, delta: float, accountant: str, q: float, hint: int | None = None
) -> tuple[float, dict]:
    if accountant == "zcdp":
        return _epsilon_of(_rho_spent(log_s, log_c), delta), {}
    if accountant == "exact":
        mu = math.sqrt(2.0 * _rho_spent(log_s, log_c))
        return gdp_epsilon(mu, delta), {"mu": mu}
    if accountant == "rdp":
        rdp = _Rdp(np.asarray(log_s) + log_c, q)
        eps, order = rdp.epsilon(0.0, delta, hint)
        return eps, {"optimal_order": order, "rdp_lattice_step": rdp.lattice_step}
    return _pld_epsilon(log_s, log_c, q, delta), {}


def _log_sigmas(sigmas: Any, key: str = "sigmas") -> np.ndarray:
    s = np.asarray(sigmas, dtype=float).reshape(-1)
    bad = np.flatnonzero(~(np.isfinite(s) & (s > 0)))
    if bad.size:
        raise ConfigError(f"{key} must be finite numbers > 0, got {key}[{bad[0]}]={float(s[bad[0]])!r}")
    return np.log(s)


def spent_rho(sigmas: Sequence[float]) -> float:
    """zCDP spent by Gaussian steps with these noise multipliers: sum_t 1/(2 sigma_t^2) (Dynamic Noise Influence,
    Thm 3.1; the paper's R is twice this). Claims no amplification by sampling."""
    return _rho_spent(_log_sigmas(sigmas), 0.0)


def spent_epsilon(
    sigmas: Sequence[float], delta: float, accountant: str = "exact", sampling_rate: float = 1.0
) -> float:
    """Epsilon at ``delta`` spent by steps with these noise multipliers under ``accountant`` (see the module doc)."""
    accountant, delta = check_accountant(accountant), check_delta(delta)
    q = _sampling_rate(sampling_rate, accountant)
    return _spent_epsilon(_log_sigmas(sigmas), 0.0, delta, accountant, q)[0]


def _budget_terms(
    accountant: Any,
    rho: Any,
    R: Any,  # noqa: N803
    epsilon: Any,
    delta: Any,
    sampling_rate: Any,
) -> tuple[str, Budget, float]:
    """(accountant, budget, sampling rate) of a call, each checked."""
    accountant = check_accountant(accountant)
    budget = make_budget(rho=rho, R=R, epsilon=epsilon, delta=delta)
    return accountant, budget, _sampling_rate(sampling_rate, accountant)


def step_allowed(
    used: Sequence[float],
    next_sigma: float,
    *,
    rho: float | None = None,
    R: float | None = None,  # noqa: N803
    epsilon: float | None = None,
    delta: float | None = None,
    accountant: str = "zcdp",
    sampling_rate: float = 1.0,
) -> bool:
    """Whether the budget allows one more step with noise multiplier ``next_sigma`` after steps with the noise
    multipliers ``used``: True when all of them together spend at most the budget under ``accountant``. The test is
    the one calibration applies, so a calibrated schedule passes it at every step. (For the engine's
    validation-driven noise, whose sigma depends on a validation signal and cannot be calibrated in advance.)"""
    accountant, budget, q = _budget_terms(accountant, rho, R, epsilon, delta, sampling_rate)
    log_s = np.append(_log_sigmas(used, "used"), _log_sigmas([next_sigma], "next_sigma"))
    return _within(log_s, 0.0, budget, accountant, q)


# --- calibration ---------------------------------------------------------------------------------------------------


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


def _quantised(log_s: np.ndarray, levels: Any) -> np.ndarray:
    """The shape rounded (in log space) to ``levels`` geometric levels between its smallest and largest values."""
    levels = _integer("levels", levels)
    lo, hi = float(np.min(log_s)), float(np.max(log_s))
    if hi == lo:
        return log_s
    grid = np.linspace(lo, hi, levels) if levels > 1 else np.array([lo])
    idx = np.rint((log_s - lo) / (hi - lo) * (levels - 1)).astype(int)
    return grid[idx]


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
    under ``accountant`` (see the module doc; never more). ``levels``: first round the shape, in log space, to that
    many geometric levels (a staircase: what ``pld`` needs for a decaying shape)."""
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


__all__ = [
    "ACCOUNTANTS",
    "BASELINE_KINDS",
    "KINDS",
    "KIND_PARAMS",
    "MOMENTUM_FORMS",
    "Budget",
    "Schedule",
    "calibrate_schedule",
    "calibrate_shape",
    "check_accountant",
    "check_kind",
    "make_budget",
    "quantised_shape",
    "read_influence",
    "schedule_shape",
    "spent_epsilon",
    "spent_rho",
    "step_allowed",
]
