"""The counter-example problem of Sun, Suresh & Menon, "The importance of feature preprocessing for differentially
private linear optimization" (Sec. 4; docs/dpsgd_f.md) and the reproduction's settings: the data set D', the hinge
loss and the gap to its minimum, the universal floor of Theorem 3 and DPSGD's bound of Lemma 8, the methods compared
and the full and quick grids."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from scipy import stats
from torch import nn

REPORT, DATA_JSON, PLOT = "counterexample.md", "counterexample.json", "counterexample.png"
EPSILON, DELTA, EPS_F = 1.0, 1e-5, 0.1

#: name -> (label, make_private_dpsgd_f kind or None for the non-private reference)
METHODS: dict[str, tuple[str, str | None]] = {
    "dpsgd": ("DPSGD", "none"),
    "dpsgd_f": ("DPSGD-F Alg. 3 (eps_F = 0.1)", "private_mean"),
    "dpsgd_f_theory": ("DPSGD-F Alg. 2 (tail (100/eps) ln n)", "dpsgd_f_theory"),
    "dpsgd_f_theory_median": ("DPSGD-F Alg. 2 (tail n/2: median)", "dpsgd_f_theory"),
    "nonprivate": ("clipped GD, no noise (not private)", None),
}
PRIVATE_METHODS = ("dpsgd", "dpsgd_f", "dpsgd_f_theory", "dpsgd_f_theory_median")
#: The non-private reference also tries these larger normalized rates: without noise nothing limits the step, and
#: at mu = 1e6 with C = 1 the clipped signal on w(2) is 1/R per step.
NONPRIVATE_EXTRA_KAPPAS = (1e5, 1e6, 1e7)
#: Algorithm 2 sets the clip norm itself (sqrt(2) G tau), so the grid's clip axis is one point for it.
CLIP_FREE = ("dpsgd_f_theory", "dpsgd_f_theory_median")


@dataclass(frozen=True)
class Config:
    n: int
    mus: tuple[float, ...]
    kappas: tuple[float, ...]  # normalized learning rates: lr = kappa / C^2, C the clip norm in effect
    clips: tuple[
        str, ...
    ]  # "1" (C = 1, the paper's C_G) or "R" (C = R = sqrt(mu^2 + 1): DPSGD clips nothing)
    schedules: tuple[tuple[int, float], ...]  # (epochs, expected batch size as a fraction of n)
    tune_seeds: tuple[int, ...]
    eval_seeds: tuple[int, ...]


FULL = Config(
    n=10_000,
    mus=(1e1, 1e2, 1e3, 1e4, 3e4, 1e5, 1e6),
    kappas=(1e-4, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4),
    clips=("1", "R"),
    schedules=((10, 0.1), (300, 1.0)),
    tune_seeds=(100, 101),
    eval_seeds=(0, 1, 2, 3, 4),
)
QUICK = Config(
    n=10_000,
    mus=(1e1, 1e3, 2e4),
    kappas=(1e-4, 1e-2, 1e-1, 1.0, 10.0, 100.0),
    clips=("1",),
    schedules=((10, 0.1),),
    tune_seeds=(100,),
    eval_seeds=(0, 1, 2),
)


def counterexample_data(n: int, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """D' of Sec. 4: n/2 copies of (mu, 1) with y = +1, n/2 copies of (mu, -1) with y = -1 (y as float)."""
    if n < 2 or n % 2:
        raise ValueError(f"n must be even and >= 2, got {n}")
    x = torch.zeros(n, 2)
    x[:, 0] = mu
    x[: n // 2, 1], x[n // 2 :, 1] = 1.0, -1.0
    y = torch.ones(n)
    y[n // 2 :] = -1.0
    return x, y


def hinge_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """max{1 - y z, 0} per example, z the score (outputs [B, 1]) and y in {-1, +1} (float targets [B])."""
    return torch.clamp(1 - targets * outputs.squeeze(1), min=0)


@torch.no_grad()
def hinge_gap(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """L(w, D') - min L = L(w, D') (min L = 0), evaluated in float64 on a float64 copy of ``model`` (the returned
    float32 parameters are kept exactly; only the arithmetic is exact enough at mu = 1e6)."""
    m = copy.deepcopy(model).double()
    return float(hinge_per_example(m(x.double()), y.double()).mean())


def universal_floor(delta: float = DELTA) -> float:
    """Phi(-1/sqrt(8 log(1/delta))): the floor of Pr(w(2) <= 0), hence of the gap (Lemma 2), for n < mu/eps,
    derived from Lemma 8 (App. A) with m < C/mu and (2T + 1)/(T + 1) >= 3/2."""
    return float(stats.norm.cdf(-1.0 / math.sqrt(8 * math.log(1 / delta))))


def lemma8_bound(
    mu: float, n: int, clip: float, steps: int, epsilon: float = EPSILON, delta: float = DELTA
) -> float:
    """Lemma 8 (App. A): Pr(avg w(2) <= 0) >= Phi(-m/sqrt(v)), m = min{1, C/sqrt(mu^2 + 1)},
    v = 16 (2T + 1) C^2 log(1/delta)/(3 (T + 1) n^2 eps^2) (Bassily et al.'s noise, w_0(2) <= 0)."""
    m = min(1.0, clip / math.sqrt(mu * mu + 1))
    v = 16 * (2 * steps + 1) * clip**2 * math.log(1 / delta) / (3 * (steps + 1) * n * n * epsilon**2)
    return float(stats.norm.cdf(-m / math.sqrt(v)))
