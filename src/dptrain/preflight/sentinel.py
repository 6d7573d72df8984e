"""The sentinel: the model probe's checks, continued on the chunks training actually forms.

The probe before training (:mod:`dptrain.preflight.checks`) sees the shapes and examples it tries. A model may behave
differently at others: mix examples only in the Poisson remainder chunk, only for odd batch sizes, only when an
outlier is in the batch; write a buffer only on some batches. So during training, on every chunk, before anything of
its step is released:

- **buffers**: every buffer slot is watched across the chunk's forward and backward pass
  (:class:`dptrain.preflight.buffers.BufferWatch`: slot, version counter, storage, and the value of buffers up to
  4 MiB). A write refuses the step with one line naming the buffer (the buffer is put back: nothing of the batch stays
  in the model), or, with ``buffer_updates="restore"``, is put back and the step goes on (a parameter, or a slot that
  cannot be put back exactly, is still refused), or, with ``buffer_updates="not_private"``, labels the run not private
  from then on;
- **coverage** is proven on every chunk by the layerwise backend itself (:mod:`dptrain.stages.coverage`);
- **mixing at every batch size**: the first chunk of every batch size the run meets (the probe checked one) is
  compared with the same examples alone, by forward passes (:func:`dptrain.preflight.gradient_check.forward_check`:
  training mode, dropout off, the training precision's tolerance), on ROWS secret rows, and every row of it against
  the chunk in a secret order (a model mixing into some places only, the last row, moves there); the losses too, in
  the same passes, where the comparison runs in float64 (a loss mixing the chunk's examples at some sizes only). So no
  step is released from a chunk of a batch size whose mixing was never checked (the Poisson remainder chunk, an odd size);
- **per-example gradients at secret places**: the first chunk of the run (in each process: a resumed run's too) and
  RATE of the chunks, at secret random places, are compared forward and backward (:func:`dptrain.preflight.gradient_check.compare`): data-dependent mixing or a rule wrong on some data
  that the probe missed is caught with probability RATE per chunk where it occurs.

A mismatch stops the run before the step's release with a :class:`SentinelError`, and the trainer is marked not
private (its report is not certified: earlier steps may have mixed examples unseen). Which chunks and rows are
checked is a keyed hash of the step with a secret key derived from the run's entropy
(:meth:`dptrain.randomness.generators.Randomness.derived_key`): secret, and the same when a step is retried or the run
resumed, so a stopped run stops again at the same place. The comparison's outcome is released only as "the run went
on": for a model that computes each example's gradient from that example alone it passes whatever the data (float
rounding is far inside the tolerance), so it says nothing about the data of a run that is certified.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from dptrain.data.batches import copied
from dptrain.errors import DPTrainError, ModelError
from dptrain.preflight import exact, gradient_check
from dptrain.preflight.batch_dependence import output_leaves, randomness_state, same_randomness
from dptrain.preflight.buffers import COMPARED_BYTES, BufferWatch, check_buffers
from dptrain.stages.precision import MixedPrecision

#: The fraction of chunks compared at secret random places (besides the first chunk of each new batch size).
RATE = 1 / 64
#: Examples of a checked chunk compared with each example alone.
ROWS = 2


class SentinelError(ModelError):
    """The sentinel found, during training, a chunk whose per-example gradients are not each example's alone."""


@dataclass
class Trained:
    """A chunk as drawn (``x``, ``y``) and, where known, the leaves of the model's outputs in training's own pass on it
    (:func:`dptrain.preflight.batch_dependence.output_leaves`; None: not kept), and the backend's result of that pass."""

    x: object
    y: torch.Tensor
    outputs: dict | None = None
    result: tuple | None = None  # the backend's (per-example gradients, losses) of that pass (set by the trainer)
    key: tuple = ()  # (step, chunk index)


class Sentinel:
    """The checks of every chunk of a run (module docstring). ``verified``: batch sizes the probe compared;
    the secret key of the checked places is read from the trainer's randomness at each check (a resumed run has its
    entropy back only once its checkpoint is loaded); ``mixing`` / ``gradients``: which comparisons run;
    ``reference``: how an example alone is computed (:func:`dptrain.preflight.gradient_check.compare`)."""

    def __init__(self, trainer, verified: set[int], *, mixing: bool, gradients: bool, reference: str,
                 buffer_updates: str):
        self.trainer, self.verified = trainer, set(verified)
        self.mixing, self.gradients, self.reference = mixing, gradients, reference
        self.buffer_updates = buffer_updates
        #: why a check stopped the run during training, after a release (None: none did): the sentinel, or non-finite
        #: values computed from the private batch (:meth:`stop`); such a run is not private
        self.stopped: str | None = None
        #: chunks compared so far (in this process); whether one was compared backward (the first chunk is)
        self.checked = 0
        self.compared_backward = False
        self._held: Trained | None = None  # training's own pass on the chunk the next check compares (hold)

    def stop(self, reason: str) -> None:
        """Label the run not private: a check stopped it during training, at a moment that depends on the private
        examples and the secret batches, and the moment is released (the steps recorded, the error's step)."""
        self.stopped = self.stopped or reason
        self.trainer.ledger.private = False

    # -- buffers -----------------------------------------------------------------------------------------------
    def watch(self) -> BufferWatch:
        """Every buffer of the model as it is before a chunk's forward pass."""
        return BufferWatch(self.trainer.model, COMPARED_BYTES)

    def written(self, watch: BufferWatch, user_code: bool = False) -> list[str]:
        """After a chunk's forward and backward pass: a written slot of the model's state (a buffer, a parameter, a
        module's attribute) is put back and refused, or (not private by the user's choice) recorded, labelling the
        run not private. A slot that cannot be put back exactly (a large tensor written in place), or one written while
        code of the user's ran (``user_code``: your own loop's body, which may have read or saved it), labels the run
        not private even when refused. With ``buffer_updates="restore"`` the slots put back exactly (none a parameter)
        are the end of it: the step goes on. Returns the slots written (none: ``watch`` still holds)."""
        names = watch.written()
        if not names:
            return names
        trainer = self.trainer
        if self.buffer_updates != "not_private":
            lost = watch.restore()
            # (restore: slots put back exactly, none a parameter, are the user's scratch state by their choice)
            restoring = (self.buffer_updates == "restore" and not lost
                         and not any(watch.kind(n) == "parameter" for n in names))
            kept = lost if restoring or not user_code else names
            if kept:
                trainer.not_private_buffers[:] = sorted({*trainer.not_private_buffers, *kept})
                trainer.ledger.private = trainer.private
            if restoring:
                return names
            check_buffers(names, "refuse", watch.kinds)
        trainer.not_private_buffers[:] = sorted({*trainer.not_private_buffers, *names})
        trainer.ledger.private = trainer.private
        return names

    # -- per-example gradients ---------------------------------------------------------------------------------
    def _hash(self, step: int, index: int) -> bytes:
        data = step.to_bytes(8, "little") + index.to_bytes(8, "little")
        key = self.trainer.randomness.derived_key("sentinel")
        return hashlib.blake2b(data, key=key, digest_size=32).digest()

    def due(self, step: int, index: int, size: int, first: bool = False) -> tuple[list[int], bool, bool]:
        """(rows, new size, compared backward) of chunk ``index`` of step ``step`` (``size`` examples): the rows to
        compare (none: not checked), whether the chunk's batch size is one not checked yet, whether its gradients are
        compared (a secret place, or ``first``: the first chunk of the run in this process)."""
        if size < 1 or not (self.mixing or self.gradients):
            return [], False, False
        h = self._hash(step, index)
        new = self.mixing and size not in self.verified
        secret = int.from_bytes(h[:8], "little") < RATE * 2**64 or (first and self.gradients)
        if not (new or secret):
            return [], False, False
        return sorted({int.from_bytes(h[8 + 8 * r : 16 + 8 * r], "little") % size for r in range(ROWS)}), new, secret

    def drawn(self, step: int, index: int, x, y) -> tuple:
        """The chunk ``x``, ``y`` of chunk ``index`` of step ``step`` as drawn, for :meth:`check` after training's pass
        on it: a copy when it is due (the pass may write its inputs in place: a model centering them by the batch's
        mean leaves centered rows, whose examples alone agree with the mixed batch), else the tensors themselves."""
        return copied((x, y)) if self.rows_of(step, index, len(y)) else (x, y)

    def rows_of(self, step: int, index: int, size: int) -> list[int]:
        """The rows of chunk ``index`` of step ``step`` (``size`` examples) that :meth:`check` will compare (none: the
        chunk is not compared), known before training's pass on it."""
        return self.due(step, index, size, first=not self.compared_backward)[0]

    @contextlib.contextmanager
    def training_pass(self, step: int, index: int, x, y):
        """Around training's own pass on chunk ``index`` of step ``step`` (``x``, ``y``): yields the :class:`Trained`
        that :meth:`check` compares after it: the chunk as drawn (:meth:`drawn`) and, when it is due, the backend
        forms the chunk in one forward pass (layerwise) and the pass draws no random number, the model's outputs in
        its last call in training mode (the backend's own layout passes run in evaluation mode), the pass (what training released is compared, not a pass run again)."""
        held = Trained(*self.drawn(step, index, x, y), key=(step, index))
        if held.y is y or not gradient_check.batched_forward(self.trainer.grad_sampler):
            yield held
            return
        calls: list = []
        def called(module, args, out) -> None:  # (the backend's own layout passes run in evaluation mode: not kept)
            if module.training:
                calls.append(output_leaves(out))

        handle = self.trainer.model.register_forward_hook(called)
        before = randomness_state(self.trainer.device.type)
        try:
            yield held
        finally:
            handle.remove()
        if calls and same_randomness(before, randomness_state(self.trainer.device.type)) and \
                gradient_check.batched_forward(self.trainer.grad_sampler):
            held.outputs = calls[-1]  # (a pass the backend measured again runs the model again: the last is its own)
            self.hold(held)

    def order(self, step: int, index: int, size: int):
        """The secret permutation of chunk ``index`` of step ``step`` (``size`` examples) that its forward comparison
        sets every row against (:func:`dptrain.preflight.gradient_check.forward_check`)."""
        seed = int.from_bytes(self._hash(step, index)[-8:], "little") >> 1
        return torch.randperm(size, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu")

    def hold(self, trained: Trained) -> None:
        """Keep training's own pass on a chunk (:class:`Trained`, its ``key`` the chunk's) for the :meth:`check` of
        that chunk, which compares it (the check's signature stays that of a chunk alone)."""
        self._held = trained

    def _compared(self, x, y, rows: list[int], new: bool, secret: bool, tol, sampler,
                  order=None) -> tuple[list[int], list[str]]:
        """(rows that moved, parameters that disagree) of the chunk ``x``, ``y`` against each example alone and (every
        row) against the chunk permuted by ``order``: forward passes for a new batch size, forward and backward at a
        secret place."""
        trainer, moved, bad = self.trainer, [], []
        outputs = self.mixing and self.reference == "autograd"  # (mixing shows in the outputs, beside their own norm)
        if new or (secret and outputs):
            try:  # (the losses too, in float64 only: a well-fit example's loss is a cancellation that float32 rounds
                # by more than its tolerance; a model that cannot run in float64 has its loss compared at secret places)
                gradient_check.forward_check(trainer, x, y, rows, tol, "not_private", set(), sampler=sampler,
                                             order=order if self.mixing else None,
                                             losses=self.mixing and tol is gradient_check.EXACT)
            except ModelError:
                moved = rows
        if secret and not moved:
            grads, losses = sampler(*copied((x, y)))  # (the chunk as drawn stays for the examples alone)
            moved, bad = gradient_check.compare(
                trainer.model, sampler, trainer.loss_fn, x, y, grads, losses, rows, tol, mixing=self.mixing and not outputs,
                gradients=self.gradients, reference=self.reference, floor=tol.whole * trainer.clipping.sensitivity,
                params=trainer.params,
            )
        return moved, bad

    def _as_trained(self, x, y, rows: list[int], order, trained: dict | None = None) -> list[int]:
        """The rows that moved when the chunk's outputs (``trained``: those of training's own pass; None: a pass run
        now) are compared with each example's alone by forward passes in the training precision (its tolerance), every
        row against the chunk permuted by ``order``."""
        trainer = self.trainer
        tol = gradient_check.tolerance_of(trainer.grad_sampler, trainer.model)
        try:
            gradient_check.forward_check(trainer, x, y, rows, tol, "not_private", set(), order=order, trained=trained)
        except ModelError:
            return rows
        return []

    def _trained_gradients(self, x, y, rows: list[int], result) -> list[str]:
        """The parameters whose per-example gradient in training's own pass (``result``: the backend's gradients and
        losses) disagrees with the example's alone, on ``rows``, in the training precision (its tolerance): what was
        clipped and released, not a pass run again (a backward that computes otherwise in the checks' float64)."""
        trainer = self.trainer
        sampler = trainer.grad_sampler
        tol = gradient_check.tolerance_of(sampler, trainer.model)
        return gradient_check.compare(
            trainer.model, sampler, trainer.loss_fn, x, y, result[0], result[1], rows, tol, mixing=False,
            gradients=True, reference=self.reference, floor=tol.whole * trainer.clipping.sensitivity,
            params=trainer.params,
        )[1]

    def check(self, step: int, index: int, x, y) -> bool:
        """Compare chunk ``index`` of step ``step`` (inputs ``x``, labels ``y``, on the trainer's device) with each
        example alone if it is due: forward passes for a new batch size (mixing shows in the outputs), forward and
        backward at a secret place. SentinelError (the run marked not private) on a mismatch. Returns whether it
        compared (its float64 passes recast the parameters' ``.data``: a watch begun before is stale)."""
        # (the run's first chunk, the run's chunk size in the common case, is compared backward too: the probe
        # compares gradients on a few examples and at the chunk size forward passes only)
        held, self._held = self._held, None
        held = held if held is not None and held.key == (step, index) else Trained(x, y)
        trained = held.outputs  # (training's own pass on the chunk, where it drew no random number: hold)
        rows, new, secret = self.due(step, index, len(y), first=not self.compared_backward)
        if not rows:
            return False
        self.compared_backward = self.compared_backward or secret
        trainer = self.trainer
        model = trainer.model
        order = self.order(step, index, len(y))
        sampler = trainer.grad_sampler
        with exact.probing(model):
            try:  # in float64 where the model runs in it: rounding is then 1e-11, not a float32 cancellation's 1e-2
                inner = sampler.backend if isinstance(sampler, MixedPrecision) else None
                with exact.float64(model):
                    moved, bad = self._compared(exact.as_float64(x), exact.as_float64(y), rows, new, secret,
                                                gradient_check.EXACT, inner or sampler, order)
                as_trained = any(p.dtype != torch.float64 for p in trainer.params.values())
            except (RuntimeError, TypeError) as e:  # a model that cannot run in float64: its own precision
                if isinstance(e, DPTrainError):
                    raise
                moved, bad = self._compared(x, y, rows, new, secret, gradient_check.tolerance_of(sampler, model),
                                            sampler, order)
                as_trained = False  # (compared in the training precision just now)
            if self.mixing and not (moved or bad) and (as_trained or trained is not None):
                # and the outputs in the training precision, as training computed them (``trained``: training's own
                # pass): a model may compute otherwise in float64 (a path for float32 inputs only mixed the Poisson
                # remainder chunks unseen), or when run again (state kept in a global, used only on a new batch)
                moved = self._as_trained(x, y, rows, order, trained)
            if secret and self.gradients and held.result is not None and not (moved or bad):
                bad = self._trained_gradients(x, y, rows, held.result)
        self.checked += 1
        if moved or bad:
            what = ("an example's output or loss in its chunk differs from the example's alone (the model mixes "
                    "examples)" if moved else
                    f"the per-example gradient of parameter {bad[0]!r} differs from the example's alone")
            # (not the chunk's size: a Poisson batch's realized size is secret)
            self.stop(f"the sentinel stopped the run at step {step + 1}: {what}")
            raise SentinelError(
                f"{self.stopped}; nothing of that step was released and the run is not certified (earlier steps may "
                "have mixed examples unseen): remove the cross-example operation, or report the model"
            )
        if new:
            self.verified.add(len(y))
        return True


__all__ = ["RATE", "ROWS", "Sentinel", "SentinelError", "Trained"]
