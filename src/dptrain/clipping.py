"""Clipping: bound each example's contribution so the sum of per-example gradients has a known L2
sensitivity. A clipping rule takes per-example gradients (name -> tensor [B, ...]) and returns their
clipped sum plus statistics; its ``sensitivity`` is the L2 norm bound of one example's clipped
contribution, which the noise is scaled to. New rules (per-layer, the papers' refined clipping) are
classes with the same two members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dptrain.errors import ConfigError

CLIPPING_NAMES = ("flat", "per_layer")


@dataclass
class ClipStats:
    examples: int
    clipped: int  # examples whose gradient norm exceeded the bound
    norm_sum: float  # sum of pre-clipping per-example norms (for the mean)

    def merge(self, other: ClipStats) -> ClipStats:
        return ClipStats(
            self.examples + other.examples, self.clipped + other.clipped, self.norm_sum + other.norm_sum
        )


class Clipping(Protocol):
    sensitivity: float

    def clip_and_sum(self, grads: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], ClipStats]: ...


def _scale_and_sum(grads: dict[str, torch.Tensor], factors: torch.Tensor) -> dict[str, torch.Tensor]:
    return {n: torch.tensordot(factors, g, dims=1) for n, g in grads.items()}


def per_example_norms(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """L2 norm over all parameters of each example's gradient."""
    sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values())
    return torch.sqrt(sq)


def _factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
    # min(1, C / ||g||): the clipped gradient has norm <= C exactly (no epsilon slack above C).
    return torch.clamp(bound / norms.clamp_min(1e-12), max=1.0)


@dataclass(frozen=True)
class FlatClipping:
    """Clip the whole per-example gradient (all parameters as one vector) to L2 norm ``max_grad_norm``."""

    max_grad_norm: float

    def __post_init__(self) -> None:
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"privacy.max_grad_norm must be a finite number > 0, got {self.max_grad_norm}")

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def clip_and_sum(self, grads):
        norms = per_example_norms(grads)
        factors = _factors(norms, self.max_grad_norm)
        stats = ClipStats(len(norms), int((norms > self.max_grad_norm).sum()), float(norms.sum()))
        return _scale_and_sum(grads, factors), stats


@dataclass(frozen=True)
class PerLayerClipping:
    """Clip each parameter tensor k to its own bound C_k = max_grad_norm / sqrt(K) (equal split), so that
    one example's whole clipped gradient has norm <= sqrt(sum_k C_k^2) = max_grad_norm."""

    max_grad_norm: float

    def __post_init__(self) -> None:
        FlatClipping(self.max_grad_norm)  # same validation

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def clip_and_sum(self, grads):
        bound = self.max_grad_norm / math.sqrt(len(grads))
        out, clipped, total = {}, None, None
        for n, g in grads.items():
            norms = g.reshape(g.shape[0], -1).norm(dim=1)
            out[n] = torch.tensordot(_factors(norms, bound), g, dims=1)
            clipped = (norms > bound) if clipped is None else clipped | (norms > bound)
            total = norms.pow(2) if total is None else total + norms.pow(2)
        examples = next(iter(grads.values())).shape[0]
        return out, ClipStats(examples, int(clipped.sum()), float(total.sqrt().sum()))


def make_clipping(name: str, max_grad_norm: float) -> Clipping:
    if name == "flat":
        return FlatClipping(max_grad_norm)
    if name == "per_layer":
        return PerLayerClipping(max_grad_norm)
    raise ConfigError(f"unknown clipping rule {name!r}; accepted: {', '.join(CLIPPING_NAMES)}")
