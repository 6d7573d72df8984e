"""Noise correlated across steps: banded matrix factorization's C^{-1} Z, streamed.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023). C is the lower-triangular banded Toeplitz matrix with first column
c_0..c_{b-1} (unit norm); step t of the run adds std * w_t to the sum of clipped gradients (std = sigma x clip norm),
with w = C^{-1} z, z_t the step's standard normal draws. Row t of C w = z gives the recurrence

    w_t = (z_t - sum_{j=1}^{min(t, b-1)} c_j w_{t-j}) / c_0

(their Algorithm 9's streamed noise for a Toeplitz C; :func:`dptrain.accounting.bandmf_noise.streamed_noise` is the
numpy reference, tested against the dense solve). The stage keeps the b - 1 previous w (secret: b - 1 vectors of the
model's size, in the private checkpoint) in a ring, and combines them with one matrix-vector product per step.

The draws z_t are exactly those :func:`dptrain.stages.noise.add_gaussian_noise` adds (the same grouping of the
parameters by device and dtype, one draw per group, ``stream.gaussian``), and with b = 1 (c = [1]) the noisy sum is
formed by the same floating-point operations: b = 1 is DP-SGD bit for bit with the same streams. A secure stream's
draws are float64 (hardened sampler, :mod:`dptrain.randomness.secure`): the recurrence and its history are then
float64 and the noisy sum is rounded once to the gradient's dtype, as its add_gaussian does.

A step is atomic: :meth:`BandedNoise.__call__` computes w_t without touching the history; :meth:`BandedNoise.commit`
(called where the engine records the release) stores it. A step that fails before its release leaves the history as
it was, and its streams are rolled back by the engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dptrain.accounting.bandmf_ledger import check_unit_coefficients
from dptrain.accounting.bandmf_noise import noise_recurrence
from dptrain.errors import DataError
from dptrain.randomness.streams import Stream


def noise_groups(summed: dict[str, torch.Tensor]) -> list[tuple[str, ...]]:
    """The parameter names noised as one vector: those of one device and dtype, in order (as add_gaussian_noise)."""
    groups: dict[tuple, list[str]] = {}
    for n, s in summed.items():
        groups.setdefault((s.device, s.dtype), []).append(n)
    return [tuple(names) for names in groups.values()]


class BandedNoise:
    """The noise stage of a BandMF run: ``stage(summed, std, stream)`` -> the noisy sums (same signature as
    :func:`dptrain.stages.noise.add_gaussian_noise`), std * w_t added. ``index_of()`` gives the step's index t within
    the BandMF run (the engine reads it from the ledger: 0 starts a run, with no history)."""

    def __init__(self, coefficients, index_of: Callable[[], int]):
        c = check_unit_coefficients(coefficients)
        self.coefficients = tuple(float(x) for x in c)
        rec = noise_recurrence(c)
        self.bands, self.scale = rec.bands, rec.scale
        self._feedback = torch.tensor(rec.feedback, dtype=torch.float64)  # c_j / c_0, j = 1..b-1
        self.index_of = index_of
        #: names -> (b - 1, numel) ring: w_s in row s mod (b - 1), for the last b - 1 steps s
        self._history: dict[tuple[str, ...], torch.Tensor] = {}
        #: w's stored so far in this run: the index t of the next step
        self.count = 0
        self._pending: tuple[int, dict[tuple[str, ...], torch.Tensor]] | None = None

    def _weights(self, t: int, dtype: torch.dtype, device) -> torch.Tensor:
        """a with a[(t - j) mod (b - 1)] = c_j / c_0 for j = 1..min(t, b - 1), 0 elsewhere: sum_j c_j w_{t-j} / c_0 is
        a @ ring."""
        m = self.bands - 1
        a = torch.zeros(m, dtype=torch.float64)
        j = torch.arange(1, min(t, m) + 1)
        a[(t - j) % m] = self._feedback[: len(j)]
        return a.to(device=device, dtype=dtype)

    def __call__(self, summed: dict[str, torch.Tensor], std: float, stream: Stream) -> dict[str, torch.Tensor]:
        t = self.index_of()
        if t not in (0, self.count):
            raise DataError(
                f"the BandMF noise history holds {self.count} steps but the ledger's run is at step {t}: a run "
                "continues only from its own checkpoint (load_state_dict)"
            )
        noisy, pending = {}, {}
        for names in noise_groups(summed):
            flat = summed[names[0]] if len(names) == 1 else torch.cat([summed[n].reshape(-1) for n in names])
            z = stream.gaussian(flat)
            w = z if self.scale == 1.0 else z * self.scale
            if t > 0 and self.bands > 1:
                ring = self._history[names]
                w = (w.reshape(-1) - self._weights(t, ring.dtype, ring.device) @ ring).view(flat.shape)
            if self.bands > 1:
                pending[names] = w
            if w.dtype == flat.dtype:  # std w + x: add_gaussian_noise's operations (w = z exactly when b = 1)
                out = (w * std if self.bands > 1 else w.mul_(std)).add_(flat)
            else:  # a secure stream's float64 noise, rounded once
                out = (flat.to(w.dtype) + std * w).to(flat.dtype)
            if len(names) == 1:
                noisy[names[0]] = out
                continue
            for n, part in zip(names, out.split([summed[n].numel() for n in names]), strict=True):
                noisy[n] = part.view(summed[n].shape)
        self._pending = (t, pending)
        return noisy

    def commit(self) -> None:
        """The release of the step last noised happened: store its w_t (the oldest w drops out of the ring)."""
        if self._pending is None:
            raise DataError("BandMF noise committed without a noised step")
        t, pending = self._pending
        self._pending = None
        if self.bands > 1:
            m = self.bands - 1
            if t == 0:  # a new run: no history before it
                self._history = {k: w.new_zeros((m, w.numel())) for k, w in pending.items()}
            for k, w in pending.items():
                self._history[k][t % m].copy_(w.reshape(-1))
        self.count = t + 1

    @property
    def history_bytes(self) -> int:
        """The memory the history holds (b - 1 vectors of the noised parameters' size)."""
        return sum(r.numel() * r.element_size() for r in self._history.values())

    # -- the private checkpoint --
    def state_dict(self) -> dict:
        """SECRET (the history is noise the releases contain): private checkpoint only."""
        return {
            "coefficients": list(self.coefficients),
            "count": self.count,
            "history": {"\n".join(k): r for k, r in self._history.items()},
        }

    def load_state_dict(self, state: dict, device=None) -> None:
        if [float(x) for x in state.get("coefficients", ())] != list(self.coefficients):
            raise DataError(
                "the checkpoint's BandMF coefficients differ from this run's (the bands, the planned steps or the "
                "optimizer's momentum changed, or the numpy/scipy versions that optimize them: resume with those the "
                "run started with)"
            )
        history = {tuple(k.split("\n")): r.to(device) if device is not None else r for k, r in state["history"].items()}
        count = int(state["count"])
        if self.bands > 1 and count > 0 and not history:
            raise DataError("the checkpoint's BandMF run has steps but no noise history")
        self._history, self.count, self._pending = history, count, None


__all__ = ["BandedNoise", "noise_groups"]
