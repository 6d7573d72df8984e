"""Mixed precision: the forward and backward passes of the per-example gradients under ``torch.autocast``, everything
that decides privacy in float32.

``mixed_precision="bf16"`` (or ``"fp16"``; config ``training.mixed_precision``) runs the backend's forward pass, and
torch.func's per-module or whole-model passes, under autocast on the run's device. The model's parameters stay in
their dtype (float32), so the per-example gradients are formed in float32 from the recorded low-precision activations
and output gradients (the layer rules upcast them), and the per-example norms, the clipping, the sum and the noise are
float32: the sensitivity bound holds as for a float32 run. What changes is the gradient's value, within bfloat16's
rounding (tests/test_precision.py bounds it against float32). The per-example loss is computed in float32
(:mod:`dptrain.models.losses`).
"""

from __future__ import annotations

import contextlib

import torch

from dptrain.errors import ConfigError

#: Accepted names -> autocast dtypes (None: full precision).
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Low-precision floating dtypes whose tensors the layer rules upcast to float32.
LOW = (torch.bfloat16, torch.float16)


def check_precision(value, key: str = "mixed_precision"):
    if value is None or value in PRECISIONS:
        return value
    raise ConfigError(f"{key} must be one of {', '.join(PRECISIONS)} (or absent: full precision), got {value!r}")


def upcast(t):
    """A low-precision floating tensor as float32 (anything else unchanged)."""
    return t.float() if torch.is_tensor(t) and t.dtype in LOW else t


class MixedPrecision:
    """A per-example gradient backend whose passes run under ``torch.autocast(device, dtype)``; every other attribute
    is the backend's."""

    def __init__(self, backend, dtype: torch.dtype, device: torch.device):
        self.backend, self.dtype, self.device_type = backend, dtype, torch.device(device).type

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype)

    def __call__(self, x, y):
        with self.autocast():
            return self.backend(x, y)

    def from_losses(self, losses):
        with self.autocast():
            return self.backend.from_losses(losses)

    @property
    def name(self) -> str:
        return f"{self.backend.name} ({'bf16' if self.dtype == torch.bfloat16 else 'fp16'} autocast)"

    def __getattr__(self, name):
        return getattr(self.__dict__["backend"], name)


def autocast_of(backend):
    """The autocast context a backend's passes run under (a null context at full precision)."""
    make = getattr(backend, "autocast", None)
    return make() if make is not None else contextlib.nullcontext()


__all__ = ["LOW", "PRECISIONS", "MixedPrecision", "autocast_of", "check_precision", "upcast"]
