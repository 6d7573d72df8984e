"""BandMF, decided (``dptrain reproduce bandmf``): does banded matrix factorization buy accuracy over DP-SGD at equal
certified privacy?

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023) report that BandMF with cyclic Poisson sampling matches or beats DP-SGD
in every regime they tried, more so as epsilon grows and when training takes few epochs. Here both methods get the
SAME certified budget, on Fashion-MNIST (55,000 training examples; 5,000 more held out for choosing the learning rate;
the 10,000-image test set for the accuracies), with two models: Tramer & Boneh's CNN on ScatterNet features
("Differentially Private Learning Needs Better Features (or Much More Data)",
:func:`dptrain.models.scatternet.scatter_cnn_fmnist`) and their CNN on pixels (``cnn28``). Target epsilon 1, 3 and 8
at delta 1e-5, sampling rate q = 0.01 (expected batch 550), 10 epochs (1000 steps) and 2 epochs (200 steps), clip
norm C = 1, plain SGD:

- **dpsgd**: DP-SGD, Poisson sampling, its noise calibrated by pld to the target;
- **bandmf**: BandMF (docs/bandmf.md), b secret groups sampled cyclically (rate b q within the group), noise
  C^{-1} Z with the coefficients optimized for the steps (prefix sums: plain SGD), b chosen before training by
  :func:`dptrain.accounting.choose_bands` (the least RMSE of the prefix sums relative to DP-SGD at the target,
  ``bands = "auto"``), its noise calibrated by pld to the same target (ceil(T/b) participations at rate b q);
- **non_private**: the ceiling, a real recipe (momentum 0.9, batch 128, 20 epochs, cosine learning rate, no clipping).

Hyperparameters: the same learning-rate grid for both private methods (0.5, 1, 2); seed 0 trains at every rate, the
one with the best accuracy on the 5,000 held-out examples is kept and seeds 1, 2 train at it; while the best is the
smallest (largest) rate tried, half (twice) it is tried too, up to 4 times each way (0.03125 to 32), the same rule for
both (:func:`dptrain.reproduce.equal_privacy.lr_cell`). The selection reads held-out private data without accounting
for it (for both methods alike: a comparison, not a private release).

Every run is seeded (torch before the model is built, and the engine's sampling and noise streams): a reproducible
experiment whose models are NOT private (the engine's NotPrivateWarning is expected and silenced); the certified
epsilons are what the same runs spend with secret randomness, read from each run's own ledger by pld.

Each finished run is kept in ``OUT/decided.partial.json``, so an interrupted reproduction goes on where it stopped.

Wall time, measured (2026-11-27, 2 otherwise idle CPU cores): a 1000-step private run takes about 22 s with the
ScatterNet CNN and 40 s with cnn28, the same for DP-SGD and BandMF; with at least 130 runs (the learning-rate rule
adds runs where a grid is extended) about 50 minutes at least, plus the ScatterNet features (a few minutes once).
The same runs took 5 to 15 times longer while other jobs loaded the cores.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError
from dptrain.reproduce import equal_privacy
from dptrain.reproduce.equal_privacy import (
    Runs,
    execute,
    load_data,
    lr_cell,
    non_private_row,
    prepare,
    run_key,
    seeds_measured,
)

__all__ = ["DELTA", "EPSILONS", "FULL", "METHODS", "QUICK", "choose_setting", "estimate_seconds", "run"]

PARTIAL = "decided.partial.json"
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = 3
METHODS = ("dpsgd", "bandmf", "non_private")
PRIVATE = METHODS[:2]
FULL: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "models": ("scatternet_cnn", "cnn28"),
    "validation": 5000,
    "sampling_rate": 0.01,
    "epochs": (10, 2),
    "max_grad_norm": 1.0,
    "learning_rates": (0.5, 1.0, 2.0),
    "grid_extension": 4,
    "physical_batch": 256,
    "non_private": {"batch_size": 128, "epochs": 20, "momentum": 0.9, "learning_rates": (0.02, 0.05, 0.1)},
    #: seconds per private step (1000-step runs at q = 0.01 on 2 otherwise idle CPU cores, 2026-11-27: ScatterNet CNN
    #: 22.2 s DP-SGD, 22.7 s BandMF; cnn28 39.6 s and 39.5 s) and per non-private run (modelmix-decided's
    #: measurement): the estimate printed before the experiment starts (:func:`estimate_seconds`)
    "seconds_per_step": {"scatternet_cnn": 0.023, "cnn28": 0.040},
    "seconds_non_private": {"scatternet_cnn": 40.0, "cnn28": 90.0},
}
#: Quick (seconds, for tests): a synthetic Gaussian mixture, two tiny models, one target, one seed.
QUICK: dict[str, Any] = {
    **FULL,
    "dataset": "synthetic",
    "data_options": {"n": 1500, "dim": 10, "num_classes": 3, "separation": 3.0},
    "models": ("logistic", "mlp"),
    "validation": 200,
    "sampling_rate": 0.05,
    "epochs": (1.5, 0.5),
    "learning_rates": (0.5, 2.0),
    "grid_extension": 0,
    "physical_batch": 64,
    "non_private": {"batch_size": 32, "epochs": 3, "momentum": 0.9, "learning_rates": (0.1,)},
    "epsilons": (3.0,),
    "seeds": 1,
    "seconds_per_step": {"logistic": 0.004, "mlp": 0.005},
    "seconds_non_private": {"logistic": 0.5, "mlp": 0.5},
}


# --- the accountants' choice (public quantities only) ---------------------------------------------------------


def choose_setting(target: float, epochs: float, cfg: dict, n_train: int) -> dict[str, Any]:
    """Both private methods' parameters at ``target`` for ``epochs`` epochs: DP-SGD's pld noise; BandMF's b (auto),
    coefficients, RMSE ratio and pld noise; each one's certified epsilon for the planned run."""
    from dptrain.accounting import (
        bandmf_ledger,
        calibrate_dpsgd_noise,
        choose_bands,
        dpsgd_ledger,
        epsilon,
        steps_for_epochs,
    )

    q, clip = cfg["sampling_rate"], cfg["max_grad_norm"]
    steps = steps_for_epochs(epochs, q)
    z = calibrate_dpsgd_noise(target, DELTA, q, steps, accountant="pld")
    choice = choose_bands(steps, q, target, DELTA)  # prefix sums: plain SGD's iterates
    banded = bandmf_ledger(choice.noise_multiplier, q, steps, choice.coefficients)
    return {
        "target_epsilon": target,
        "epochs": epochs,
        "steps": steps,
        "sampling_rate": q,
        "expected_batch_size": q * n_train,
        "max_grad_norm": clip,
        "dpsgd": {
            "noise_multiplier": z,
            "bands": 1,
            "rmse_ratio": 1.0,
            "certified_epsilon": epsilon(dpsgd_ledger(z, q, steps), DELTA, "pld").epsilon,
            "accountant": "pld",
        },
        "bandmf": {
            "noise_multiplier": choice.noise_multiplier,
            "bands": choice.bands,
            "coefficients": list(choice.coefficients),
            "rmse_ratio": choice.rmse_ratio,
            "candidates": {str(b): r for b, r in choice.candidates.items()},
            "certified_epsilon": epsilon(banded, DELTA, "pld").epsilon,
            "accountant": "pld",
        },
    }


# --- one run ------------------------------------------------------------------------------------------------


def train_private(method: str, data: tuple, setting: dict, lr: float, seed: int, cfg: dict) -> dict[str, Any]:
    """One seeded private run of ``method``: validation and test accuracy, and the epsilon pld certifies for the ledger
    the run wrote."""
    import torch

    def optimizer(model):
        return torch.optim.SGD(model.parameters(), lr=lr)

    if method != "bandmf":
        return equal_privacy.train_private(data, setting, method, seed, cfg, DELTA, optimizer)
    s = setting[method]

    def check(trainer) -> None:
        if list(trainer.bandmf.coefficients) != s["coefficients"]:
            raise ConfigError("the engine's BandMF coefficients differ from the ones chosen for the budget")

    return equal_privacy.train_private(
        data, setting, method, seed, cfg, DELTA, optimizer, check=check,
        noise="bandmf", bands=s["bands"], planned_steps=setting["steps"],
    )  # fmt: skip


# --- the experiment -----------------------------------------------------------------------------------------


def _method_key(method: str, epochs: float) -> str:
    return f"{method}@{epochs:g}ep"


def estimate_seconds(cfg: dict, epsilons: tuple, seeds: int, runs: Runs) -> tuple[float, int]:
    """(seconds, runs) left of the experiment's smallest plan: per (model, epochs, target, method) the grid's rates at
    seed 0 and seeds 1.. at one rate, and the non-private ceiling's, less the runs already in the cache; each private
    run timed as its steps x the model's measured seconds per step (``cfg["seconds_per_step"]``, about the same for
    both methods: benchmarks/bandmf_step.py), each non-private run as measured. A grid extended at its ends adds runs."""
    from dptrain.accounting import steps_for_epochs

    total, count = 0.0, 0
    for model in cfg["models"]:
        for epochs in cfg["epochs"]:
            steps = steps_for_epochs(epochs, cfg["sampling_rate"])
            for target in epsilons:
                for method in PRIVATE:
                    key = _method_key(method, epochs)
                    planned = [(r, 0) for r in cfg["learning_rates"]] + [(None, s) for s in range(1, seeds)]
                    done = sum(1 for r, s in planned if r is not None and run_key(model, target, key, r, s) in runs.runs)
                    left = len(planned) - done
                    total, count = total + left * steps * cfg["seconds_per_step"][model], count + left
        left = len(cfg["non_private"]["learning_rates"]) + seeds - 1
        total, count = total + left * cfg["seconds_non_private"][model], count + left
    return total, count


def experiment(cfg: dict, quick: bool, epsilons: tuple, seeds: int, partial: Path) -> dict[str, Any]:
    runs = Runs(partial, quick)
    data = load_data(cfg, quick)
    n_train = {m: len(data[m][0]) for m in cfg["models"]}
    seconds, count = estimate_seconds(cfg, epsilons, seeds, runs)
    print(
        f"dptrain reproduce bandmf: about {count} runs to go, estimated {seconds / 3600:.1f} hours "
        f"({seconds:.0f} s; more if a learning-rate grid is extended)",
        file=sys.stderr,
    )
    rows, cells = [], []
    dataset = "synthetic" if quick else "fashion_mnist"
    for model in cfg["models"]:
        run_cfg = {**cfg, "model": model}
        d = data[model]
        for epochs in cfg["epochs"]:
            for target in epsilons:
                key = f"{n_train[model]}|{epochs:g}|{target:g}"
                if key not in runs.settings:
                    runs.settings[key] = choose_setting(target, epochs, cfg, n_train[model])
                    runs.save()
                setting = runs.settings[key]
                for method in PRIVATE:
                    cell = lr_cell(
                        runs,
                        model,
                        target,
                        _method_key(method, epochs),
                        seeds,
                        cfg["learning_rates"],
                        lambda lr, seed, m=method, d=d, s=setting, c=run_cfg: train_private(m, d, s, lr, seed, c),
                        cfg["grid_extension"],
                    )
                    s = setting[method]
                    accuracies = [r["test_accuracy"] for r in cell["runs"]]
                    rows.append(
                        {
                            "model": model,
                            "epochs": epochs,
                            "target_epsilon": target,
                            "method": method,
                            "bands": s["bands"],
                            **seeds_measured(accuracies, cell["runs"], seeds),
                            "accountant": s["accountant"],
                            "noise_multiplier": s["noise_multiplier"],
                            "rmse_ratio": s["rmse_ratio"],
                        }
                    )
                    cells.append({"model": model, "epochs": epochs, "target_epsilon": target, "method": method, **cell})
        row, cell = non_private_row(runs, model, d, cfg, seeds, dataset)
        row.pop("dataset")
        rows.append({**row, "epochs": cfg["non_private"]["epochs"], "bands": None, "rmse_ratio": None})
        cells.append({**cell, "epochs": cfg["non_private"]["epochs"]})
    settings = [s for k, s in runs.settings.items() if float(k.split("|")[2]) in epsilons]
    return {"dataset": dataset, "rows": rows, "cells": cells, "settings": settings}


def run(out_dir: str | Path, quick: bool = False, seeds: int | None = None, epsilons=None, models=None) -> Path:
    """``dptrain reproduce bandmf``; returns the report's path. ``seeds``: seeds 0..seeds-1 (default 3); ``epsilons``:
    the target epsilons (default 1, 3, 8; a comma-separated string from the CLI); ``models``: some of the models (a
    comma-separated string from the CLI; default both)."""
    from dptrain.reproduce.bandmf_decided_text import render

    cfg, epsilons, seeds, command = prepare("bandmf", out_dir, quick, seeds, epsilons, models, FULL, QUICK, EPSILONS, SEEDS)
    return execute(
        experiment, render, cfg=cfg, quick=quick, epsilons=epsilons, seeds=seeds, out_dir=out_dir, command=command,
        doc=__doc__, partial=PARTIAL, delta=DELTA,
    )
