"""dp_accounting's RdpAccountant with the RDP of one Poisson-sampled Gaussian step computed once per (q, sigma,
orders) in a process.

dp_accounting computes the RDP of a Poisson-subsampled Gaussian (Mironov, Talwar & Zhang, "Renyi Differential Privacy
of the Sampled Gaussian Mechanism", 2019) order by order in Python, about 30 ms for dptrain's orders, every time a
ledger is composed: a run reports its epsilon at every evaluation, in its summary and beside the other accountants, so
the same step's RDP was computed again and again (a third of the test suite's time). The vector depends on q, sigma
and the orders alone; composing ``count`` such steps adds ``count`` times it, exactly as dp_accounting's own
composition does (the same function, the same arithmetic: the epsilon is bit for bit dp_accounting's).

This reads dp_accounting 0.6.0's private composition hook (``_maybe_compose``) and RDP function, as pinned in
pyproject.toml; every other event goes through dp_accounting unchanged."""

from __future__ import annotations

import functools

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

_ADD_OR_REMOVE = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


@functools.lru_cache(maxsize=4096)
def poisson_gaussian_rdp(q: float, noise_multiplier: float, orders: tuple[float, ...]) -> np.ndarray:
    """The RDP of one Poisson-sampled Gaussian step at ``orders`` (read-only: callers add multiples of it)."""
    rdp = np.asarray(rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(  # dp_accounting 0.6.0 (pinned)
        q=q, noise_multiplier=noise_multiplier, orders=list(orders)), dtype=float)
    rdp.setflags(write=False)
    return rdp


class RdpStepsAccountant(rdp_privacy_accountant.RdpAccountant):
    """dp_accounting's RdpAccountant, reading a Poisson-sampled Gaussian step's RDP from :func:`poisson_gaussian_rdp`."""

    def _maybe_compose(self, event, count: int, do_compose: bool):
        if do_compose and isinstance(event, dpa.GaussianDpEvent):  # (dp_accounting: q = 1, whatever the adjacency)
            self._rdp += count * poisson_gaussian_rdp(1.0, float(event.noise_multiplier), tuple(self._orders))
            return None
        if (do_compose and isinstance(event, dpa.PoissonSampledDpEvent)
                and isinstance(event.event, dpa.GaussianDpEvent) and self._neighboring_relation is _ADD_OR_REMOVE):
            self._rdp += count * poisson_gaussian_rdp(
                float(event.sampling_probability), float(event.event.noise_multiplier), tuple(self._orders))
            return None
        return super()._maybe_compose(event, count, do_compose)


__all__ = ["RdpStepsAccountant", "poisson_gaussian_rdp"]
