"""Clipping: bound each example's contribution so the sum of per-example gradients has a known L2
sensitivity. A clipping rule takes the per-example gradients of a batch (a
:class:`~dptrain.stages.per_example.PerExampleGrads`: squared norms, weighted sums, or the materialized
[B, ...] tensors) and returns their clipped sum plus statistics; its ``sensitivity`` is the L2 norm
bound of one example's clipped contribution, which the noise is scaled to. New rules (the papers'
refined clipping) are classes with the same two members.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dptrain.errors import ConfigError
from dptrain.stages.per_example import PerExampleGrads

CLIPPING_NAMES = ("flat", "per_layer", "l2_linf")


@dataclass
class ClipStats:
    """Statistics of a batch's per-example gradients. Computed from private data: NOT private, never written to a
    run's outputs unless the user asks for non-private statistics."""

    examples: int
    clipped: int  # examples whose gradient norm exceeded the bound
    norm_sum: float  # sum of pre-clipping per-example norms (for the mean; non-finite norms excluded)
    non_finite: int = 0  # examples whose gradient held NaN or inf: they contribute zero

    def merge(self, other: ClipStats) -> ClipStats:
        return ClipStats(
            self.examples + other.examples,
            self.clipped + other.clipped,
            self.norm_sum + other.norm_sum,
            self.non_finite + other.non_finite,
        )


class Clipping(Protocol):
    sensitivity: float

    def clip_and_sum(self, grads: PerExampleGrads) -> tuple[dict[str, torch.Tensor], ClipStats]: ...


class WrappedRule:
    """A clipping rule standing in for ``rule`` (an audit's canary split, an injected bug): it reports the wrapped
    rule's sensitivity and ledger facts, so the noise std and what the ledger records do not change."""

    def __init__(self, rule):
        self.rule = rule

    @property
    def sensitivity(self) -> float:
        return self.rule.sensitivity

    @property
    def facts(self) -> dict:
        return dict(getattr(self.rule, "facts", {}))


def per_example_norms(grads: PerExampleGrads) -> torch.Tensor:
    """L2 norm over all parameters of each example's gradient."""
    return torch.sqrt(sum(grads.sq_norms().values()))


def screen_non_finite(sq: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B] of the examples whose gradient holds NaN or inf, each example's total squared norm with those at 0).
    Such examples contribute exactly zero (a rule applied to each example alone, so the sum keeps its sensitivity:
    scaling a NaN by a clip factor would put NaN into everyone's release)."""
    values = list(sq.values())
    dtype = values[0].dtype
    for v in values[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    total = torch.stack([v.to(dtype) for v in values]).sum(0)
    bad = ~(total < math.inf)  # a sum of squares is >= 0, +inf or NaN: not finite exactly when not below inf
    return bad, torch.where(bad, total.new_zeros(()), total)


def read_counts(*values: torch.Tensor) -> list[float]:
    """Scalar tensors read back together (one synchronization instead of one per statistic)."""
    return torch.stack([v.to(torch.float64) for v in values]).tolist()


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
        bad, total = screen_non_finite(grads.sq_norms())
        norms = total.sqrt()
        dropped, clipped, norm_sum = read_counts(bad.sum(), (norms > self.max_grad_norm).sum(), norms.sum())
        if dropped:
            grads = grads.zero_examples(bad)
        stats = ClipStats(len(norms), int(clipped), norm_sum, int(dropped))
        return grads.weighted_sum(_factors(norms, self.max_grad_norm)), stats


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
        sq = grads.sq_norms()
        bad, total = screen_non_finite(sq)
        bound = self.max_grad_norm / math.sqrt(len(sq))
        norms = {n: torch.where(bad, v.new_zeros(()), v).sqrt() for n, v in sq.items()}
        clipped = torch.stack([v > bound for v in norms.values()]).any(0)
        dropped, n_clipped, norm_sum = read_counts(bad.sum(), clipped.sum(), total.sqrt().sum())
        if dropped:
            grads = grads.zero_examples(bad)
        summed = grads.weighted_sum({n: _factors(v, bound) for n, v in norms.items()})
        return summed, ClipStats(len(total), int(n_clipped), norm_sum, int(dropped))


@dataclass(frozen=True)
class L2LinfClipping:
    """Algorithm 2 of Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix": clip each example's
    whole gradient to L2 norm C, then each coordinate to [-C/sqrt(p), C/sqrt(p)]. The result satisfies both
    ||g||_2 <= C (truncation only lowers the L2 norm, so the sensitivity stays C) and ||g||_inf <= C/sqrt(p),
    which the ``modelmix`` accountant turns into a smaller divergence (Cor. 4.1); the ledger records p. With
    p = 1 it is flat clipping (a coordinate of an L2-clipped vector is at most C). It needs each example's
    gradient materialized (chunks of max_physical_batch_size examples)."""

    max_grad_norm: float
    linf_p: int = 1

    def __post_init__(self) -> None:
        FlatClipping(self.max_grad_norm)  # same validation
        if isinstance(self.linf_p, bool) or not isinstance(self.linf_p, int) or self.linf_p < 1:
            raise ConfigError(f"privacy.linf_p must be an integer >= 1, got {self.linf_p!r}")

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    @property
    def facts(self) -> dict:
        return {"linf_p": self.linf_p}

    def clip_and_sum(self, grads):
        bad, total = screen_non_finite(grads.sq_norms())
        norms = total.sqrt()
        dropped, n_clipped, norm_sum = read_counts(bad.sum(), (norms > self.max_grad_norm).sum(), norms.sum())
        if dropped:
            grads = grads.zero_examples(bad)
        factors = _factors(norms, self.max_grad_norm)
        bound = self.max_grad_norm / math.sqrt(self.linf_p)
        summed = {}
        for n, g in grads.materialize().items():
            clipped = g * factors.reshape(-1, *([1] * (g.dim() - 1))).to(g.dtype)
            summed[n] = clipped.clamp(-bound, bound).sum(0)
        return summed, ClipStats(len(norms), int(n_clipped), norm_sum, int(dropped))


def clipped_sum(chunks, clipping: Clipping, params: dict[str, torch.Tensor], with_loss: bool = False):
    """The clipping stage over a logical batch: (sum of clipped per-example gradients by parameter name, clip
    statistics, sum of the losses if ``with_loss`` else 0). ``chunks`` yields (PerExampleGrads, losses) per
    physical chunk."""
    summed: dict[str, torch.Tensor] | None = None
    stats, loss_sum = ClipStats(0, 0, 0.0), 0.0
    for grads, losses in chunks:
        clipped, chunk_stats = clipping.clip_and_sum(grads)
        if losses is not None:
            # one read of the float64 sum: NaN or inf if any loss is (finite float32 losses cannot overflow it)
            chunk_loss = float(losses.sum(dtype=torch.float64))
            if not math.isfinite(chunk_loss):
                chunk_stats = dataclasses.replace(chunk_stats, non_finite=max(chunk_stats.non_finite, 1))
            elif with_loss:
                loss_sum += chunk_loss
        if summed is None:  # the first chunk's sums as they are: no zeros to add them to
            summed = {n: clipped[n].reshape(p.shape).to(sum_dtype(p)).contiguous() for n, p in params.items()}
        else:  # out of place: never writes into a tensor a clipping rule returned
            summed = {n: t + clipped[n].reshape(t.shape) for n, t in summed.items()}
        stats = stats.merge(chunk_stats)
    if summed is None:  # an empty batch: the sum is zero (and is noised like any other)
        summed = {n: torch.zeros_like(p, dtype=sum_dtype(p), memory_format=torch.contiguous_format)
                  for n, p in params.items()}
    return summed, stats, loss_sum


def sum_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's clipped sum and its noise are formed in: float32 for a bfloat16 or float16 parameter
    (rounding the sum to 8 bits of mantissa before the noise is added would move it by up to 2^-8 of its size, more
    than one example's clipped contribution in a large batch: the noise would no longer cover the sensitivity); the
    noisy gradient is cast to the parameter's dtype afterwards (post-processing)."""
    return torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype


def make_clipping(name: str, max_grad_norm: float, linf_p: int | None = None) -> Clipping:
    if linf_p is not None and name != "l2_linf":
        raise ConfigError(f'privacy.linf_p is for privacy.clipping = "l2_linf", not {name!r}')
    if name == "flat":
        return FlatClipping(max_grad_norm)
    if name == "per_layer":
        return PerLayerClipping(max_grad_norm)
    if name == "l2_linf":
        return L2LinfClipping(max_grad_norm, 1 if linf_p is None else linf_p)
    raise ConfigError(f"unknown clipping rule {name!r}; accepted: {', '.join(CLIPPING_NAMES)}")
