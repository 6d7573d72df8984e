"""Weight averaging: an exponential moving average (EMA) of the model's trainable parameters over the released
iterates (De, Berrada, Hayes, Smith & Balle, "Unlocking High-Accuracy Differentially Private Image Classification
through Scale", 2022, Section 3: "parameter averaging").

After step t (t = 1, 2, ...) releases the iterate theta_t, the average becomes

    ema_t = ema_{t-1} + w_t (theta_t - ema_{t-1}),   w_t = (1 - beta) / (1 - beta^t)

which is sum_{s=1..t} beta^(t-s) theta_s (1 - beta) / (1 - beta^t): the EMA of decay beta over theta_1..theta_t with the
bias correction of Kingma & Ba ("Adam: A Method for Stochastic Optimization", Algorithm 1, the division by 1 - beta^t).
That correction is the warm-up: ema_1 = theta_1, and the initial (data-independent) model theta_0 has no weight, so a
short run is not dominated by its random initialization (0.999^234 = 0.79 would be its weight without it).

Privacy: every theta_s is a release of a run whose every iterate is released (DP-SGD), so the average is
post-processing: it spends nothing and writes nothing in the ledger. A run releasing only its last iterate (projected
noisy SGD) is refused: its intermediate iterates are not releases.

Precision: the average is kept in at least float32 (``torch.promote_types(dtype, float32)``: float64 parameters in
float64), whatever the parameters' dtype. In a bfloat16 or float16 model each step moves the average by w_t (theta_t -
ema), about (1 - beta) times the distance the model travels in 1 / (1 - beta) steps, far below half a unit in the last
place of bfloat16 (2^-9 of the value): rounded to the parameter's dtype every step, the average would stay at the first
iterate. It is rounded to the parameters' dtype only where it is applied (evaluated or saved).

Buffers are not averaged: the averaged model uses the current model's buffers (and frozen parameters). A buffer is not
trained by the gradient: in a private run it is constant (a buffer a training-mode forward writes from the batch is
refused, :mod:`dptrain.preflight.buffers`), so averaging it would change nothing, and where the user kept one
(buffer_updates = "not_private", e.g. BatchNorm's running statistics, themselves an average; an integer counter)
averaging it would mix statistics of different models.
"""

from __future__ import annotations

import contextlib
import math

import torch

from dptrain.errors import ConfigError, DataError


def check_decay(decay) -> float:
    """An EMA decay beta in (0, 1)."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay < 1:
        raise ConfigError(f"training.ema must be a decay in (0, 1), e.g. 0.999, got {decay!r}")
    return float(decay)


def average_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the average of parameters of ``dtype`` is kept in: at least float32 (bfloat16, float16 -> float32)."""
    return torch.promote_types(dtype, torch.float32)


class WeightAverage:
    """The EMA of a model's trainable parameters ``params`` (name -> parameter), updated after each released step."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float):
        self.decay = check_decay(decay)
        self.params = params
        # (ema_0 = theta_0: its weight in ema_t is 0 by the correction; a copy keeps the shapes and devices, in at
        # least float32: :func:`average_dtype`)
        self.averages = {n: p.detach().to(average_dtype(p.dtype), copy=True) for n, p in params.items()}

    def weight(self, step: int) -> float:
        """w_t = (1 - beta) / (1 - beta^t) for step t >= 1 (computed in float64; 1 at t = 1)."""
        return (1.0 - self.decay) / -math.expm1(step * math.log(self.decay))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the iterate the step ``step`` (from 1) released: ema += w_t (theta_t - ema)."""
        w = 1.0 if step == 1 else self.weight(step)
        names = list(self.averages)
        iterates = [self.params[n].detach().to(self.averages[n].dtype) for n in names]  # (no copy when the dtypes agree)
        torch._foreach_lerp_([self.averages[n] for n in names], iterates, w)

    @contextlib.contextmanager
    def applied(self):
        """The model with the averaged parameters inside (its buffers and frozen parameters as they are); the
        iterate's values are put back on leaving, bit for bit."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.averages[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    def state_dict(self) -> dict:
        return {"decay": self.decay, "averages": {n: t.clone() for n, t in self.averages.items()}}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise DataError("the checkpoint holds no weight average: it was written by a run without training.ema")
        if float(state["decay"]) != self.decay or set(state["averages"]) != set(self.averages):
            raise DataError(
                f"the checkpoint's weight average (decay {state['decay']}) is not this run's (decay {self.decay})"
            )
        for n, t in state["averages"].items():
            self.averages[n].copy_(t)


__all__ = ["WeightAverage", "average_dtype", "check_decay"]
