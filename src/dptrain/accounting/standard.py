"""RDP and PLD accountants, delegated to Google's dp_accounting (we do not re-implement them).

- ``rdp``: Renyi DP of the (sub)sampled Gaussian, Mironov 2017 / Mironov, Talwar, Zhang 2019,
  converted to (epsilon, delta) with the conversion implemented in dp_accounting's RdpAccountant.
- ``pld``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022), dp_accounting's
  PLDAccountant with a pessimistic discretization, so the epsilon it returns is an upper bound.
"""

from __future__ import annotations

import contextlib
import logging
import math

from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dptrain.accounting.base import PrivacyReport, register_accountant
from dptrain.accounting.ledger import Ledger
from dptrain.errors import AccountingError


def _compose(accountant, ledger: Ledger, name: str):
    event = ledger.dp_event()
    if not accountant.supports(event):
        schemes = sorted({str(e.facts.get("sampling", "?")) for e in ledger.entries})
        raise AccountingError(
            f"the {name} accountant cannot certify this ledger (events {type(event).__name__}, sampling "
            f"{', '.join(schemes)}, {ledger.neighboring} adjacency); it covers Gaussian releases, Poisson-sampled"
            " ones (add/remove adjacency) and fixed-size samples without replacement (replace-one adjacency)"
        )
    accountant.compose(event)
    return accountant


@contextlib.contextmanager
def quiet_absl():
    """dp_accounting logs a warning (through absl) each time a fractional RDP order fails to converge and
    is dropped from the minimum over orders. Dropping an order can only make epsilon larger (a valid
    bound), so the messages carry no risk; they would flood a progress bar."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


#: dp_accounting's default orders jump 64 -> 128 -> 256 -> 512 and stop there; small-epsilon, large-sigma runs
#: (seed 002's settings) have their optimum in those gaps or beyond, so we fill them. Any set of orders gives a
#: valid bound; a denser set, a tighter one.
_EXTRA_ORDERS = (
    80,
    96,
    112,
    160,
    192,
    224,
    320,
    384,
    448,
    640,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
RDP_ORDERS = tuple(sorted(set(rdp_privacy_accountant.DEFAULT_RDP_ORDERS) | set(_EXTRA_ORDERS)))


class RdpAccountant:
    name = "rdp"
    facts_used = ()  # events and adjacency only
    description = "Renyi DP of the subsampled Gaussian (dp_accounting RdpAccountant)"

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        acc = rdp_privacy_accountant.RdpAccountant(
            RDP_ORDERS, neighboring_relation=ledger.neighboring_relation
        )
        with quiet_absl():
            _compose(acc, ledger, self.name)
            eps, order = acc.get_epsilon_and_optimal_order(delta)
        if not math.isfinite(eps):
            raise AccountingError(
                "the rdp accountant found no finite epsilon for this ledger (noise too small)"
            )
        return PrivacyReport(float(eps), delta, self.name, True, {"optimal_order": float(order)})


class PldAccountant:
    name = "pld"
    facts_used = ()  # events and adjacency only
    description = "privacy loss distributions, pessimistic discretization (dp_accounting PLDAccountant)"

    def __init__(self, value_discretization_interval: float = 1e-4):
        self.value_discretization_interval = value_discretization_interval

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        acc = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=ledger.neighboring_relation,
            value_discretization_interval=self.value_discretization_interval,
        )
        _compose(acc, ledger, self.name)
        eps = acc.get_epsilon(delta)
        if not math.isfinite(eps):
            raise AccountingError(
                "the pld accountant found no finite epsilon for this ledger (noise too small)"
            )
        return PrivacyReport(
            float(eps), delta, self.name, True, {"discretization": self.value_discretization_interval}
        )


register_accountant(RdpAccountant())
register_accountant(PldAccountant())
