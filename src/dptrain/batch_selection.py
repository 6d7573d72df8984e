"""Batch selection: which examples take part in a step. The scheme is part of every ledger event,
because which accountant applies (and how much the sampling amplifies privacy) depends on it.

Every sampler draws from the run's secret "sampling" stream (:mod:`dptrain.randomness`), so which examples a
step used cannot be recomputed from anything a run shares, and a checkpoint resumes the same draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dptrain.accounting.ledger import gaussian_step_event, step_facts
from dptrain.errors import ConfigError
from dptrain.randomness import Stream

SAMPLING_NAMES = ("poisson", "full")


class BatchSampler(Protocol):
    scheme: str
    dataset_size: int

    @property
    def expected_batch_size(self) -> float:
        """Mean expected batch size over the run."""
        ...

    @property
    def steps_per_epoch(self) -> int: ...

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

    def release(self, noise_multiplier: float, step: int, **facts) -> tuple:
        """(DpEvent, facts) recorded in the ledger for noisy step number ``step``."""
        ...


@dataclass(frozen=True)
class PoissonSampling:
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

    @property
    def steps_per_epoch(self) -> int:
        return max(1, round(1 / self.sampling_rate))

    max_steps = None

    def rate_at(self, step: int) -> float:
        return self.sampling_rate

    def expected_batch_size_at(self, step: int) -> float:
        return self.rate_at(step) * self.dataset_size

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        # u < q' with u on the grid k 2^-53 and q' = floor(q 2^53) 2^-53 <= q: each example joins with probability
        # exactly q' <= q, never more than the rate the ledger records.
        threshold = math.floor(self.rate_at(step) * 2.0**53) * 2.0**-53
        mask = stream.uniform((self.dataset_size,), torch.float64) < threshold
        return mask.nonzero().squeeze(1)

    def release(self, noise_multiplier: float, step: int, **facts) -> tuple:
        q = self.rate_at(step)
        event = gaussian_step_event(noise_multiplier, "poisson", sampling_rate=q)
        return event, step_facts("poisson", noise_multiplier, q, dataset_size=self.dataset_size, **facts)


@dataclass(frozen=True)
class ScheduledPoissonSampling(PoissonSampling):
    """Poisson sampling whose rate changes from step to step: step i uses q_i = s_i / N for a given sequence of
    expected sample sizes s_i (e.g. increasing batch sizes, seed 002 App. B.4). ``sampling_rate`` is the mean."""

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
class FullBatch:
    """Every example in every step (no amplification by sampling)."""

    dataset_size: int
    scheme: str = "full"

    @property
    def expected_batch_size(self) -> float:
        return float(self.dataset_size)

    @property
    def steps_per_epoch(self) -> int:
        return 1

    max_steps = None

    def expected_batch_size_at(self, step: int) -> float:
        return float(self.dataset_size)

    def sample(self, stream: Stream, step: int) -> torch.Tensor:
        return torch.arange(self.dataset_size)

    def release(self, noise_multiplier: float, step: int, **facts) -> tuple:
        event = gaussian_step_event(noise_multiplier, "full")
        return event, step_facts("full", noise_multiplier, 1.0, dataset_size=self.dataset_size, **facts)


def make_sampler(
    scheme: str, dataset_size: int, batch_size: float | None = None, sample_sizes=None
) -> BatchSampler:
    """A sampler by name. ``batch_size`` is the expected logical batch size (Poisson: q = batch_size / n);
    ``sample_sizes`` (Poisson only) gives one expected batch size per step instead."""
    if dataset_size < 1:
        raise ConfigError(f"the training set is empty (dataset size {dataset_size})")
    if sample_sizes is not None:
        if scheme != "poisson":
            raise ConfigError('a sample-size schedule needs privacy.sampling = "poisson"')
        return ScheduledPoissonSampling.from_sizes(dataset_size, sample_sizes)
    if scheme == "poisson":
        if batch_size is None or not 0 < batch_size <= dataset_size:
            raise ConfigError(
                f"training.batch_size must be in (0, {dataset_size}] (the training set size), got {batch_size}"
            )
        return PoissonSampling(dataset_size, batch_size / dataset_size)
    if scheme == "full":
        return FullBatch(dataset_size)
    raise ConfigError(f"unknown sampling scheme {scheme!r}; accepted: {', '.join(SAMPLING_NAMES)}")
