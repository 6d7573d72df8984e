"""A ``transformers.Trainer`` made private: :class:`DPTrainer` is the Trainer with DP-SGD's steps, so that a Trainer
script becomes private by changing the class and adding the privacy arguments::

    trainer = DPTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=test,
                        data_collator=collator, privacy_args=PrivacyArguments(target_epsilon=8.0, delta=1e-5))
    trainer.train()                    # logs carry epsilon, delta, accountant, certified
    print(trainer.epsilon())           # PrivacyReport; float(trainer.epsilon()) is the number

Why a subclass and not a callback: a callback sees the Trainer's steps but cannot change them, and privacy needs three
changes to them: which examples a logical batch holds (dptrain's secret sampling instead of the Trainer's sampler), the
loss (one per example, so that each example's gradient is clipped) and the backward pass (per-example gradients,
clipping and the noise). dp-transformers' ``OpacusDPTrainer`` is a subclass for the same reasons.

How a step runs. One optimizer step of the Trainer (``gradient_accumulation_steps`` micro-batches) is one logical batch
of dptrain's private loop (:func:`dptrain.engine.private_loop.make_private_loop`): of expected size
``per_device_train_batch_size x gradient_accumulation_steps``, drawn by the secret sampler (Poisson by default, so its
size varies), cut into chunks of at most ``per_device_train_batch_size`` examples. The Trainer's loop still counts
``gradient_accumulation_steps`` micro-batches per step, but the first ones do nothing and the last runs every chunk of
the logical batch: the per-example gradients of each chunk are clipped and added, and the noise is added once, on the
last chunk (the release, recorded in the ledger). Then the Trainer clips the released gradient (its ``max_grad_norm``:
post-processing), steps the optimizer and the LR scheduler once, and logs. A step is never skipped, so the scheduler
and the optimizer step exactly once per logical batch, and the number of steps is the Trainer's own ``max_steps`` (from
``num_train_epochs`` over ``round(1 / q)`` logical batches an epoch, or ``max_steps``): the noise is calibrated for it.

What leaves the run. The logs keep the released quantities and the certificate (``epsilon``, ``delta``,
``accountant``, ``certified``), what evaluation logs on data declared public (``eval_is_public``: post-processing;
otherwise refused, or labelled ``_not_private`` with ``log_not_private``), and the learning rate and
the norm of the released gradient; statistics of the private batches (the training loss, FLOPs counted from the
batches' sizes) are dropped, or logged labelled ``_not_private`` with ``privacy_args.log_not_private``.
:mod:`dptrain.huggingface.refusals` lists the Trainer options that are refused, and why.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers
from torch.utils._pytree import tree_map

from dptrain.accounting import AUTO, PrivacyReport
from dptrain.accounting.ledger import write_json_atomic
from dptrain.accounting.run_numbers import steps_for_epochs
from dptrain.data.batches import DatasetSource
from dptrain.engine.private_loop import PrivateLoop, make_private_loop
from dptrain.errors import BudgetExhausted, ConfigError, ModelError
from dptrain.huggingface.arguments import PrivacyArguments
from dptrain.huggingface.labels import STACKED_KEY, StackedLabels
from dptrain.huggingface.refusals import (
    NOT_PUBLIC,
    check_arguments,
    check_evaluation,
    check_held_out,
    check_overrides,
    check_trainer,
    refuse_resume,
    refuse_search,
    whole_model_refusal,
)
from dptrain.models.losses import LabelSmoothed, default_loss
from dptrain.preflight.checks import eager
from dptrain.runs.job import resolve_accountant
from dptrain.runs.progress import step_bar
from dptrain.stages.per_example import WholeModelError

#: Log keys of the Trainer's training loop that are released quantities or public facts: the learning rate (a public
#: schedule), the norm of the released gradient (post-processing) and the epoch. Anything else the training loop logs
#: is a statistic of the private batches, the wall-clock runtime and speed too (a step's time depends on its realized,
#: secret, batch size).
RELEASED_KEYS = frozenset({"learning_rate", "grad_norm", "epoch"})
#: The certificate, added to every log.
CERTIFICATE_KEYS = ("epsilon", "delta", "accountant", "certified")
NOT_PRIVATE_SUFFIX = "_not_private"
#: What :meth:`DPTrainer.save_model` writes beside the weights (each checkpoint's too).
LEDGER_FILE, CERTIFICATE_FILE = "ledger.json", "certificate.json"


class _StepProgress(transformers.trainer_callback.ProgressCallback):
    """The Trainer's progress bar without time (:func:`dptrain.runs.progress.step_bar`): a step's time depends on its
    realized (secret) batch size. (The evaluation's bar, over held-out data, is the Trainer's.)"""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = step_bar(state.max_steps)
        self.current_step = 0


class _Wait:
    """A micro-batch of the Trainer's loop that is not its step's last: the logical batch runs on the last one."""


class _Run:
    """The last micro-batch of a Trainer step: the whole logical batch, chunk by chunk, and its release."""


class _LogicalBatches:
    """What the Trainer's loop iterates in place of its DataLoader: per logical batch, ``accumulation`` markers (the last
    one runs it); ``steps_per_epoch`` logical batches an epoch. ``dataset`` is read by the Trainer for its counts."""

    def __init__(self, dataset, steps_per_epoch: int, accumulation: int):
        self.dataset, self.steps_per_epoch, self.accumulation = dataset, steps_per_epoch, accumulation

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def __iter__(self):
        for i in range(len(self)):
            yield _Run if (i + 1) % self.accumulation == 0 else _Wait


def _is_datasets_dataset(dataset) -> bool:
    """A Hugging Face ``datasets.Dataset`` (by its class, without importing the datasets package)."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("datasets.") for c in type(dataset).__mro__)


def _check_training_data(dataset) -> None:
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ConfigError("DPTrainer needs a map-style train_dataset (__len__ and __getitem__) to sample from")


class DPTrainer(transformers.Trainer):
    """``transformers.Trainer`` with DP-SGD (see the module's docstring): the Trainer's arguments, plus
    ``privacy_args`` (:class:`dptrain.huggingface.arguments.PrivacyArguments`) and ``loss_fn`` (``(outputs, labels)``
    -> one loss per example; default: cross-entropy on the logits, shifted for a causal language model:
    :func:`dptrain.models.losses.default_loss`). Options it cannot make private are refused in one line when it is
    made (:mod:`dptrain.huggingface.refusals`)."""

    def __init__(self, model=None, args=None, *more, privacy_args: PrivacyArguments | None = None, loss_fn=None,
                 **kwargs):
        if not isinstance(privacy_args, PrivacyArguments):
            raise ConfigError(
                "DPTrainer needs privacy_args=dptrain.huggingface.PrivacyArguments(target_epsilon=... or "
                "noise_multiplier=..., delta=...)"
            )
        if (privacy_args.target_epsilon is None) == (privacy_args.noise_multiplier is None):
            raise ConfigError("privacy_args takes exactly one of target_epsilon and noise_multiplier")
        check_overrides(self, DPTrainer)
        if args is not None:
            check_arguments(args)
        _check_training_data(kwargs.get("train_dataset", more[1] if len(more) > 1 else None))
        # (a torch.compile'd model trains as the eager model it wraps, as with make_private: the Trainer read no label
        # name in the wrapper's forward(*args, **kwargs) and refused it, or dropped every column as unused)
        super().__init__(None if model is None else eager(model), args, *more, **kwargs)
        check_trainer(self)
        if any(type(c) is transformers.trainer_callback.ProgressCallback for c in self.callback_handler.callbacks):
            self.remove_callback(transformers.trainer_callback.ProgressCallback)
            self.add_callback(_StepProgress)
        self.privacy_args, self.loss_fn = privacy_args, self._smoothed(loss_fn)
        check_evaluation(self.args, privacy_args)
        self.dataset_size = len(self.train_dataset)
        #: the expected logical batch: per_device_train_batch_size x gradient_accumulation_steps
        self.expected_batch_size = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        if privacy_args.sampling != "full" and self.expected_batch_size > self.dataset_size:
            raise ConfigError(
                f"the logical batch per_device_train_batch_size x gradient_accumulation_steps = "
                f"{self.expected_batch_size} exceeds the training set's {self.dataset_size} examples"
            )
        #: the private loop (made with the optimizer, when training starts)
        self.private_loop: PrivateLoop | None = None
        self.planned_steps: int | None = None
        self._chunks = None  # the loop's chunks of this train() call
        self._in_evaluation = False
        self._dropped: set[str] = set()

    def _smoothed(self, loss_fn):
        """``loss_fn``, or with ``label_smoothing_factor`` the default loss smoothed example by example
        (:class:`dptrain.models.losses.LabelSmoothed`: the Trainer's smoother averages over the batch's labelled
        tokens, which mixes examples)."""
        epsilon = self.args.label_smoothing_factor
        if not epsilon:
            return loss_fn
        if loss_fn is not None:
            raise ConfigError("label_smoothing_factor smooths the default loss; with loss_fn, smooth in it (or leave "
                              "label_smoothing_factor 0)")
        return LabelSmoothed(default_loss(self.model), epsilon)

    # -- the numbers ------------------------------------------------------------------------------------------------
    @property
    def sampling_rate(self) -> float:
        """q: the expected fraction of the training set in a logical batch (1 with ``sampling="full"``)."""
        return 1.0 if self.privacy_args.sampling == "full" else self.expected_batch_size / self.dataset_size

    def get_train_dataloader(self):
        """Logical batches in place of the Trainer's DataLoader: ``round(1 / q)`` an epoch (q: the sampling rate), each
        ``gradient_accumulation_steps`` micro-batches long for the Trainer's counting (:class:`_LogicalBatches`)."""
        steps = steps_for_epochs(1.0, self.sampling_rate)
        return _LogicalBatches(self.train_dataset, steps, self.args.gradient_accumulation_steps)

    def set_initial_training_values(self, args, dataloader):
        values = super().set_initial_training_values(args, dataloader)
        self.planned_steps = values[-1]  # (the Trainer's max_steps: the steps the noise is calibrated for)
        return values

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return [m for _, m in zip(range(num_batches), epoch_iterator, strict=False)], None

    def floating_point_ops(self, inputs) -> int:
        return 0  # (counted from the private batches' sizes: not released)

    # -- the private loop ------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.private_loop is None:
            self.private_loop = self._make_loop(optimizer)
        return optimizer

    def _training_source(self) -> DatasetSource:
        """The training examples as the Trainer would collate them (its unused columns removed), for dptrain's
        sampler: read item by item in this process."""
        dataset, collator = self.train_dataset, self.data_collator
        if _is_datasets_dataset(dataset):  # (as the Trainer's own _get_dataloader does)
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if len(self.label_names) > 1:  # (a question-answering head's start and end positions: one label per example)
            return DatasetSource(dataset, STACKED_KEY, collate_items=StackedLabels(collator, self.label_names))
        return DatasetSource(dataset, self.label_names[0], collate_items=collator)

    def _make_loop(self, optimizer) -> PrivateLoop:
        p, args = self.privacy_args, self.args
        if self.planned_steps is None:
            raise ConfigError("DPTrainer makes its optimizer when train() starts (the noise needs the planned steps)")
        common = dict(
            max_grad_norm=p.per_sample_max_grad_norm,
            batch_size=self.expected_batch_size,
            max_physical_batch_size=args.per_device_train_batch_size,
            sampling=p.sampling,
            accountant=p.accountant,
            secure_noise=p.secure_noise,
            buffer_updates=p.buffer_updates,
            seed=p.privacy_seed,
            loss_fn=self.loss_fn,
            label_key=self.label_names[0] if len(self.label_names) == 1 else STACKED_KEY,
            mixed_precision="bf16" if args.bf16 else None,
            device=args.device,
        )
        source = self._training_source()
        try:
            if p.noise_multiplier is not None:
                loop = make_private_loop(self.model, optimizer, source, noise_multiplier=p.noise_multiplier,
                                         delta=p.delta, **common)
            else:
                loop = make_private_loop(self.model, optimizer, source, target_epsilon=p.target_epsilon,
                                         target_delta=p.delta, steps=self.planned_steps, **common)
        except WholeModelError as e:
            raise ModelError(whole_model_refusal(e)) from None
        if loop.trainer.accountant == AUTO:  # (fixed noise: the accountant that certifies the planned run tightest)
            loop.trainer.accountant = resolve_accountant(loop.trainer, self.planned_steps)
        self.loss_fn = loop.trainer.loss_fn
        t = loop.trainer
        transformers.utils.logging.get_logger(__name__).info(
            f"dptrain: {self.planned_steps} private steps, expected logical batch {self.expected_batch_size} "
            f"({t.sampler.scheme} sampling, rate {t.sampling_rate:.4g}; the Trainer's sampler is replaced) in chunks "
            f"of at most {t.max_physical_batch_size}, noise multiplier {t.noise_multiplier:.4g}, per-example clip "
            f"norm {p.per_sample_max_grad_norm:g}, certified by {t.accountant}"
        )
        return loop

    def training_step(self, model, inputs, num_items_in_batch=None):
        if inputs is _Wait:
            return torch.zeros((), device=self.args.device)
        if inputs is not _Run:
            raise ConfigError("DPTrainer.training_step runs the logical batches its own loop hands out")
        if self.private_loop is None:  # (a subclass's create_optimizer that does not call the Trainer's)
            self.private_loop = self._make_loop(getattr(self.optimizer, "optimizer", self.optimizer))
        loop = self.private_loop
        if self._chunks is None:
            self._chunks = loop.batches(steps=self.planned_steps)
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()  # (schedule-free optimizers, as the Trainer's training_step)
        loss_sum, count = torch.zeros((), device=self.args.device, dtype=torch.float64), 0
        while True:
            try:
                inputs, labels = next(self._chunks)
            except StopIteration:
                raise BudgetExhausted(
                    f"the private loop allows no more logical batches after {loop.steps} (its budget); the Trainer "
                    "asked for another"
                ) from None
            if len(labels) == 0:  # (an empty Poisson batch: its release is noise alone; models need not take it)
                losses = labels.new_zeros(0, dtype=torch.float32)
            else:
                # (detached: the loop hands its floating tensors out requiring grad, to see what a loop body computes
                # from them; this body is ours, and Wav2Vec2's feature encoder sets requires_grad on a view of its
                # input_values, which torch refuses for a tensor requiring grad: a raw RuntimeError)
                inputs = ({k: v.detach() if torch.is_tensor(v) else v for k, v in inputs.items()}
                          if isinstance(inputs, Mapping) else tree_map(lambda t: t.detach() if torch.is_tensor(t) else t,
                                                                       inputs))
                outputs = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
                losses = self.loss_fn(outputs, labels)
            loop.backward(losses)
            loss_sum += losses.detach().sum().to(loss_sum.dtype)
            count += len(losses)
            if loop.is_last_chunk:
                return (loss_sum / max(count, 1)).float()

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        if resume_from_checkpoint not in (None, False):
            refuse_resume()
        if trial is not None:
            refuse_search()
        loop = self.private_loop
        if loop is not None and loop.trainer.allowed_steps() is not None and not loop.trainer.can_step():
            raise BudgetExhausted(
                f"this DPTrainer spent its budget (epsilon {loop.trainer.budget.epsilon:g} at delta "
                f"{loop.trainer.budget.delta:g}) in {loop.steps} steps; make a new DPTrainer to train more"
            )
        try:
            output = super().train(resume_from_checkpoint=None, trial=None, **kwargs)
        finally:
            if self._chunks is not None:
                self._chunks.close()  # (a logical batch left unfinished by an error releases nothing)
                self._chunks = None
        metrics = self._released(dict(output.metrics))
        loss = output.training_loss if self.privacy_args.log_not_private else math.nan
        return transformers.trainer_utils.TrainOutput(output.global_step, loss, metrics)

    def predict(self, test_dataset, *args, **kwargs):
        """The Trainer's predictions and metrics on held-out data (post-processing of the released model)."""
        check_held_out(test_dataset, self.train_dataset, "predict()'s data")
        return super().predict(test_dataset, *args, **kwargs)

    def hyperparameter_search(self, *args, **kwargs):
        refuse_search()

    def evaluate(self, eval_dataset=None, *args, **kwargs):
        """The Trainer's evaluation on held-out data. Its metrics are computed from the evaluation examples: logged and
        returned as they are when ``privacy_args.eval_is_public`` (public data: post-processing of the released
        model), labelled ``_not_private`` with ``log_not_private``, else refused."""
        chosen = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict):
            chosen = self.eval_dataset.get(eval_dataset)
        check_held_out(chosen, self.train_dataset, "the evaluation data")
        public, labelled = self.privacy_args.eval_is_public, self.privacy_args.log_not_private
        if not public and not labelled:
            raise ConfigError(f"DPTrainer.evaluate(): the metrics {NOT_PUBLIC}")
        self._in_evaluation = True
        try:
            metrics = super().evaluate(eval_dataset, *args, **kwargs)
        finally:
            self._in_evaluation = False
        return metrics if public else {k + NOT_PRIVATE_SUFFIX: v for k, v in metrics.items()}

    # -- what leaves the run ---------------------------------------------------------------------------------------
    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> PrivacyReport:
        """The privacy spent so far (``float(trainer.epsilon())`` is the number): the run's accountant on its ledger."""
        if self.private_loop is None:
            raise ConfigError("this DPTrainer has not trained: it has released nothing yet")
        return self.private_loop.epsilon(delta, accountant)

    @property
    def ledger(self):
        return None if self.private_loop is None else self.private_loop.ledger

    def certificate(self) -> dict:
        """The certificate as logged: epsilon, delta, accountant, certified (with the steps, the noise and the rate)."""
        if self.private_loop is None:
            return {}
        report, t = self.epsilon(), self.private_loop.trainer
        return {
            "epsilon": report.epsilon,
            "delta": report.delta,
            "accountant": report.accountant,
            "certified": report.certified,
            "private_steps": t.steps,
            "noise_multiplier": t.noise_multiplier,
            "sampling_rate": t.sampling_rate,
        }

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's ``save_model`` (also every checkpoint's weights), with what the saved weights cost beside them:
        ``ledger.json`` (the ledger so far, as a ``dptrain train`` run writes it: ``dptrain.accounting.Ledger.load``)
        and ``certificate.json`` (:meth:`certificate`). Both are public: what was released and how, no generator
        state (a Trainer checkpoint holds none of dptrain's: its ``rng_state.pth`` is the global generators', which
        draw no noise and no batch)."""
        super().save_model(output_dir, _internal_call)
        if self.private_loop is None or not self.args.should_save:
            return
        directory = Path(output_dir if output_dir is not None else self.args.output_dir)
        self.private_loop.ledger.save(directory / LEDGER_FILE)
        certificate = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                       for k, v in self.certificate().items()}
        write_json_atomic(directory / CERTIFICATE_FILE, certificate)

    def _released(self, logs: dict) -> dict:
        """``logs`` less the statistics of the private batches (or those labelled, with log_not_private), plus the
        certificate."""
        if self._in_evaluation:  # (not public: evaluate() ran only with log_not_private, which labels them)
            kept, held = (dict(logs), {}) if self.privacy_args.eval_is_public else ({}, dict(logs))
        else:
            kept = {k: v for k, v in logs.items() if k in RELEASED_KEYS or k in CERTIFICATE_KEYS}
            held = {k: v for k, v in logs.items() if k not in kept}
        if self.privacy_args.log_not_private:
            kept.update({k + NOT_PRIVATE_SUFFIX: v for k, v in held.items()})
        elif set(held) - self._dropped:
            self._dropped |= set(held)
            warnings.warn(
                f"dptrain: not logged, statistics of the private batches: {', '.join(sorted(held))} "
                "(privacy_args.log_not_private=True logs them labelled _not_private)",
                stacklevel=3,
            )
        return {**kept, **self.certificate()}

    def log(self, logs: dict, start_time: float | None = None) -> None:
        super().log(self._released(logs), start_time)


__all__ = ["CERTIFICATE_FILE", "CERTIFICATE_KEYS", "DPTrainer", "LEDGER_FILE", "RELEASED_KEYS"]
