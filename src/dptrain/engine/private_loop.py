"""Your own training loop, made private: you keep the forward pass, the loss and ``optimizer.step()``; dptrain draws the
batches, forms the per-example gradients of your per-example losses, clips them, adds the noise once per logical batch
and records the release.

    loop = dptrain.make_private_loop(model, optimizer, data, target_epsilon=3.0, target_delta=1e-5, epochs=3,
                                     batch_size=256, max_grad_norm=1.0, max_physical_batch_size=64)
    for inputs, labels in loop.batches(epochs=3):
        losses = loss_fn(model(inputs), labels)      # one loss per example
        loop.backward(losses)                        # on the logical batch's last chunk: p.grad = the private gradient
        optimizer.step()                             # does nothing on the other chunks (loop.step_skipped)
        optimizer.zero_grad()

Built on a :class:`dptrain.engine.trainer.PrivateTrainer` (``loop.trainer``: its probe, checks, streams, sampler,
clipping, noise, ledger, budget, checkpoints), a logical batch is the trainer's step cut where your code runs: with the
same seed, data and loss, a loop and ``trainer.train`` take bit-identical steps (``tests/test_private_loop.py``). What
your code may do and what is refused in one line (:class:`LoopError`): docs/training_loop.md. A logical batch is
atomic as far as a loop can be: an error (or Ctrl-C) before its last chunk's ``backward`` releases nothing and rolls
the streams back; SIGINT/SIGTERM between the release and your ``optimizer.step()`` wait for the step.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from dptrain.data.batches import as_source, loader_batch_size
from dptrain.engine.api import _check_options, make_private, make_private_with_epsilon
from dptrain.engine.extra_terms import ExtraRefused, check_reads_no_example, extra_gradients
from dptrain.engine.grad_scaler import REFUSAL as GRAD_SCALER_REFUSAL
from dptrain.engine.grad_scaler import called_by_grad_scaler
from dptrain.engine.interrupts import deferred_signals
from dptrain.engine.loop_chunks import (
    derived_from,
    hand_out,
    mixed_losses,
    reaches,
    same_examples,
    tensors_of,
    uncovered,
)
from dptrain.engine.loop_state import OptimizerWatch, changed_optimizer_state, changed_outside_step
from dptrain.engine.released import kept as kept_gradients
from dptrain.engine.released import unapplied
from dptrain.engine.trainer import PrivateTrainer, optimizer_step
from dptrain.errors import ConfigError, DPTrainError, ModelError
from dptrain.preflight.batch_dependence import output_leaves, randomness_state, same_randomness
from dptrain.preflight.sentinel import Trained
from dptrain.stages.clipping import ClipStats, clipped_sum
from dptrain.stages.coverage import CoverageError
from dptrain.stages.devices import to_device
from dptrain.stages.precision import autocast_of


class LoopError(DPTrainError, RuntimeError):
    """A private loop was used in a way it cannot account for (nothing of the logical batch was released)."""


@dataclass
class _Chunk:
    """A physical chunk handed to the loop body, from its yield to its ``backward``."""

    last: bool
    size: int
    handed: list[torch.Tensor]
    floats: list[torch.Tensor]
    recording: contextlib.ExitStack
    index: int = 0  # its place in the logical batch
    batch: tuple = ()  # (inputs, labels) as drawn, for the sentinel (dptrain.preflight.sentinel)
    watch: object = None  # the model's buffers when it was handed out
    outputs: list[torch.Tensor] = field(default_factory=list)  # the model's outputs on the chunk
    layer_outputs: list[torch.Tensor] = field(default_factory=list)  # outputs of the modules with parameters
    calls: int = 0
    as_leaves: bool = True  # the model got the chunk's tensors requiring grad, as handed out (DPTrainer: detached)
    done: bool = False  # backpropagated
    rows: list[int] = field(default_factory=list)  # the rows the sentinel compares (none: not compared)
    randomness: tuple | None = None  # the generators when a chunk the sentinel compares was handed out
    trained: dict | None = None  # then the model's outputs in the loop body's (last) call on it


@dataclass
class _Batch:
    """A logical batch, from its draw to the optimizer step after its release."""

    saved: dict
    chunks: int = 0
    summed: dict | None = None
    stats: ClipStats = field(default_factory=lambda: ClipStats(0, 0, 0.0))
    extra: dict | None = None
    released: bool = False
    stepped: bool = False
    written: dict = field(default_factory=dict)  # the .grad tensors the release wrote, by parameter name
    values: dict = field(default_factory=dict)  # copies of their values (dptrain.engine.released)


class PrivateLoop:
    """A user's own training loop over a :class:`~dptrain.engine.trainer.PrivateTrainer` (make one with
    :func:`make_private_loop`): :meth:`batches` hands out the secret batches chunk by chunk, :meth:`backward` takes
    each chunk's per-example losses, and the optimizer's ``step()`` applies the private gradient once per logical
    batch (it does nothing on the other chunks: :attr:`step_skipped`)."""

    def __init__(self, trainer: PrivateTrainer):
        if trainer.group is not None:
            raise ConfigError("make_private_loop does not run data parallel (torchrun): train with make_private")
        if trainer.augment is not None or trainer.weight_average is not None:
            raise ConfigError("augment and ema are stages of the trainer's own step: train with make_private")
        if trainer.compiled:
            raise ModelError(
                "make_private_loop needs the model itself, not torch.compile's wrapper: pass the model you call in "
                "your loop (per-example gradients read its modules' forward passes)"
            )
        recording = getattr(trainer.grad_sampler, "recording", None)
        if recording is None:
            raise ModelError(
                f"the per-example gradient backend {trainer.grad_sampler.name!r} recomputes the forward pass itself: a "
                "loop of your own needs grad_sampler='auto' or 'layerwise' (or train with make_private)"
            )
        with recording(0):  # (the automatic backend refuses here a model that needs torch.func whole)
            pass
        other = getattr(trainer.optimizer.step, "_dptrain_loop", None)
        if other is not None and not other._closed:  # (a loop made again on the same optimizer, e.g. in a notebook)
            if other._batch is not None:
                raise LoopError("this optimizer belongs to another private loop in a logical batch: close that loop first")
            other.close()
        self.trainer = trainer
        self.model, self.optimizer = trainer.model, trainer.optimizer
        #: True when the last ``optimizer.step()`` did nothing: it came after a chunk that is not its logical batch's
        #: last (the gradient of a logical batch is released with its last chunk), as Opacus' BatchMemoryManager does.
        self.step_skipped = False
        self._sampler, self._size = trainer.sampler, self._data_size()
        self._gen: weakref.ref | None = None  # the iteration in progress (weak: a loop body's error drops and ends it)
        self._batch: _Batch | None = None
        self._chunk: _Chunk | None = None
        self._held: contextlib.ExitStack | None = None  # signals held from a release to its optimizer step
        self._foreign = False  # a backward pass of the user's own accumulated into the parameters' .grad
        #: True while the backend forms a chunk's per-example gradients: a module without a rule (the model itself when
        #: it owns a parameter) is then called again by torch.func, example by example, and the loop's hooks must not
        #: take those calls for the loop body's
        self._forming = False
        self._closed = False
        model = self.model
        self._handles = [
            model.register_forward_pre_hook(self._model_called, with_kwargs=True),
            model.register_forward_hook(self._model_returned),
        ]
        self._handles += [
            m.register_forward_hook(self._layer_returned)
            for m in model.modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._handles += [p.register_post_accumulate_grad_hook(self._accumulated) for p in trainer.params.values()]
        self._install_step()
        #: the model's state since the loop last checked it: it changes only in the optimizer step (:meth:`_check_state`)
        self._state = trainer.sentinel.watch()
        #: the optimizer's state since its last step: it changes only in the step too
        self._optimizer_state = OptimizerWatch(self.optimizer, model)
        trainer.step = self._trainer_step  # (the trainer's own steps would call the loop's optimizer step)

    def _trainer_step(self):
        raise LoopError(
            "this trainer belongs to a private loop: train in your loop (loop.batches), or close the loop and use "
            "make_private"
        )

    # -- what the loop body calls --------------------------------------------------------------------------------
    def batches(self, steps: int | None = None, epochs: float | None = None) -> Iterator:
        """The chunks of up to ``steps`` logical batches (or ``epochs`` passes' worth), each ``(inputs, labels)`` on
        the trainer's device, never a logical batch the budget does not allow. A logical batch larger than
        ``max_physical_batch_size`` comes in several chunks (:attr:`is_last_chunk`); an empty Poisson batch as one chunk
        of no example. Starting a new iteration ends an unfinished one (nothing of its logical batch is released)."""
        total = self.trainer.steps_for(steps, epochs)
        self._check_open()
        self._end_iteration()
        gen = self._iterate(total)
        self._gen = weakref.ref(gen)
        return gen

    def backward(self, losses: torch.Tensor, extra: Callable[[dict], torch.Tensor] | None = None) -> None:
        """The per-example gradients of ``losses`` (one per example of the chunk, from the model's forward pass on the
        chunk in this loop body), clipped and added to the logical batch's sum; on its last chunk the sum is noised once,
        divided by the expected batch size and set as every parameter's ``.grad`` (the release, recorded in the
        ledger). ``extra``: a function of the parameters, ``extra(params) -> scalar`` (``params``: name -> the trainable
        parameter; a weight regularizer), which the loop calls itself: its gradient, averaged over the logical batch's
        chunks, is added to the private gradient (post-processing). A term that reads the chunk's examples, by any
        path the loop can replay, is refused (:meth:`_extra_gradients`)."""
        chunk, batch = self._chunk, self._batch
        if chunk is None or batch is None:
            raise LoopError(
                "loop.backward(losses) takes the losses of a chunk that loop.batches() handed out, inside its loop body"
            )
        if chunk.done:
            self._refuse("loop.backward() was called twice on one chunk: each chunk is backpropagated once")
        trained = chunk.trained if chunk.calls == 1 and chunk.randomness is not None and same_randomness(
            chunk.randomness, randomness_state(self.trainer.device.type)) else None  # (the sentinel compares them)
        try:
            self._check_state(parameters_only=True)  # (a parameter changed in the loop body: before anything else)
            self._check_foreign()
            chunk.recording.close()  # the chunk's forward pass is what was recorded up to here
            # (a chunk of no example, an empty Poisson batch, may skip the forward pass: its sum is zero, as the trainer's)
            empty = chunk.size == 0 and not chunk.calls and torch.is_tensor(losses) and tuple(losses.shape) == (0,)
            if not empty:
                self._check_losses(chunk, losses)
            extra_grads = None if extra is None else self._extra_gradients(chunk, extra)
            if empty:
                summed, stats, _ = clipped_sum([], self.trainer.clipping, self.trainer.params)
            else:
                self._check_per_example(chunk, losses)
                self._forming = True
                try:
                    grads = self.trainer.grad_sampler.from_losses(losses)
                except CoverageError as e:  # (in your loop the way out is not a backend, which the loop cannot change)
                    if not e.fixable:  # (a layer run without autograd, a compiled graph: its own message)
                        raise
                    self._refuse(uncovered(e.names))
                finally:
                    self._forming = False
                # (state the chunk's passes or your code wrote: refused and labelled not private, or labelled only)
                wrote = self.trainer.sentinel.written(chunk.watch, user_code=True)
                if extra is not None:  # (after the chunk's backward: the check writes the chunk's tensors, then restores)
                    self._extra_replayed(chunk, extra, extra_grads)
                summed, stats, _ = clipped_sum([(grads, losses.detach())], self.trainer.clipping, self.trainer.params)
            if batch.summed is None:
                batch.summed = summed
            else:  # (the additions clipping.clipped_sum makes over a trainer's chunks, in the same order)
                batch.summed = {n: t + summed[n] for n, t in batch.summed.items()}
            batch.stats = batch.stats.merge(stats)
            if extra_grads is not None:
                acc = batch.extra or {}
                batch.extra = {**acc, **{n: acc[n] + g if n in acc else g for n, g in extra_grads.items()}}
            chunk.done = True
            chunk.handed = chunk.floats = chunk.outputs = chunk.layer_outputs = []  # (the chunk's activations, freed)
            # (compared as the model got it: requiring grad as handed out, or detached as DPTrainer calls it)
            (inputs, labels), _, _ = hand_out(chunk.batch) if chunk.as_leaves else (chunk.batch, None, None)
            chunk.batch = ()
            self.trainer.sentinel.hold(Trained(inputs, labels, trained, key=(self.trainer.steps, chunk.index)))
            ran = self.trainer.sentinel.check(self.trainer.steps, chunk.index, inputs, labels)  # before the release
            if empty or ran or wrote or self._state is not chunk.watch:  # (else the chunk's watch still holds)
                self._state = self.trainer.sentinel.watch()
            if chunk.last:
                self._release(batch)
        except BaseException:
            self._abandon()
            raise

    @property
    def is_last_chunk(self) -> bool:
        """Whether the chunk the loop body holds is its logical batch's last (its backward releases the gradient)."""
        return self._chunk is not None and self._chunk.last

    # -- the run --------------------------------------------------------------------------------------------------
    @property
    def ledger(self):
        return self.trainer.ledger

    @property
    def steps(self) -> int:
        """Logical batches released so far (optimizer steps)."""
        return self.trainer.steps

    def epsilon(self, delta: float | None = None, accountant: str | None = None):
        """Privacy spent so far (:meth:`dptrain.engine.trainer.PrivateTrainer.epsilon`)."""
        return self.trainer.epsilon(delta, accountant)

    def evaluate(self, x, y=None, batch_size: int = 1024) -> float:
        """Accuracy on held-out data (:meth:`dptrain.engine.trainer.PrivateTrainer.evaluate`); not inside a logical batch."""
        self._check_between_steps("evaluate()")
        self._check_state()
        try:
            return self.trainer.evaluate(x, y, batch_size)
        finally:
            self._state = self.trainer.sentinel.watch()  # (held-out data in eval mode: not a training release)

    def state_dict(self) -> dict:
        """The trainer's checkpoint (SECRET: it holds the generators' states), between logical batches only."""
        self._check_between_steps("state_dict()")
        return self.trainer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._check_between_steps("load_state_dict()")
        self.trainer.load_state_dict(state)
        self._state = self.trainer.sentinel.watch()
        self._optimizer_state = OptimizerWatch(self.optimizer, self.model)

    def close(self) -> None:
        """End the loop: an unfinished logical batch is abandoned (nothing released), the hooks are removed and the
        optimizer's ``step`` is its own again."""
        if self._closed:
            return
        self._end_iteration()
        self._abandon()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.optimizer.__dict__.get("step") is self._step:
            if self._previous_step is None:
                del self.optimizer.__dict__["step"]
            else:
                self.optimizer.step = self._previous_step
        self._closed = True  # (a step wrapped again since, by an LR scheduler made later, now passes through)
        self.trainer.__dict__.pop("step", None)
        self.trainer.close()

    def __enter__(self) -> PrivateLoop:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- logical batches ------------------------------------------------------------------------------------------
    def _iterate(self, total: int):
        trainer = self.trainer
        allowed = trainer.allowed_steps()
        end = trainer.steps + total if allowed is None else min(trainer.steps + total, allowed)
        try:
            while trainer.steps < end and trainer.can_step():
                yield from self._logical_batch()
            self._check_state()  # (the last loop body, after its optimizer step)
        finally:
            self._abandon()

    def _logical_batch(self):
        trainer = self.trainer
        self._check_sampling()
        trainer.check_allowed()
        batch = self._batch = _Batch(self._snapshot())
        self._foreign, self.step_skipped = False, False
        try:
            if not self.model.training:  # (evaluate() left it in eval mode; as the trainer's step)
                self.model.train()
            with deferred_signals():
                idx = trainer.sampler.sample(trainer.randomness.stream("sampling"), trainer.steps)
            chunks = list(idx.split(trainer.max_physical_batch_size)) if len(idx) else [idx]
            batch.chunks = len(chunks)
            for k, c in enumerate(chunks):
                self._check_state()  # (what your code did since the loop last looked: before the chunk is read)
                drawn = to_device(trainer.data.batch(c), trainer.device)
                (inputs, labels), handed, floats = hand_out(drawn)
                checked = trainer.sentinel.drawn(trainer.steps, k, *drawn)  # (a copy if it is checked: your code may write it)
                recording = contextlib.ExitStack()
                recording.enter_context(trainer.grad_sampler.recording(len(c)))
                recording.enter_context(autocast_of(trainer.grad_sampler))
                chunk = self._chunk = _Chunk(k == len(chunks) - 1, len(c), handed, floats, recording, k,
                                             checked, self._state)  # (checked just now: it holds)
                chunk.rows = trainer.sentinel.rows_of(trainer.steps, k, len(c))
                if chunk.rows:  # (compared with the outputs your loop body computes, if it draws no number)
                    chunk.randomness = randomness_state(trainer.device.type)
                yield inputs, labels
                if self._batch is not batch:
                    raise LoopError(
                        "this logical batch ended after an error (nothing of it was released unless its last chunk was "
                        "backpropagated): start the iteration again with loop.batches()"
                    )
                self._check_foreign()
                if not chunk.done:
                    self._refuse(
                        "the loop body ended without loop.backward(losses) on the chunk it was handed: every chunk "
                        "is backpropagated once"
                    )
            if not batch.stepped:
                raise LoopError(
                    "a logical batch was released (loop.backward on its last chunk) but optimizer.step() was not called: "
                    "call it once per logical batch, after loop.backward"
                )
        finally:
            self._abandon()

    def _release(self, batch: _Batch) -> None:
        """The logical batch's release (the trainer's privatize), signals held until the optimizer step."""
        self._held = contextlib.ExitStack()
        self._held.enter_context(deferred_signals())
        self.trainer.privatize(batch.summed, batch.stats)
        batch.released = True
        if batch.extra:  # post-processing of the release: the mean over the chunks of the extra terms' gradients
            for n, g in batch.extra.items():
                p = self.trainer.params[n]
                p.grad.add_((g / batch.chunks).to(p.grad.dtype))
        batch.written = {n: p.grad for n, p in self.trainer.params.items()}
        batch.summed, batch.values = None, kept_gradients(batch.written)  # (the sum's memory for the copies)

    def _optimizer_step(self, previous, args, kwargs):
        if self._closed:
            return previous(*args, **kwargs)
        chunk, batch = self._chunk, self._batch
        if chunk is None or batch is None:
            raise LoopError(
                "optimizer.step() outside a loop body of loop.batches(): the optimizer applies private gradients only "
                "(close the loop with loop.close() to use it otherwise)"
            )
        self._check_foreign()
        if called_by_grad_scaler():
            self._refuse(GRAD_SCALER_REFUSAL)
        if any(callable(a) for a in (*args, *kwargs.values())):  # (run by the optimizer inside its step)
            for p in self.trainer.params.values():
                p.grad = None
            self._refuse(
                "optimizer.step(closure): the optimizer runs the closure inside its step, where a loss and gradient "
                "it recomputes (or edits) would be applied instead of the release; call optimizer.step() without one "
                "(an optimizer that needs a closure, such as LBFGS, evaluates the loss more than once per release)"
            )
        if not chunk.done:
            self._refuse("optimizer.step() without loop.backward(losses) on the chunk: backpropagate it first")
        if not chunk.last:
            self.step_skipped = True  # (the logical batch's gradient is released with its last chunk)
            return None
        if batch.stepped:
            raise LoopError("optimizer.step() was called twice for one logical batch: one step per release")
        self._check_stepped(batch)
        self._check_optimizer_state()
        self._check_state()
        try:
            result = optimizer_step(previous, self.trainer.steps, *args, **kwargs)
            batch.stepped = True
            self.step_skipped = False
        finally:
            held, self._held = self._held, None
            if held is not None:
                held.close()  # (a signal held since the release is delivered here, after the update)
        self._state = self.trainer.sentinel.watch()  # (the one place the parameters may change)
        self._optimizer_state = OptimizerWatch(self.optimizer, self.model)  # (and the optimizer's state)
        self.trainer.check_weights()
        return result

    def _install_step(self) -> None:
        """The optimizer's ``step`` as the loop's: an instance attribute bound to the optimizer (as torch's LR schedulers
        wrap it), so that the user's own reference to the optimizer works and a scheduler made later wraps it in turn."""
        opt = self.optimizer
        self._previous_step = opt.__dict__.get("step")
        previous = opt.step
        loop = self

        def step(optimizer, *args, **kwargs):
            return loop._optimizer_step(previous, args, kwargs)

        step._dptrain_loop = self  # (copied onto an LR scheduler's wrapper of it by functools.wraps)
        if getattr(previous, "_wrapped_by_lr_sched", False):  # (a scheduler made before: its wrapper still runs inside)
            step._wrapped_by_lr_sched = True
        self._step = types.MethodType(step, opt)
        opt.step = self._step

    # -- checks ---------------------------------------------------------------------------------------------------
    def _model_called(self, module, args, kwargs):
        chunk = self._chunk
        if chunk is None or chunk.done or self._forming:
            return None
        if not torch.is_grad_enabled():  # (the layerwise recording would hold outputs that have no gradient)
            self._refuse(
                "the model was called under torch.no_grad (or inference_mode) on a chunk before its loop.backward: make "
                "such a call after loop.backward(losses)"
            )
        tensors = tensors_of(args) + tensors_of(kwargs)
        ours = [same_examples(t, chunk.handed) for t in tensors]
        foreign = chunk.size > 1 and any(
            not mine and t.dim() and t.shape[0] == chunk.size for t, mine in zip(tensors, ours, strict=True)
        )
        if not any(ours) or foreign:
            self._refuse(
                "the model was called on a batch the loop did not hand out: call it on the chunk's own inputs (transform "
                "examples in the Dataset or the DataLoader's collate_fn, which dptrain reads example by example)"
            )
        if any(not mine and derived_from(t, chunk.floats) for t, mine in zip(tensors, ours, strict=True)):
            self._refuse(  # (whatever its shape: x.mean(0), the batch's maximum; each example must see only itself)
                "the model was called with a tensor computed from the chunk's examples besides the chunk itself (a "
                "statistic of the batch such as x.mean(0) or its maximum): it mixes the examples, so clipping does not "
                "bound one example's influence; pass the chunk's own tensors, and compute per-example inputs in the "
                "Dataset or the DataLoader's collate_fn"
            )
        chunk.calls += 1
        chunk.as_leaves = any(t.requires_grad for t, mine in zip(tensors, ours, strict=True) if mine)
        return None

    def _model_returned(self, module, args, output):
        chunk = self._chunk
        if chunk is not None and not chunk.done and not self._forming:
            chunk.outputs += [t for t in tensors_of(output) if t.requires_grad]
            if chunk.randomness is not None and module.training:
                chunk.trained = output_leaves(output)

    def _layer_returned(self, module, args, output):
        chunk = self._chunk
        if chunk is not None and not chunk.done and not self._forming:
            chunk.layer_outputs += [t for t in tensors_of(output) if t.requires_grad]

    def _accumulated(self, param) -> None:
        if self._batch is not None and not self._batch.stepped:
            self._foreign = True

    def _check_state(self, parameters_only: bool = False) -> None:
        """The model's state as the loop last saw it (then ``self._state`` holds), else refused (:mod:`.loop_state`)."""
        if not self._state.written():
            return
        message = changed_outside_step(self.trainer, self._state, parameters_only)
        self._state = self.trainer.sentinel.watch()
        if message is not None:
            for p in self.trainer.params.values():  # (a gradient of the logical batch is not applied)
                p.grad = None
            self._refuse(message)

    def _check_optimizer_state(self) -> None:
        """The optimizer's state as its last step left it, read when its next step is about to apply it (once per
        logical batch: a checksum of every moment costs a pass over the optimizer's memory), else refused and the run
        labelled (:func:`.loop_state.changed_optimizer_state`)."""
        message = changed_optimizer_state(self.trainer, self._optimizer_state)
        if message is not None:
            self._optimizer_state = OptimizerWatch(self.optimizer, self.model)
            for p in self.trainer.params.values():  # (a gradient of the logical batch is not applied)
                p.grad = None
            self._refuse(message)

    def _check_foreign(self) -> None:
        if self._foreign:
            if self._batch is not None and self._batch.released:  # (what was added to the private gradient is dropped)
                for p in self.trainer.params.values():
                    p.grad = None
            self._refuse(
                "a backward pass of your own (loss.backward()) wrote into the parameters' .grad during a logical "
                "batch: only loop.backward(losses) may (a term of the parameters goes to loop.backward(losses, extra=fn))"
            )

    def _check_stepped(self, batch: _Batch) -> None:
        """Before the optimizer step of a release: every gradient it would apply is one this release wrote. Refused:
        a trainable parameter the loop does not privatize (added to the model or the optimizer after the loop was
        made, whatever gave it a gradient: ``torch.autograd.backward(..., inputs=[p])``, a hand-written ``.grad``),
        a privatized parameter frozen since (``requires_grad_(False)``: the release's noise would move it), and
        a privatized parameter whose ``.grad`` is no longer the tensor the release wrote or holds more than its values
        clipped (clip_grad_norm_, clip_grad_value_: post-processing). Nothing is applied: the gradients are dropped (the
        release stays recorded)."""
        message = unapplied(self.trainer, batch.written, batch.values)  # (dptrain.engine.released)
        if message is None:
            return
        for p in [*self.trainer.params.values(), *self.model.parameters(),
                  *(q for g in self.optimizer.param_groups for q in g["params"])]:
            p.grad = None
        self._refuse(message)

    def _check_losses(self, chunk: _Chunk, losses) -> None:
        if not torch.is_tensor(losses) or losses.dim() != 1 or losses.shape[0] != chunk.size:
            self._refuse(
                "loop.backward(losses) takes one loss per example of the chunk the loop handed out (a 1-D tensor as "
                "long as its labels), not a mean or a batch of another length"
            )
        if not chunk.calls:
            self._refuse(
                "the model was not called on the chunk in this loop body: loop.backward(losses) takes losses computed "
                "from the model's forward pass on the chunk the loop handed out"
            )
        if losses.grad_fn is None or not reaches(losses, chunk.outputs):
            self._refuse(
                "the losses do not come from the model's outputs on the chunk the loop handed out (computed from "
                "another forward pass, detached, or under torch.no_grad)"
            )

    def _check_per_example(self, chunk: _Chunk, losses: torch.Tensor) -> None:
        found = mixed_losses(losses, chunk.outputs, chunk.floats, chunk.rows)  # (dptrain.engine.loop_chunks)
        if found is not None:
            if found[1]:  # (at the sentinel's places: as its own comparisons, the run is not certified)
                self.trainer.sentinel.stop(f"at step {self.trainer.steps + 1}, {found[0]}")
            self._refuse(found[0])

    def _extra_gradients(self, chunk: _Chunk, extra) -> dict[str, torch.Tensor]:
        try:  # (dptrain.engine.extra_terms: what the loop checks of extra, and what it cannot see)
            return extra_gradients(extra, self.trainer.params, chunk.floats + chunk.layer_outputs + chunk.outputs)
        except ExtraRefused as e:
            self._refuse(str(e))

    def _extra_replayed(self, chunk: _Chunk, extra, gradients: dict[str, torch.Tensor]) -> None:
        try:
            check_reads_no_example(extra, gradients, self.trainer.params, chunk.handed)
        except ExtraRefused as e:
            self._refuse(str(e))

    def _check_sampling(self) -> None:
        sampler = self.trainer.sampler
        if sampler is not self._sampler or sampler.dataset_size != self._size or self._data_size() != self._size:
            raise LoopError(
                "the sampling changed since the loop was made (its sampler, or the size of the training data): the "
                "sampling rate the ledger records would not be the one used; make a new loop"
            )

    def _data_size(self) -> int:
        data = self.trainer.data
        return len(getattr(data, "dataset", data))

    def _check_open(self) -> None:
        if self._closed:
            raise LoopError("this loop is closed: make a new one with make_private_loop")

    def _check_between_steps(self, what: str) -> None:
        if self._batch is not None and not self._batch.stepped:
            raise LoopError(f"{what} inside a logical batch: call it between optimizer steps")

    # -- atomicity --------------------------------------------------------------------------------------------------
    def _end_iteration(self) -> None:
        gen = self._gen() if self._gen is not None else None
        self._gen = None
        if gen is not None:
            gen.close()

    def _snapshot(self) -> dict:
        trainer = self.trainer
        return {
            "streams": {p: trainer.randomness.stream(p).get_state() for p in ("sampling", "noise", "mixing")},
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
        }

    def _refuse(self, message: str):
        self._abandon()
        raise LoopError(message)

    def _abandon(self) -> None:
        """End the logical batch in progress: unreleased, its streams are rolled back (torch's generator too, as the
        trainer's step does), so that nothing of it happened; released, it stays released (and counted)."""
        chunk, batch, held = self._chunk, self._batch, self._held
        self._chunk = self._batch = self._held = None
        if chunk is not None:
            chunk.recording.close()
        if batch is not None and not batch.released:
            trainer = self.trainer
            for p, state in batch.saved["streams"].items():
                trainer.randomness.stream(p).set_state(state)
            torch.set_rng_state(batch.saved["torch"])
            if batch.saved["cuda"] is not None:
                torch.cuda.set_rng_state(batch.saved["cuda"], trainer.device)
            for p in trainer.params.values():
                p.grad = None
        if held is not None:
            held.close()


def make_private_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    max_grad_norm: float = 1.0,
    batch_size: float | None = None,
    max_physical_batch_size: int | None = None,
    **options,
) -> PrivateLoop:
    """A private loop (:class:`PrivateLoop`) for your own training code: ``noise_multiplier`` fixed
    (:func:`dptrain.engine.api.make_private`; ``delta=`` among the options), or calibrated to ``target_epsilon`` at
    ``target_delta`` for ``epochs`` (or ``steps``), which the loop then never exceeds
    (:func:`dptrain.engine.api.make_private_with_epsilon`). ``data``: what the trainer takes, or a ``DataLoader`` (its
    dataset and collate_fn; its batch_size when ``batch_size`` is None). ``batch_size`` is the expected logical
    batch size (Poisson), cut into chunks of at most ``max_physical_batch_size`` examples. The other options are
    the trainer's (``loss_fn``: the per-example loss the model probe checks, best the one your loop computes)."""
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ConfigError("make_private_loop takes exactly one of noise_multiplier or target_epsilon")
    taken = ("noise_multiplier", "max_grad_norm", "batch_size", "max_physical_batch_size")
    _check_options(options, "make_private_loop", taken + (("delta",) if target_epsilon is not None else ()))
    if batch_size is None:
        batch_size = loader_batch_size(data)
    source = as_source(data, options.get("label_key", "labels"))  # (a DataLoader says here that its sampler goes)
    if noise_multiplier is not None:
        if target_delta is not None or epochs is not None or steps is not None:
            raise ConfigError(
                "target_delta, epochs and steps go with target_epsilon; with a noise_multiplier, delta= sets delta"
            )
        trainer = make_private(
            model, optimizer, source, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
            batch_size=batch_size, max_physical_batch_size=max_physical_batch_size, **options,
        )
    else:
        if target_delta is None:
            raise ConfigError("make_private_loop with target_epsilon needs target_delta (and epochs or steps)")
        trainer = make_private_with_epsilon(
            model, optimizer, source, target_epsilon=target_epsilon, target_delta=target_delta, epochs=epochs,
            steps=steps, max_grad_norm=max_grad_norm, batch_size=batch_size,
            max_physical_batch_size=max_physical_batch_size, **options,
        )
    try:
        return PrivateLoop(trainer)
    except BaseException:
        trainer.close()
        raise


__all__ = ["LoopError", "PrivateLoop", "make_private_loop"]
