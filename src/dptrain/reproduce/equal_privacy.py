"""Methods compared at equal certified privacy: the harness shared by the experiments that decide whether a method
buys accuracy over DP-SGD (``dptrain reproduce modelmix-decided``, ``dptrain reproduce bandmf``, ...).

- the data: Fashion-MNIST's training images with a fixed held-out part for choosing hyperparameters (never trained
  on), the test set used once for the accuracies; a synthetic mixture in quick mode;
- the models: Tramer & Boneh's CNN on ScatterNet features and their CNN on pixels ("Differentially Private Learning
  Needs Better Features (or Much More Data)");
- the learning-rate rule (:func:`lr_cell`): seed 0 at every rate of a grid, the best on the held-out examples kept and
  seeds 1.. trained at it; while the best is at an end of the rates tried, the grid is extended, up to a reach;
- a cache of finished runs (:class:`Runs`): every run is seeded, so an interrupted experiment goes on where it
  stopped and a run re-done gives the same numbers;
- the non-private ceiling (a real recipe: :func:`dptrain.reproduce.modelmix_training.non_private_sgd`).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dptrain.errors import ConfigError


def load_data(cfg: dict, quick: bool) -> dict[str, tuple]:
    """model name -> (x_train, y_train, x_val, y_val, x_test, y_test). The validation examples are a fixed part of
    the training set (generator seed 0), the same for both models; they are never trained on."""
    import torch

    if quick and cfg.get("dataset") == "synthetic_images":
        sets = dict.fromkeys(cfg["models"], _synthetic_images(**cfg["data_options"]))
    elif quick:
        from dptrain.data.loaders import load_dataset

        split = load_dataset("synthetic", **cfg["data_options"])
        base = (split.train.x, split.train.y, split.test.x, split.test.y)
        sets = dict.fromkeys(cfg["models"], base)
    else:
        from dptrain.reproduce import fashion_mnist
        from dptrain.reproduce.modelmix_training import features

        def pixels():
            images = fashion_mnist()
            return images.train.x, images.train.y, images.test.x, images.test.y

        loaders = {"scatternet_cnn": lambda: features(False), "scatternet_linear": lambda: features(False), "cnn28": pixels}
        sets = {name: loaders[name]() for name in cfg["models"]}
    out = {}
    for name in cfg["models"]:
        x, y, x_test, y_test = sets[name]
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        val, train = perm[: cfg["validation"]], perm[cfg["validation"] :]
        out[name] = (x[train], y[train], x[val], y[val], x_test, y_test)
    return out


def _synthetic_images(n: int, side: int):
    """(x, y, x_test, y_test): quick mode's images, (n, 1, side, side) of noise whose label says whether the centre is
    brighter than the rest (a fifth of them for the test), generator seed 0."""
    import numpy as np
    import torch

    g = np.random.default_rng(0)
    x = g.normal(size=(n, 1, side, side)).astype(np.float32)
    c = slice(side // 4, side - side // 4)
    y = (x[:, 0, c, c].mean((1, 2)) > x[:, 0].mean((1, 2))).astype(np.int64)
    k = n - n // 5
    return torch.from_numpy(x[:k]), torch.from_numpy(y[:k]), torch.from_numpy(x[k:]), torch.from_numpy(y[k:])


def classes(y, y_test) -> int:
    return int(max(int(y.max()), int(y_test.max()))) + 1


def build(name: str, x, num_classes: int):
    if name == "scatternet_cnn":
        from dptrain.models.scatternet import scatter_cnn_fmnist

        return scatter_cnn_fmnist(num_classes)
    from dptrain.models.builders import build_model

    return build_model(name, tuple(x.shape[1:]), num_classes)


def scored(model, data: tuple, certified: float | None, start: float) -> dict[str, Any]:
    """One run's record: its accuracy on the held-out and the test examples, its certificate, its time."""
    from dptrain.reproduce.modelmix_training import evaluate

    _, _, x_val, y_val, x_test, y_test = data
    return {
        "validation_accuracy": evaluate(model, x_val, y_val)[0],
        "test_accuracy": evaluate(model, x_test, y_test)[0],
        "certified_epsilon": certified,
        "seconds": time.perf_counter() - start,
    }


def train_non_private(data: tuple, lr: float, seed: int, cfg: dict) -> dict[str, Any]:
    """One seeded non-private run of the recipe :func:`dptrain.reproduce.modelmix_training.non_private_sgd`."""
    import torch

    from dptrain.reproduce.modelmix_training import non_private_sgd

    x, y, *_, y_test = data
    recipe = cfg["non_private"]
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = build(cfg["model"], x, classes(y, y_test))
    non_private_sgd(model, x, y, lr, seed, **{k: recipe[k] for k in ("batch_size", "epochs", "momentum")})
    return scored(model, data, None, start)


def train_private(
    data: tuple,
    setting: dict,
    method: str,
    seed: int,
    cfg: dict,
    delta: float,
    optimizer: Callable[[Any], Any],
    *,
    check: Callable[[Any], None] | None = None,
    **engine_options: Any,
) -> dict[str, Any]:
    """One seeded private run of ``method`` at a chosen setting (``setting[method]``: its noise multiplier and
    accountant; ``setting``: the clip norm, expected batch and steps, the same for every method): the model built under
    ``seed``, ``optimizer(model)``, the engine's extra ``engine_options``; ``check(trainer)`` before the first step.
    Its record (:func:`scored`) holds the epsilon the accountant certifies for the ledger the run wrote."""
    import torch

    from dptrain.accounting import epsilon
    from dptrain.engine.api import make_private

    x, y, *_, y_test = data
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = build(cfg["model"], x, classes(y, y_test))
    s = setting[method]
    trainer = make_private(
        model, optimizer(model), (x, y), noise_multiplier=s["noise_multiplier"],
        max_grad_norm=setting["max_grad_norm"], batch_size=setting["expected_batch_size"], seed=seed,
        max_physical_batch_size=cfg["physical_batch"], delta=delta, accountant=s["accountant"], **engine_options,
    )  # fmt: skip
    try:
        if check is not None:
            check(trainer)
        for _ in trainer.iter_steps(setting["steps"]):
            pass
        certified = epsilon(trainer.ledger, delta, s["accountant"]).epsilon
    finally:
        trainer.close()
    return scored(model, data, certified, start)


def run_key(model: str, target: float | None, method: str, lr: float, seed: int) -> str:
    return f"{model}|{target}|{method}|{lr:g}|{seed}"


class Runs:
    """Finished runs, kept in ``path`` after each one (an interrupted reproduction goes on where it stopped: every run
    is seeded, so a run re-done gives the same numbers)."""

    def __init__(self, path: Path, quick: bool):
        self.path = path
        saved = json.loads(path.read_text()) if path.exists() else {}
        fresh = saved.get("quick") != quick
        self.settings: dict[str, dict] = {} if fresh else saved.get("settings", {})
        self.runs: dict[str, dict] = {} if fresh else saved.get("runs", {})
        self.quick = quick

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"quick": self.quick, "settings": self.settings, "runs": self.runs}))

    def get(self, key: str, compute) -> dict:
        if key not in self.runs:
            self.runs[key] = compute()
            self.save()
        return self.runs[key]


def lr_cell(
    runs: Runs, model: str, target: float | None, method: str, seeds: int, grid, train, extend: int = 0,
    score: str = "validation_accuracy",
) -> dict:
    """Seed 0 at every learning rate of ``grid``; the best on the held-out examples (ties: the smaller rate) trains
    seeds 1.. too. While the best is the smallest (largest) rate tried, the rate half (twice) that is tried too, up to
    ``extend`` times each way: the rate kept is then inside the rates tried, or the reach is disclosed. The row's
    accuracies are the test accuracies of every seed at the rate kept. ``score``: the run record's key the rates are
    ranked by (another key of the same runs ranks, e.g., their weight averages: no run is trained twice)."""
    grid, low, high = sorted(grid), min(grid) / 2**extend, max(grid) * 2**extend
    first: dict[float, dict] = {}
    while True:
        for r in grid:
            if r not in first:
                first[r] = runs.get(run_key(model, target, method, r, 0), lambda r=r: train(r, 0))
        lr = max(grid, key=lambda r: (first[r][score], -r))
        if lr == grid[0] and lr / 2 >= low * (1 - 1e-9):
            grid.insert(0, lr / 2)
        elif lr == grid[-1] and lr * 2 <= high * (1 + 1e-9):
            grid.append(lr * 2)
        else:
            break
    done = [first[lr]] + [
        runs.get(run_key(model, target, method, lr, s), lambda s=s: train(lr, s)) for s in range(1, seeds)
    ]
    return {
        "learning_rate": lr,
        "runs": done,
        "grid": {f"{r:g}": first[r][score] for r in grid},
        # the best rate is the end of the reach: a better one may lie beyond what was tried
        "at_reach": len(grid) > 1 and lr in (grid[0], grid[-1]),
    }


def parse_options(epsilons, seeds) -> tuple[tuple[float, ...] | None, int | None]:
    if isinstance(epsilons, str):
        try:
            epsilons = tuple(float(e) for e in epsilons.split(","))
        except ValueError:
            raise ConfigError(f"--epsilons takes comma-separated numbers, got {epsilons!r}") from None
    if epsilons is not None:
        epsilons = tuple(epsilons)
        if not epsilons or not all(
            isinstance(e, int | float) and math.isfinite(e) and e > 0 for e in epsilons
        ):
            raise ConfigError(f"--epsilons takes positive numbers, got {epsilons!r}")
    if seeds is not None and (isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1):
        raise ConfigError(f"--seeds takes a number of seeds >= 1, got {seeds!r}")
    return epsilons, seeds


def seeds_measured(accuracies: list[float], runs: list[dict], seeds: int) -> dict[str, Any]:
    """What every row of a comparison says of its seeds: the median test accuracy, the accuracies, the seeds, and the
    largest epsilon certified among the runs (None for runs without a certificate)."""
    certified = [r["certified_epsilon"] for r in runs if r["certified_epsilon"] is not None]
    return {
        "accuracy_median": statistics.median(accuracies),
        "accuracies": accuracies,
        "seeds": list(range(seeds)),
        "certified_epsilon": max(certified) if certified else None,
    }


def non_private_row(runs: Runs, model: str, data: tuple, cfg: dict, seeds: int, dataset: str) -> tuple[dict, dict]:
    """The non-private ceiling of ``model``: its row (the JSON schema of the private rows, no certificate) and its
    learning-rate cell."""
    cell = lr_cell(
        runs,
        model,
        None,
        "non_private",
        seeds,
        cfg["non_private"]["learning_rates"],
        lambda lr, seed: train_non_private(data, lr, seed, {**cfg, "model": model}),
        cfg["grid_extension"],
    )
    accuracies = [r["test_accuracy"] for r in cell["runs"]]
    row = {
        "dataset": dataset,
        "model": model,
        "target_epsilon": None,
        "method": "non_private",
        **seeds_measured(accuracies, cell["runs"], seeds),
        "accountant": None,
        "noise_multiplier": 0.0,
    }
    return row, {"model": model, "target_epsilon": None, "method": "non_private", **cell}


def prepare(name: str, out_dir, quick: bool, seeds, epsilons, models, full: dict, small: dict, default_epsilons,
            default_seeds: int) -> tuple[dict, tuple[float, ...], int, str]:
    """(config, target epsilons, seeds, the command line) of ``dptrain reproduce NAME``: ``seeds`` 0..seeds-1,
    ``epsilons`` (a comma-separated string from the CLI), ``models`` some of the config's models (the same)."""
    epsilons, seeds = parse_options(epsilons, seeds)
    cfg = small if quick else full
    if models is not None:
        chosen = tuple(m.strip() for m in models.split(",")) if isinstance(models, str) else tuple(models)
        if not chosen or not set(chosen) <= set(cfg["models"]):
            raise ConfigError(f"--models takes some of {','.join(cfg['models'])}, got {models!r}")
        cfg = {**cfg, "models": chosen}
    epsilons = tuple(epsilons or cfg.get("epsilons", default_epsilons))
    seeds = seeds or cfg.get("seeds", default_seeds)
    command = f"dptrain reproduce {name} --out {Path(out_dir)}" + (" --quick" if quick else "")
    if seeds != cfg.get("seeds", default_seeds):
        command += f" --seeds {seeds}"
    if epsilons != tuple(cfg.get("epsilons", default_epsilons)):
        command += " --epsilons " + ",".join(f"{e:g}" for e in epsilons)
    if models is not None:
        command += " --models " + ",".join(cfg["models"])
    return cfg, epsilons, seeds, command


def execute(experiment, render, *, cfg: dict, quick: bool, epsilons, seeds: int, out_dir, command: str, doc: str,
            partial: str, delta: float, **extra) -> Path:
    """Run ``experiment(cfg, quick, epsilons, seeds, partial_path)`` (its finished runs cached in ``OUT/partial``),
    then write ``render(data)``'s report; the cache is removed once the report is written."""
    import contextlib
    import warnings

    from dptrain.reproduce import single_thread

    start = time.perf_counter()
    path = Path(out_dir) / partial
    # one torch thread for the quick mode's tiny models (reproduce.single_thread); the full runs use the default
    with warnings.catch_warnings(), single_thread() if quick else contextlib.nullcontext():
        warnings.simplefilter("ignore")  # seeded runs: a reproducible experiment (NotPrivateWarning expected)
        result = experiment(cfg, quick, tuple(epsilons), seeds, path)
    data = {
        "command": command,
        "about": doc.split("\n\n", 1)[1].rsplit("\n\nEach finished run", 1)[0].strip(),
        "quick": quick,
        "wall_time_s": time.perf_counter() - start,
        "delta": delta,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        **extra,
        **result,
    }
    written = render(data).write(out_dir)
    path.unlink(missing_ok=True)
    return written
