"""Reproduction of the counter-example of Sun, Suresh & Menon, "The importance of feature preprocessing for
differentially private linear optimization" (Sec. 4, Theorem 3, Lemmas 2 and 8, App. A;
docs/dpsgd_f.md).

``run(out_dir, quick=False)`` writes ``counterexample.md`` (the report), ``counterexample.json`` (every number) and
``counterexample.png`` into ``out_dir``.

The data set D' (d = 2): n/2 copies of x = mu e1 + e2 with y = +1 and n/2 copies of x = mu e1 - e2 with y = -1.
Hinge loss l(z, y) = max{1 - y z, 0} on the score z = w.x + b of a ``torch.nn.Linear(2, 1)`` started at w = 0,
b = 0 (footnote 3: a bias feature gives the same result; w* = (0, 1), b* = 0 has zero loss, so min L = 0 and the
reported gap is L(w, D') itself). Every point has norm R = sqrt(mu^2 + 1), so feature normalization to C_F = R
changes nothing (the hinge loss is not scale invariant: C_F = R keeps the problem the paper's).

Formulas (each cited where it is used):

- Lemma 2: L(w, D') - min L >= E[max{1 - w(2), 0}] >= Pr(w(2) <= 0), for every iterate and the average iterate;
  the same holds with the labels flipped (D''), and both bounds hold with any bias since
  0.5 max{1 - s - w(2), 0} + 0.5 max{1 + s - w(2), 0} >= max{1 - w(2), 0} for s = mu w(1) + b (convexity).
- Lemma 8 (App. A, with Bassily et al.'s noise sigma^2 = 8 T C^2 log(1/delta)/(n^2 eps^2) on the averaged
  gradient, w_0(2) <= 0): Pr(avg w(2) <= 0) >= Pr(N(m, v) <= 0) = Phi(-m/sqrt(v)), m = min{1, C/sqrt(mu^2 + 1)},
  v = 16 (2T + 1) C^2 log(1/delta) / (3 (T + 1) n^2 eps^2) (the printed last display has the inequality
  reversed; the lemma's statement has the right direction).
- The universal floor (derived from Lemma 8): since m < C/mu and (2T + 1)/(T + 1) >= 3/2, for n < mu/eps
  m/sqrt(v) <= n eps/(mu sqrt(8 log(1/delta))) < 1/sqrt(8 log(1/delta)), so Pr(w(2) <= 0) >=
  Phi(-1/sqrt(8 log(1/delta))) = 0.4585 at delta = 1e-5, whatever C, eta and T.
- DPSGD-F's residual offset (derived, not in the paper): ||mu_hat - mu|| ~ sigma_F R sqrt(d)/n for the
  Gaussian mean of Algorithm 3 (and of this library's Algorithm 2, which uses the same Gaussian mean instead of
  Huang et al.'s estimator), so DPSGD-F is DPSGD on a counter-example with mu replaced by that offset.

The methods, all through :func:`dptrain.dpsgd_f.make_private_dpsgd_f` at (eps, delta) = (1, 1e-5) except the
non-private reference: ``dpsgd`` (kind "none": DP-SGD on the raw features, Poisson sampling, PLD-calibrated
noise), ``dpsgd_f`` (kind "private_mean", eps_F = 0.1: Algorithm 3), ``dpsgd_f_theory`` (kind "dpsgd_f_theory":
Algorithm 2 with the paper's quantile tail (100/eps) ln n), ``dpsgd_f_theory_median`` (Algorithm 2 with
quantile_tail = n/2: tau = a private median of the distances; see the report for why) and ``nonprivate``
(:func:`dptrain.engine.api.make_private` with ``non_private=True``: the same clipped (S)GD without noise, a reference
for what is an optimization limit and what a privacy one).

Hyper-parameters: one grid for every method (normalized learning rate kappa = lr C^2 x clip norm C x schedule);
the best configuration per (method, mu) is chosen by the mean gap over separate tuning seeds, then re-run on the
evaluation seeds (the paper also tunes without accounting for it, footnote 8). Both outputs are reported: the model
``run.raw_model()`` returns (the last iterate) and the average of the iterates w_1..w_T (Algorithm 1's output;
post-processing, free), each with its own selection.

The parts: :mod:`~dptrain.reproduce.dpsgd_f_counterexample_setup` (the problem and the settings), this module (one
run and the experiment), :mod:`~dptrain.reproduce.dpsgd_f_counterexample_text` (the report).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dptrain.accounting import certified_epsilon, gaussian_mechanism_noise
from dptrain.reproduce import single_thread
from dptrain.reproduce.dpsgd_f_counterexample_setup import (
    CLIP_FREE,
    DELTA,
    EPS_F,
    EPSILON,
    FULL,
    METHODS,
    NONPRIVATE_EXTRA_KAPPAS,
    QUICK,
    Config,
    counterexample_data,
    hinge_gap,
    hinge_per_example,
    lemma8_bound,
    universal_floor,
)
from dptrain.reproduce.dpsgd_f_counterexample_text import render

__all__ = [
    "FULL",
    "METHODS",
    "QUICK",
    "Config",
    "counterexample_data",
    "experiment",
    "hinge_per_example",
    "lemma8_bound",
    "render",
    "run",
    "train_once",
    "universal_floor",
]

# --- one run ------------------------------------------------------------------------------------------------------


def _zero_linear() -> nn.Linear:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    return model


def train_once(
    method: str,
    n: int,
    mu: float,
    kappa: float,
    clip: str,
    epochs: int,
    batch_frac: float,
    seed: int,
    certify=None,
) -> dict[str, Any]:
    """One training run; returns the gaps of the last and of the average iterate (on the raw features) and what
    the preprocessing released. The SGD learning rate is kappa / C^2 with C the clip norm in effect: the grid's C
    for DPSGD and Alg. 3, sqrt(2) tau for Alg. 2 (tau is released, so the rate is post-processing)."""
    from dptrain.dpsgd_f import make_private_dpsgd_f
    from dptrain.engine.api import make_private

    x, y = counterexample_data(n, mu)
    r = math.sqrt(mu * mu + 1)
    c = 1.0 if clip == "1" else r
    batch = batch_frac * n
    model = _zero_linear()

    def sgd(params, clip_norm: float) -> torch.optim.Optimizer:  # lr = kappa / C^2, C the clip norm in effect
        return torch.optim.SGD(params, lr=kappa / clip_norm**2)

    torch.manual_seed(seed)
    out: dict[str, Any] = {"seed": seed}
    if method == "nonprivate":
        trainer = make_private(
            model,
            sgd(model.parameters(), c),
            (x, y),
            noise_multiplier=0.0,
            non_private=True,
            max_grad_norm=c,
            batch_size=batch,
            loss_fn=hinge_per_example,
            seed=seed,
        )
        to_raw = lambda m: m  # noqa: E731  (raw features already; normalization to R is the identity)
        prep = None
    else:
        kind = METHODS[method][1]
        options: dict[str, Any] = {}
        if method == "dpsgd_f":
            options["eps_f"] = EPS_F
        if method == "dpsgd_f_theory_median":
            options["quantile_tail"] = n // 2
        run = make_private_dpsgd_f(
            model,
            sgd,
            (x, y),
            target_epsilon=EPSILON,
            target_delta=DELTA,
            feature_norm=r,
            kind=kind,
            epochs=epochs,
            batch_size=batch,
            max_grad_norm=c,
            loss_fn=hinge_per_example,
            lipschitz=1.0,  # the hinge loss is 1-Lipschitz in the score (Alg. 2's clip norm sqrt(2) G tau)
            seed=seed,
            **options,
        )
        trainer, prep = run.trainer, run.preprocessing
        to_raw = prep.raw_model
    out["lr"] = trainer.optimizer.param_groups[0]["lr"]
    trained = trainer.model
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in trained.state_dict().items()}
    count = 0

    def accumulate(_result) -> None:
        nonlocal count
        for k, v in trained.state_dict().items():
            total[k] += v.double()
        count += 1

    try:
        trainer.train(epochs=epochs, callback=accumulate)
    finally:
        trainer.close()
    average = copy.deepcopy(trained)
    average.load_state_dict({k: (v / max(count, 1)).float() for k, v in total.items()})
    last_raw, avg_raw = to_raw(trained), to_raw(average)
    out["gap_last"] = hinge_gap(last_raw, x, y)
    out["gap_avg"] = hinge_gap(avg_raw, x, y)
    w_last, w_avg = _raw_weight(last_raw), _raw_weight(avg_raw)
    out["w2_last"], out["w2_avg"] = w_last[1], w_avg[1]
    out["steps"] = trainer.steps
    out["noise_multiplier"] = trainer.noise_multiplier
    out["clip_norm"] = float(trainer.clipping.sensitivity)
    if prep is not None:
        if certify is not None:
            out["epsilon"] = float(certify(trainer.ledger, DELTA, trainer.accountant).epsilon)
        if prep.mean is not None:
            out["mean_error"] = float(
                (prep.mean.double() - torch.tensor([mu, 0.0], dtype=torch.float64)).norm()
            )
        if prep.tau is not None:
            out["tau"] = float(prep.tau)
    return out


def _raw_weight(model: nn.Module) -> list[float]:
    layer = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return [float(v) for v in layer.weight.detach().reshape(-1)]


# --- the experiment ----------------------------------------------------------------------------------------------


def _grid(config: Config, method: str) -> list[dict[str, Any]]:
    clips = ("1",) if method in CLIP_FREE else config.clips
    kappas = config.kappas + (NONPRIVATE_EXTRA_KAPPAS if method == "nonprivate" else ())
    return [
        {"kappa": k, "clip": c, "epochs": e, "batch_frac": b}
        for (e, b) in config.schedules
        for c in clips
        for k in kappas
    ]


def _summary(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    v = np.array([r[key] for r in runs], dtype=np.float64)
    return {
        "values": v.tolist(),
        "mean": float(v.mean()),
        "median": float(np.median(v)),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
    }


def experiment(config: Config, log=None) -> dict[str, Any]:
    """For every mu and method: the grid on the tuning seeds, the best configuration for the last and for the
    average iterate (smallest mean gap), each re-run on the evaluation seeds."""
    results: dict[str, Any] = {"config": asdict(config), "cells": []}
    certify = certified_epsilon  # memoized by ledger content inside dptrain.accounting
    for mu in config.mus:
        for method in METHODS:
            t0 = time.perf_counter()
            tune_seeds = config.tune_seeds[:1] if method == "nonprivate" else config.tune_seeds
            grid = []
            for cfg in _grid(config, method):
                runs = [train_once(method, config.n, mu, seed=s, certify=certify, **cfg) for s in tune_seeds]
                grid.append(
                    {
                        **cfg,
                        "gap_last": float(np.mean([r["gap_last"] for r in runs])),
                        "gap_avg": float(np.mean([r["gap_avg"] for r in runs])),
                    }
                )
            cell: dict[str, Any] = {"mu": mu, "method": method, "grid": grid}
            evaluated: dict[tuple, list[dict[str, Any]]] = {}
            for output in ("last", "avg"):
                best = min(grid, key=lambda g, o=output: g[f"gap_{o}"])  # first (smallest kappa) on ties
                cfg = {k: best[k] for k in ("kappa", "clip", "epochs", "batch_frac")}
                key = tuple(cfg.values())
                if key not in evaluated:
                    evaluated[key] = [
                        train_once(method, config.n, mu, seed=s, certify=certify, **cfg)
                        for s in config.eval_seeds
                    ]
                runs = evaluated[key]
                gap = _summary(runs, f"gap_{output}")
                w2 = np.array([r[f"w2_{output}"] for r in runs])
                entry = {
                    "selected": cfg,
                    "tune_gap": best[f"gap_{output}"],
                    "gap": gap,
                    "w2": w2.tolist(),
                    "pr_w2_nonpositive": float(np.mean(w2 <= 0)),
                    "steps": runs[0]["steps"],
                    "noise_multiplier": runs[0]["noise_multiplier"],
                    "clip_norm": runs[0]["clip_norm"],
                    "lr": _summary(runs, "lr"),
                    "epsilon": runs[0].get("epsilon"),
                }
                for extra in ("tau", "mean_error"):
                    if extra in runs[0]:
                        entry[extra] = _summary(runs, extra)
                if method == "dpsgd":
                    entry["lemma8_bound"] = lemma8_bound(mu, config.n, runs[0]["clip_norm"], runs[0]["steps"])
                cell[output] = entry
            cell["seconds"] = time.perf_counter() - t0
            results["cells"].append(cell)
            if log is not None:
                log(
                    f"mu={mu:g} {method}: last {cell['last']['gap']['mean']:.3g}, avg {cell['avg']['gap']['mean']:.3g}"
                    f" ({cell['seconds']:.1f} s)"
                )
    return results


def run(out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``counterexample.md``.
    ``quick``: 3 values of mu, a 6-point learning-rate grid with C = 1 and one schedule, 1 tuning seed and 3
    evaluation seeds (about 20 s)."""
    command = f"dptrain reproduce dpsgd-f-counterexample --out {Path(out_dir)}" + (
        " --quick" if quick else ""
    )
    start = time.perf_counter()
    with single_thread():  # a 3-parameter model
        results = experiment(QUICK if quick else FULL)
    results.update(
        command=command,
        quick=quick,
        wall_s=time.perf_counter() - start,
        epsilon=EPSILON,
        delta=DELTA,
        eps_f=EPS_F,
        sigma_f=gaussian_mechanism_noise(EPS_F, DELTA),
        floor=universal_floor(),
    )
    return render(results).write(out_dir)
