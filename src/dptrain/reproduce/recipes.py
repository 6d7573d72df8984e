"""Recipes (``dptrain reproduce recipes``): the most accurate models at a certified budget, with and without weight
averaging and augmentation multiplicity.

Fashion-MNIST (55,000 training examples; 5,000 more held out for choosing hyperparameters; the 10,000-image test set
for the accuracies), target epsilon 1, 3 and 8 at delta 1e-5, Poisson sampling, the noise calibrated by pld (the
tightest accountant for these runs), the certificate read from each run's own ledger. The recipes:

- **scatternet_linear**: Tramer & Boneh's ScatterNet + linear ("Differentially Private Learning Needs Better Features
  (or Much More Data)", ICLR 2021): per-example GroupNorm of the (81, 7, 7) ScatterNet features, one linear layer;
  expected batch 8192, 60 epochs, momentum 0.9, clip norm 0.1 (their setting, with Poisson batches instead of their
  shuffled ones, so that the accounting holds);
- **scatternet_cnn**: their CNN on the same features, at modelmix-decided's setting (expected batch 550, 10 epochs,
  plain SGD, clip norm 1), DP-SGD's best there;
- **cnn28** and **cnn28_augment**: their CNN on the pixels at the same setting, without and with augmentation
  multiplicity (De, Berrada, Hayes, Smith & Balle, "Unlocking High-Accuracy Differentially Private Image
  Classification through Scale", 2022): K = 4 views of each example (random crops of the zero-padded image,
  horizontal flips) averaged before clipping, at epsilon 3.

Every run also keeps the exponential moving average of its released iterates (De et al.'s weight averaging: post-
processing, no privacy cost) at decays 0.9, 0.99 and 0.999; the ``+ema`` rows report it.

Hyperparameters, the same way for every row: seed 0 trains at each learning rate of the recipe's grid, the one with the
best accuracy on the held-out examples is kept and seeds 1, 2 train at it; while the best is at an end of the rates
tried, half (twice) it is tried too, up to 4 times each way (:func:`dptrain.reproduce.equal_privacy.lr_cell`). An
``+ema`` row's learning rate is chosen the same way on the averaged model's held-out accuracy (its best decay at each
rate), from the same runs, and its decay on seed 0's held-out accuracy at that rate. The selection reads held-out
private data without accounting for it (every row alike: a comparison, not a private release). The test set is read
once per run, for the numbers reported.

Every run is seeded (torch before the model is built, and the engine's streams): a reproducible experiment whose
models are NOT private (the engine's NotPrivateWarning is expected and silenced); the certified epsilons are what the
same runs spend with secret randomness.

Each finished run is kept in ``OUT/recipes.partial.json``, so an interrupted reproduction goes on where it stopped.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from dptrain.reproduce.equal_privacy import (
    Runs,
    build,
    classes,
    execute,
    load_data,
    lr_cell,
    prepare,
    run_key,
    scored,
    seeds_measured,
)

__all__ = ["DELTA", "EMA_DECAYS", "EPSILONS", "FULL", "QUICK", "RECIPES", "choose_setting", "run"]

PARTIAL = "recipes.partial.json"
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
SEEDS = 3
EMA_DECAYS = (0.9, 0.99, 0.999)
#: recipe -> its model and training setting; ``epsilons``: the targets it runs at (default: all of the experiment's)
RECIPES: dict[str, dict[str, Any]] = {
    "scatternet_linear": {
        "model": "scatternet_linear", "batch_size": 8192, "epochs": 60, "momentum": 0.9, "max_grad_norm": 0.1,
        "learning_rates": (4.0, 8.0, 16.0), "augment": 1,
    },
    "scatternet_cnn": {
        "model": "scatternet_cnn", "batch_size": 550, "epochs": 10, "momentum": 0.0, "max_grad_norm": 1.0,
        "learning_rates": (0.5, 1.0, 2.0), "augment": 1,
    },
    "cnn28": {
        "model": "cnn28", "batch_size": 550, "epochs": 10, "momentum": 0.0, "max_grad_norm": 1.0,
        "learning_rates": (0.5, 1.0, 2.0), "augment": 1, "epsilons": (3.0,),
    },
    "cnn28_augment": {
        "model": "cnn28", "batch_size": 550, "epochs": 10, "momentum": 0.0, "max_grad_norm": 1.0,
        "learning_rates": (0.5, 1.0, 2.0), "augment": 4, "epsilons": (3.0,),
    },
}  # fmt: skip
FULL: dict[str, Any] = {
    "dataset": "fashion-mnist",
    "models": tuple(RECIPES),
    "recipes": RECIPES,
    "validation": 5000,
    "grid_extension": 4,
    "crop_padding": 2,
    "flip": True,
    #: seconds per example-pass on 2 otherwise idle cores (2026-11-27): the estimate printed before it starts
    "seconds_per_example": {"scatternet_linear": 4e-6, "scatternet_cnn": 4e-5, "cnn28": 7e-5},
}
#: Quick (seconds, for tests): a synthetic mixture of 8x8 images, two small recipes, one target, one seed.
QUICK: dict[str, Any] = {
    **FULL,
    "dataset": "synthetic_images",
    "data_options": {"n": 1200, "side": 8},
    "models": ("mlp", "mlp_augment"),
    "recipes": {
        "mlp": {"model": "mlp", "batch_size": 64, "epochs": 2, "momentum": 0.9, "max_grad_norm": 1.0,
                "learning_rates": (0.5,), "augment": 1},
        "mlp_augment": {"model": "mlp", "batch_size": 64, "epochs": 2, "momentum": 0.9, "max_grad_norm": 1.0,
                        "learning_rates": (0.5,), "augment": 2, "epsilons": (3.0,)},
    },
    "validation": 200,
    "grid_extension": 0,
    "crop_padding": 1,
    "epsilons": (3.0,),
    "seeds": 1,
    "seconds_per_example": {"mlp": 1e-5},
}  # fmt: skip


def choose_setting(target: float, recipe: dict, n_train: int) -> dict[str, Any]:
    """A recipe's run at ``target``: its Poisson rate, steps, the pld noise multiplier and what pld certifies for the
    planned run (public quantities only)."""
    from dptrain.accounting import calibrate_dpsgd_noise, dpsgd_ledger, epsilon, steps_for_epochs

    q = recipe["batch_size"] / n_train
    steps = steps_for_epochs(recipe["epochs"], q)
    z = calibrate_dpsgd_noise(target, DELTA, q, steps, accountant="pld")
    return {
        "target_epsilon": target,
        "sampling_rate": q,
        "steps": steps,
        "noise_multiplier": z,
        "certified_epsilon": epsilon(dpsgd_ledger(z, q, steps), DELTA, "pld").epsilon,
        "accountant": "pld",
    }


def train(recipe: dict, data: tuple, setting: dict, lr: float, seed: int, cfg: dict) -> dict[str, Any]:
    """One seeded private run of ``recipe`` at learning rate ``lr``: the last iterate's held-out and test accuracy, the
    weight average's at each of EMA_DECAYS, and the epsilon pld certifies for the ledger the run wrote."""
    import torch

    from dptrain.accounting import epsilon
    from dptrain.engine.api import make_private
    from dptrain.engine.weight_averaging import WeightAverage
    from dptrain.reproduce.modelmix_training import evaluate

    x, y, x_val, y_val, x_test, y_test = data
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = build(recipe["model"], x, classes(y, y_test))
    options: dict[str, Any] = {"max_grad_norm": recipe["max_grad_norm"], "seed": seed, "delta": DELTA}
    if recipe["augment"] > 1:
        options["augment"] = {"multiplicity": recipe["augment"], "crop_padding": cfg["crop_padding"], "flip": cfg["flip"]}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=recipe["momentum"])
    trainer = make_private(
        model, optimizer, (x, y), noise_multiplier=setting["noise_multiplier"],
        batch_size=setting["sampling_rate"] * len(x), accountant="pld", **options,
    )
    averages = [WeightAverage(trainer.params, d) for d in EMA_DECAYS]
    try:
        for _ in trainer.iter_steps(setting["steps"]):
            for a in averages:
                a.update(trainer.steps)
        certified = epsilon(trainer.ledger, DELTA, "pld").epsilon
    finally:
        trainer.close()
    record = scored(model, data, certified, start)
    record["ema"] = {}
    for d, a in zip(EMA_DECAYS, averages, strict=True):
        with a.applied():
            record["ema"][f"{d:g}"] = {
                "validation_accuracy": evaluate(model, x_val, y_val)[0],
                "test_accuracy": evaluate(model, x_test, y_test)[0],
            }
    best = max(record["ema"], key=lambda d: (record["ema"][d]["validation_accuracy"], -float(d)))
    record["ema_validation_accuracy"] = record["ema"][best]["validation_accuracy"]
    return record


def estimate_seconds(cfg: dict, epsilons: tuple, seeds: int, runs: Runs, n_train: int) -> tuple[float, int]:
    """(seconds, runs) left of the smallest plan: per (recipe, target) the grid's rates at seed 0 and seeds 1.. at one
    rate, less the runs already cached, each timed as its epochs x n x K x the model's seconds per example-pass."""
    total, count = 0.0, 0
    for name in cfg["models"]:
        recipe = cfg["recipes"][name]
        for target in recipe.get("epsilons", epsilons):
            if target not in epsilons:
                continue
            planned = [(r, 0) for r in recipe["learning_rates"]] + [(None, s) for s in range(1, seeds)]
            left = sum(1 for r, s in planned if r is None or run_key(name, target, name, r, s) not in runs.runs)
            per_run = recipe["epochs"] * n_train * recipe["augment"] * cfg["seconds_per_example"][recipe["model"]]
            total, count = total + left * per_run, count + left
    return total, count


def _row(name: str, recipe: dict, setting: dict, cell: dict, seeds: int, ema: bool) -> dict[str, Any]:
    runs = cell["runs"]
    if ema:  # the decay chosen on seed 0's held-out accuracy at the rate kept
        decay = max(runs[0]["ema"], key=lambda d: (runs[0]["ema"][d]["validation_accuracy"], -float(d)))
        accuracies = [r["ema"][decay]["test_accuracy"] for r in runs]
    else:
        decay, accuracies = None, [r["test_accuracy"] for r in runs]
    return {
        "model": recipe["model"],
        "recipe": name + ("+ema" if ema else ""),
        "target_epsilon": setting["target_epsilon"],
        **seeds_measured(accuracies, runs, seeds),
        "accountant": setting["accountant"],
        "noise_multiplier": setting["noise_multiplier"],
        "epochs": recipe["epochs"],
        "batch_size": recipe["batch_size"],
        "augment_multiplicity": recipe["augment"],
        "ema": None if decay is None else float(decay),
        "learning_rate": cell["learning_rate"],
        "momentum": recipe["momentum"],
        "max_grad_norm": recipe["max_grad_norm"],
    }


def experiment(cfg: dict, quick: bool, epsilons: tuple, seeds: int, partial: Path) -> dict[str, Any]:
    runs = Runs(partial, quick)
    models = tuple(dict.fromkeys(cfg["recipes"][name]["model"] for name in cfg["models"]))
    data = load_data({**cfg, "models": models}, quick)
    n_train = len(next(iter(data.values()))[0])
    seconds, count = estimate_seconds(cfg, epsilons, seeds, runs, n_train)
    print(
        f"dptrain reproduce recipes: about {count} runs to go, estimated {seconds / 3600:.1f} hours "
        f"({seconds:.0f} s; more if a learning-rate grid is extended)",
        file=sys.stderr,
    )
    rows, cells, settings = [], [], []
    for name in cfg["models"]:
        recipe = cfg["recipes"][name]
        d = data[recipe["model"]]
        for target in (t for t in recipe.get("epsilons", epsilons) if t in epsilons):
            key = f"{name}|{len(d[0])}|{target:g}"
            if key not in runs.settings:
                runs.settings[key] = choose_setting(target, recipe, len(d[0]))
                runs.save()
            setting = runs.settings[key]
            settings.append({"recipe": name, **setting})

            def one(lr, seed, recipe=recipe, d=d, setting=setting):
                return train(recipe, d, setting, lr, seed, cfg)

            for ema in (False, True):
                cell = lr_cell(
                    runs, name, target, name, seeds, recipe["learning_rates"], one, cfg["grid_extension"],
                    score="ema_validation_accuracy" if ema else "validation_accuracy",
                )
                rows.append(_row(name, recipe, setting, cell, seeds, ema))
                cells.append({"recipe": rows[-1]["recipe"], "target_epsilon": target, **cell})
    return {"rows": rows, "cells": cells, "settings": settings}


def run(out_dir: str | Path, quick: bool = False, seeds: int | None = None, epsilons=None, models=None) -> Path:
    """``dptrain reproduce recipes``; returns the report's path. ``seeds``: seeds 0..seeds-1 (default 3);
    ``epsilons``: the target epsilons (default 1, 3, 8; a comma-separated string from the CLI); ``models``: some of
    the recipes (a comma-separated string from the CLI; default all)."""
    from dptrain.reproduce.recipes_text import render

    cfg, epsilons, seeds, command = prepare("recipes", out_dir, quick, seeds, epsilons, models, FULL, QUICK, EPSILONS, SEEDS)
    return execute(
        experiment, render, cfg=cfg, quick=quick, epsilons=epsilons, seeds=seeds, out_dir=out_dir, command=command,
        doc=__doc__, partial=PARTIAL, delta=DELTA,
    )
