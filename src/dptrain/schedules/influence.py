"""Noise influence q_t: how much the expected final loss grows per unit of sigma_t^2.

"On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021 submission) writes the utility
bound of private gradient descent as a sum over steps of q_t sigma_t^2 (Thm 4.1, eq. 3), and Lemma 4.1 turns any
positive influence vector into the budget allocation that minimises it (``kind = "influence"``). Two ways to get q:

- :func:`quadratic_influence`: analytic, for a quadratic loss f(theta) = 1/2 (theta - theta*)^T H (theta - theta*) +
  const trained by gradient descent with step eta and noise G sigma_t nu_t / N (nu_t ~ N(0, I); no clipping). Unrolling
  e_{t+1} = (I - eta H) e_t - eta G sigma_t nu_t / N gives E f(theta_{T+1}) = (noise-free loss) + sum_t q_t sigma_t^2 with

      q_t = (eta^2 G^2 / (2 N^2)) sum_j lambda_j (1 - eta lambda_j)^(2 (T - t)),   t = 1..T,

  lambda_j the eigenvalues of H. The paper says only that its squared-loss influence is "computed by analytical
  solution using the Hessian eigen values" (App. D); this formula is our derivation, checked against simulation in
  tests/test_schedule_influence.py. It ignores clipping (the paper's experiments clip at G = 4).
- :func:`estimate_influence`: by retraining, as App. D does: fix every sigma_i (i != t) at a base schedule, set
  sigma_t to each value of a grid (the paper: 20 to 200), train ``repeats`` times, and fit the mean final loss as
  c2 sigma_t^2 + c0 by least squares; q_t = c2. Each repeat uses the same seed at every grid value (common random
  numbers: the fit sees the effect of sigma_t, not the noise of other steps), which also gives one c2 per repeat and
  hence the spread of the estimate. Work is spread over processes and cached per setting.

numpy only (the training run is the caller's ``final_loss`` function).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.errors import ConfigError

#: App. D's grid of sigma_t values (10 points from 20 to 200).
PAPER_GRID = tuple(float(v) for v in np.linspace(20.0, 200.0, 10))


def quadratic_influence(
    eigenvalues: Sequence[float], T: int, learning_rate: float, clip_norm: float, n: int  # noqa: N803
) -> np.ndarray:
    """q_1..q_T of gradient descent on a quadratic loss with Hessian eigenvalues ``eigenvalues`` (see the module
    doc; in log space, so long runs do not underflow)."""
    lam = np.asarray(eigenvalues, dtype=float).reshape(-1)
    if not (lam.size and np.all(np.isfinite(lam)) and np.all(lam >= 0)):
        raise ConfigError("eigenvalues must be finite numbers >= 0 (a positive semi-definite Hessian)")
    if not (isinstance(T, int) and T >= 1):
        raise ConfigError(f"T must be an integer >= 1, got {T!r}")
    if not (learning_rate > 0 and clip_norm > 0 and n >= 1):
        raise ConfigError("learning_rate and clip_norm must be > 0 and n >= 1")
    lam = lam[lam > 0]
    if not lam.size:
        return np.zeros(T)
    k = 2.0 * (T - np.arange(1, T + 1, dtype=float))  # 2 (T - t)
    with np.errstate(divide="ignore"):
        log_base = np.log(np.abs(1.0 - learning_rate * lam))  # (1 - eta lambda)^(even power): its absolute value
    terms = np.log(lam)[None, :] + k[:, None] * log_base[None, :]
    top = np.max(terms, axis=1)
    log_sum = top + np.log(np.sum(np.exp(terms - top[:, None]), axis=1))
    return np.exp(log_sum + 2 * math.log(learning_rate * clip_norm / n) - math.log(2.0))


@dataclass(frozen=True)
class InfluenceFit:
    """The retraining fit of one step t: final loss ~ c2 sigma_t^2 + c0."""

    t: int
    c2: float  # the influence estimate q_t
    c0: float
    #: mean and variance (over repeats) of the final loss at each grid value
    loss_mean: list[float]
    loss_var: list[float]
    #: c2 fitted to each repeat's curve (same seed at every grid value)
    c2_per_repeat: list[float]

    @property
    def relative_variance(self) -> float:
        """Variance / mean of the final loss over repeats, averaged over the grid (App. D's "relative variance")."""
        return float(np.mean(np.asarray(self.loss_var) / np.abs(np.asarray(self.loss_mean))))

    @property
    def c2_relative_variance(self) -> float:
        """Variance / mean of the per-repeat quadratic coefficient (App. D reports it for the logistic loss)."""
        c = np.asarray(self.c2_per_repeat)
        return float(np.var(c) / abs(np.mean(c)))


@dataclass(frozen=True)
class InfluenceEstimate:
    q: np.ndarray  # q_t for t = 1..T (nan where not estimated)
    grid: tuple[float, ...]
    repeats: int
    fits: dict[int, InfluenceFit] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "q": [None if not math.isfinite(v) else float(v) for v in self.q],
            "grid": list(self.grid),
            "repeats": self.repeats,
            "fits": {
                str(t): {**f.__dict__, "relative_variance": f.relative_variance, "c2_relative_variance": f.c2_relative_variance}
                for t, f in self.fits.items()
            },
        }


def _fit(grid: np.ndarray, losses: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Least squares of losses (repeats x grid) on [sigma^2, 1]: (c2, c0) of the mean curve, and c2 per repeat."""
    design = np.stack([grid**2, np.ones_like(grid)], axis=1)
    coef, *_ = np.linalg.lstsq(design, losses.T, rcond=None)  # (2, repeats): the fit is linear in the data
    mean = coef.mean(axis=1)  # = the fit of the mean curve
    return float(mean[0]), float(mean[1]), coef[0]


def _run_cell(final_loss, batched: bool, base: np.ndarray, t: int, sigma: float, seeds: Sequence[int]) -> list[float]:
    sigmas = base.copy()
    sigmas[t - 1] = sigma
    if batched:
        return [float(v) for v in final_loss(sigmas, list(seeds))]
    return [float(final_loss(sigmas, seed)) for seed in seeds]


def _cache_path(cache: str | os.PathLike, setting: Any, base: np.ndarray, grid: np.ndarray, repeats: int, seed: int):
    key = json.dumps(
        {"setting": setting, "base": base.tolist(), "grid": grid.tolist(), "repeats": repeats, "seed": seed},
        sort_keys=True,
        default=str,
    )
    key_hash = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache) / f"influence-{key_hash}.json"


def estimate_influence(
    final_loss: Callable[[np.ndarray, int], float],
    base_sigmas: Sequence[float],
    *,
    steps: Sequence[int] | None = None,
    grid: Sequence[float] = PAPER_GRID,
    repeats: int = 100,
    seed: int = 0,
    workers: int | None = 1,
    cache: str | os.PathLike | None = None,
    setting: Any = None,
    progress: bool = False,
    batched: bool = False,
) -> InfluenceEstimate:
    """q_t by retraining (App. D; see the module doc). ``final_loss(sigmas, seed)``: the final loss of one training
    run with noise multipliers ``sigmas`` (length T) and randomness ``seed`` (a top-level function, or a
    functools.partial of one, so that worker processes can run it). ``steps``: the t (1-based) to estimate (default
    all). ``workers``: processes (None: all cores). ``cache``: a directory; results are kept per (``setting``, base
    schedule, grid, repeats, seed), and ``setting`` must name everything else the runs depend on. ``batched``:
    ``final_loss(sigmas, seeds)`` takes the list of seeds and returns one final loss per seed (runs vectorised over
    repeats)."""
    base = np.asarray(base_sigmas, dtype=float).reshape(-1)
    if not (base.size and np.all(np.isfinite(base)) and np.all(base > 0)):
        raise ConfigError("base_sigmas must be T >= 1 finite numbers > 0")
    T = base.size  # noqa: N806
    grid_a = np.asarray(grid, dtype=float)
    if grid_a.size < 2 or not np.all(grid_a > 0) or np.unique(grid_a).size != grid_a.size:
        raise ConfigError("grid must hold at least 2 distinct sigma values > 0")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ConfigError(f"repeats must be an integer >= 1, got {repeats!r}")
    steps = list(range(1, T + 1)) if steps is None else [int(t) for t in steps]
    bad = [t for t in steps if not 1 <= t <= T]
    if bad:
        raise ConfigError(f"steps must be in 1..{T}, got {bad[0]}")
    seeds = [seed + r for r in range(repeats)]
    path = None if cache is None else _cache_path(cache, setting, base, grid_a, repeats, seed)
    done: dict[str, list[list[float]]] = {}
    if path is not None and path.exists():
        done = json.loads(path.read_text())
    todo = [t for t in steps if str(t) not in done]
    cells = [(t, float(s)) for t in todo for s in grid_a]
    results: dict[tuple[int, float], list[float]] = {}
    if cells:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(cells), unit="cell", desc="influence by retraining")
        if workers == 1:
            for cell in cells:
                results[cell] = _run_cell(final_loss, batched, base, *cell, seeds)
                bar is not None and bar.update(1)
        else:
            with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
                futures = {pool.submit(_run_cell, final_loss, batched, base, *cell, seeds): cell for cell in cells}
                for future in concurrent.futures.as_completed(futures):
                    results[futures[future]] = future.result()
                    bar is not None and bar.update(1)
        if bar is not None:
            bar.close()
        for t in todo:
            done[str(t)] = [results[(t, float(s))] for s in grid_a]  # grid x repeats
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(done))
            os.replace(tmp, path)
    q = np.full(T, np.nan)
    fits = {}
    for t in steps:
        losses = np.asarray(done[str(t)], dtype=float).T  # repeats x grid
        c2, c0, per_repeat = _fit(grid_a, losses)
        q[t - 1] = c2
        fits[t] = InfluenceFit(
            t, c2, c0, losses.mean(axis=0).tolist(), losses.var(axis=0).tolist(), per_repeat.tolist()
        )
    return InfluenceEstimate(q, tuple(float(v) for v in grid_a), repeats, fits)


__all__ = ["PAPER_GRID", "InfluenceEstimate", "InfluenceFit", "estimate_influence", "quadratic_influence"]
