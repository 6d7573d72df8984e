"""Buffers are part of the released model: a buffer that a training-mode forward writes is a release.

DP-SGD's guarantee covers the noisy gradients and what is computed from them. A module whose training-mode forward
writes into a buffer (BatchNorm's running mean, a running maximum of |x|, an outlier counter, torch.ao's
``MinMaxObserver``) puts something computed from the private batch, unnoised, into ``model.state_dict()`` and
``model.pt``. Which statistic it is does not matter (a counter of calls counts the chunks, hence the secret batch
sizes), so the rule is the sound one: any write is a release. A :class:`BufferWatch` sees every kind of write to every
buffer slot of the model between two points: the tensor in the slot replaced (``self.buf = ...``), written in place
(its version counter), its storage swapped (``set_``), or its value changed by a path that bypasses the version counter
(``buf.data.copy_(...)``, through numpy). Before training the model probe watches its training-mode passes; during
training every chunk's forward and backward are watched (:mod:`dptrain.preflight.sentinel`). A written buffer refuses
the model with one line naming it (:func:`check_buffers`), unless the user opts out (``buffer_updates="not_private"``),
which labels the whole run not private. The probe restores every buffer exactly: it leaves no trace of the examples it
read.
"""

from __future__ import annotations

import contextlib

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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors: one shape and dtype, equal values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


#: Buffers up to this size (bytes) have their values compared as well during training (larger ones are watched by
#: slot, version and storage only there; before training every value is compared).
COMPARED_BYTES = 2**22


class BufferWatch:
    """Every buffer slot of a model at one point: the tensor in it, its version counter, its storage and (for
    buffers of at most ``max_bytes``, every one by default) a copy of its value. :meth:`written` names the buffers
    written since."""

    def __init__(self, model: nn.Module, max_bytes: int | None = None):
        self.model = model
        self.slots = {}
        for name, (_, _, t) in _buffers(model).items():
            if t is None:
                self.slots[name] = None
                continue
            keep = max_bytes is None or t.numel() * t.element_size() <= max_bytes
            self.slots[name] = (t, t._version, t.data_ptr(), t.shape, t.detach().clone() if keep else None)

    def written(self) -> list[str]:
        now = _buffers(self.model)
        names = []
        for name in sorted(set(now) | set(self.slots)):
            before, after = self.slots.get(name, None), now[name][2] if name in now else None
            if name not in now or name not in self.slots:
                names.append(name)
            elif before is None or after is None:
                if before is not after:
                    names.append(name)
            else:
                t, version, ptr, shape, value = before
                if after is not t or t._version != version or t.data_ptr() != ptr or t.shape != shape:
                    names.append(name)
                elif value is not None and not _same(value, t):
                    names.append(name)
        return names

    def restore(self) -> None:
        """Every slot as it was: the same tensors, with their values put back where a copy was kept."""
        current = _buffers(self.model)
        for name, (module, local, _) in current.items():
            if name not in self.slots:
                del module._buffers[local]
        for name, slot in self.slots.items():
            module, local, _ = current.get(name) or _slot(self.model, name)
            if slot is not None and slot[4] is not None:
                tensor, value = slot[0], slot[4]
                with torch.no_grad():
                    if tensor.shape != value.shape or tensor.dtype != value.dtype:
                        tensor.set_(value.clone())
                    else:
                        tensor.copy_(value)
            module._buffers[local] = None if slot is None else slot[0]


def check_buffers(names: list[str], buffer_updates: str) -> list[str]:
    """Refuse (ModelError naming the first buffer) when ``names`` (buffers written from the batch) is not empty,
    unless ``buffer_updates == "not_private"``: then return them, for the run to label itself not private."""
    if names and buffer_updates != "not_private":
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ModelError(
            f"model buffer {names[0]!r}{more} is written by a training-mode forward pass (whatever it holds, a statistic "
            "or a count of private batches, it is released unnoised with the model); compute it without buffers, or pass "
            'buffer_updates="not_private" (config: training.buffer_updates) to train anyway with the run labelled '
            "NOT private"
        )
    return list(names)


__all__ = [
    "BUFFER_UPDATES",
    "BufferWatch",
    "check_buffer_updates",
    "check_buffers",
    "restored",
]
