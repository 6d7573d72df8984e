"""Privacy filters: a budget for runs whose noise is chosen adaptively, and the ``filter`` accountant.

When a step's noise multiplier depends on what the run has released so far (a ``validation`` noise schedule lowers the
noise when a validation metric stops improving), the usual accountants do not apply: they compose mechanisms whose
parameters were fixed in advance, and the (epsilon, delta) they would compute from the realized noise is itself a
function of the data. What does apply is a *privacy filter*: a rule, fixed before the run, that stops it before the
spend measured in one fixed currency would pass a fixed budget. Then the whole run is private at the budget,
whatever the adaptive choices were. Three filters, each valid under fully adaptive composition:

- ``gdp`` (full-batch Gaussian steps only): step t is (1/sigma_t)-GDP; the run continues while sum_t sigma_t^-2 <=
  mu_B^2, and is then mu_B-GDP (Smith & Thakurta 2022, "Fully Adaptive Composition for Gaussian Differential
  Privacy"). mu_B is the largest mu whose exact (epsilon, delta) curve (Dong, Roth & Su 2022, Cor. 2.13)
  meets the budget: no loss against a non-adaptive run of the same total.
- ``zcdp``: step t costs 1/(2 sigma_t^2) (rho-zCDP, no amplification by sampling claimed); the run continues while
  the sum is <= rho_B. It is rho_B-zCDP: the stopping rule bounds the sum at every Renyi order alpha at once (the
  RDP curve is alpha rho), and a Renyi filter at a fixed order is valid (Feldman & Zrnic 2021, "Individual Privacy
  Accounting via a Renyi Filter", NeurIPS 2021). This is the residual-budget check of Algorithm 1 of "On Dynamic Noise
  Influence in Differential Private Learning" (anonymous ICLR 2021 submission), made non-strict (<=).
- ``rdp`` (Poisson-subsampled steps): a Renyi filter at ONE order alpha_0 fixed before the run (Feldman & Zrnic,
  2021): step t costs its RDP at alpha_0 (Mironov, Talwar & Zhang 2019, by dp_accounting), the run continues
  while the sum is <= B, B the largest RDP at alpha_0 whose conversion (dp_accounting's, Canonne, Kamath & Steinke
  2020) meets the budget. Taking the best order after the run would not be valid: the order would depend on the
  realized noise.

PLD has no known fully adaptive filter and is not offered.

The filter is recorded beside every step of the ledger (fact ``filter``); the ``filter`` accountant certifies such a
ledger by checking that its recorded steps stay within the filter and reporting the filter's (epsilon, delta), and
every other accountant refuses it (:func:`dptrain.accounting.base.epsilon`).

numpy/scipy/dp_accounting only, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from dptrain.accounting.base import PrivacyReport, register_accountant
from dptrain.accounting.checks import check_delta, check_epsilon
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.ledger import FILTER_FACT, Ledger
from dptrain.accounting.standard import quiet_absl, refuse_search
from dptrain.errors import AccountingError

FILTERS = ("gdp", "zcdp", "rdp")


def _rdp_epsilon(order: float, rdp: float, delta: float) -> float:
    with quiet_absl():
        return float(rdp_privacy_accountant.compute_epsilon([order], [rdp], delta)[0])


def _largest(fits, hi: float) -> float:
    """The largest x in (0, hi] with fits(x) (fits monotone: true below a threshold), to float precision."""
    while fits(hi):
        hi *= 2
    lo = hi / 2
    while not fits(lo):
        lo /= 2
        if lo < 1e-300:
            raise AccountingError("no positive budget meets this (epsilon, delta)")
    while math.nextafter(lo, hi) < hi:  # bisection on fits(lo) and not fits(hi), to adjacent floats
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class PrivacyFilter:
    """A budget for adaptively chosen steps (see the module doc). ``budget``: mu_B^2 (gdp), rho_B (zcdp) or the RDP
    at ``order`` (rdp); a step's cost is in the same currency, priced from the step's own event (its sampling rate
    and noise multiplier). ``sampling_rate`` is the rate the filter was planned for (information only)."""

    kind: str
    epsilon: float
    delta: float
    budget: float
    sampling_rate: float = 1.0
    order: int | None = None

    def __post_init__(self) -> None:
        ok = (
            self.kind in FILTERS
            and _finite_positive(self.epsilon)
            and _finite_positive(self.delta)
            and self.delta < 1
            and _finite_positive(self.budget)
            and _finite_positive(self.sampling_rate)
            and self.sampling_rate <= 1
            and (
                (isinstance(self.order, int) and not isinstance(self.order, bool) and self.order >= 2)
                if self.kind == "rdp"
                else self.order is None
            )
        )
        if not ok:
            raise AccountingError(f"malformed privacy filter: {self.to_fact()}")

    def cost(self, event: dpa.DpEvent) -> float:
        """What one release ``event`` spends: a Gaussian (full batch) or a Poisson-sampled Gaussian step. Anything
        else is refused; a noise multiplier that is not a finite number > 0 costs infinity."""
        q, sigma = _gaussian_step(event)
        if not _finite_positive(sigma):
            return math.inf
        if self.kind == "gdp":
            if q < 1:
                raise AccountingError(
                    "the gdp filter covers full-batch Gaussian steps only; this ledger records Poisson-sampled steps"
                )
            return sigma**-2
        if self.kind == "zcdp":
            return 0.5 * sigma**-2
        if q >= 1:
            return self.order * 0.5 * sigma**-2
        with np.errstate(over="ignore"):
            return float(
                rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(  # dp_accounting 0.6.0 (pinned)
                    q, sigma, [self.order]
                )[0]
            )

    def spent(self, ledger: Ledger) -> float:
        """The spend of every release in the ledger (entries in order, count x cost each)."""
        if ledger.neighboring != "add_or_remove_one":
            raise AccountingError("privacy filters here cover add/remove-one adjacency only")
        return math.fsum(e.count * self.cost(e.event) for e in ledger.entries)

    def allows(self, ledger: Ledger, event: dpa.DpEvent) -> bool:
        """Whether one more release ``event`` keeps the run within the filter (non-strict: a run may end exactly at
        its budget)."""
        total = math.fsum([self.spent(ledger), self.cost(event)])
        return math.isfinite(total) and total <= self.budget

    def epsilon_at(self, delta: float) -> float:
        """Epsilon of the whole run at ``delta`` (the filter's budget converted; a fixed number, not the spend)."""
        if self.kind == "gdp":
            return gdp_epsilon(math.sqrt(self.budget), delta)
        if self.kind == "zcdp":
            orders = [1.0 + x / 8 for x in range(1, 80)] + list(range(11, 257))
            with quiet_absl():
                return float(rdp_privacy_accountant.compute_epsilon(orders, [a * self.budget for a in orders], delta)[0])
        return _rdp_epsilon(self.order, self.budget, delta)

    def to_fact(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "budget": self.budget,
            "sampling_rate": self.sampling_rate,
            "order": self.order,
        }

    @classmethod
    def from_fact(cls, fact: dict[str, Any]) -> PrivacyFilter:
        try:
            return cls(**fact)
        except TypeError as e:
            raise AccountingError(f"the ledger's privacy filter is malformed: {e}") from None


def _finite_positive(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _gaussian_step(event: dpa.DpEvent) -> tuple[float, float]:
    """(sampling rate, noise multiplier) of a Gaussian or Poisson-sampled Gaussian release; others are refused."""
    if isinstance(event, dpa.GaussianDpEvent):
        return 1.0, event.noise_multiplier
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.GaussianDpEvent):
        q = event.sampling_probability
        if not (_finite_positive(q) and q <= 1):
            raise AccountingError(f"a privacy filter cannot price a sampling rate of {q!r}")
        return q, event.event.noise_multiplier
    raise AccountingError(
        f"privacy filters price Gaussian and Poisson-sampled Gaussian releases only, not {type(event).__name__}"
    )


def make_filter(
    kind: str,
    epsilon: float,
    delta: float,
    *,
    sampling_rate: float = 1.0,
    order: int | None = None,
    rho: float | None = None,
) -> PrivacyFilter:
    """The filter of ``kind`` for the budget (epsilon, delta). ``zcdp``: ``rho`` is rho_B (default: the largest rho
    whose RDP curve converts to at most epsilon); ``rdp``: ``order`` is alpha_0 (an integer >= 2, chosen before the
    run)."""
    epsilon, delta = check_epsilon(epsilon), check_delta(delta)
    if kind not in FILTERS:
        raise AccountingError(f"privacy filter must be one of {', '.join(FILTERS)}, got {kind!r}")
    if kind == "gdp":
        if sampling_rate < 1:
            raise AccountingError(
                "the gdp filter covers full-batch Gaussian steps only (subsampled steps are not exactly Gaussian); "
                "use the rdp or zcdp filter"
            )
        mu = _largest(lambda m: gdp_delta(epsilon, m) <= delta, 1.0) * (1 - 1e-12)  # margin for scipy's rounding
        return PrivacyFilter("gdp", epsilon, delta, mu * mu, sampling_rate)
    if kind == "zcdp":
        if rho is None:
            rho = _largest(lambda r: PrivacyFilter("zcdp", epsilon, delta, r).epsilon_at(delta) <= epsilon, 1.0)
        return PrivacyFilter("zcdp", epsilon, delta, float(rho), sampling_rate)
    if not (isinstance(order, int) and order >= 2):
        raise AccountingError(f"the rdp filter needs one integer order >= 2 fixed before the run, got {order!r}")
    budget = _largest(lambda b: _rdp_epsilon(order, b, delta) <= epsilon, 1.0)
    return PrivacyFilter("rdp", epsilon, delta, budget, sampling_rate, order)


def ledger_filter(ledger: Ledger) -> PrivacyFilter | None:
    """The privacy filter a ledger's steps were recorded under (None: none); refuses a ledger that mixes filters or
    holds releases outside its filter."""
    facts = [e.facts.get(FILTER_FACT) for e in ledger.entries]
    if not any(facts):
        return None
    if not all(facts) or any(f != facts[0] for f in facts):
        raise AccountingError(
            "the filter accountant certifies runs whose every release was made under one privacy filter; this ledger "
            "mixes filtered and other releases"
        )
    return PrivacyFilter.from_fact(facts[0])


class FilterAccountant:
    name = "filter"
    facts_used = (FILTER_FACT,)
    description = "privacy filter of adaptively chosen noise (validation schedules)"

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        refuse_search(ledger, self.name)
        filt = ledger_filter(ledger)
        if filt is None:
            raise AccountingError(
                "the filter accountant certifies runs with adaptively chosen noise (a validation noise schedule); "
                "this ledger records none: use rdp, pld or gdp"
            )
        spent = filt.spent(ledger)
        if not (math.isfinite(spent) and spent <= filt.budget):
            raise AccountingError(
                f"the ledger records a spend of {spent:.6g} under its {filt.kind} filter, above its budget "
                f"{filt.budget:.6g}: not certified"
            )
        eps = filt.epsilon_at(delta)  # the budget's own conversion: at most filt.epsilon at filt.delta
        details = {"filter": filt.kind, "spent": spent, "budget": filt.budget}
        if filt.order is not None:
            details["optimal_order"] = float(filt.order)
        return PrivacyReport(eps, delta, self.name, True, details)


register_accountant(FilterAccountant())
