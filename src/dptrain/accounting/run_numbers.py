"""The numbers of a run that every part of dptrain must agree on, computed in one place.

:class:`RunNumbers` is built once at the edge (``dptrain train``, ``calibrate``, ``account``, ``plan``,
``utility-graph``) from what the user gave (a sampling scheme, a batch size or a rate, steps or epochs, a
batch-size schedule), and everything downstream reads it: a number of epochs is converted to a number of steps
here and nowhere else, so that every command trains and certifies the same number of steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dptrain.accounting.ledger import Ledger, gaussian_step_event, step_facts
from dptrain.accounting.proactive import increasing_sample_sizes
from dptrain.errors import ConfigError


def steps_for_epochs(epochs: float, sampling_rate: float) -> int:
    """Steps whose expected number of passes over the data is ``epochs``: max(1, round(epochs / q)).

    ``sampling_rate`` q is the expected fraction of the training set one step uses (Poisson rate, b/n for
    batches of b out of n, 1 for full batches): T steps make T q expected passes. Example: n = 50,000, expected
    batch 300 (q = 0.006), 10 epochs -> round(1666.7) = 1667 steps."""
    if not (isinstance(epochs, int | float) and not isinstance(epochs, bool) and math.isfinite(epochs)):
        raise ConfigError(f"epochs must be a finite number > 0, got {epochs!r}")
    if epochs <= 0:
        raise ConfigError(f"epochs must be a finite number > 0, got {epochs!r}")
    if not (isinstance(sampling_rate, int | float) and 0 < sampling_rate <= 1):
        raise ConfigError(f"the sampling rate must be in (0, 1], got {sampling_rate!r}")
    return max(1, round(epochs / sampling_rate))


@dataclass(frozen=True)
class RunNumbers:
    """What a run is, in numbers: the sampling scheme and its (mean) rate q, the data set size n and expected
    batch size when known, the per-step expected batch sizes of a schedule, the number of steps T, and once chosen
    the noise multiplier sigma and the clip norm C."""

    sampling: str
    sampling_rate: float
    steps: int
    dataset_size: int | None = None
    batch_size: float | None = None
    sample_sizes: tuple[float, ...] | None = None
    noise_multiplier: float | None = None
    clip_norm: float | None = None

    @classmethod
    def planned(
        cls,
        sampling: str = "poisson",
        *,
        dataset_size: int | None = None,
        batch_size: float | None = None,
        sampling_rate: float | None = None,
        steps: int | None = None,
        epochs: float | None = None,
        batch_growth: float = 0.0,
        noise_multiplier: float | None = None,
        clip_norm: float | None = None,
    ) -> RunNumbers:
        """The numbers of a run from what its user gives: a batch size and the data set size (or a rate), and
        exactly one of steps or epochs. ``batch_growth`` p > 0: expected batch sizes s_i ~ (i+1)^p with mean
        ``batch_size`` (van Dijk et al., "Proactive DP", App. B.4)."""
        if (steps is None) == (epochs is None):
            raise ConfigError("give exactly one of steps or epochs")
        if sampling == "full":
            q = 1.0
            batch_size = dataset_size
        elif sampling_rate is not None:
            q = float(sampling_rate)
        elif batch_size is not None and dataset_size:
            q = batch_size / dataset_size
        else:
            raise ConfigError(f"{sampling} sampling needs a sampling rate, or a batch size and the data set size")
        if not 0 < q <= 1:
            raise ConfigError(f"the sampling rate must be in (0, 1], got {q!r}")
        if steps is None:
            steps = steps_for_epochs(epochs, q)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
        sizes = None
        if batch_growth > 0:
            if sampling != "poisson" or not dataset_size or batch_size is None:
                raise ConfigError("a growing batch size needs Poisson sampling, a batch size and the data set size")
            sizes = tuple(float(s) for s in increasing_sample_sizes(batch_size, steps, batch_growth, dataset_size))
        return cls(sampling, q, steps, dataset_size, batch_size, sizes, noise_multiplier, clip_norm)

    def with_noise(self, noise_multiplier: float) -> RunNumbers:
        return dataclasses.replace(self, noise_multiplier=noise_multiplier)

    def ledger(self, noise_multiplier: float | None = None):
        """The planned ledger of a DP-SGD run with these numbers (at ``noise_multiplier``, default the run's), for
        Poisson or full batches: what calibration, ``account`` and ``plan`` reason about. (A trainer's own planned
        ledger is :meth:`dptrain.engine.trainer.PrivateTrainer.ledger_after`, which also knows other schemes and facts.)"""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if sigma is None:
            raise ConfigError("the run's numbers have no noise multiplier yet")
        if self.sampling not in ("poisson", "full"):
            raise ConfigError(f"planned ledgers cover poisson and full batches, not {self.sampling!r}")
        if self.sample_sizes is None:
            runs = [(self.sampling_rate, self.steps)]
        else:
            runs = [(s / self.dataset_size, 1) for s in self.sample_sizes]
        facts = {"dataset_size": self.dataset_size, "clip_norm": self.clip_norm}
        ledger = Ledger()
        for q, count in runs:
            event = gaussian_step_event(sigma, self.sampling, sampling_rate=q)
            ledger.record(event, step_facts(self.sampling, q, **facts), count)
        return ledger
