"""Devices: where a run's model, per-example gradients, clipping, noise and update live, and moving batches there.

No tensor of a run is created on an implicit default device (tests/test_devices.py runs every stage with torch's
default device set to meta).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from dptrain.errors import ConfigError

#: Devices a run accepts by name (any torch.device of an available accelerator works too).
DEVICES = ("cpu", "cuda", "auto")


def resolve_device(device) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu; a name or torch.device -> that device, if this machine has it
    (a one-line ConfigError otherwise)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} is not available on this machine (no CUDA GPU); use cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")
    return dev


def to_device(inputs, device: torch.device):
    """A batch (a tensor or a tuple/list/dict of tensors) on ``device``. (Tensors and pairs of tensors, the common case,
    without the pytree machinery: it costs more than the copy itself for a small batch on the CPU.)"""
    if torch.is_tensor(inputs):
        return inputs.to(device, non_blocking=True)
    if type(inputs) is tuple and all(torch.is_tensor(t) for t in inputs):
        return tuple(t.to(device, non_blocking=True) for t in inputs)
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, inputs)


__all__ = ["DEVICES", "resolve_device", "to_device"]
