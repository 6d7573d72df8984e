"""Your own loop changes the model only in its optimizer step: the state watch between the points a loop checks.

A loop's body is your code, and the examples are in its hands: a second update path (the gradient of a mean loss
from ``torch.autograd.grad`` applied by hand, a second optimizer, a write to ``p.data``) trains the model without
clipping or noise, and a statistic kept on the model (a tensor attribute, a buffer) is released with it. The loop
watches every slot of the model's state (:class:`dptrain.preflight.buffers.BufferWatch`: buffers, parameters, the tensors
the modules' attributes hold) from one point it checks to the next: the chunk's hand-out, its ``loop.backward``, the
optimizer step's entry and exit, the end of the loop body. Only the optimizer step (with its step hooks: a projection
or weight constraint goes in ``optimizer.register_step_post_hook``) and the model's own passes on a chunk (the
sentinel's to check: :mod:`dptrain.preflight.sentinel`) lie between two checks. Not seen: values kept outside the
model (a global, a closure, a Python number or flag set on a module between steps, which frameworks such as
accelerate do), and the model after the loop's last body.
"""

from __future__ import annotations

from dptrain.preflight.buffers import BufferWatch, state_slots


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


__all__ = ["changed_outside_step"]
