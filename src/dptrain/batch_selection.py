"""Batch selection: which examples take part in a step. The scheme is part of every ledger event,
because which accountant applies (and how much the sampling amplifies privacy) depends on it.

Every sampler draws from an explicit ``torch.Generator`` so a run is reproducible and resumable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dptrain.accounting.ledger import gaussian_step_event, step_facts
from dptrain.errors import ConfigError

SAMPLING_NAMES = ("poisson", "full")


class BatchSampler(Protocol):
    scheme: str
    dataset_size: int

    @property
    def expected_batch_size(self) -> float:
        """The data-independent normalizer of the noisy gradient sum."""
        ...

    @property
    def steps_per_epoch(self) -> int: ...

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        """Indices of the examples in the next logical batch."""
        ...

    def release(self, noise_multiplier: float, **facts) -> tuple:
        """(DpEvent, facts) recorded in the ledger for one noisy step with this sampler."""
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

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        mask = torch.rand(self.dataset_size, generator=generator) < self.sampling_rate
        return mask.nonzero().squeeze(1)

    def release(self, noise_multiplier: float, **facts) -> tuple:
        event = gaussian_step_event(noise_multiplier, "poisson", sampling_rate=self.sampling_rate)
        return event, step_facts(
            "poisson", noise_multiplier, self.sampling_rate, dataset_size=self.dataset_size, **facts
        )


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

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        return torch.arange(self.dataset_size)

    def release(self, noise_multiplier: float, **facts) -> tuple:
        event = gaussian_step_event(noise_multiplier, "full")
        return event, step_facts("full", noise_multiplier, 1.0, dataset_size=self.dataset_size, **facts)


def make_sampler(scheme: str, dataset_size: int, batch_size: float | None = None) -> BatchSampler:
    """A sampler by name. ``batch_size`` is the expected logical batch size (Poisson: q = batch_size / n)."""
    if dataset_size < 1:
        raise ConfigError(f"the training set is empty (dataset size {dataset_size})")
    if scheme == "poisson":
        if batch_size is None or not 0 < batch_size <= dataset_size:
            raise ConfigError(
                f"training.batch_size must be in (0, {dataset_size}] (the training set size), got {batch_size}"
            )
        return PoissonSampling(dataset_size, batch_size / dataset_size)
    if scheme == "full":
        return FullBatch(dataset_size)
    raise ConfigError(f"unknown sampling scheme {scheme!r}; accepted: {', '.join(SAMPLING_NAMES)}")
