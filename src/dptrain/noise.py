"""Noise: Gaussian N(0, sigma^2 C^2) added once per logical step to the sum of clipped gradients.

The noise comes from the run's secret "noise" stream (:mod:`dptrain.randomness`): torch's generator seeded from
operating-system entropy by default, or AES-256-CTR with a hardened sampler (``privacy.secure_noise = true``,
:mod:`dptrain.secure_random`).
"""

from __future__ import annotations

import torch

from dptrain.randomness import Stream


def add_gaussian_noise(summed: dict[str, torch.Tensor], std: float, stream: Stream) -> dict[str, torch.Tensor]:
    """Return ``summed`` plus independent N(0, std^2) noise in every coordinate."""
    return {n: stream.add_gaussian(s, std) for n, s in summed.items()}
