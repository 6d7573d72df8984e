"""A ``torch.amp.GradScaler`` stepping a private loop's optimizer is refused (:class:`dptrain.engine.private_loop`).

The scaler multiplies the loss by S before ``loop.backward``: each example's gradient is then clipped at
``max_grad_norm`` in the scaled units, and after ``unscale_`` the clip norm and the noise are both S times smaller than
asked (still private, but not the run configured, and nothing says so). The loop cannot tell a scaled loss from any
other per-example loss; it can tell that its optimizer step was called by a scaler's ``step``, which every use of one
goes through. A private loop needs no scaler: per-example gradients are clipped in float32 (docs/training_loop.md).
"""

from __future__ import annotations

import sys

#: The modules of torch's gradient scalers (their ``step`` calls ``optimizer.step()``).
SCALER_MODULES = ("torch.amp.grad_scaler", "torch.cuda.amp.grad_scaler", "torch.cpu.amp.grad_scaler")
#: The refusal's message.
REFUSAL = (
    "torch.amp.GradScaler is not for a private loop: the loss it scales by S is clipped at max_grad_norm in scaled "
    "units, so the clip norm and the noise would be S times smaller than asked; call optimizer.step() without a "
    "scaler (bfloat16 autocast, or float16 without one: per-example gradients are clipped in float32)"
)


def called_by_grad_scaler(depth: int = 8) -> bool:
    """Whether one of the ``depth`` callers of the caller is a torch GradScaler's code (its ``step``, through an LR
    scheduler's or a profiler's wrapper of ``optimizer.step``)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith(SCALER_MODULES):
            return True
    return False


__all__ = ["REFUSAL", "called_by_grad_scaler"]
