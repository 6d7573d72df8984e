"""Buffers are part of the released model: a buffer written from a private batch is a release.

DP-SGD's guarantee covers the noisy gradients and what is computed from them. A module whose training-mode forward
writes a statistic of its batch into a buffer (BatchNorm's running mean, a user's running average, an example
count) puts that statistic, unnoised, into ``model.state_dict()`` and ``model.pt``; a buffer that later forwards read
also makes one example's gradient depend on other examples. BatchNorm is refused by type
(:func:`dptrain.models.builders.check_private_compatible`), but any module can do this, so before training
:func:`batch_dependent_buffers` runs the model itself: training-mode forwards on a batch of real training examples, on
the same batch with one example replaced and on the batch less one example, each from the same starting state. A
buffer whose value after the forward differs between them (it depends on the batch's values or on its size) is
written from private data; the model is refused naming it (:func:`check_buffers`), unless the user explicitly opts
out (``buffer_updates="not_private"``), which labels the whole run not private.

A buffer that a forward changes the same way whatever the batch (a step counter, a cache computed from shapes) holds
no private data and is allowed. Every probe restores the buffers exactly as they were: the check leaves no trace of
the examples it read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch import nn

from dptrain.errors import ConfigError, ModelError

#: What a run does with buffers written from private batches: refuse the model (default), or train and label the run
#: not private (the buffers are released unnoised).
BUFFER_UPDATES = ("refuse", "not_private")


def check_buffer_updates(value: str, key: str = "buffer_updates") -> str:
    if value not in BUFFER_UPDATES:
        raise ConfigError(f"{key} must be one of {', '.join(BUFFER_UPDATES)}, got {value!r}")
    return value


def _buffers(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor | None]]:
    """Full name -> (owning module, local name, tensor) of every buffer slot (persistent or not)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, t in module._buffers.items():
            out[f"{prefix}.{local}" if prefix else local] = (module, local, t)
    return out


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Full name -> (the buffer tensor itself, a copy of its value): what :func:`restore` puts back."""
    return {
        name: (t, None if t is None else t.detach().clone()) for name, (_, _, t) in _buffers(model).items()
    }


def restore(model: nn.Module, saved: dict) -> None:
    """Every buffer slot as in ``saved``: the same tensor objects with their saved values; slots added since removed."""
    current = _buffers(model)
    for name, (module, local, _) in current.items():
        if name not in saved:
            del module._buffers[local]
    for name, (tensor, value) in saved.items():
        module, local, _ = current.get(name) or _slot(model, name)
        if tensor is not None:
            with torch.no_grad():
                if tensor.shape != value.shape or tensor.dtype != value.dtype:
                    tensor.set_(value.clone())
                else:
                    tensor.copy_(value)
        module._buffers[local] = tensor


def _slot(model: nn.Module, name: str) -> tuple[nn.Module, str, None]:
    prefix, _, local = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), local, None


@contextlib.contextmanager
def restored(model: nn.Module):
    """Run a block and put every buffer back as it was before it (a probe leaves no trace)."""
    saved = snapshot(model)
    try:
        yield
    finally:
        restore(model, saved)


def _state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: (None if t is None else t.detach().clone()) for name, (_, _, t) in _buffers(model).items()}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal slots: both empty, or tensors of one shape and dtype with equal values (NaN equal to NaN)."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def batch_dependent_buffers(model: nn.Module, forwards: Iterable[Callable[[], object]]) -> list[str]:
    """Names of the buffers whose state after a forward depends on which forward ran: each of ``forwards`` (e.g. a
    training-mode forward on different batches) runs from the same starting state, which is restored after each."""
    saved = snapshot(model)
    states = []
    try:
        for forward in forwards:
            with torch.no_grad():
                forward()
            states.append(_state(model))
            restore(model, saved)
    finally:
        restore(model, saved)
    names = sorted({n for s in states for n in s})
    return [n for n in names if any(not _same(s.get(n), states[0].get(n)) for s in states[1:])]


def check_buffers(names: list[str], buffer_updates: str) -> list[str]:
    """Refuse (ModelError naming the first buffer) when ``names`` (buffers written from the batch) is not empty,
    unless ``buffer_updates == "not_private"``: then return them, for the run to label itself not private."""
    if names and buffer_updates != "not_private":
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ModelError(
            f"model buffer {names[0]!r}{more} is written from the training batch by a training-mode forward (a running "
            "statistic of private data, released unnoised with the model); compute it without buffers, or pass "
            'buffer_updates="not_private" (config: training.buffer_updates) to train anyway with the run labelled '
            "NOT private"
        )
    return list(names)


__all__ = [
    "BUFFER_UPDATES",
    "batch_dependent_buffers",
    "check_buffer_updates",
    "check_buffers",
    "restored",
]
