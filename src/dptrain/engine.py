"""The DP-SGD engine: one private step is a fixed sequence of stages.

    batch selection -> per-example gradients (physical chunks) -> clipping -> noise -> optimizer step
                                                     |
                                   one ledger event per noisy release

The optimizer sees only the privatized (noisy, normalized) gradient, so any torch optimizer (SGD,
momentum, Adam, ...) is post-processing. The engine never computes epsilon itself: it records
events in its ledger and asks an accountant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.accounting import (
    Ledger,
    PrivacyReport,
    calibrate_noise,
    certified_epsilon,
    epsilon,
    max_releases,
)
from dptrain.batch_selection import BatchSampler, make_sampler
from dptrain.clipping import Clipping, ClipStats, make_clipping
from dptrain.errors import BudgetExhausted, ConfigError, DataError
from dptrain.models import check_private_compatible
from dptrain.noise import add_gaussian_noise
from dptrain.per_example import LossFn, cross_entropy_per_example, make_grad_sampler, trainable_parameters


@dataclass
class StepResult:
    step: int  # number of steps released so far (this one included)
    batch_size: int  # actual (random, private) size of the logical batch
    loss: float  # mean loss over the batch: computed from private data, for monitoring only
    clip_stats: ClipStats


@dataclass
class Budget:
    """A target (epsilon, delta) that the run must never exceed."""

    epsilon: float
    delta: float


#: Memory the materialized per-example gradients of one physical chunk may take by default.
PER_EXAMPLE_GRADIENT_MEMORY = 256 * 2**20


def auto_physical_batch_size(params: dict[str, torch.Tensor]) -> int:
    """Largest chunk whose materialized per-example gradients fit in PER_EXAMPLE_GRADIENT_MEMORY."""
    per_example = sum(p.numel() * p.element_size() for p in params.values())
    return max(1, PER_EXAMPLE_GRADIENT_MEMORY // max(1, per_example))


def _dpsgd_steps(ledger: Ledger) -> int:
    """DP-SGD steps in a ledger (a ledger may also hold other releases, e.g. a private feature mean)."""
    return sum(e.count for e in ledger.entries if e.facts.get("mechanism") == "dpsgd")


def _as_tensors(data) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(data, "x") and hasattr(data, "y"):
        return data.x, data.y
    if isinstance(data, torch.utils.data.TensorDataset):
        x, y = data.tensors[:2]
        return x, y
    if isinstance(data, tuple | list) and len(data) == 2:
        return data[0], data[1]
    raise ConfigError("training data must be an ArrayDataset, a TensorDataset or an (x, y) pair of tensors")


class PrivateTrainer:
    """A private training run: model, optimizer and data wrapped with DP-SGD and a privacy ledger.

    Create one with :func:`make_private` or :func:`make_private_with_epsilon`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data,
        *,
        noise_multiplier: float,
        max_grad_norm: float = 1.0,
        batch_size: float | None = None,
        sampling: str = "poisson",
        delta: float = 1e-5,
        accountant: str = "rdp",
        clipping: str | Clipping = "flat",
        loss_fn: LossFn = cross_entropy_per_example,
        max_physical_batch_size: int | None = None,
        grad_sampler: str = "auto",
        seed: int = 0,
        budget: Budget | None = None,
        ledger: Ledger | None = None,
        sample_sizes=None,
    ):
        check_private_compatible(model)
        if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
            raise ConfigError(
                f"privacy.noise_multiplier must be a finite number >= 0, got {noise_multiplier}"
            )
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise ConfigError(f"training.max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.model, self.optimizer = model, optimizer
        self.x, self.y = _as_tensors(data)
        self.sampler: BatchSampler = make_sampler(sampling, len(self.x), batch_size, sample_sizes)
        self.clipping: Clipping = (
            make_clipping(clipping, max_grad_norm) if isinstance(clipping, str) else clipping
        )
        self.noise_multiplier = float(noise_multiplier)
        self.delta, self.accountant, self.budget = delta, accountant, budget
        self.grad_sampler = make_grad_sampler(model, loss_fn, grad_sampler)
        self.params = trainable_parameters(model)
        self.max_physical_batch_size = int(max_physical_batch_size or auto_physical_batch_size(self.params))
        self._check_optimizer()
        self.generator = torch.Generator().manual_seed(seed)
        self.ledger = ledger if ledger is not None else Ledger()
        self.steps = _dpsgd_steps(self.ledger)
        self._allowed_steps: int | None = None

    def _check_optimizer(self) -> None:
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in in_opt]
        if missing:
            raise ConfigError(
                f"the optimizer does not hold these trainable parameters of the model: {missing[:3]}"
            )

    # -- the privacy side ---------------------------------------------------------------------------------
    def release_event(self, step: int | None = None):
        """(DpEvent, facts) of step number ``step`` (default: the next one), as recorded in the ledger."""
        step = self.steps if step is None else step
        return self.sampler.release(self.noise_multiplier, step, clip_norm=self.clipping.sensitivity)

    def ledger_after(self, more: int) -> Ledger:
        """The ledger as it will be after ``more`` further steps (for budgets and calibration)."""
        ledger = self.ledger.copy()
        for step in range(self.steps, self.steps + more):
            if self.sampler.max_steps is None:  # identical steps: record them all at once
                ledger.record(*self.release_event(step), count=more)
                break
            ledger.record(*self.release_event(step))
        return ledger

    @property
    def sampling_rate(self) -> float:
        return self.sampler.expected_batch_size / self.sampler.dataset_size

    @property
    def expected_epochs(self) -> float:
        """Expected passes over the data so far: sum of the steps' sampling rates."""
        if self.sampler.max_steps is None:
            return self.steps * self.sampler.expected_batch_size / self.sampler.dataset_size
        return (
            sum(self.sampler.expected_batch_size_at(i) for i in range(self.steps)) / self.sampler.dataset_size
        )

    def allowed_steps(self) -> int | None:
        """Total steps the budget allows (None without a budget). Computed once, by the run's accountant."""
        if self.budget is None:
            return None
        if self._allowed_steps is None:
            limit = 10**9 if self.sampler.max_steps is None else self.sampler.max_steps - self.steps
            more = max_releases(
                self.ledger_after, self.budget.epsilon, self.budget.delta, self.accountant, limit
            )
            self._allowed_steps = self.steps + more
        return self._allowed_steps

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> PrivacyReport:
        """Privacy spent so far (epsilon at ``delta``), from the ledger."""
        delta = self.delta if delta is None else delta
        return epsilon(self.ledger, delta, accountant or self.accountant)

    # -- training -----------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Draw a batch, privatize its gradient, record the release and update the model."""
        allowed = self.allowed_steps()
        if allowed is not None and self.steps >= allowed:
            raise BudgetExhausted(
                f"the budget epsilon={self.budget.epsilon} at delta={self.budget.delta} allows {allowed} steps, "
                "all of them taken"
            )
        self.model.train()
        idx = self.sampler.sample(self.generator, self.steps)
        summed, stats, loss_sum = self._clipped_sum(idx)
        std = self.noise_multiplier * self.clipping.sensitivity
        noisy = add_gaussian_noise(summed, std, self.generator)
        scale = 1.0 / self.sampler.expected_batch_size_at(self.steps)
        for n, p in self.params.items():
            p.grad = (noisy[n] * scale).to(p.dtype)
        # Record before the update: from here on the release has happened.
        event, facts = self.release_event()
        self.ledger.record(event, facts)
        self.steps += 1
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = len(idx)
        return StepResult(self.steps, n, loss_sum / n if n else float("nan"), stats)

    def _clipped_sum(self, idx: torch.Tensor):
        summed = {
            n: torch.zeros_like(p, memory_format=torch.contiguous_format) for n, p in self.params.items()
        }
        stats, loss_sum = ClipStats(0, 0, 0.0), 0.0
        for chunk in idx.split(self.max_physical_batch_size) if len(idx) else ():
            grads, losses = self.grad_sampler(self.x[chunk], self.y[chunk])
            clipped, chunk_stats = self.clipping.clip_and_sum(grads)
            for n in summed:
                summed[n] += clipped[n].reshape(summed[n].shape)
            stats = stats.merge(chunk_stats)
            loss_sum += float(losses.sum())
        return summed, stats, loss_sum

    def train(
        self,
        steps: int | None = None,
        epochs: float | None = None,
        callback: Callable[[StepResult], None] | None = None,
    ) -> list[StepResult]:
        """Take ``steps`` steps (or ``epochs`` passes' worth), stopping early if the budget runs out."""
        results = []
        for result in self.iter_steps(self.steps_for(steps, epochs)):
            results.append(result)
            if callback is not None:
                callback(result)
        return results

    def steps_for(self, steps: int | None = None, epochs: float | None = None) -> int:
        if (steps is None) == (epochs is None):
            raise ConfigError("give exactly one of steps or epochs")
        if steps is None:
            steps = max(1, round(epochs * self.sampler.steps_per_epoch))
        if steps < 0:
            raise ConfigError(f"steps must be >= 0, got {steps}")
        if self.sampler.max_steps is not None:
            steps = min(steps, self.sampler.max_steps)
        return steps

    def iter_steps(self, steps: int) -> Iterator[StepResult]:
        """Yield up to ``steps`` more steps; never one the budget does not allow."""
        allowed = self.allowed_steps()
        end = self.steps + steps if allowed is None else min(self.steps + steps, allowed)
        while self.steps < end:
            yield self.step()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> float:
        """Accuracy on held-out data (not private data: evaluation on the training set would leak)."""
        self.model.eval()
        correct = sum(
            int((self.model(xb).argmax(1) == yb).sum())
            for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True)
        )
        return correct / max(1, len(y))

    # -- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: model, optimizer, RNG states and the ledger."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "ledger": self.ledger.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.ledger = Ledger.from_dict(state["ledger"])
        self.steps = int(state["steps"])
        if self.steps != _dpsgd_steps(self.ledger):
            raise DataError(
                f"checkpoint is inconsistent: {self.steps} steps but its ledger records {_dpsgd_steps(self.ledger)}"
            )
        self.noise_multiplier = float(state["noise_multiplier"])
        self._allowed_steps = None

    def close(self) -> None:
        self.grad_sampler.close()


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    noise_multiplier: float,
    max_grad_norm: float = 1.0,
    batch_size: float | None = None,
    **options,
) -> PrivateTrainer:
    """Wrap a model, its optimizer and training data into a DP-SGD run with a fixed noise multiplier.

    ``batch_size`` is the expected logical batch size (Poisson sampling rate q = batch_size / len(data)).
    Options: sampling ("poisson" | "full"), delta, accountant, clipping ("flat" | "per_layer"), loss_fn
    (per-example losses), max_physical_batch_size (default: automatic, per-example gradients of a chunk
    within 256 MiB), grad_sampler ("auto" | "func" | "layerwise"), seed,
    budget (a :class:`Budget` the run must not exceed), ledger (to continue an earlier one).
    """
    return PrivateTrainer(
        model,
        optimizer,
        data,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        **options,
    )


def make_private_with_epsilon(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: float | None = None,
    steps: int | None = None,
    max_grad_norm: float = 1.0,
    batch_size: float | None = None,
    accountant: str = "rdp",
    **options,
) -> PrivateTrainer:
    """Like :func:`make_private`, but calibrates the smallest noise multiplier that lets ``epochs`` (or
    ``steps``) steps meet (target_epsilon, target_delta), and enforces that budget during training."""
    trainer = PrivateTrainer(
        model,
        optimizer,
        data,
        noise_multiplier=0.0,
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        delta=target_delta,
        accountant=accountant,
        **options,
    )
    total = trainer.steps_for(steps, epochs)

    def ledger_for(sigma: float) -> Ledger:
        trainer.noise_multiplier = sigma
        return trainer.ledger_after(total)

    trainer.noise_multiplier = calibrate_noise(target_epsilon, target_delta, ledger_for, accountant)
    trainer.budget = Budget(target_epsilon, target_delta)
    # Sanity: the planned run is within budget according to the accountant that will certify it ...
    certified_epsilon(ledger_for(trainer.noise_multiplier), target_delta, accountant)
    # ... so it may take exactly its planned steps (no search for the last step the budget would allow).
    trainer._allowed_steps = trainer.steps + total
    return trainer
