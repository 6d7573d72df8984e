"""What your own loop's optimizer step may apply: the gradient the release wrote, or that gradient post-processed in
place by a rule of its own values (:mod:`dptrain.engine.private_loop`).

Between ``loop.backward`` on a logical batch's last chunk and ``optimizer.step()`` your code holds the released
gradient in every parameter's ``.grad``. Post-processing it is free (``clip_grad_norm_`` scales it, ``clip_grad_value_``
clamps it), but an in-place write of anything else is not: ``p.grad.add_(g)`` with ``g`` the gradient of a loss on
private examples (``torch.autograd.grad``, which accumulates nothing and so passes the loop's other checks) put an
unclipped, unnoised gradient into the step of a certified run. So the loop keeps the released values (:func:`kept`)
and, before the step applies them, accepts a changed gradient only where it is the released one clamped to a symmetric
range and scaled by one non-negative factor, parameter by parameter (:func:`changed`); anything else is refused with
nothing applied. A term of the parameters alone (a weight decay added by hand) belongs in
``loop.backward(losses, extra=fn)``, which checks that it reads no example.

Not seen: a factor or a clamp computed from private data (one number per parameter and step, released unaccounted).
"""

from __future__ import annotations

import torch

from dptrain.engine.trainer import FROZEN_REFUSAL


def kept(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of the released gradients (by parameter name), to compare with the ``.grad`` the step applies."""
    return {n: g.detach().clone() for n, g in grads.items()}


def _clipped(before: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether ``now`` is ``before`` clamped to a symmetric range [-c, c] (``clip_grad_value_``; c may exceed every
    entry), then scaled by one non-negative factor s (``clip_grad_norm_``), within the rounding of one product per entry:
    the entries below the largest magnitude m are s times theirs, those at m have their sign and s |before| >= m."""
    if not now.is_floating_point() or not bool(now.isfinite().all()):
        return False
    b, n = before.detach().double().flatten(), now.detach().double().flatten()
    m = float(n.abs().max()) if n.numel() else 0.0
    if m == 0.0:
        return True  # (zeroed: nothing applied)
    eps = 8 * torch.finfo(now.dtype).eps
    top = n.abs() >= m * (1 - eps)
    inner = ~top
    if not bool((torch.sign(n[top]) == torch.sign(b[top])).all()):
        return False
    bb = float((b[inner] ** 2).sum())
    if bb == 0.0:  # (no entry below m with a value: any large enough factor gives the entries at m)
        return not bool(n[inner].any())
    s = float((n[inner] * b[inner]).sum()) / bb
    return (s >= 0 and bool(((n[inner] - s * b[inner]).abs() <= eps * (s * b[inner]).abs() + 1e-300).all())
            and bool((s * b[top].abs() >= m * (1 - 2 * eps)).all()))


def changed(before: dict[str, torch.Tensor], params: dict[str, torch.Tensor]) -> list[str]:
    """The parameters whose ``.grad`` holds more than the released gradient ``before`` post-processed in place (a
    scaling or a clamp): a write the step must not apply."""
    out = []
    for n, b in before.items():
        g = params[n].grad
        if g is None or torch.equal(g, b):
            continue
        if g.shape != b.shape or not _clipped(b, g):
            out.append(n)
    return out


def unapplied(trainer, written: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> str | None:
    """The refusal of an optimizer step that would apply more than the release (None: it applies the release, maybe
    clipped): a privatized parameter frozen since (the release's noise would move it), a trainable parameter the loop
    does not privatize (added to the model or the optimizer after the loop was made, whatever gave it a gradient:
    ``torch.autograd.backward(..., inputs=[p])``, a hand-written ``.grad``), a ``.grad`` that is not the tensor the
    release ``written`` or holds more than its ``values`` clipped (:func:`changed`)."""
    frozen = trainer.frozen_parameters()
    if frozen:
        return FROZEN_REFUSAL.format(names=", ".join(frozen[:3]))
    foreign = trainer.unprivatized_parameters()
    if foreign:
        return (
            f"the optimizer would step parameters the loop does not privatize ({', '.join(foreign[:3])}): every "
            "trainable parameter must be one whose per-example gradients the loop clips and noises (a parameter "
            "added after make_private_loop is not: make the loop again, or freeze it with requires_grad_(False))"
        )
    replaced = [n for n, p in trainer.params.items() if p.grad is not None and p.grad is not written.get(n)]
    replaced = replaced or changed(values, trainer.params)
    if replaced:
        return (
            f"the gradient of {', '.join(replaced[:3])} is not the one loop.backward released (p.grad was replaced or "
            "written after the release): clip it in place (clip_grad_norm_, clip_grad_value_) or leave it; a term of "
            "the parameters goes to loop.backward(losses, extra=fn)"
        )
    return None


__all__ = ["changed", "kept", "unapplied"]
