"""The DP-SGD engine: one private step is a fixed sequence of stages.

    batch selection -> per-example gradients (physical chunks) -> clipping -> noise -> optimizer step
                                                     |
                                   one ledger event per noisy release

The optimizer sees only the privatized (noisy, normalized) gradient, so any torch optimizer (SGD,
momentum, Adam, ...) is post-processing. The engine never computes epsilon itself: it records
events in its ledger and asks an accountant.

A step is atomic: SIGINT/SIGTERM wait until it ends (:mod:`dptrain.engine.interrupts`), and an exception before the
release is recorded rolls the random streams back, so a retried or resumed step is the step an uninterrupted
run would have taken. Sampling and noise come from the run's secret streams (:mod:`dptrain.randomness.generators`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from dptrain.accounting import (
    AUTO,
    Ledger,
    check_accountant,
    check_noise_multiplier,
    steps_for_epochs,
)
from dptrain.accounting.checks import check_delta, check_delta_for_size
from dptrain.accounting.ledger import training_steps
from dptrain.data.batches import as_source, loader_batch_size
from dptrain.engine import bandmf, distributed
from dptrain.engine.checkpoint import Checkpointing
from dptrain.engine.evaluation import accuracy, evaluation_source
from dptrain.engine.interrupts import deferred_signals
from dptrain.engine.privacy_side import PrivacySide
from dptrain.engine.weight_averaging import WeightAverage, check_decay
from dptrain.errors import (
    AccountingError,
    BudgetExhausted,
    ConfigError,
    DPTrainError,
    ModelError,
    NonFiniteError,
)
from dptrain.models.builders import check_private_compatible
from dptrain.models.decoder_inputs import with_decoder_inputs
from dptrain.models.losses import default_loss
from dptrain.preflight import checks as preflight
from dptrain.preflight.buffers import check_buffer_updates
from dptrain.randomness.generators import Randomness
from dptrain.stages.augmentation import Multiplicity, make_augmentation
from dptrain.stages.batch_selection import REPLACE_ONE_SCHEMES, BatchSampler, make_sampler
from dptrain.stages.clipping import Clipping, ClipStats, clipped_sum, make_clipping, sum_dtype
from dptrain.stages.devices import resolve_device, to_device
from dptrain.stages.noise import add_gaussian_noise, check_noise_schedule
from dptrain.stages.per_example import (
    LossFn,
    PerExampleGrads,
    make_grad_sampler,
    trainable_parameters,
)
from dptrain.stages.precision import PRECISIONS, MixedPrecision, check_precision


@dataclass
class StepResult:
    step: int  # number of steps released so far (this one included)
    #: Only with ``report_not_private=True``: statistics of the private batch (its realized size, mean loss, clip
    #: statistics). They are NOT private: keep them out of anything you share.
    not_private: dict | None = None


@dataclass
class Budget:
    """A target (epsilon, delta) that the run must never exceed."""

    epsilon: float
    delta: float


#: Release policies: every iterate is released (DP-SGD), or only the last one (projected noisy SGD).
RELEASES = ("every_iterate", "last_iterate")
#: A step's refusal of parameters frozen after the trainer was made (:meth:`PrivateTrainer.frozen_parameters`).
FROZEN_REFUSAL = (
    "parameters frozen after the trainer was made ({names}): it privatizes them, and every release would still move "
    "them by its noise; freeze parameters before make_private (or make the trainer again), or unfreeze them"
)


def _all_finite(tensors) -> bool:
    """Whether every element of every tensor is finite, read back in one synchronization: a float64 sum per tensor is
    NaN or inf exactly when an element is (float32 or narrower values cannot overflow it); a float64 tensor is summed
    times zero (0 per finite element, NaN per NaN or inf), which cannot overflow either."""
    sums = [(t * 0 if t.dtype == torch.float64 else t).sum(dtype=torch.float64) for t in tensors]
    # (the sum of those float64 sums cannot overflow either: NaN or inf exactly when one of them is)
    return not sums or math.isfinite(torch.stack(sums).sum().item())


def optimizer_step(step, number: int, *args, **kwargs):
    """Call the optimizer's ``step``; an overflow of the parameters' dtype (e.g. a learning rate of 1e39) is a
    one-line NonFiniteError naming the step ``number``, not torch's RuntimeError."""
    try:
        return step(*args, **kwargs)
    except RuntimeError as e:
        if "overflow" not in str(e):
            raise
        raise NonFiniteError(
            f"training diverged at step {number}: the optimizer step overflows the model's dtype; lower the "
            "learning rate"
        ) from None


class PrivateTrainer(Checkpointing, PrivacySide):
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
        accountant: str = AUTO,
        clipping: str | Clipping = "flat",
        linf_p: int | None = None,
        loss_fn: LossFn | None = None,
        max_physical_batch_size: int | None = None,
        grad_sampler="auto",
        seed: int | None = None,
        secure_noise: bool = False,
        randomness: Randomness | None = None,
        budget: Budget | None = None,
        ledger: Ledger | None = None,
        sample_sizes=None,
        check_independence: bool = True,
        check_gradients: bool = True,
        report_not_private: bool = False,
        non_private: bool = False,
        release_facts: dict | None = None,
        release: str = "every_iterate",
        label_key: str = "labels",
        buffer_updates: str = "refuse",
        mixed_precision: str | None = None,
        device="auto",
        group=None,
        noise_schedule=None,
        noise_controller=None,
        augment=None,
        ema: float | None = None,
        noise: str = "gaussian",
        bands: int | str | None = None,
        planned_steps: int | None = None,
    ):
        #: True when the model was torch.compile'd: its per-example passes run the eager modules it wraps
        self.compiled = preflight.eager(model) is not model
        model = preflight.eager(model)
        check_private_compatible(model)
        #: where the model, the per-example gradients, clipping, the noise and the update live
        self.device = resolve_device(device)
        #: a data-parallel run's group (:mod:`dptrain.engine.distributed`; default: the one this process joined)
        self.group = group if group is not None else distributed.current()
        model.to(self.device)
        self.non_private = bool(non_private)
        if self.non_private:  # a baseline: the same stages without the noise, no ledger, no guarantee
            if noise_multiplier != 0 or budget is not None:
                raise ConfigError("a non_private baseline takes noise_multiplier=0 and no budget")
            self._noise_multiplier = 0.0
        else:
            self._noise_multiplier = check_noise_multiplier(noise_multiplier, "noise_multiplier")
        self.delta = check_delta(delta, "delta")
        if ema is not None and (check_decay(ema) and release != "every_iterate"):
            raise ConfigError(
                "training.ema averages the released iterates: this run releases only its last iterate, so the "
                "intermediate ones it would average are not releases"
            )
        self.accountant = check_accountant(accountant)
        if budget is not None:
            check_delta(budget.delta, "budget delta")
        if max_physical_batch_size is not None and max_physical_batch_size < 1:
            raise ConfigError(f"training.max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        self.model, self.optimizer, self.budget = model, optimizer, budget
        #: the training examples (:mod:`dptrain.data.batches`): tensors in memory or a map-style Dataset
        if batch_size is None:  # a DataLoader's own batch size, as the expected logical batch
            batch_size = loader_batch_size(data)
        self.data = with_decoder_inputs(as_source(data, label_key), model)  # (an encoder-decoder's, from its labels)
        augmentation = make_augmentation(augment)
        #: augmentation multiplicity (:mod:`dptrain.stages.augmentation`): each example's gradient the mean over K
        #: augmented views before clipping; None without ``augment``
        self.augment = None if augmentation is None else Multiplicity(augmentation).checked(self.data.example()[0])
        self.sampler: BatchSampler = make_sampler(sampling, len(self.data), batch_size, sample_sizes)
        self.clipping: Clipping = (
            make_clipping(clipping, max_grad_norm, linf_p) if isinstance(clipping, str) else clipping
        )
        #: one loss per example; default: cross-entropy on the model's logits (causal-LM shifted for a causal language
        #: model: :func:`dptrain.models.losses.default_loss`)
        self.loss_fn = loss_fn = loss_fn if loss_fn is not None else default_loss(model)
        self.grad_sampler = (
            make_grad_sampler(model, loss_fn, grad_sampler) if isinstance(grad_sampler, str) else grad_sampler
        )
        #: None, "bf16" or "fp16": the per-example passes under autocast, norms/clipping/noise in float32
        self.mixed_precision = check_precision(mixed_precision)
        if self.mixed_precision is not None:
            self.grad_sampler = MixedPrecision(self.grad_sampler, PRECISIONS[self.mixed_precision], self.device)
        self.params = trainable_parameters(model)
        preflight.check_trainable(self.params)
        self._check_optimizer()
        preflight.warm_up(model, self.data, self.device)  # (a framework's first-call set-up, from no example)
        preflight.check_labels(model, self.data, loss_fn, self.device, own_backend=isinstance(grad_sampler, str))
        check_delta_for_size(self.delta, len(self.data), "delta")
        if budget is not None:
            check_delta_for_size(budget.delta, len(self.data), "budget delta")
        self.independence_checked = bool(check_independence)
        #: Buffers a training-mode forward writes from the batch, kept only with buffer_updates="not_private" (the run
        #: is then labelled not private: they are released unnoised with the model).
        self.not_private_buffers: list[str] = []
        #: the check of the backend's per-example gradients on real examples (:mod:`dptrain.preflight.gradient_check`): the
        #: backend it settled on and its cost; None when skipped (check_gradients=False)
        self.gradient_check = None
        self.max_physical_batch_size, self.not_private_buffers, self.gradient_check, probed = preflight.probe_model(
            self,
            max_physical_batch_size,
            self.independence_checked,
            check_buffer_updates(buffer_updates),
            # (a backend object of the caller's, e.g. a GLM's closed form, need not use loss_fn: nothing to compare)
            check_gradients=bool(check_gradients) and isinstance(grad_sampler, str),
        )
        if self.augment is not None:  # (the backend sees K rows per example: the chunk's memory is for its views)
            self.max_physical_batch_size = self.augment.examples_per_chunk(self.max_physical_batch_size)
        if randomness is None:  # (a data-parallel run's ranks draw the same batches and noise: rank 0's entropy)
            entropy = distributed.shared_entropy(self.group, seed)
            randomness = Randomness(seed, secure=secure_noise, entropy=entropy)
        self.randomness = randomness
        #: the probe's checks on the chunks of training: buffers written, batch sizes not yet checked, secret random
        #: chunks compared with each example alone (:mod:`dptrain.preflight.sentinel`)
        self.sentinel = preflight.sentinel_for(self, probed, self.independence_checked,
                                               bool(check_gradients) and isinstance(grad_sampler, str), buffer_updates)
        bind = getattr(optimizer, "bind_randomness", None)
        if bind is not None:  # an update stage that draws secret randomness (ModelMix's mixing weights)
            bind(self.randomness)
        self.report_not_private = bool(report_not_private)
        #: The noise stage, (sums, std, stream) -> noisy sums; None: :func:`dptrain.stages.noise.add_gaussian_noise`;
        #: BandMF's correlated noise (noise="bandmf"). Otherwise only an audit's deliberately injected bug replaces it
        #: (:mod:`dptrain.auditing.bugs`), never a training run.
        self.noise_stage: Callable | None = None
        #: The per-example gradient stage: indices of a logical batch -> (gradients, losses) per physical chunk.
        self.per_example: Callable[[torch.Tensor], Iterator[tuple[PerExampleGrads, torch.Tensor]]] = (
            self._tensor_chunks
        )
        self._chunk_offset = 0  # (the index in its step of the chunk a data-parallel rank computes)
        self.agreed = False  # (whether the ranks of a data-parallel run compared their state: distributed.agree_on)
        if release not in RELEASES:
            raise ConfigError(f"release must be one of {', '.join(RELEASES)}, got {release!r}")
        #: every_iterate (DP-SGD: every model after a step is a release) or last_iterate (only the final model is;
        #: the run must not evaluate, log or share an intermediate one).
        self.release = release
        #: the exponential moving average of the released iterates (:mod:`dptrain.engine.weight_averaging`), or None
        self.weight_average = None if ema is None else WeightAverage(self.params, ema)
        #: Facts recorded with every step; default: DP-SGD's (sampling scheme, rate, data set size, clip norm).
        self.release_facts = release_facts
        neighboring = "replace_one" if self.sampler.scheme in REPLACE_ONE_SCHEMES else "add_or_remove_one"
        if ledger is not None and release_facts is None and neighboring == "replace_one" != ledger.neighboring:
            # (DP-SGD steps recorded at sensitivity C, under an adjacency they do not meet; a mechanism with its own
            # release facts states its adjacency there, for its accountant: last_iterate refuses cyclic + remove)
            raise ConfigError(
                f"{self.sampler.scheme} batches are certified under replace-one adjacency (sensitivity 2C: adding an "
                f"example moves others between batches), but the ledger given records {ledger.neighboring}: pass "
                "no ledger, or one made with Ledger(neighboring='replace_one')"
            )
        self.ledger = ledger if ledger is not None else Ledger(neighboring=neighboring)
        self.ledger.private = self.private
        self.steps = training_steps(self.ledger)
        self._allowed_steps: int | None = None
        #: The noise schedule's shape (None: constant noise): step t (from 0) adds noise of multiplier
        #: noise_multiplier x noise_schedule[t] (Dynamic Noise Influence; :mod:`dptrain.schedules`). It also
        #: bounds the run: a schedule of T steps allows T steps.
        self.noise_schedule = check_noise_schedule(noise_schedule)
        if self.noise_schedule is not None:
            if self.non_private:
                raise ConfigError("a non_private baseline adds no noise: it takes no noise_schedule")
            if release_facts is not None:
                raise ConfigError(
                    "a noise schedule is a stage of DP-SGD steps; this run records its own release facts "
                    f"({release_facts.get('mechanism', 'custom')}), whose analysis assumes one noise multiplier"
                )
        #: Adaptive noise (None: none): an object choosing each step's sigma from what the run released so far
        #: (:class:`dptrain.schedules.validation.ValidationNoise`) under a privacy filter, which stops the run
        #: before the budget would be passed; its ``facts`` are recorded beside every step.
        self.noise_controller = noise_controller
        if noise_controller is not None:
            from dptrain.schedules.validation import check_controller

            check_controller(noise_controller, self, budget=budget, release_facts=release_facts)
            self.accountant = "filter"
        #: Banded matrix factorization (noise="bandmf": cyclic Poisson groups, noise C^{-1} Z; :mod:`dptrain.engine.bandmf`)
        #: or None (independent Gaussian noise)
        self.bandmf: bandmf.BandMF | None = None
        if bandmf.check_noise(noise, bands, planned_steps) == "bandmf":
            self.bandmf = bandmf.install(self, bands, planned_steps)

    def unprivatized_parameters(self) -> list[str]:
        """Parameters an optimizer step could change that this trainer does not privatize: the model's or the
        optimizer's that are trainable (``requires_grad``) or hold a ``.grad`` and are not in :attr:`params` (a
        parameter added after the trainer was made, given a gradient by any means). Their update would be neither
        clipped nor noised: a step refuses them (names, or the optimizer's ``param_groups[k]`` for one outside the
        model)."""
        ours = {id(p) for p in self.params.values()}
        live = lambda p: p.requires_grad or p.grad is not None  # noqa: E731
        named = list(self.model.named_parameters(remove_duplicate=False))
        found = [n for n, p in named if id(p) not in ours and live(p)]
        in_model = {id(p) for _, p in named}
        for k, group in enumerate(self.optimizer.param_groups):
            if any(id(p) not in ours and id(p) not in in_model and live(p) for p in group["params"]):
                found.append(f"a parameter of the optimizer's param_groups[{k}]")
        return list(dict.fromkeys(found))

    def frozen_parameters(self) -> list[str]:
        """Parameters this trainer privatizes that were frozen (``requires_grad_(False)``) after it was made: every
        release would still move them (by its noise), against the freeze. The set of trainable parameters is the one
        the trainer was made with, in both directions (:meth:`unprivatized_parameters`)."""
        in_model = {id(p) for p in self.model.parameters()}  # (not a tensor of dptrain's own, the audit's canaries)
        return [n for n, p in self.params.items() if not p.requires_grad and id(p) in in_model]

    def check_parameters(self) -> None:
        """ModelError naming the parameters of :meth:`unprivatized_parameters` or :meth:`frozen_parameters`, if any."""
        frozen = self.frozen_parameters()
        if frozen:
            raise ModelError(FROZEN_REFUSAL.format(names=", ".join(frozen[:3])))
        found = self.unprivatized_parameters()
        if found:
            raise ModelError(
                f"trainable parameters the run does not privatize ({', '.join(found[:3])}): every parameter the "
                "optimizer steps must be one whose per-example gradients are clipped and noised; a parameter added "
                "after the trainer was made is not (make the trainer again, or freeze it with requires_grad_(False))"
            )

    def _check_optimizer(self) -> None:
        in_opt = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in in_opt]
        if missing:
            raise ConfigError(
                f"the optimizer does not hold these trainable parameters of the model: {missing[:3]}"
            )
        if isinstance(self.optimizer, torch.optim.SparseAdam):
            raise ConfigError(
                "torch.optim.SparseAdam takes sparse gradients only, and the private gradient is dense (the noise reaches "
                "every coordinate, every row of an Embedding(sparse=True)): use torch.optim.Adam or SGD"
            )

    # -- the run's numbers --------------------------------------------------------------------------------
    @property
    def noise_multiplier(self) -> float:
        """sigma: fixed when the trainer is made (the ledger and any budget depend on it); with a noise schedule its
        scale c (sigma_t = c s_t); with adaptive noise the next step's."""
        if self.noise_controller is not None:
            return self.noise_controller.sigma
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        raise ConfigError(
            "the noise multiplier is fixed when the trainer is made (its budget and ledger depend on it); make a "
            "new trainer with make_private(noise_multiplier=...) or make_private_with_epsilon(...)"
        )

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

    def steps_for(self, steps: int | None = None, epochs: float | None = None) -> int:
        """Steps for ``steps`` or ``epochs`` (:func:`dptrain.accounting.steps_for_epochs`), capped by a finite
        batch-size schedule."""
        if (steps is None) == (epochs is None):
            raise ConfigError("give exactly one of steps or epochs")
        if steps is None:
            steps = steps_for_epochs(epochs, self.sampling_rate)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"steps must be an integer >= 0, got {steps!r}")
        if self.max_steps is not None:
            steps = min(steps, self.max_steps)
        return steps

    @property
    def max_steps(self) -> int | None:
        """The most steps the run can take whatever its budget: a finite batch-size schedule's or a noise schedule's
        length (None: unbounded)."""
        bounds = [n for n in (self.sampler.max_steps, self.noise_schedule and len(self.noise_schedule)) if n]
        return min(bounds) if bounds else None

    def noise_multiplier_at(self, step: int, scale: float | None = None) -> float:
        """sigma of step number ``step`` (from 0): the run's noise multiplier (or ``scale``), times the noise
        schedule's s_step when there is one."""
        if self.noise_controller is not None:  # chosen adaptively: known for the next step only
            if step != self.steps:
                raise AccountingError(
                    "the noise of this run is chosen adaptively (validation schedule): only the next step's is known"
                )
            return self.noise_controller.sigma
        c = self._noise_multiplier if scale is None else scale
        if self.noise_schedule is None:
            return c
        if not 0 <= step < len(self.noise_schedule):
            raise BudgetExhausted(
                f"the noise schedule has {len(self.noise_schedule)} steps; step {step + 1} is beyond it"
            )
        return c * self.noise_schedule[step]

    # -- training -----------------------------------------------------------------------------------------
    def check_allowed(self) -> None:
        """BudgetExhausted unless the run may take one more step (its budget, its privacy filter)."""
        allowed = self.allowed_steps()
        if allowed is not None and self.steps >= allowed:
            raise BudgetExhausted(
                f"the budget epsilon={self.budget.epsilon} at delta={self.budget.delta} allows {allowed} steps, "
                "all of them taken"
            )
        controller = self.noise_controller
        if controller is not None and not controller.allows(self.ledger, self.release_event()[0]):
            raise BudgetExhausted(
                f"the privacy filter stops the run: one more step at noise multiplier {controller.sigma:.6g} would "
                f"pass its budget (epsilon={controller.filter.epsilon:g} at delta={controller.filter.delta:g})"
            )

    def step(self) -> StepResult:
        """Draw a batch, privatize its gradient, record the release and update the model (atomically). A model in eval
        mode (after :meth:`evaluate`) is put back in training mode; a submodule set to eval inside a training model is
        left as it is."""
        self.check_allowed()
        self.check_parameters()
        distributed.agree_on(self)
        with deferred_signals(), self._rolled_back_on_error():
            if not self.model.training:  # (evaluate() left it in eval mode)
                self.model.train()
            idx = self.sampler.sample(self.randomness.stream("sampling"), self.steps)
            if self.augment is not None:
                self.augment.new_step(self.randomness.stream("augmentation"))
            summed, stats, loss_sum = self._clipped_sum(idx)
            self.privatize(summed, stats)
            optimizer_step(self.optimizer.step, self.steps)
            for p in self.params.values():  # (the gradients this step set: the optimizer's zero_grad, less its overhead)
                p.grad = None
            if self.weight_average is not None:  # post-processing of the iterate just released
                self.weight_average.update(self.steps)
        self.check_weights()
        result = StepResult(self.steps)
        if self.report_not_private:
            n = len(idx)
            result.not_private = {
                "batch_size": n,
                "train_loss": loss_sum / n if n else None,
                "clipped_fraction": stats.clipped / n if n else None,
                "mean_grad_norm": stats.norm_sum / n if n else None,
                "non_finite_gradients": stats.non_finite,
            }
        return result

    def privatize(self, summed: dict[str, torch.Tensor], stats) -> None:
        """The release of step ``self.steps + 1``: the sum of the logical batch's clipped per-example gradients
        ``summed`` (by parameter name) noised once, divided by the expected batch size and set as every parameter's
        ``.grad``, the event recorded in the ledger and the step counted, together. Refuses (NonFiniteError) a batch
        with a non-finite loss or gradient (``stats.non_finite``) or a noise that overflows the dtype, before anything
        is released. Call it inside :meth:`_rolled_back_on_error` (the step's streams roll back on an error before)."""
        if stats.non_finite:
            raise self._stopped_by_the_batch(NonFiniteError(
                f"the loss or the per-example gradients of step {self.steps + 1} are not finite (NaN or inf): "
                "check the data and the loss function; nothing of this step was released (the moment a run "
                "stops depends on the data: start a fresh run once fixed)"
            ))
        std = self.noise_multiplier_at(self.steps) * self.clipping.sensitivity
        dtype_max = min(torch.finfo(p.dtype).max for p in self.params.values())
        if not std < dtype_max / 64:
            raise NonFiniteError(
                f"the noisy gradient of step {self.steps + 1} is not finite: noise std sigma x C = {std:.4g} "
                "overflows the model's dtype; lower privacy.max_grad_norm"
            )
        # (a sum that overflows despite the clip bound leaves non-finite weights: caught after the update)
        scale = 1.0 / self.sampler.expected_batch_size_at(self.steps)
        if self.non_private:
            grads = {n: s * scale for n, s in summed.items()}
        else:  # the noisy sums are fresh tensors: scaled in place, in one call
            grads = (self.noise_stage or add_gaussian_noise)(summed, std, self.randomness.stream("noise"))
            torch._foreach_mul_(list(grads.values()), scale)
        grads = {n: grads[n].to(p.dtype) for n, p in self.params.items()}
        # Whatever the clipping rule (one that does not screen each example, a Lipschitz bound) and the dtype: a
        # non-finite noisy gradient is never released (its NaN would be everyone's, and the sensitivity no bound).
        if not _all_finite(grads.values()):
            raise self._stopped_by_the_batch(NonFiniteError(
                f"the noisy gradient of step {self.steps + 1} is not finite (NaN or inf): a per-example gradient or "
                "their sum overflowed; check the data and the loss function, lower privacy.max_grad_norm; nothing of "
                "this step was released"
            ))
        for n, p in self.params.items():
            p.grad = grads[n]
        if self.bandmf is not None:  # the step's noise joins the secret history, with the release
            self.bandmf.noise.commit()
        # The release happens here: record it, count it and apply it together.
        self._committed = True
        if not self.non_private:
            self.ledger.record(*self.release_event())
        self.steps += 1

    def _stopped_by_the_batch(self, error: NonFiniteError) -> NonFiniteError:
        """``error``, raised because of values computed from this step's private batch: after a release, the step at
        which the run stops depends on the data and the secret batches, and it is released (the steps recorded, the
        error's message), so the run is labelled not private (before the first release, nothing is: start afresh).
        (A weight that overflows after an update is post-processing of the releases: :meth:`check_weights`.)"""
        if self.steps > 0 and not self.non_private:
            self.sentinel.stop(
                f"stopped at step {self.steps + 1} by non-finite values computed from the private batch (when a run "
                "stops depends on the data and the secret batches)"
            )
        return error

    def training_state(self) -> dict[str, list[torch.Tensor]]:
        """The floating-point tensors the next step reads, by part: the model's weights, the optimizer's state (e.g.
        Adam's moments, whose overflow to inf leaves the weights finite but the updates dead) and the weight average
        (which is released)."""
        optimizer_state = [v for s in self.optimizer.state.values() for v in s.values()
                           if torch.is_tensor(v) and v.is_floating_point()]
        average = list(self.weight_average.averages.values()) if self.weight_average is not None else []
        return {"model's weights": list(self.params.values()), "optimizer's state": optimizer_state,
                "weight average (EMA)": average}

    def non_finite_part(self) -> str | None:
        """The first part of :meth:`training_state` holding a NaN or inf, or None (one synchronization when all are
        finite)."""
        parts = self.training_state()
        if _all_finite([t for ts in parts.values() for t in ts]):
            return None
        return next(name for name, ts in parts.items() if not _all_finite(ts))

    def check_weights(self) -> None:
        """NonFiniteError if an update left a weight, the optimizer's state or the weight average NaN or infinite
        (never a silent NaN model, never a run that goes on from a NaN state)."""
        part = self.non_finite_part()
        if part is not None:
            raise NonFiniteError(
                f"training diverged at step {self.steps}: the {part} hold NaN or inf after the optimizer step "
                "(not finite); lower the learning rate or privacy.max_grad_norm"
            )

    @contextlib.contextmanager
    def _rolled_back_on_error(self):
        """Until the release is committed, an exception restores the streams (and torch's global generator, which
        dropout uses), so that trying the step again draws the same batch and noise: nothing was released."""
        purposes = ("sampling", "noise", "mixing") + (("augmentation",) if self.augment is not None else ())
        saved = {p: self.randomness.stream(p).get_state() for p in purposes}
        torch_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._committed = False
        try:
            yield
        except BaseException:
            if not self._committed:
                for p, state in saved.items():
                    self.randomness.stream(p).set_state(state)
                torch.set_rng_state(torch_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, self.device)
                for p in self.params.values():
                    p.grad = None
            raise

    def _tensor_chunks(self, idx: torch.Tensor):
        for k, chunk in enumerate(idx.split(self.max_physical_batch_size) if len(idx) else ()):
            inputs, labels = to_device(self.data.batch(chunk), self.device)
            with preflight.loss_errors_named():
                watch = self.sentinel.watch()

                def sampled(rows, row_labels, k=k, watch=watch):
                    with self.sentinel.training_pass(self.steps, k + self._chunk_offset, rows, row_labels) as drawn:
                        got = drawn.result = self.grad_sampler(rows, row_labels)
                    self.sentinel.written(watch)  # a buffer the passes wrote: refused, or the run not private
                    # (the rows the model saw, K views each; a data-parallel rank's chunk at its place in the batch)
                    self.sentinel.check(self.steps, k + self._chunk_offset, drawn.x, drawn.y)
                    return got

                yield sampled(inputs, labels) if self.augment is None else self.augment(sampled, inputs, labels, chunk)

    def _clipped_sum(self, idx: torch.Tensor):
        if self.group is None:
            return clipped_sum(self.per_example(idx), self.clipping, self.params, self.report_not_private)
        # Data parallel (dptrain.engine.distributed): rank r clips the chunks r, r + N, ...; every rank adds all the chunk
        # sums in chunk order, the additions one process makes.
        # A refusal on one rank's chunks (the sentinel, a buffer written, a loss error) and the labels its chunks put on
        # the run travel with the sums: every rank stops, and labels the run, as the one process would.
        g = self.group
        chunks = list(idx.split(self.max_physical_batch_size)) if len(idx) else []
        mine, failed = [], None
        try:
            for c in range(g.rank, len(chunks), g.world):
                self._chunk_offset = c  # (the sentinel's secret places are those of the one-process run's chunks)
                s, stats, loss = clipped_sum(self.per_example(chunks[c]), self.clipping, self.params,
                                             self.report_not_private)
                mine.append((c, {n: t.cpu() for n, t in s.items()}, stats, loss))
        except DPTrainError as e:
            failed = e
        finally:
            self._chunk_offset = 0
        ranks = distributed.gather(g, [(mine, failed, self.sentinel.stopped, list(self.not_private_buffers))])
        for _, _, stopped, buffers in ranks:
            if stopped is not None:
                self.sentinel.stop(stopped)
            self.not_private_buffers[:] = sorted({*self.not_private_buffers, *buffers})
        self.ledger.private = self.ledger.private and self.private
        failure = next((f for _, f, _, _ in ranks if f is not None), None)
        if failure is not None:
            raise failure
        mine = [item for part, _, _, _ in ranks for item in part]
        summed = {n: torch.zeros_like(p, dtype=sum_dtype(p), memory_format=torch.contiguous_format)
                  for n, p in self.params.items()}
        stats, loss_sum = ClipStats(0, 0, 0.0), 0.0
        for _, s, chunk_stats, loss in sorted(mine, key=lambda item: item[0]):
            for n in summed:
                summed[n] += s[n].to(summed[n].device)
            stats, loss_sum = stats.merge(chunk_stats), loss_sum + loss
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

    def iter_steps(self, steps: int) -> Iterator[StepResult]:
        """Yield up to ``steps`` more steps; never one the budget (or the privacy filter) does not allow."""
        allowed = self.allowed_steps()
        end = self.steps + steps if allowed is None else min(self.steps + steps, allowed)
        while self.steps < end and self.can_step():
            yield self.step()

    def can_step(self) -> bool:
        """Whether the run may take one more step: within its budget, its schedule and its privacy filter."""
        allowed = self.allowed_steps()
        if allowed is not None and self.steps >= allowed:
            return False
        if self.max_steps is not None and self.steps >= self.max_steps:
            return False
        return self.noise_controller is None or self.noise_controller.allows(self.ledger, self.release_event()[0])

    def observe_validation(self, value: float) -> None:
        """A validation result for adaptive noise (higher is better). It must come from public data, or its use be
        accounted (docs/schedules.md); without adaptive noise it is ignored."""
        if self.noise_controller is not None:
            self.noise_controller.observe(value)

    @torch.no_grad()
    def evaluate(self, x, y=None, batch_size: int = 1024) -> float:
        """Accuracy on held-out data (not private data: evaluation on the training set would leak). ``x``, ``y``: the
        structures training takes (a tensor, a tuple or dict of tensors, with labels ``y``; or a Dataset or
        DataLoader with ``y`` None). Classification accuracy, or token accuracy over labelled tokens for [B, T, K]
        scores (shifted for a causal language model)."""
        return accuracy(self.model, evaluation_source(x, y), self.device, batch_size, self.loss_fn)

    def close(self) -> None:
        self.grad_sampler.close()


__all__ = [
    "Budget",
    "PrivateTrainer",
    "StepResult",
]
