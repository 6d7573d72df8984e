"""The interface every stream of randomness implements (:class:`Stream`), and what the streams share: the check that
a saved state was written by a stream of the same kind (:func:`check_state_kind`).

The streams themselves: :class:`dptrain.randomness.generators.TorchStream` and :class:`dptrain.randomness.secure.SecureStream`; the
streams of a run, one per purpose: :class:`dptrain.randomness.generators.Randomness`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from dptrain.errors import ConfigError


class Stream(Protocol):
    """What the stages draw from. Every method advances the stream."""

    kind: str

    def uniform(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Independent U[0, 1) values."""
        ...

    def normal(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Independent N(0, 1) values."""
        ...

    def gaussian(self, like: torch.Tensor) -> torch.Tensor:
        """Independent N(0, 1) values of ``like``'s shape, on its device: the draws ``add_gaussian(like, std)`` would
        scale by std and add (``like``'s dtype; float64 for a secure stream, whose noise is added in float64 and the
        sum rounded once). Correlated noise (:mod:`dptrain.stages.correlated_noise`) combines them before adding."""
        ...

    def add_gaussian(self, x: torch.Tensor, std: float) -> torch.Tensor:
        """``x`` plus independent N(0, std^2) noise in every coordinate (same dtype as ``x``)."""
        ...

    def integers(self, low: int, high: int) -> int:
        """One integer uniform on [low, high), exactly (no modulo bias)."""
        ...

    def words(self, count: int) -> np.ndarray:
        """``count`` independent uniform 64-bit words (uint64): raw bits for exact discrete draws."""
        ...

    def permutation(self, n: int) -> torch.Tensor:
        """A uniformly random permutation of 0..n-1 (int64)."""
        ...

    def get_state(self) -> dict: ...

    def set_state(self, state: dict) -> None: ...


def check_state_kind(stream: Stream, state: dict) -> None:
    """Refuse (ConfigError) a saved state that another kind of stream wrote: a checkpoint of a run with
    ``privacy.secure_noise`` changed."""
    if not isinstance(state, dict) or state.get("kind") != stream.kind:
        raise ConfigError(
            f"the saved random state is of kind {state.get('kind') if isinstance(state, dict) else state!r}, "
            f"this run's stream is {stream.kind!r} (was privacy.secure_noise changed?)"
        )


__all__ = ["Stream", "check_state_kind"]
