"""Noise: Gaussian N(0, sigma^2 C^2) added once per logical step to the sum of clipped gradients.

Note: torch's generator is a Mersenne Twister, not a cryptographically secure source; like most research
DP libraries we accept that (floating-point attacks on the Gaussian sampler are also out of scope).
"""

from __future__ import annotations

import torch


def add_gaussian_noise(
    summed: dict[str, torch.Tensor], std: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Return ``summed`` plus independent N(0, std^2) noise in every coordinate."""
    if std == 0:
        return summed
    return {
        n: s + std * torch.randn(s.shape, generator=generator, dtype=s.dtype, device=s.device)
        for n, s in summed.items()
    }
