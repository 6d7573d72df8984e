"""Noise: Gaussian N(0, sigma^2 C^2) added once per logical step to the sum of clipped gradients.

The noise comes from the run's secret "noise" stream (:mod:`dptrain.randomness.generators`): torch's generator seeded from
operating-system entropy by default, or AES-256-CTR with a hardened sampler (``privacy.secure_noise = true``,
:mod:`dptrain.randomness.secure`).
"""

from __future__ import annotations

import math

import torch

from dptrain.errors import ConfigError
from dptrain.randomness.generators import Stream


def add_gaussian_noise(summed: dict[str, torch.Tensor], std: float, stream: Stream) -> dict[str, torch.Tensor]:
    """Return ``summed`` plus independent N(0, std^2) noise in every coordinate.

    The tensors of one device and dtype are noised as one vector (their coordinates in order, one draw from the
    stream) and returned as views of it: one draw and one addition per step instead of one per parameter tensor (a
    ResNet-20 has 59)."""
    groups: dict[tuple, list[str]] = {}
    for n, s in summed.items():
        groups.setdefault((s.device, s.dtype), []).append(n)
    noisy = {}
    for names in groups.values():
        if len(names) == 1:
            noisy[names[0]] = stream.add_gaussian(summed[names[0]], std)
            continue
        flat = stream.add_gaussian(torch.cat([summed[n].reshape(-1) for n in names]), std)
        for n, part in zip(names, flat.split([summed[n].numel() for n in names]), strict=True):
            noisy[n] = part.view(summed[n].shape)
    return noisy


def check_noise_schedule(schedule) -> tuple[float, ...] | None:
    """A noise schedule's shape s_1..s_T as a tuple of floats (sigma_t = noise_multiplier x s_t), or None. Accepts
    any sequence of finite numbers > 0, or a calibrated :class:`dptrain.schedules.calibration.Schedule` (its shape)."""
    if schedule is None:
        return None
    shape = schedule.shape if hasattr(schedule, "sigmas") else schedule  # a calibrated Schedule: its shape
    try:
        values = tuple(float(v) for v in (shape.tolist() if hasattr(shape, "tolist") else shape))
    except (TypeError, ValueError):
        raise ConfigError(f"noise_schedule must be a sequence of numbers > 0, got {type(schedule).__name__}") from None
    if not values:
        raise ConfigError("noise_schedule must hold T >= 1 numbers > 0, got none")
    bad = next((i for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)), None)
    if bad is not None:
        raise ConfigError(f"noise_schedule must hold finite numbers > 0, got noise_schedule[{bad}]={values[bad]!r}")
    return values
