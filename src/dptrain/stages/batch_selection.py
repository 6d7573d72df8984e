"""Batch selection: which examples take part in a step. The scheme is part of every ledger event, because which
accountant applies (and how much the sampling amplifies privacy) depends on it.

Schemes (``make_sampler``):

- ``poisson``: each example joins independently with probability q (Abadi et al.'s DP-SGD; amplification by
  Poisson subsampling); a per-step schedule of rates (increasing batch sizes) is ``ScheduledPoissonSampling``;
- ``full``: every example in every step (no amplification);
- ``fixed_size``: a uniformly random subset of exactly b examples, drawn afresh every step (amplification by
  sampling without replacement; its accounting needs replace-one adjacency);
- ``cyclic``: one secret permutation drawn before the first step, then its consecutive blocks of b in turn
  (needs b | n; no amplification claimed);
- ``shuffled``: a fresh secret permutation every epoch, cut into consecutive blocks of b (the last block of an
  epoch may be smaller; no amplification claimed).

Every sampler draws from the run's secret "sampling" stream (:mod:`dptrain.randomness.generators`), so which examples a
step used cannot be recomputed from anything a run shares, and a checkpoint resumes the same draws (samplers
that keep a permutation expose it in their state, which lives in the secret checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import dp_accounting as dpa
import numpy as np
import torch

from dptrain.accounting.ledger import gaussian_step_event
from dptrain.errors import ConfigError
from dptrain.randomness.generators import Stream

SAMPLING_NAMES = ("poisson", "full", "fixed_size", "cyclic", "shuffled")
#: Schemes certified under replace-one adjacency, each step's sum of sensitivity 2C: fixed-size samples
#: (dp_accounting's sampling-without-replacement analysis), and every scheme whose batches are blocks of positions
#: in a permutation of the n examples (cyclic, shuffled). Adding an example to a permutation shifts every later
#: example to the next position and so moves others between blocks (the step sums after it differ by up to 2C,
#: not C: tests/test_permutation_batches_adjacency.py); replacing one keeps every other example where it was.
REPLACE_ONE_SCHEMES = ("fixed_size", "cyclic", "shuffled")


class BatchSampler(Protocol):
    scheme: str
    dataset_size: int

    @property
    def expected_batch_size(self) -> float:
        """Mean expected batch size over the run."""
        ...

    @property
    def max_steps(self) -> int | None:
        """Length of a finite schedule (None: unbounded)."""
        ...

    def expected_batch_size_at(self, step: int) -> float:
        """The data-independent normalizer of step ``step``'s noisy gradient sum."""
        ...

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        """Indices of the examples in logical batch number ``step``."""
        ...

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        """The DpEvent of noisy step number ``step`` (``noise_multiplier``: its std over the sensitivity of the
        released sum under the ledger's adjacency)."""
        ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


class _Stateless:
    """Samplers whose draws all come from the stream (its state is the whole state)."""

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass


class _ExactBatch:
    """Samplers whose every step uses exactly ``batch_size`` examples (the normalizer is that size)."""

    batch_size: int
    max_steps = None

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def expected_batch_size_at(self, step: int) -> float:
        return float(self.batch_size)


#: Bits of the uniform draw each Poisson inclusion is decided by: example i joins iff u_i < k with u_i uniform on
#: {0, ..., 2^53 - 1} and k = floor(q 2^53), i.e. with probability exactly q' = k 2^-53 <= q (never more than the
#: rate the ledger records).
POISSON_BITS = 53


class _CoinFlips:
    """Fair coin flips from a stream's 64-bit words, counted in blocks: ``heads(m)`` is how many of m fresh flips
    come up 1. The words are drawn ahead (2m flips at the first call: what :func:`binomial_below` needs on average)
    into one Python integer, whose bit_count does the counting."""

    def __init__(self, stream: Stream):
        self.stream, self.pool, self.left = stream, 0, 0

    def heads(self, m: int) -> int:
        if m > self.left:
            words = self.stream.words((2 * m - self.left) // 64 + 16)
            self.pool |= int.from_bytes(words.tobytes(), "little") << self.left
            self.left += 64 * len(words)
        flips = self.pool & ((1 << m) - 1)
        self.pool >>= m
        self.left -= m
        return flips.bit_count()


def binomial_below(heads: Callable[[int], int], n: int, k: int, bits: int = POISSON_BITS) -> int:
    """Exactly Binomial(n, k 2^-bits): how many of n independent uniforms u_i on {0, ..., 2^bits - 1} fall below k,
    decided bit by bit from the most significant down. At each bit the examples still undecided (all their higher
    bits equal k's) split by a fair coin: with k's bit 1, those whose bit is 0 are below k; with k's bit 0, those
    whose bit is 1 are above it; the rest stay undecided (equal to k in every bit: not below). ``heads(m)`` is the
    number of ones among m fresh fair coin flips. About 2n flips in all instead of n uniforms."""
    if k >= 2**bits:  # every uniform is below k (q = 1)
        return n
    below, undecided = 0, n
    for level in range(bits - 1, -1, -1):
        if not undecided:
            break
        ones = heads(undecided)
        if (k >> level) & 1:
            below, undecided = below + undecided - ones, ones
        else:
            undecided -= ones
    return below


def uniform_subset(stream: Stream, n: int, size: int) -> torch.Tensor:
    """A uniformly random subset of ``size`` of {0, ..., n-1}, sorted (int64): the first ``size`` distinct values of
    a sequence of independent uniform integers (exact: 64-bit words by rejection, no modulo bias); for more than
    half of n, the complement of such a subset."""
    if 2 * size > n:
        keep = np.ones(n, dtype=bool)
        keep[uniform_subset(stream, n, n - size).numpy()] = False
        return torch.from_numpy(np.flatnonzero(keep)).to(torch.int64)
    if size == 0:
        return torch.zeros(0, dtype=torch.int64, device="cpu")
    limit = (2**64 // n) * n  # words below limit, reduced mod n, are uniform on {0, ..., n-1}
    draws, distinct = np.zeros(0, np.uint64), 0
    while True:
        w = stream.words(size - distinct + 16)
        if limit < 2**64:
            w = w[w < np.uint64(limit)]
        draws = np.concatenate([draws, w % np.uint64(n)])
        head, later = distinct_in_order(draws, size)
        distinct = len(head) + len(later)
        if distinct >= size:
            return torch.from_numpy(np.sort(np.concatenate([head, later[: size - len(head)]])).astype(np.int64))


def distinct_in_order(draws: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of the sequence ``draws``, split for :func:`uniform_subset`: those of its first ``size``
    entries (sorted), and the others in the order they first appear. The first ``size`` distinct values of the
    sequence are the first part and the start of the second. (The same values as ``np.unique(draws,
    return_index=True)`` ordered by first index, without a stable sort of the whole sequence: the repeats are few.)"""
    head = np.sort(draws[:size])
    head = head[np.concatenate(([True], head[1:] != head[:-1]))] if len(head) else head
    rest = draws[size:]
    if len(head) and len(rest):
        at = np.minimum(np.searchsorted(head, rest), len(head) - 1)
        rest = rest[head[at] != rest]  # (a value past the last of head is not in it either)
    if len(rest) < 2:
        return head, rest
    values, first = np.unique(rest, return_index=True)
    return head, values[np.argsort(first)]


def poisson_indices(stream: Stream, n: int, rate: float) -> torch.Tensor:
    """Poisson sampling of {0, ..., n-1} (each example independently with probability q' = floor(q 2^53) 2^-53 <=
    q), drawn as its batch size first, then the examples: the size is exactly Binomial(n, q') (:func:`binomial_below`)
    and, given its size, a Poisson sample is a uniformly random subset of that size (:func:`uniform_subset`), so the
    batch has exactly the distribution of n independent coin flips, from about 2n bits and 64 per chosen example
    instead of one 53-bit uniform per example. Sorted int64 indices."""
    k = math.floor(rate * 2.0**POISSON_BITS)
    size = binomial_below(_CoinFlips(stream).heads, n, k)
    return uniform_subset(stream, n, size)


@dataclass(frozen=True)
class PoissonSampling(_Stateless):
    """Each example joins the batch independently with probability q (batch size is random)."""

    dataset_size: int
    sampling_rate: float
    scheme: str = "poisson"

    def __post_init__(self) -> None:
        if not 0 < self.sampling_rate <= 1:
            raise ConfigError(f"sampling rate must be in (0, 1], got {self.sampling_rate}")

    @property
    def expected_batch_size(self) -> float:
        return self.sampling_rate * self.dataset_size

    max_steps = None

    def rate_at(self, step: int) -> float:
        return self.sampling_rate

    def expected_batch_size_at(self, step: int) -> float:
        return self.rate_at(step) * self.dataset_size

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        return poisson_indices(stream, self.dataset_size, self.rate_at(step))

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        return gaussian_step_event(noise_multiplier, "poisson", sampling_rate=self.rate_at(step))


@dataclass(frozen=True)
class ScheduledPoissonSampling(PoissonSampling):
    """Poisson sampling whose rate changes from step to step: step i uses q_i = s_i / N for a given sequence of
    expected sample sizes s_i (e.g. increasing batch sizes, van Dijk et al., "Proactive DP", App. B.4).
    ``sampling_rate`` is the mean."""

    rates: tuple[float, ...] = ()

    @classmethod
    def from_sizes(cls, dataset_size: int, sizes) -> ScheduledPoissonSampling:
        rates = tuple(float(x) / dataset_size for x in sizes)
        if not rates or not all(0 < r <= 1 for r in rates):
            raise ConfigError(f"sample sizes must be a non-empty sequence in (0, {dataset_size}]")
        return cls(dataset_size, sum(rates) / len(rates), rates=rates)

    @property
    def max_steps(self) -> int:
        return len(self.rates)

    def rate_at(self, step: int) -> float:
        if step >= len(self.rates):
            raise ConfigError(
                f"the sample-size schedule has {len(self.rates)} steps; step {step + 1} is beyond it"
            )
        return self.rates[step]


@dataclass(frozen=True)
class FullBatch(_Stateless, _ExactBatch):
    """Every example in every step (no amplification by sampling)."""

    dataset_size: int
    scheme: str = "full"

    @property
    def batch_size(self) -> int:
        return self.dataset_size

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        return torch.arange(self.dataset_size)

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        return gaussian_step_event(noise_multiplier, "full")


@dataclass(frozen=True)
class FixedSizeSampling(_Stateless, _ExactBatch):
    """A uniformly random subset of exactly ``batch_size`` examples, drawn independently at every step
    (:func:`uniform_subset`)."""

    dataset_size: int
    batch_size: int
    scheme: str = "fixed_size"

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        return uniform_subset(stream, self.dataset_size, self.batch_size)

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        if self.batch_size == self.dataset_size:
            return gaussian_step_event(noise_multiplier, "full")
        return gaussian_step_event(
            noise_multiplier,
            "fixed_size_without_replacement",
            dataset_size=self.dataset_size,
            batch_size=self.batch_size,
        )


@dataclass
class PermutationBatches(_ExactBatch):
    """Consecutive blocks of ``batch_size`` of a secret permutation: ``cyclic`` draws one permutation before the
    first step and cycles through its blocks (b must divide n); ``shuffled`` draws a fresh one every epoch (the
    last block of an epoch may be smaller). No amplification by sampling is claimed: every step is accounted as
    an unsampled Gaussian release of sensitivity 2C, under replace-one adjacency (REPLACE_ONE_SCHEMES)."""

    dataset_size: int
    batch_size: int
    scheme: str = "cyclic"
    _order: torch.Tensor | None = field(default=None, repr=False)
    _epoch: int = -1

    def __post_init__(self) -> None:
        if self.scheme == "cyclic" and self.dataset_size % self.batch_size:
            raise ConfigError(
                f"cyclic batches need the batch size to divide the training set size {self.dataset_size}, got "
                f"{self.batch_size}"
            )

    @property
    def blocks(self) -> int:
        return math.ceil(self.dataset_size / self.batch_size)

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        epoch = 0 if self.scheme == "cyclic" else step // self.blocks
        if self._order is None or epoch != self._epoch:
            self._order, self._epoch = stream.permutation(self.dataset_size), epoch
        k = step % self.blocks
        return self._order[k * self.batch_size : (k + 1) * self.batch_size]

    def event(self, noise_multiplier: float, step: int) -> dpa.DpEvent:
        return gaussian_step_event(noise_multiplier, "cyclic")

    def get_state(self) -> dict:
        return {} if self._order is None else {"order": self._order.clone(), "epoch": self._epoch}

    def set_state(self, state: dict) -> None:
        self._order = state["order"].clone() if "order" in state else None
        self._epoch = int(state.get("epoch", -1))


def make_sampler(
    scheme: str, dataset_size: int, batch_size: float | None = None, sample_sizes=None
) -> BatchSampler:
    """A sampler by name. ``batch_size`` is the expected logical batch size (Poisson: q = batch_size / n; the other
    schemes: exactly batch_size examples); ``sample_sizes`` (Poisson only) gives one expected batch size per step
    instead."""
    if dataset_size < 1:
        raise ConfigError(f"the training set is empty (dataset size {dataset_size})")
    if scheme not in SAMPLING_NAMES:
        raise ConfigError(f"unknown sampling scheme {scheme!r}; accepted: {', '.join(SAMPLING_NAMES)}")
    if sample_sizes is not None:
        if scheme != "poisson":
            raise ConfigError('a sample-size schedule needs privacy.sampling = "poisson"')
        return ScheduledPoissonSampling.from_sizes(dataset_size, sample_sizes)
    if scheme == "full":
        return FullBatch(dataset_size)
    if batch_size is None or not 0 < batch_size <= dataset_size:
        raise ConfigError(
            f"training.batch_size must be in (0, {dataset_size}] (the training set size), got {batch_size}"
        )
    if scheme == "poisson":
        return PoissonSampling(dataset_size, batch_size / dataset_size)
    if float(batch_size) != int(batch_size):
        raise ConfigError(f"{scheme} batches need a whole batch size, got {batch_size}")
    if scheme == "fixed_size":
        return FixedSizeSampling(dataset_size, int(batch_size))
    return PermutationBatches(dataset_size, int(batch_size), scheme)
