"""Basic composition of a pipeline's phases (Dwork & Roth 2014, Theorem 3.16): if phase i is
(eps_i, delta_i)-DP, the whole run is (sum eps_i, sum delta_i)-DP.

This is how the theoretical Algorithm 2 of DPSGD-F (Sun, Suresh & Menon, Sec. 5 and App. B.5) certifies its three phases:
private mean, private quantile and DP-SGD, each at (eps/3, delta/3). The ledger says which entries are
preprocessing releases (``facts["mechanism"]`` is ``private_mean`` or ``private_quantile``) and the delta
each one was given (``facts["delta"]``):

- a private mean (one Gaussian release) costs its exact epsilon at its delta (Balle & Wang 2018, Thm 8);
- a private quantile (the exponential mechanism, pure DP) costs ``facts["epsilon"]`` with delta 0
  (McSherry & Talwar 2007, Theorem 6: weights exp(eps u / 2) with a sensitivity-1 utility give eps-DP);
- everything else (the DP-SGD steps) is one phase, accounted by the PLD accountant at the delta that is left.

The accountant refuses a ledger whose preprocessing entries do not state their delta, or leave none for the
rest. This module imports no torch.
"""

from __future__ import annotations

import math

from dptrain.accounting.base import PrivacyReport, epsilon, register_accountant
from dptrain.accounting.calibration import gaussian_mechanism_epsilon
from dptrain.accounting.ledger import Ledger, LedgerEntry
from dptrain.accounting.standard import refuse_search
from dptrain.errors import AccountingError

#: Ledger facts["mechanism"] of the releases a preprocessing stage records (dptrain.dpsgd_f).
PREPROCESSING_MECHANISMS = ("private_mean", "private_quantile")


def _phase_cost(entry: LedgerEntry) -> tuple[float, float]:
    """(epsilon_i, delta_i) of one preprocessing entry."""
    import dp_accounting as dpa

    facts, mechanism = entry.facts, entry.facts.get("mechanism")
    if entry.count != 1:
        raise AccountingError(f"the composition accountant expects one {mechanism} release per entry")
    if mechanism == "private_quantile":
        eps = facts.get("epsilon")
        if not (isinstance(eps, int | float) and eps > 0 and math.isfinite(eps)):
            raise AccountingError("a private_quantile entry must state its pure epsilon (facts.epsilon)")
        return float(eps), 0.0
    delta = facts.get("delta")
    if not (
        isinstance(entry.event, dpa.GaussianDpEvent) and isinstance(delta, int | float) and 0 < delta < 1
    ):
        raise AccountingError(
            "a private_mean entry must be one Gaussian release stating the delta it was given (facts.delta)"
        )
    return gaussian_mechanism_epsilon(entry.event.noise_multiplier, delta), float(delta)


class CompositionAccountant:
    name = "composition"
    facts_used = ("mechanism", "delta", "epsilon")  # events and adjacency only plus these
    covers_bandmf = True  # the training phase (DP-SGD or BandMF) goes to pld
    description = "basic composition of a pipeline's phases (Dwork & Roth Thm 3.16; DPSGD-F Algorithm 2)"

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        refuse_search(ledger, self.name)
        pre = [e for e in ledger.entries if e.facts.get("mechanism") in PREPROCESSING_MECHANISMS]
        if not pre:
            raise AccountingError(
                "the composition accountant certifies pipelines with preprocessing phases (DPSGD-F Algorithm 2); "
                "for a plain DP-SGD run use rdp or pld"
            )
        costs = [_phase_cost(e) for e in pre]
        delta_rest = delta - sum(d for _, d in costs)
        rest = Ledger([e for e in ledger.entries if all(e is not p for p in pre)], ledger.neighboring)
        phases = {e.facts["mechanism"]: c for e, c in zip(pre, costs, strict=True)}
        eps_rest = 0.0
        if rest.entries:
            if delta_rest <= 0:
                raise AccountingError(
                    f"the preprocessing phases use delta {delta - delta_rest:g}, leaving nothing of delta={delta:g} "
                    "for training"
                )
            eps_rest = epsilon(rest, delta_rest, "pld").epsilon
            phases["training"] = (eps_rest, delta_rest)
        total = sum(e for e, _ in costs) + eps_rest
        return PrivacyReport(float(total), delta, self.name, True, {"phases": phases})


register_accountant(CompositionAccountant())
