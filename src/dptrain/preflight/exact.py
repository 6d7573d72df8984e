"""The conditions under which per-example gradients are compared: training mode with dropout off, and float64.

A check of per-example gradients against single-example passes must see the function training computes, and must
tell rounding from error:

- **training mode, dropout off.** Hugging Face models turn gradient checkpointing off in evaluation mode, and a model
  may take other paths only in training; so the comparison runs in training mode, with every dropout made the
  identity (:func:`dropout_off`: dropout modules and dropout rates of the model at 0, and a torch function mode that
  passes the input of ``F.dropout`` and its variants through and sets ``scaled_dot_product_attention``'s
  ``dropout_p`` to 0, whoever calls them). Dropout's masks depend on the batch, so a batch and a single example could
  not be compared with it on; with it off both compute the same function.
- **float64** (:func:`float64`). In float32 a batched and a single-example pass round differently: on parameters whose
  gradient is a cancellation (the attention keys of a random model) the two differ by up to 4e-3 of that parameter's
  gradient, as much as a wrong rule. In float64 they differ by about 1e-11, so a tolerance of 1e-6 of each parameter's
  own gradient tells a rule that is 1e-3 off from rounding. The model's parameters and floating buffers are cast in
  place for the check (the same objects: hooks, tied weights and the optimizer see them) and restored exactly after.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from dptrain.preflight.buffers import restored
from dptrain.stages.dropout_replay import DROPOUTS
from dptrain.stages.dropout_replay import SDPA as _SDPA

# DROPOUTS: the functions whose randomness is dropout (their first argument passes through when it is off).
_SDPA_DROPOUT = 4  # (its position among scaled_dot_product_attention's arguments)


class _NoDropout(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func in _SDPA:
            if len(args) > _SDPA_DROPOUT:
                args = (*args[:_SDPA_DROPOUT], 0.0, *args[_SDPA_DROPOUT + 1 :])
            elif "dropout_p" in kwargs:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


@contextlib.contextmanager
def dropout_off(model: nn.Module):
    """Every dropout of the model is the identity inside: its dropout modules' ``p`` and its modules' float
    attributes named like a dropout rate (``dropout``, ``attention_dropout``, ``dropout_prob``: the rates Hugging Face
    models pass to ``F.dropout`` and attention) set to 0, and any other call of a dropout function passed through (a
    torch function mode). The attributes hold in a backward pass too, which recomputes a checkpointed forward; the
    mode holds in the forward pass only (torch function modes do not reach the backward pass)."""
    saved = []
    for m in model.modules():
        for name, value in vars(m).items():
            if isinstance(value, float) and not isinstance(value, bool) and "drop" in name.lower() and 0 < value < 1:
                saved.append((m, name, value))
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
    try:
        for m, name, _ in saved:
            setattr(m, name, 0.0)
        with _NoDropout():
            yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)


@contextlib.contextmanager
def training_mode(model: nn.Module):
    """The model in training mode inside (each module's own flag restored after: a submodule the user set to
    evaluation stays so, as in a training step)."""
    flags = [(m, m.training) for m in model.modules()]
    was = model.training
    if not was:
        model.train()
    try:
        yield
    finally:
        if not was:
            for m, flag in flags:
                m.training = flag


@contextlib.contextmanager
def probing(model: nn.Module):
    """A comparison's conditions: training mode, dropout off; torch's generators and every buffer as they were
    after (a check leaves no trace of the examples it read)."""
    devices = sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)
    with restored(model), training_mode(model), dropout_off(model), torch.random.fork_rng(devices=devices):
        yield


def _floating(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point()


@contextlib.contextmanager
def float64(model: nn.Module):
    """The model's floating parameters and buffers as float64 inside (in place: the same tensor objects), restored to
    their own storage after."""
    saved, seen = [], set()
    tensors = [*model.parameters(), *model.buffers()]
    try:
        for t in tensors:
            if id(t) in seen or not _floating(t) or t.dtype == torch.float64:
                continue
            seen.add(id(t))
            data = t.data
            saved.append((t, data))
            t.data = data.to(torch.float64)
        yield torch.float64
    finally:
        for t, data in saved:
            t.data = data


def as_float64(batch):
    """A batch's floating tensors as float64 (token ids, masks of integers and labels as they are)."""
    return tree_map(lambda t: t.to(torch.float64) if _floating(t) else t, batch)


__all__ = ["DROPOUTS", "as_float64", "dropout_off", "float64", "probing", "training_mode"]
