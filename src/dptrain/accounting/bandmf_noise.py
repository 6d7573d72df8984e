"""The correlated noise of banded matrix factorization, as a reference in plain numpy: w = C^{-1} z streamed step by
step (what the engine implements in torch) and by a dense triangular solve (what the tests compare it with).

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023). C is T x T lower-triangular banded Toeplitz with first column
c_0..c_{b-1}; step t of the run adds sigma * clip * w_t to the sum of clipped gradients, where w = C^{-1} z and z has
independent standard normal rows. Because C is lower-triangular and b-banded, row t of C w = z reads
c_0 w_t + c_1 w_{t-1} + ... + c_{b-1} w_{t-b+1} = z_t, so

    w_t = (z_t - sum_{j=1}^{b-1} c_j w_{t-j}) / c_0,

which needs only the b - 1 previous noise vectors (the run's secret noise state; a checkpoint must keep them, and a
new run, or a new BandMF ledger entry, starts with none). numpy only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy import linalg

from dptrain.accounting.bandmf_strategy import check_coefficients, check_steps


@dataclass(frozen=True)
class NoiseRecurrence:
    """w_t = scale * z_t - sum_{j=1}^{b-1} feedback[j-1] * w_{t-j}: scale = 1/c_0, feedback_j = c_j/c_0
    (w_{t-j} = 0 before the run's first step). The whole recipe an engine needs besides its Gaussian draws z_t."""

    scale: float
    feedback: tuple[float, ...]

    @property
    def bands(self) -> int:
        return len(self.feedback) + 1


def noise_recurrence(coefficients) -> NoiseRecurrence:
    """The recurrence of w = C^{-1} z for C with first column ``coefficients`` (the streamed solve of the banded
    lower-triangular system C w = z; Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", the noise
    generation of their Algorithm 9 specialized to a Toeplitz C)."""
    c = check_coefficients(coefficients)
    return NoiseRecurrence(float(1.0 / c[0]), tuple(float(x / c[0]) for x in c[1:]))


def streamed_noise(coefficients, z) -> np.ndarray:
    """w = C^{-1} z computed row by row from the b - 1 previous rows only (``z``: shape (T,) or (T, d), one row per
    step); the reference the engine's torch implementation is tested against."""
    rec = noise_recurrence(coefficients)
    z = np.asarray(z, dtype=float)
    history: deque[np.ndarray] = deque(maxlen=rec.bands - 1)  # w_{t-1}, w_{t-2}, ... (newest first)
    out = np.empty_like(z)
    for t in range(z.shape[0]):
        w = rec.scale * z[t]
        for f, past in zip(rec.feedback, history, strict=False):
            w = w - f * past
        out[t] = w
        if rec.bands > 1:
            history.appendleft(out[t])
    return out


def strategy_matrix(coefficients, steps: int) -> np.ndarray:
    """The dense T x T lower-triangular banded Toeplitz C (columns truncated at the last row)."""
    c, steps = check_coefficients(coefficients), check_steps(steps)
    column = np.zeros(steps)
    n = min(steps, len(c))
    column[:n] = c[:n]
    return linalg.toeplitz(column, np.zeros(steps))


def dense_noise(coefficients, z) -> np.ndarray:
    """w = C^{-1} z by a dense lower-triangular solve (for tests)."""
    z = np.asarray(z, dtype=float)
    return linalg.solve_triangular(strategy_matrix(coefficients, z.shape[0]), z, lower=True)
