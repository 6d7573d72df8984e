"""Per-example gradients of one physical chunk, kept in whatever form is cheapest: materialized [B, *shape] tensors, the
two factors of a Linear layer's gradient, an Embedding's ids and output gradients, or the sum of several of those for a
parameter used in several places (tied weights). Clipping rules ask a :class:`PerExampleGrads` for per-example squared
norms and weighted sums over examples, and materialize only when they must.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PerExampleGrads:
    """Per-example gradients of one (physical) batch, by parameter name."""

    def __init__(self, parts: dict[str, torch.Tensor | _LinearFactors]):
        self._parts = parts

    def names(self) -> list[str]:
        return list(self._parts)

    def parts(self) -> dict:
        """name -> the gradients of that parameter in the form they are kept in (a tensor or factors)."""
        return dict(self._parts)

    def sq_norms(self) -> dict[str, torch.Tensor]:
        """name -> [B]: each example's squared L2 norm of its gradient for that parameter."""
        return {n: _sq_norms(part) for n, part in self._parts.items()}

    def weighted_sum(self, factors: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """name -> sum_i f_i g_i (one factor per example, or one [B] vector per parameter)."""
        return {
            n: _weighted_sum(part, factors[n] if isinstance(factors, dict) else factors)
            for n, part in self._parts.items()
        }

    def zero_examples(self, mask: torch.Tensor) -> PerExampleGrads:
        """The same gradients with those of the examples in boolean ``mask`` [B] set to exactly zero."""
        keep = ~mask

        def zeroed(part):
            return part.zeroed(keep) if isinstance(part, _FACTORS) else _zero_rows(part, keep)

        return PerExampleGrads({n: zeroed(part) for n, part in self._parts.items()})

    def materialize(self) -> dict[str, torch.Tensor]:
        """name -> [B, *parameter shape]."""
        return {n: part.materialize() if isinstance(part, _FACTORS) else part for n, part in self._parts.items()}


@dataclass(frozen=True)
class _LinearFactors:
    """Per-example gradients delta_i a_i^T of a Linear weight, kept as their two factors. On sequences ([B, T, out]
    and [B, T, in]) the gradient is sum_t delta_it a_it^T and its squared norm the Gram form
    sum_{t,t'} (delta_t . delta_t')(a_t . a_t') (Li et al. 2022, "ghost clipping"): no [B, out, in] tensor."""

    delta: torch.Tensor  # [B, out] or [B, T, out]
    a: torch.Tensor  # [B, in] or [B, T, in]

    def materialize(self) -> torch.Tensor:
        if self.delta.dim() == 2:
            return torch.einsum("bo,bi->boi", self.delta, self.a)
        return torch.einsum("bto,bti->boi", self.delta, self.a)

    def sq_norms(self) -> torch.Tensor:
        if self.delta.dim() == 2:
            return _row_sq_norms(self.delta) * _row_sq_norms(self.a)
        return (self.delta @ self.delta.transpose(1, 2) * (self.a @ self.a.transpose(1, 2))).sum((1, 2))

    def weighted_sum(self, f: torch.Tensor) -> torch.Tensor:
        if self.delta.dim() == 2:
            return (self.delta * f[:, None]).T @ self.a
        return torch.einsum("bto,bti->oi", self.delta * f[:, None, None], self.a)

    def zeroed(self, keep: torch.Tensor) -> _LinearFactors:
        return _LinearFactors(_zero_rows(self.delta, keep), _zero_rows(self.a, keep))


@dataclass(frozen=True)
class _EmbeddingFactors:
    """Per-example gradients of an Embedding weight from the looked-up ids [B, T] and the output gradients
    [B, T, dim]: row v of example i's gradient is the sum of delta_it over the positions t with id v. The squared
    norm is sum over pairs of positions with equal ids of delta_t . delta_t' (no [B, vocabulary, dim] tensor)."""

    ids: torch.Tensor  # [B, T] (int)
    delta: torch.Tensor  # [B, T, dim]
    num_embeddings: int

    def materialize(self) -> torch.Tensor:
        b, t, d = self.delta.shape
        out = self.delta.new_zeros(b, self.num_embeddings, d)
        return out.scatter_add_(1, self.ids[..., None].expand(b, t, d), self.delta)

    def sq_norms(self) -> torch.Tensor:
        same = (self.ids[:, :, None] == self.ids[:, None, :]).to(self.delta.dtype)
        return (self.delta @ self.delta.transpose(1, 2) * same).sum((1, 2))

    def weighted_sum(self, f: torch.Tensor) -> torch.Tensor:
        d = self.delta.shape[-1]
        out = self.delta.new_zeros(self.num_embeddings, d)
        return out.index_add_(0, self.ids.reshape(-1), (self.delta * f[:, None, None]).reshape(-1, d))

    def zeroed(self, keep: torch.Tensor) -> _EmbeddingFactors:
        return _EmbeddingFactors(self.ids, _zero_rows(self.delta, keep), self.num_embeddings)


@dataclass(frozen=True)
class _SharedParts:
    """The per-example gradient of a parameter used in several places (tied weights: GPT-2's token embedding is
    also its output layer's weight): the sum of the gradients of every use, each kept in its own form. Its squared
    norm is sum_i ||p_i||^2 + 2 sum_{i<j} <p_i, p_j>, the cross terms computed from the factors
    (:func:`_inner`), so an Embedding tied to a Linear never builds a [B, vocabulary, dim] tensor."""

    parts: tuple

    def materialize(self) -> torch.Tensor:
        return sum(_materialize(p) for p in self.parts)

    def sq_norms(self) -> torch.Tensor:
        total = sum(_sq_norms(p) for p in self.parts)
        for i, p in enumerate(self.parts):
            for q in self.parts[i + 1 :]:
                total = total + 2 * _inner(p, q)
        return total

    def weighted_sum(self, f: torch.Tensor) -> torch.Tensor:
        return sum(_weighted_sum(p, f) for p in self.parts)

    def zeroed(self, keep: torch.Tensor) -> _SharedParts:
        return _SharedParts(tuple(p.zeroed(keep) if isinstance(p, _FACTORS) else _zero_rows(p, keep) for p in self.parts))


_FACTORS = (_LinearFactors, _EmbeddingFactors, _SharedParts)


def shared(a, b):
    """The per-example gradient of one parameter reached through two uses (either may already be shared)."""
    parts = (a.parts if isinstance(a, _SharedParts) else (a,)) + (b.parts if isinstance(b, _SharedParts) else (b,))
    return _SharedParts(parts)


def _materialize(part) -> torch.Tensor:
    return part.materialize() if isinstance(part, _FACTORS) else part


def _sequence(f: _LinearFactors) -> tuple[torch.Tensor, torch.Tensor]:
    """A Linear's factors as sequences: [B, T, out], [B, T, in] (T = 1 for [B, features] inputs)."""
    return (f.delta[:, None], f.a[:, None]) if f.delta.dim() == 2 else (f.delta, f.a)


def _inner(p, q) -> torch.Tensor:
    """[B]: each example's inner product <p_b, q_b> of two per-example gradients of the same parameter."""
    if isinstance(p, _SharedParts) or isinstance(q, _SharedParts):
        ps = p.parts if isinstance(p, _SharedParts) else (p,)
        qs = q.parts if isinstance(q, _SharedParts) else (q,)
        return sum(_inner(a, b) for a in ps for b in qs)
    if isinstance(q, _LinearFactors) and isinstance(p, _EmbeddingFactors):
        p, q = q, p
    if isinstance(p, _LinearFactors) and isinstance(q, _LinearFactors):
        (d1, a1), (d2, a2) = _sequence(p), _sequence(q)  # sum_{t,t'} (d_t . d'_t') (a_t . a'_t')
        return (d1 @ d2.transpose(1, 2) * (a1 @ a2.transpose(1, 2))).sum((1, 2))
    if isinstance(p, _EmbeddingFactors) and isinstance(q, _EmbeddingFactors):
        same = (p.ids[:, :, None] == q.ids[:, None, :]).to(p.delta.dtype)
        return (p.delta @ q.delta.transpose(1, 2) * same).sum((1, 2))
    if isinstance(p, _LinearFactors) and isinstance(q, _EmbeddingFactors):
        # A Linear of weight [V, D] (out V, in D) tied to an Embedding of V rows: <sum_t' d_t' a_t'^T, sum_t e_{id_t}
        # g_t^T> = sum_{t', t} d_t'[id_t] (a_t' . g_t)
        d, a = _sequence(p)
        picked = d.gather(2, q.ids[:, None, :].expand(-1, d.shape[1], -1))  # [B, T', T]: d_t'[id_t]
        return (picked * (a @ q.delta.transpose(1, 2))).sum((1, 2))
    if isinstance(q, _FACTORS) and not isinstance(p, _FACTORS):
        p, q = q, p
    if isinstance(p, _LinearFactors):  # against a dense [B, out, in]: sum_t d_t^T G a_t
        d, a = _sequence(p)
        return torch.einsum("bto,boi,bti->b", d, q, a)
    if isinstance(p, _EmbeddingFactors):  # against a dense [B, V, D]: sum_t G[id_t] . g_t
        rows = q.gather(1, p.ids[..., None].expand(-1, -1, q.shape[-1]))
        return (rows * p.delta).sum((1, 2))
    return _rows(p * q).sum(1)


def _zero_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows where ``keep`` is False replaced by zeros (where(), so NaN and inf do not survive)."""
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, t.new_zeros(()))


def _row_sq_norms(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B]: each row's squared L2 norm. vector_norm makes no [B, ...] temporary (vecdot and pow do: on
    the CPU a step's large temporaries cost page faults) and is the fastest of the three here. A 0-dim parameter's
    gradients are [B] (:func:`_rows`)."""
    return torch.linalg.vector_norm(_rows(t), dim=1).square()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B, elements]: each example's gradient as a row (a 0-dim parameter's [B] as [B, 1]: flatten(1)
    needs a second dimension, and reshape(B, -1) fails for a chunk of no example)."""
    return t.flatten(1) if t.dim() > 1 else t[:, None]


def _sq_norms(part) -> torch.Tensor:
    if isinstance(part, _FACTORS):
        return part.sq_norms()
    return _row_sq_norms(part)


def _weighted_sum(part, f: torch.Tensor) -> torch.Tensor:
    if isinstance(part, _FACTORS):
        return part.weighted_sum(f)
    return torch.tensordot(f.to(part.dtype), part, dims=1)  # (the factors in the gradients' dtype: float32 or float64)
