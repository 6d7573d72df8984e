"""Per-example gradients of one module without a layerwise rule (attention, a custom layer, peft's DoRA magnitude):
torch.func over that module alone, from the inputs and output gradients the layerwise backend recorded (or, for a
module using a custom autograd.Function torch.func cannot transform, autograd example by example on that module alone).

vmap runs over the examples of grad of <m(inputs_i), output gradient_i>, each example's inputs being its rows of every
tensor the module receives (positional, keyword, inside tuples: every leaf), as the layout measurement of
:mod:`dptrain.stages.batch_layout` found them: ``rows`` (k rows per example: [B, ...] gives each example [1, ...],
Swin's [B * windows, N, C] gives it its windows) or ``shared`` (passed whole to every example). The per-example outputs
are checked against the recorded batch outputs: a mismatch is a :class:`FallbackError` (the whole model then goes to
torch.func), never a wrong gradient. An output computed once for the whole batch whose gradient reaches the loss holds
every example's gradient summed: that is a FallbackError too.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptrain.errors import ModelError, one_line
from dptrain.stages.batch_layout import ROWS, SHARED, CallLayout, rows_per_example, tensors, view_rows
from dptrain.stages.dropout_replay import Replayer, ReplayError, Shared
from dptrain.stages.precision import LOW, upcast
from dptrain.stages.recurrent import RecurrentError, recurrent_gradients


class FallbackError(ModelError):
    """A module without a layerwise rule could not be differentiated per example on its own."""


def call_with(module: nn.Module, named: dict[str, torch.Tensor], args: tuple = (), kwargs: dict | None = None):
    """``functional_call(module, named, args, kwargs)`` with each slot of the module's state swapped exactly once.

    ``named`` holds tensors by one of their names (``named_parameters()`` and ``named_buffers()``: tied ones once);
    every slot holding the same tensor gets the same replacement (GPT-2's ``lm_head.weight``, the token embedding's),
    as with ``tie_weights=True``, but a submodule registered in several places (one module shared by several layers:
    peft's RandLoRA and VeRA bases, Lily's experts, a bank of weights) is one slot, not one per path to it. torch's
    tying swaps such a slot once per path and puts it back once per path, so the slot kept a tensor of the transform
    (not the model's Parameter or buffer): the model then read a copy the optimizer never updated, and dptrain's watch
    of the model's state refused it for writing its buffers."""
    slots: dict[int, list[str]] = {}
    for prefix, m in module.named_modules():  # (each module once, whatever the number of paths to it)
        for local, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                slots.setdefault(id(t), []).append(f"{prefix}.{local}" if prefix else local)
    swap = {}
    for name, replacement in named.items():
        owner, _, local = name.rpartition(".")
        m = module.get_submodule(owner)
        t = m._parameters[local] if local in m._parameters else m._buffers[local]
        for slot in slots.get(id(t), [name]):
            swap[slot] = replacement
    return functional_call(module, swap, tuple(args), kwargs or {}, tie_weights=False)


def separated(output, copy: bool = False):
    """``output`` with each tensor that requires grad replaced by a view of it (same values, a node of its own), and
    the list of its tensors: the gradient that reaches each returned tensor is then what the module's consumers send
    it, not also what flows back into it from another output computed from it inside the module (Mixtral's router
    returns its logits and the top-k weights computed from them: the weights' gradient would be counted twice). None
    for the list when the output is a container this cannot rebuild. ``copy``: copies instead of views (for a
    consumer that modifies them in place)."""

    def view(t):
        if type(t) in (tuple, list):  # (nested: an LSTM's (output, (h_n, c_n)))
            return type(t)(view(o) for o in t)
        if not (torch.is_tensor(t) and t.requires_grad):
            return t
        return t.clone() if copy else t.view_as(t)

    if torch.is_tensor(output):
        output = view(output)
    elif type(output) in (tuple, list):
        output = view(output)
    elif type(output) is dict:
        output = {k: view(v) for k, v in output.items()}
    elif isinstance(output, dict) and dataclasses.is_dataclass(output):  # (transformers' ModelOutput)
        output = type(output)(**{k: view(v) for k, v in output.items()})
    elif sum(t.requires_grad for t in tensors(output)) > 1:
        return output, None
    return output, tensors(output)


def _reproduces(o: torch.Tensor, r: torch.Tensor) -> bool:
    """Whether a module's output recomputed example by example (``o``) reproduces its batch output ``r``: to float
    rounding element by element, or for a low-precision output (autocast) to bfloat16's rounding of each example's
    row as a whole (an element that is a cancellation of larger terms rounds by more than its own size)."""
    if o.shape != r.shape:
        return False
    if r.dtype in LOW or o.dtype in LOW:
        rows = r.detach().double().flatten(1) if r.dim() > 1 else r.detach().double()[:, None]
        diff = (o.double().reshape(rows.shape) - rows).norm(dim=1)
        return bool((diff <= 3e-2 * rows.norm(dim=1) + 1e-6).all())
    return torch.allclose(o, r.detach(), rtol=1e-4, atol=1e-6)


def _by_size(leaves: list, recorded: list) -> CallLayout:
    """The layout a caller without a measured one gets: tensors whose first dimension is the outputs' are rows."""
    b = int(recorded[0].shape[0]) if recorded and recorded[0].dim() else 0

    def kind(t):
        return "-" if not torch.is_tensor(t) else ROWS if t.dim() and t.shape[0] == b else SHARED

    return CallLayout(tuple(kind(t) for t in leaves), tuple(ROWS for _ in recorded))


def _one_example(leaves: list, recorded: list) -> CallLayout:
    """A chunk of one example: everything the module sees is that example's."""

    def kind(t):
        return "-" if not torch.is_tensor(t) else ROWS if t.dim() else SHARED

    return CallLayout(tuple(kind(t) for t in leaves), tuple(kind(o) for o in recorded))


#: What torch.func says of a custom ``torch.autograd.Function`` it cannot transform (no ``setup_context``: peft's
#: LoHa weight, RandLoRA's bases, C3A's circulant convolution). Such a module, and one vmap fails on for another
#: reason (SHiRA's sparse weights), is differentiated example by example with autograd instead (:func:`_looped`), on
#: its own, as exact and only slower for that module; not one that draws random numbers vmap refused (:data:`RANDOM`:
#: the loop would draw new ones), which goes to the whole model.
CUSTOM_FUNCTION = "autograd.Function with functorch transforms"
RANDOM = "random operation"


def _looped(inner, params: dict, batch: int, inputs: list, out_grads: list, index, drops: list):
    """What ``vmap(grad(inner, has_aux=True))`` returns, by a loop over the examples with autograd: example i's rows of
    every split input, output gradient and dropout mask, ``inner``'s loss differentiated by ``torch.autograd.grad``."""
    grads: dict[str, list] = {n: [] for n in params}
    outs: list[list] = []
    for i in range(batch):
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        with torch.enable_grad():
            loss, picked = inner(leaves, [t[i] for t in inputs], [g[i] for g in out_grads],
                                 None if index is None else index[i], [d[i] for d in drops])
            found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        for (n, p), g in zip(leaves.items(), found, strict=True):
            grads[n].append(torch.zeros_like(p) if g is None else g)
        outs.append(picked)
    return {n: torch.stack(gs) for n, gs in grads.items()}, [torch.stack(o) for o in zip(*outs, strict=True)]


def per_module_gradients(
    m: nn.Module, args: tuple, kwargs: dict, gos: list, recorded: list, layout: CallLayout | None = None,
    batch: int | None = None, masks: list | None = None,
) -> dict[str, torch.Tensor]:
    """Per-example gradients [B, ...] of every trainable parameter of ``m`` (and its submodules) for one recorded call
    ``m(*args, **kwargs)`` -> ``recorded`` (its output tensors), ``gos`` their gradients (None: the output does not
    reach the loss), laid out as ``layout`` says for a chunk of ``batch`` examples (None: tensors whose first
    dimension is the outputs' are split by example, the others passed whole). ``masks``: the masks of the dropouts
    the call drew, in order, and its random factories' draws (:class:`dptrain.stages.dropout_replay.Shared`),
    replayed example by example."""
    if isinstance(m, nn.RNNBase):  # (torch.func cannot: the recurrence run again by kind)
        try:
            return recurrent_gradients(m, args, kwargs, gos, recorded, batch or len(recorded[0]))
        except (RecurrentError, RuntimeError, ValueError) as e:
            raise FallbackError(f"per-example gradients of {type(m).__name__}: {one_line(e, 160)}") from None
    params = {n: p.detach() for n, p in m.named_parameters() if p.requires_grad}
    buffers = dict(m.named_buffers())
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    if batch == 1:
        layout = _one_example(leaves, recorded)
    elif layout is None:
        layout = _by_size(leaves, recorded)
        batch = int(recorded[0].shape[0]) if recorded and recorded[0].dim() else 0
    if len(layout.inputs) != len(leaves) or len(layout.outputs) != len(recorded) or not layout.consistent:
        first = (" (batch_first=False: examples along dimension 1; build it with batch_first=True for the layerwise "
                 "backend and your own loop)") if getattr(m, "batch_first", None) is False else ""
        raise FallbackError(f"{type(m).__name__}: its inputs are not laid out by example{first} (see "
                            "dptrain.stages.batch_layout)")
    whole = [j for j, k in enumerate(layout.outputs) if k == SHARED and gos[j] is not None]
    if whole and batch != 1:
        raise FallbackError(
            f"{type(m).__name__} returns a tensor computed once for the whole batch whose gradient reaches the loss: "
            "it holds every example's gradient summed"
        )
    split = [i for i, k in enumerate(layout.inputs) if k == ROWS]
    rows = [j for j, k in enumerate(layout.outputs) if k == ROWS]
    if any(rows_per_example(leaves[i], batch) is None for i in split) or any(
        rows_per_example(recorded[j], batch) is None for j in rows
    ):
        raise FallbackError(f"{type(m).__name__}: a tensor's rows are not a multiple of the chunk's examples")
    draws = [k for k in masks or [] if isinstance(k, Shared)]  # (whole, to every example)
    masks = [k for k in masks or [] if not isinstance(k, Shared)]
    if masks and (not split or any(rows_per_example(k, batch) is None for k in masks)):
        raise FallbackError(f"{type(m).__name__} draws dropout masks that are not laid out by example")
    inputs = [view_rows(leaves[i], batch) for i in split]
    drops = [view_rows(k, batch) for k in masks]
    out_grads = [view_rows(torch.zeros_like(recorded[j]) if gos[j] is None else gos[j], batch) for j in rows]
    # A module whose output is laid out by example but none of whose inputs is (Perceiver's latents expanded to the
    # batch size it is given, a learned query repeated to the batch): it is called on the same inputs for each example,
    # which gives the whole batch's output, and example i's gradient is that of example i's rows of it.
    expanding = bool(rows) and not split
    index = torch.arange(batch if expanding else 0, device=next((t.device for t in recorded), None))

    def per_example(leaves, inputs, out_grads, gos, loop: bool = False):
        def inner(params, tensors_i, gos_i, i, drops_i):
            full = list(leaves)
            for k, t in zip(split, tensors_i, strict=True):
                full[k] = t
            a, kw = tree_unflatten(full, spec)
            with Replayer(drops_i, draws) as replay:  # (the batch's dropout masks, this example's rows; its draws)
                outs = tensors(call_with(m, {**params, **buffers}, tuple(a), kw))
            if replay.used != len(drops_i) or replay.replayed != len(draws):
                raise ReplayError(f"{replay.used} dropouts and {replay.replayed} draws example by example, "
                                  f"{len(drops_i)} and {len(draws)} for the batch")
            if len(outs) != len(recorded):
                raise ValueError(f"{len(outs)} output tensors example by example, {len(recorded)} for the batch")
            picked = [view_rows(outs[j], batch).index_select(0, i.reshape(1))[0] if expanding else outs[j]
                      for j in rows]
            loss = sum((o * g).sum() for o, g in zip(picked, gos_i, strict=True))
            loss = loss + sum((outs[j] * gos[j]).sum() for j in whole)
            return loss, [o.detach() for o in picked]

        if loop:  # (example by example with autograd: a custom autograd.Function torch.func cannot transform)
            return _looped(inner, params, batch, inputs, out_grads, index if expanding else None, drops)
        with warnings.catch_warnings():  # torch.func has no batching rule for some fused kernels (CPU attention)
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            return vmap(grad(inner, has_aux=True), in_dims=(None, 0, 0, 0 if expanding else None, 0),
                        randomness="error")(params, inputs, out_grads, index if expanding else None, drops)

    try:
        try:
            grads, outs = per_example(leaves, inputs, out_grads, gos)
        except (RuntimeError, ValueError, TypeError) as e:
            device = next((t.device.type for t in tensors(leaves)), "cpu")
            if RANDOM in str(e):  # (a random operation not replayed: the whole model's)
                raise
            if CUSTOM_FUNCTION in str(e) or not torch.is_autocast_enabled(device):
                grads, outs = per_example(leaves, inputs, out_grads, gos, loop=True)
            else:
                # Under autocast, torch.func fails on some chains of layers (vmap of grad of a Linear feeding a
                # LayerNorm, BERT's masked-LM head: "expected scalar type BFloat16 but found Float"): the module is
                # differentiated in float32 from its recorded bfloat16 inputs and output gradients instead (as the
                # layer rules form theirs), its outputs checked against the batch's within bfloat16's rounding below.
                with torch.autocast(device, enabled=False):
                    grads, outs = per_example([upcast(t) for t in leaves], [upcast(t) for t in inputs],
                                              [upcast(g) for g in out_grads], [upcast(g) for g in gos])
    except (RuntimeError, ValueError, TypeError) as e:
        raise FallbackError(
            f"per-example gradients of {type(m).__name__} through torch.func failed ({' '.join(str(e).split())[:200]})"
        ) from None
    expected = [view_rows(recorded[j], batch) for j in rows]
    if len(outs) != len(expected) or not all(_reproduces(o, r) for o, r in zip(outs, expected, strict=True)):
        raise FallbackError(
            f"{type(m).__name__} computed example by example does not reproduce its batch output (an argument was split "
            "or shared wrongly)"
        )
    return grads


__all__ = ["FallbackError", "call_with", "per_module_gradients", "separated", "tensors"]
