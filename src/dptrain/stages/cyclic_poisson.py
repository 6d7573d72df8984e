"""Batch selection for banded matrix factorization: cyclic Poisson sampling over b secret groups.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023), the cyclic Poisson sampling of their Algorithm 2, with the groups drawn
as docs/accounting.md requires under add/remove adjacency: before the first step every example's group is drawn
uniformly from 0..b-1, independently of every other example's, from the run's secret sampling stream (so adding or
removing one example moves nobody else, and the group sizes are counts of the data: secret, like batch sizes). Step t
of the BandMF run (its index within the run, :func:`dptrain.accounting.bandmf_ledger.bandmf_step_index`) Poisson-samples
group t mod b at rate min(1, b q) (:func:`dptrain.stages.batch_selection.poisson_indices`), so the expected batch is
q n as with Poisson sampling while b q <= 1.

The assignment is secret state: it lives in the sampler's state, i.e. in the private checkpoint, and a resumed run
continues with it. Every rank of a data-parallel run draws it from the same shared stream, so it is the same on every
rank. With b = 1 nothing is drawn (one group holds every example) and the sampler is Poisson sampling draw for draw.
"""

from __future__ import annotations

import dp_accounting as dpa
import numpy as np
import torch

from dptrain.accounting.bandmf_ledger import CYCLIC_POISSON, group_sampling_rate
from dptrain.accounting.ledger import gaussian_step_event
from dptrain.errors import ConfigError, DataError
from dptrain.randomness.streams import Stream
from dptrain.stages.batch_selection import poisson_indices


def uniform_groups(stream: Stream, n: int, groups: int) -> torch.Tensor:
    """``n`` independent groups, each exactly uniform on 0..groups-1 (64-bit words by rejection: no modulo bias), as
    int16. One group needs no randomness: nothing is drawn."""
    if groups == 1:
        return torch.zeros(n, dtype=torch.int16)
    limit = np.uint64((2**64 // groups) * groups) if 2**64 % groups else None  # words below it reduce uniformly
    parts, drawn = [], 0
    while drawn < n:
        w = stream.words(n - drawn + 16)
        if limit is not None:
            w = w[w < limit]
        w = w[: n - drawn]
        parts.append((w % np.uint64(groups)).astype(np.int16))
        drawn += len(w)
    return torch.from_numpy(np.concatenate(parts))


class CyclicPoissonSampling:
    """b secret groups drawn once (:meth:`draw_groups`, before the first step); step t Poisson-samples group t mod b at
    rate min(1, b q). ``sampling_rate`` is the overall rate q."""

    scheme = CYCLIC_POISSON
    max_steps = None

    def __init__(self, dataset_size: int, sampling_rate: float, bands: int):
        if not 0 < sampling_rate <= 1:
            raise ConfigError(f"sampling rate must be in (0, 1], got {sampling_rate}")
        if isinstance(bands, bool) or not isinstance(bands, int) or not 1 <= bands <= 32767:
            raise ConfigError(f"bands must be an integer in [1, 32767], got {bands!r}")
        self.dataset_size, self.sampling_rate, self.bands = int(dataset_size), float(sampling_rate), bands
        #: min(1, b q): the rate within the sampled group (the ledger's event records it)
        self.group_rate = group_sampling_rate(self.sampling_rate, bands)
        self._groups: torch.Tensor | None = None
        self._members: tuple[torch.Tensor, torch.Tensor] | None = None  # (examples sorted by group, group starts)

    # -- the groups (secret) --
    def draw_groups(self, stream: Stream) -> None:
        """Draw every example's group from the sampling stream (once, before the first step)."""
        if self._groups is not None:
            raise DataError("the groups of a BandMF run are drawn once, before its first step")
        self._set_groups(uniform_groups(stream, self.dataset_size, self.bands))

    def _set_groups(self, groups: torch.Tensor) -> None:
        if groups.dtype != torch.int16 or groups.shape != (self.dataset_size,):
            raise DataError(
                f"a BandMF checkpoint's group assignment is for {groups.numel()} examples, this run has "
                f"{self.dataset_size}"
            )
        if len(groups) and not (0 <= int(groups.min()) and int(groups.max()) < self.bands):
            raise DataError(f"a BandMF checkpoint's group assignment is not one of {self.bands} groups")
        self._groups, self._members = groups, None

    def _group(self, g: int) -> torch.Tensor:
        if self._groups is None:
            raise DataError("the BandMF groups have not been drawn (draw_groups before the first step)")
        if self._members is None:  # derived from the groups, not state: examples sorted by group, then by index
            order = torch.argsort(self._groups.to(torch.int64), stable=True)
            counts = torch.bincount(self._groups.to(torch.int64), minlength=self.bands)
            self._members = order, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        order, starts = self._members
        return order[starts[g] : starts[g + 1]]

    # -- the BatchSampler interface --
    @property
    def expected_batch_size(self) -> float:
        return self.expected_batch_size_at(0)

    def expected_batch_size_at(self, step: int) -> float:
        """min(1, b q) n / b: q n while b q <= 1 (for b = 1 exactly Poisson sampling's q n); data-independent (the
        group's realized size is secret)."""
        return self.group_rate * self.dataset_size / self.bands

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        """Poisson sample (rate min(1, b q)) of group ``step`` mod b; sorted int64 indices. ``step`` is the step's
        index within the BandMF run (the engine checks it against the ledger)."""
        members = self._group(step % self.bands)
        chosen = poisson_indices(stream, len(members), self.group_rate)
        return chosen if self.bands == 1 else members[chosen]

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        """One participation: the Gaussian Poisson-sampled at the group rate (what :func:`bandmf_step` records)."""
        return gaussian_step_event(noise_multiplier, "poisson", sampling_rate=self.group_rate)

    def get_state(self) -> dict:
        """The secret assignment (private checkpoint only)."""
        return {} if self._groups is None else {"bands": self.bands, "groups": self._groups}

    def set_state(self, state: dict) -> None:
        if not state:
            return
        if state.get("bands") != self.bands:
            raise DataError(f"the checkpoint's BandMF groups are {state.get('bands')}, this run has {self.bands} bands")
        self._groups = None
        self._set_groups(state["groups"].clone())


__all__ = ["CyclicPoissonSampling", "uniform_groups"]
