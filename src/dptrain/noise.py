"""Noise: Gaussian N(0, sigma^2 C^2) added once per logical step to the sum of clipped gradients.

The noise comes from the run's secret "noise" stream (:mod:`dptrain.randomness`): torch's generator seeded from
operating-system entropy by default, or AES-256-CTR with a hardened sampler (``privacy.secure_noise = true``,
:mod:`dptrain.secure_random`).
"""

from __future__ import annotations

import torch

from dptrain.randomness import Stream


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
