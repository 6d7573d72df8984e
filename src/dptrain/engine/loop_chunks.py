"""The chunk as your own loop's body gets it, and what counts as the chunk's (:mod:`dptrain.engine.private_loop`).

The loop hands out every floating tensor of a chunk as a fresh leaf that requires grad (:func:`hand_out`), so that
whatever the body computes from the examples' values shows in autograd's graph: the model must be called on the
chunk's own tensors (:func:`same_examples`: one of them, a view, or a copy with the same values), and with nothing
else computed from them (:func:`derived_from`: a statistic of the batch passed beside it, ``model(x, ctx=x.mean(0))``,
mixes the examples whatever its shape); the losses must come from the model's outputs on it (:func:`reaches`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dptrain.engine.extra_terms import graph_leaves


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors of a model's arguments or outputs (a tensor, or tuples/lists/dicts/ModelOutputs holding some)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_of(v)]
    return []


def reaches(tensor: torch.Tensor, targets: list[torch.Tensor]) -> bool:
    """Whether ``tensor``'s autograd graph goes through one of ``targets`` (a walk of its graph from the top: the model's
    outputs are a few nodes below a loss)."""
    goal = {t.grad_fn for t in targets if t.grad_fn is not None}
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if fn in goal:
            return True
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return False


def hand_out(batch):
    """The chunk as handed to the loop body: every floating tensor a fresh leaf that requires grad (the same storage), so
    that whatever is computed from the examples' values is visible in autograd's graph (an ``extra`` term is checked
    against them). Returns (the chunk, its tensors, its floating tensors)."""
    handed, floats = [], []

    def hand(t):
        if not torch.is_tensor(t):
            return t
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t = t.detach().requires_grad_()
            floats.append(t)
        handed.append(t)
        return t

    def walk(v):
        if isinstance(v, Mapping):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, tuple | list):
            return (list if isinstance(v, list) else tuple)(walk(x) for x in v)
        return hand(v)

    return walk(batch), handed, floats


def same_examples(t: torch.Tensor, handed: list[torch.Tensor]) -> bool:
    """``t`` is a tensor of the chunk: one of them, a view of one (same storage), or a copy with the same values (a cast
    or a move to another device)."""
    for h in handed:
        if t is h or (t.device == h.device and t.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()):
            return True
    for h in handed:
        if t.shape == h.shape and torch.equal(t.detach(), h.detach().to(t.device, t.dtype)):
            return True
    return False


def derived_from(t: torch.Tensor, floats: list[torch.Tensor]) -> bool:
    """Whether ``t`` is computed, through autograd's graph, from one of the chunk's handed-out floating tensors."""
    return t.requires_grad and bool(graph_leaves(t) & {id(f) for f in floats})


def _reached(losses: torch.Tensor, weights: torch.Tensor, tensors: list[torch.Tensor], rows: list[int]) -> bool:
    """Whether the weighted sum of ``losses`` has a gradient that is not 0 in ``rows`` of one of ``tensors`` (a
    non-finite entry counts as 0: it is the release's NonFiniteError, not mixing)."""
    grads = torch.autograd.grad((losses * weights).sum(), tensors, retain_graph=True, allow_unused=True)
    found = [g[rows].nan_to_num(0.0, 0.0, 0.0).abs().sum(dtype=torch.float64) for g in grads if g is not None]
    return bool(found) and torch.stack(found).sum().item() != 0


def mixed_losses(losses: torch.Tensor, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 rows: list[int]) -> tuple[str, bool] | None:
    """The refusal of per-example losses that mix the chunk's examples in autograd's graph, and whether it was found
    at the sentinel's places (None: none is seen):
    the losses of examples 1.. must not depend on example 0's ``outputs`` (the model's: a loss over the batch, minus
    its mean, a softmax across examples), and, on the chunks the sentinel compares (``rows``: its secret rows), the
    losses of the other examples must not depend on the floating ``inputs`` the loop handed out at ``rows``, by any
    path: the model, or a second model called on the chunk (a teacher with BatchNorm in training mode, whose targets
    moved every example's gradient with each example's inputs: certified), or a statistic of the chunk. One backward
    pass through the graph, on those chunks only; like the sentinel's, a mismatch there labels the run not private
    (earlier chunks may have mixed unseen). Mixing that bypasses autograd (a detached batch statistic, integer
    inputs) cannot be seen here."""
    n = len(losses)
    if n < 2:
        return None
    outs = [o for o in outputs if o.dim() and o.shape[0] == n]
    others = torch.ones(n, dtype=losses.dtype, device=losses.device)
    others[0] = 0
    if outs and _reached(losses, others, outs, [0]):
        return ("the losses mix examples: one example's outputs move the loss of others (a loss over the batch, such "
                "as minus its mean); loop.backward takes one loss per example, each from its own example's outputs",
                False)
    inputs = [t for t in inputs if t.dim() and t.shape[0] == n]
    others = torch.ones(n, dtype=losses.dtype, device=losses.device)
    others[rows] = 0
    if rows and inputs and others.any() and _reached(losses, others, inputs, rows):
        return ("the losses mix examples: one example's inputs move the loss of others (through the model, a second "
                "model called on the chunk, such as a teacher with BatchNorm in training mode, or a statistic of the "
                "chunk); loop.backward takes one loss per example, each computed from its own example alone (a "
                "teacher in evaluation mode: teacher.eval())", True)
    return None


def uncovered(names: list[str]) -> str:
    """The refusal of losses whose gradient reaches the parameters ``names`` outside the model's recorded forward pass
    on the chunk (your loop cannot change its backend: the automatic backend's way out is not one)."""
    return (
        f"the losses use parameter {names[0]!r} outside the model's forward pass on the chunk (a term of the weights "
        "added to each loss, a gradient penalty's double backward, a layer called on its own), where no per-example "
        "gradient is recorded; compute the losses from the model's outputs on the chunk only, and pass a term of the "
        "parameters alone as loop.backward(losses, extra=fn)"
    )


__all__ = ["derived_from", "hand_out", "mixed_losses", "reaches", "same_examples", "tensors_of", "uncovered"]
