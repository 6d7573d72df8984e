"""Your own loop changes the model only in its optimizer step: the state watch between the points a loop checks.

A loop's body is your code, and the examples are in its hands: a second update path (the gradient of a mean loss
from ``torch.autograd.grad`` applied by hand, a second optimizer, a write to ``p.data``) trains the model without
clipping or noise, and a statistic kept on the model (a tensor attribute, a buffer) is released with it. The loop
watches every slot of the model's state (:class:`dptrain.preflight.buffers.BufferWatch`: buffers, parameters, the tensors
the modules' attributes hold) from one point it checks to the next: the chunk's hand-out, its ``loop.backward``, the
optimizer step's entry and exit, the end of the loop body. Only the optimizer step (with its step hooks: a projection
or weight constraint goes in ``optimizer.register_step_post_hook``) and the model's own passes on a chunk (the
sentinel's to check: :mod:`dptrain.preflight.sentinel`) lie between two checks. The optimizer's state (momentum
buffers, Adam's moments, step counts: what its step applies besides the release) changes only in its step too: it is
read as the last step left it (:class:`OptimizerWatch`) and checked when the next step is about to apply it (a
momentum buffer written from the examples by hand was applied by the next step, unclipped and unnoised, in a
certified run). Not seen: values kept outside the model (a global, a closure, a Python number or
flag set on a module between steps, which frameworks such as accelerate do), the optimizer's hyperparameters
(``param_groups``: an LR scheduler sets them, from the step count or from anything else), and the model after the
loop's last body.
"""

from __future__ import annotations

import torch

from dptrain.preflight.buffers import BufferWatch, same_record, state_slots, value_record


class OptimizerWatch:
    """The optimizer's state at one point: every entry of ``optimizer.state`` (per parameter: a momentum buffer, Adam's
    moments and step) by the fingerprint the model watch keeps of a module's attribute
    (:func:`~dptrain.preflight.buffers.value_record`: a tensor by its object, version counter, storage and checksum, so a
    write through ``.data`` too; a number by its value; a list of tensors item by item). :meth:`written` names the
    entries changed, added or removed since (``<parameter name>.<key>``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        self.optimizer = optimizer
        self.names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.records = self._now()

    def _now(self) -> dict[str, tuple]:
        out = {}
        for g, group in enumerate(self.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = self.names.get(id(p), f"param_groups[{g}][{i}]")
                for key, value in self.optimizer.state.get(p, {}).items():
                    out[f"{name}.{key}"] = value_record(value)
        return out

    def written(self) -> list[str]:
        now = self._now()
        return sorted(n for n in set(now) | set(self.records) if n not in now or n not in self.records
                      or not same_record(self.records[n], now[n]))


def changed_optimizer_state(trainer, watch: OptimizerWatch) -> str | None:
    """The refusal's message when the optimizer's state changed since ``watch`` (None: unchanged). A change labels the
    run NOT private whatever follows: the written state stays in the optimizer, and its next step applies it."""
    names = watch.written()
    if not names:
        return None
    trainer.not_private_buffers[:] = sorted({*trainer.not_private_buffers, *(f"optimizer.state {n}" for n in names)})
    trainer.ledger.private = trainer.private
    return (
        f"the optimizer's state ({names[0]!r}) changed outside the loop's optimizer step (by your code: a momentum "
        "buffer or moment written by hand, another optimizer's state loaded), so the run is labelled NOT private: its "
        "next step would apply it unclipped and unnoised; change it only in optimizer.step() (a checkpoint: "
        "loop.load_state_dict)"
    )


def changed_outside_step(trainer, watch: BufferWatch, parameters_only: bool = False) -> str | None:
    """The refusal's message when the model's state changed since ``watch`` (None: unchanged, or only buffers and
    attributes under ``buffer_updates="not_private"``). A change labels the run NOT private whatever follows (what
    was written from the examples may already have been used or saved). ``parameters_only``: between a chunk's
    hand-out and its backward, where the model's own forward pass runs (its buffers are the sentinel's)."""
    names = [n for n in watch.written(tensors_only=True) if not parameters_only or watch.kind(n) == "parameter"]
    now = state_slots(trainer.model)
    # (a trainable parameter added since is refused at the step with nothing applied: PrivateLoop._check_stepped)
    names = [n for n in names if n in watch.slots or not getattr(now.get(n, (None,) * 4)[3], "requires_grad", False)]
    if not names:
        return None
    trainer.not_private_buffers[:] = sorted({*trainer.not_private_buffers, *names})
    trainer.ledger.private = trainer.private
    params = [n for n in names if watch.kind(n) == "parameter"]
    if not params and trainer.sentinel.buffer_updates == "not_private":
        return None
    what = f"parameter {params[0]!r}" if params else f"{watch.kind(names[0])} {names[0]!r}"
    return (
        f"the model's {what} changed outside the loop's optimizer step (by your code: a second optimizer, a write to "
        "p.data, a statistic kept on the model), so the run is labelled NOT private; change the model only in "
        "optimizer.step() (a projection or weight constraint: optimizer.register_step_post_hook)"
    )


__all__ = ["OptimizerWatch", "changed_optimizer_state", "changed_outside_step"]
