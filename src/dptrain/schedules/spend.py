"""What a noise schedule spends: the privacy of steps with noise multipliers sigma_t = c * s_t under each of the
schedule accountants, and the test ``step_allowed`` that calibration and the engine's validation-driven noise apply.

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

Numpy, scipy, dp_accounting and dptrain.accounting only: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special

from dptrain.accounting.base import epsilon as ledger_epsilon
from dptrain.accounting.checks import check_delta
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.ledger import Ledger, gaussian_step_event, step_facts
from dptrain.accounting.standard import RDP_ORDERS, PldAccountant, quiet_absl
from dptrain.errors import AccountingError, ConfigError, NoFiniteEpsilon
from dptrain.schedules.budget import Budget, _epsilon_of, _rho_of, make_budget
from dptrain.schedules.params import _log_sigmas, _number, check_accountant

#: rdp: up to this many distinct noise levels are summed exactly; beyond, chord bounds on a lattice.
RDP_MAX_NODES = 2048
#: rdp: the finest lattice spacing in ln(sigma^-2) for chord bounds (doubled until RDP_MAX_NODES suffice).
RDP_LATTICE_STEP = 2.0**-10
#: rdp: the orders (integer orders of dptrain's rdp accountant; the binomial expansion is exact for them).
RDP_INTEGER_ORDERS = tuple(int(a) for a in RDP_ORDERS if a >= 2 and float(a).is_integer())
#: rdp: order scans (calibration, reported epsilon) stop after this many orders in a row worse than the best one.
RDP_PATIENCE = 6
#: pld: at most this many distinct noise levels (each is a PLD to build and compose, ~1 s each).
PLD_MAX_LEVELS = 16


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
