"""Canaries for a one-run privacy audit: how they are drawn, inserted into the real engine and scored.

Setting of Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), Algorithm 1:
m canaries, each included independently with probability 1/2 (the secret S_i); one training run; a score per
canary, higher meaning "more likely included". The secrets come from the run's "canaries" stream
(:mod:`dptrain.randomness.generators`); everything else about a canary (its coordinate, its input and label) comes from a
fixed public generator, so the auditor can recompute it without ever looking at the secrets.

Two kinds:

- ``gradient`` (white box, "Dirac" canaries): canary i has a per-example gradient on a coordinate of its own.
  Where every iterate is released (DP-SGD), the coordinates are auxiliary ones appended for the audit
  (:mod:`dptrain.auditing.auxiliary`), scored on every released update. Where only the last iterate is
  (projected noisy SGD), canary i is L e_{j_i}, L the per-example bound and j_i one of m distinct coordinates of
  the flattened trainable parameters (:func:`dirac_gradients`), scored on the final iterate.
- ``input`` (black box): canary i is an example with a random input and a random label; scored by minus the
  final model's loss on it.

Both enter the engine through the per-example stage (:func:`with_canaries`): the training set holds the real
examples and one row per canary, included or not, so batch selection samples canaries like any example and the
data set size (hence q, sigma and the number of steps) does not depend on the secrets; an excluded canary
contributes nothing to the released sum, exactly as if it were absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dptrain.auditing import KINDS
from dptrain.data.loaders import ArrayDataset
from dptrain.errors import ConfigError
from dptrain.randomness.generators import Stream
from dptrain.stages.per_example import PerExampleGrads

#: Seed of the public generator of the canaries' coordinates, inputs and labels (not secret: the auditor
#: recomputes them; only the inclusion bits are secret).
PUBLIC_CANARY_SEED = 20230515

Stage = Callable[[torch.Tensor], Iterator[tuple[PerExampleGrads, torch.Tensor]]]


# --- options ----------------------------------------------------------------------------------------------


def check_options(canaries, confidence, kind) -> tuple[int | None, float, str]:
    """(m, confidence, kind) validated: m an integer >= 2 (or None: the default for the model, chosen by the
    runner), confidence in (0, 1), kind one of :data:`KINDS`."""
    if canaries is not None and (isinstance(canaries, bool) or not isinstance(canaries, int) or canaries < 2):
        raise ConfigError(f"canaries must be an integer >= 2, got {canaries!r}")
    try:
        level = float(confidence)
    except (TypeError, ValueError):
        raise ConfigError(f"confidence must be a number in (0, 1), got {confidence!r}") from None
    if isinstance(confidence, bool) or not 0 < level < 1:
        raise ConfigError(f"confidence must be a number in (0, 1), got {confidence!r}")
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return canaries, level, kind


# --- the secret and the public draws ----------------------------------------------------------------------


def draw_inclusion(m: int, stream: Stream) -> torch.Tensor:
    """S: m independent fair coins (True = included) from the secret ``stream`` (the run's "canaries" stream).
    Steinke, Nasr & Jagielski, Algorithm 1: S_i uniform on {-1, +1}, independently."""
    return stream.uniform((m,), torch.float64) < 0.5


def public_generator() -> torch.Generator:
    return torch.Generator().manual_seed(PUBLIC_CANARY_SEED)


def dirac_coordinates(m: int, num_params: int) -> torch.Tensor:
    """m distinct coordinates of a flattened parameter vector of ``num_params`` entries, from the public
    generator (chosen before training, independently of the data and of the secrets)."""
    if m > num_params:
        raise ConfigError(
            f"canaries must be at most the number of trainable parameters ({num_params}) for gradient canaries "
            f"scored on the last iterate (one distinct coordinate each), got {m}"
        )
    return torch.randperm(num_params, generator=public_generator())[:m]


def random_examples(m: int, input_shape: tuple[int, ...], num_classes: int, dtype: torch.dtype):
    """(x, y) of m input canaries from the public generator: standard-normal inputs of the data's shape (the
    loaders standardize features) and labels uniform on 0..num_classes-1."""
    g = public_generator()
    x = torch.randn((m, *input_shape), generator=g, dtype=torch.float64).to(dtype)
    y = torch.randint(0, num_classes, (m,), generator=g)
    return x, y


# --- the training set -------------------------------------------------------------------------------------


def append_examples(ds: ArrayDataset, x: torch.Tensor, y: torch.Tensor) -> ArrayDataset:
    """``ds`` with the rows (x, y) appended after its own (indices len(ds), len(ds) + 1, ...)."""
    return ArrayDataset(
        torch.cat([ds.x, x.to(ds.x.dtype)]), torch.cat([ds.y, y.to(ds.y.dtype)]), ds.num_classes, ds.name
    )


def placeholders(k: int, ds: ArrayDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """k placeholder rows for gradient canaries: all-zero inputs and label 0 (the per-example stage never
    computes their gradient; they make batch selection sample the canaries like any example)."""
    return torch.zeros((k, *ds.x.shape[1:]), dtype=ds.x.dtype), torch.zeros(k, dtype=ds.y.dtype)


# --- gradient canaries: the per-example stage -------------------------------------------------------------


def flat_size(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() for p in params.values())


def dirac_gradients(
    coordinates: torch.Tensor, params: dict[str, torch.Tensor], norm: float
) -> PerExampleGrads:
    """Per-example gradients of k Dirac canaries: example r is ``norm`` * e_{coordinates[r]} in the flattened
    parameters (the order of ``params``), as dense [k, *shape] tensors."""
    k = len(coordinates)
    dtype = next(iter(params.values())).dtype
    flat = torch.zeros((k, flat_size(params)), dtype=dtype)
    flat[torch.arange(k), coordinates] = norm
    parts, start = {}, 0
    for name, p in params.items():
        parts[name] = flat[:, start : start + p.numel()].reshape(k, *p.shape)
        start += p.numel()
    return PerExampleGrads(parts)


def with_canaries(
    stage: Stage,
    num_real: int,
    included: torch.Tensor,
    chunk: int,
    dirac: Callable[[torch.Tensor], PerExampleGrads] | None = None,
) -> Stage:
    """The per-example stage of a training set of ``num_real`` real examples followed by one row per canary
    (index num_real + r is canary r, whether or not it is included, so the data set size and with it every number
    of the run are the same for every inclusion vector): real indices go to ``stage``; an excluded canary
    contributes nothing (exactly as if absent: the released sum is the same); an included one yields its Dirac
    gradient ``dirac(r)`` (gradient canaries, with loss 0) or goes to ``stage`` like a real example (input
    canaries). Canary gradients come in chunks of at most ``chunk``."""

    def per_example(idx: torch.Tensor):
        canary = idx[idx >= num_real] - num_real
        canary = canary[included[canary]]
        if dirac is None:
            yield from stage(torch.cat([idx[idx < num_real], canary + num_real]))
            return
        yield from stage(idx[idx < num_real])
        for part in canary.split(chunk) if len(canary) else ():
            yield dirac(part), torch.zeros(len(part))

    return per_example
