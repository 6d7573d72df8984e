"""Reproduction of Sun, Suresh & Menon, "The importance of feature preprocessing for differentially private
linear optimization" (docs/dpsgd_f.md), Table 1 and Table 2.

``run(out_dir, quick=False)`` writes into ``out_dir``:

- ``dpsgd_f.md``: the report (Table 1 measured beside the paper's, Table 2, the grid, the command);
- ``dpsgd_f.json``: a list of rows with keys ``dataset``, ``epsilon``, ``method`` (``dpsgd``, ``dpsgd_f``,
  ``non_private``), ``accuracy_mean``, ``accuracy_std``, ``seeds``, the chosen hyper-parameters and ``command``;
- ``dpsgd_f_grid.json``: every grid run (accuracy, certified epsilon), Table 2 and the data sets skipped;
- ``dpsgd_f.png``: measured vs paper accuracy.

Protocol (App. C, with the choices the paper leaves open stated):
- multinomial logistic regression (softmax cross-entropy, weights and bias) on pixels in [0, 1], every example
  normalized to norm C_F for BOTH methods; DPSGD = ``kind="none"``, DPSGD-F = ``kind="private_mean"``
  (Algorithm 3); gradient clip norm C_G = 1 (De et al. 2022); Poisson batches (q = B/n), plain SGD, zero
  initial weights... (torch's default initialization, seeded), last iterate;
- delta = 1e-5; the DP-SGD noise is calibrated with PLD so that the composition of the private mean
  (sigma_F from the analytic Gaussian at (eps_F, delta)) and all steps meets (eps, delta) exactly (Lemma 9);
  every run's epsilon is recomputed from its own ledger and stored;
- grid search over C_F, batch size, learning rate, epochs (and eps_F for DPSGD-F), scored by TEST accuracy of
  seed 0, as the paper and De et al. 2022 do (the tuning is not private: footnote 8); the best configuration
  is then re-run with fresh seeds 1..S and the mean and std of those runs are reported (the selection run is
  not among them, so the reported mean carries no selection bias);
- non-private SGD: the same model on C_F = 1 normalized features, no clipping or noise, grid over the
  learning rate.

MNIST (IDX files in $DPTRAIN_MNIST_DIR or /usr/share/datasets/mnist) and CIFAR-100 penultimate-layer features
(an .npz with x, y, x_test, y_test at $DPTRAIN_CIFAR100_FEATURES) are used when present and skipped otherwise.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.accounting import steps_for_epochs
from dptrain.reproduce import md_table, single_thread
from dptrain.reproduce.report import Report, Section, figure

__all__ = ["PAPER", "PAPER_TABLE2", "concentration", "experiment", "render", "run"]

DELTA = 1e-5
EPSILONS = (1.0, 2.0)
#: Table 1 of the paper (accuracy %, mean (std) over 10 runs), delta = 1e-5.
PAPER = {
    "mnist": {
        (1.0, "dpsgd"): (87.4, 0.1),
        (1.0, "dpsgd_f"): (92.0, 0.1),
        (2.0, "dpsgd"): (89.6, 1.2),
        (2.0, "dpsgd_f"): (92.3, 0.1),
        "non_private": (92.9, 0.1),
    },
    "fashion-mnist": {
        (1.0, "dpsgd"): (77.2, 0.4),
        (1.0, "dpsgd_f"): (84.0, 0.1),
        (2.0, "dpsgd"): (78.7, 0.4),
        (2.0, "dpsgd_f"): (84.5, 0.2),
        "non_private": (85.0, 0.1),
    },
    "cifar100-features": {
        (1.0, "dpsgd"): (70.6, 0.3),
        (1.0, "dpsgd_f"): (71.6, 0.2),
        (2.0, "dpsgd"): (73.8, 0.2),
        (2.0, "dpsgd_f"): (74.4, 0.2),
        "non_private": (78.5, 0.1),
    },
}
#: Table 2 (unit-norm features): diam, max_i ||x_i - mu||, mean_i ||x_i - mu||.
PAPER_TABLE2 = {
    "cifar100-features": (1.56, 1.10, 0.9),
    "mnist": (1.41, 1.03, 0.77),
    "fashion-mnist": (1.41, 1.10, 0.62),
}

#: The grid run (the paper's: C_F {1, 10, 100, 1000}, B 256..16384, lr 2^-5..2^4, epochs 20..320, eps_F
#: {0.02, 0.05, 0.1, 0.15, 0.2}: 1400 / 7000 configurations per cell; ours fits in about an hour on 2 cores).
GRID = {
    "feature_norm": (1.0, 10.0, 100.0),
    "batch_size": (2048, 8192),
    "learning_rate": (1.0, 4.0, 16.0),
    "epochs": (20, 80),
    "eps_f": (0.02, 0.05),
}
QUICK_GRID = {
    "feature_norm": (1.0,),
    "batch_size": (1024,),
    "learning_rate": (1.0, 4.0),
    "epochs": (2,),
    "eps_f": (0.05,),
}
NON_PRIVATE_GRID = {"learning_rate": (4.0, 16.0, 32.0), "epochs": (20, 80), "batch_size": (256,)}
QUICK_NON_PRIVATE_GRID = {"learning_rate": (1.0,), "epochs": (2,), "batch_size": (256,)}
SEEDS, QUICK_SEEDS = (1, 2, 3), (1,)
QUICK_TRAIN, QUICK_TEST = 6000, 2000

_DATA: dict[str, Any] = {}  # per process: name -> DataSplit (workers load their own copy)


# --- data -------------------------------------------------------------------------------------------------


def _subset(split, n_train: int, n_test: int):
    from dptrain.data.loaders import ArrayDataset, DataSplit

    def head(ds, n):
        g = torch.Generator().manual_seed(0)
        idx = torch.randperm(len(ds), generator=g)[:n]
        return ArrayDataset(ds.x[idx], ds.y[idx], ds.num_classes, ds.name)

    return DataSplit(head(split.train, n_train), head(split.test, n_test), f"{split.description} (subset)", split.separate_test)


def _load(name: str, quick: bool):
    """(DataSplit or None, why skipped)."""
    from dptrain.data.loaders import DEFAULT_FASHION_MNIST_DIR, load_dataset
    from dptrain.errors import DataError

    try:
        if name == "fashion-mnist":
            if not Path(DEFAULT_FASHION_MNIST_DIR).is_dir():
                return None, f"Fashion-MNIST not installed at {DEFAULT_FASHION_MNIST_DIR} (make data)"
            data = load_dataset("fashion-mnist", pixels="raw")
        elif name == "mnist":
            path = os.environ.get("DPTRAIN_MNIST_DIR", "/usr/share/datasets/mnist")
            if not Path(path).is_dir():
                return None, f"no MNIST IDX files at {path} (set DPTRAIN_MNIST_DIR)"
            data = load_dataset("mnist", path, pixels="raw")
        else:
            path = os.environ.get("DPTRAIN_CIFAR100_FEATURES")
            if not path or not Path(path).is_file():
                return (
                    None,
                    "no CIFAR-100 feature file (set DPTRAIN_CIFAR100_FEATURES to an .npz with x, y, x_test, y_test)",
                )
            data = load_dataset("npz", path, num_classes=100)
    except DataError as e:
        return None, str(e)
    return (_subset(data, QUICK_TRAIN, QUICK_TEST) if quick else data), ""


def _data(name: str, quick: bool):
    key = f"{name}/{quick}"
    if key not in _DATA:
        _DATA[key] = _load(name, quick)[0]
    return _DATA[key]


def concentration(x: torch.Tensor, block: int = 4096) -> dict[str, float]:
    """Table 2's measures on unit-normalized features: diam(D) = max ||x_i - x_j|| (exact: for unit vectors
    ||x - x'||^2 = 2 - 2 x.x', so the largest distance is the smallest inner product, found blockwise over the
    whole Gram matrix), max_i ||x_i - mu|| and mean_i ||x_i - mu|| with mu the data mean."""
    from dptrain.dpsgd_f import normalize_features

    z = normalize_features(x, 1.0).to(torch.float32)
    smallest = math.inf
    for i in range(0, len(z), block):
        smallest = min(smallest, float((z[i : i + block] @ z.T).min()))
    dist = (z - z.mean(0)).norm(dim=1)
    return {
        "diam": math.sqrt(max(0.0, 2.0 - 2.0 * smallest)),
        "max_dist_to_mean": float(dist.max()),
        "mean_dist_to_mean": float(dist.mean()),
    }


# --- one run ----------------------------------------------------------------------------------------------


def _train(task: dict) -> dict:
    """One private (or non-private) training run; returns the task with accuracy and certified epsilon."""
    from dptrain.dpsgd_f import FeaturePreprocessing, make_private_dpsgd_f
    from dptrain.models.builders import build_model
    from dptrain.proactive.utility_graph import noise_free_trainer

    data = _data(task["dataset"], task["quick"])
    start = time.perf_counter()
    with single_thread():
        torch.manual_seed(task["seed"])
        make = lambda: build_model("logistic", data.train.input_shape, data.train.num_classes)  # noqa: E731
        if task["method"] == "non_private":
            prep = FeaturePreprocessing("none", 1.0)
            xt = prep.transform(data.train.x)
            n = len(xt)
            steps = steps_for_epochs(task["epochs"], task["batch_size"] / n)
            train = noise_free_trainer(
                make, (xt, data.train.y), steps, task["batch_size"], task["learning_rate"], task["seed"]
            )
            model = train(1e9)  # a clip norm no gradient reaches: plain SGD
            acc = float((model(prep.transform(data.test.x)).argmax(1) == data.test.y).float().mean())
            return {
                **task,
                "accuracy": acc,
                "epsilon_spent": math.inf,
                "seconds": time.perf_counter() - start,
            }
        model = make()
        run = make_private_dpsgd_f(
            model,
            torch.optim.SGD(model.parameters(), lr=task["learning_rate"]),
            (data.train.x, data.train.y),
            target_epsilon=task["epsilon"],
            target_delta=DELTA,
            feature_norm=task["feature_norm"],
            kind="private_mean" if task["method"] == "dpsgd_f" else "none",
            eps_f=task.get("eps_f"),
            batch_size=task["batch_size"],
            max_grad_norm=1.0,
            noise_multiplier=task["noise_multiplier"],
            accountant="pld",
            seed=task["seed"],
        )
        run.trainer.train(steps=task["steps"])  # exactly the steps the noise was calibrated for
        acc = run.evaluate(data.test.x, data.test.y)
        spent = run.trainer.epsilon(accountant="pld").epsilon
    return {**task, "accuracy": acc, "epsilon_spent": spent, "seconds": time.perf_counter() - start}


def _noise(args: tuple) -> tuple:
    from dptrain.dpsgd_f import pipeline_noise

    kind, eps, q, steps, eps_f = args
    return args, pipeline_noise(kind, eps, DELTA, q, steps, eps_f, "pld")


# --- the grid ---------------------------------------------------------------------------------------------


def _tasks(name: str, n: int, quick: bool) -> list[dict]:
    grid = QUICK_GRID if quick else GRID
    tasks = []
    for eps, cf, b, lr, ep in product(
        EPSILONS, grid["feature_norm"], grid["batch_size"], grid["learning_rate"], grid["epochs"]
    ):
        base = {"dataset": name, "quick": quick, "epsilon": eps, "feature_norm": cf, "batch_size": b}
        base |= {"learning_rate": lr, "epochs": ep, "seed": 0, "sampling_rate": b / n}
        base["steps"] = steps_for_epochs(ep, b / n)
        tasks.append({**base, "method": "dpsgd", "eps_f": None})
        tasks += [{**base, "method": "dpsgd_f", "eps_f": ef} for ef in grid["eps_f"]]
    npg = QUICK_NON_PRIVATE_GRID if quick else NON_PRIVATE_GRID
    for lr, ep, b in product(npg["learning_rate"], npg["epochs"], npg["batch_size"]):
        tasks.append(
            {"dataset": name, "quick": quick, "epsilon": None, "method": "non_private", "feature_norm": 1.0}
            | {"batch_size": b, "learning_rate": lr, "epochs": ep, "seed": 0, "eps_f": None}
        )
    return tasks


def _key(t: dict) -> tuple:
    kind = "private_mean" if t["method"] == "dpsgd_f" else "none"
    return kind, t["epsilon"], t["sampling_rate"], t["steps"], t["eps_f"]


def _pool_map(fn, items: list, workers: int, progress: str) -> list:
    from tqdm import tqdm

    if workers <= 1:
        return [fn(i) for i in tqdm(items, desc=progress, unit="run")]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        return list(tqdm(pool.imap_unordered(fn, items), total=len(items), desc=progress, unit="run"))


def _cell_key(t: dict) -> tuple:
    return t["dataset"], t["epsilon"], t["method"]


HYPER = ("feature_norm", "batch_size", "learning_rate", "epochs", "eps_f")


def experiment(quick: bool, command: str, workers: int = 1) -> tuple[list[dict], dict]:
    """The grid, the selection and the re-runs on every data set present; returns (rows, details): ``rows`` one
    per (data set, epsilon, method) with the selected configuration and the re-runs' accuracy (``dpsgd_f.json``),
    ``details`` every run, Table 2 and the data sets skipped (``dpsgd_f_grid.json``)."""
    start = time.perf_counter()
    present, skipped, table2 = [], {}, {}
    for name in ("mnist", "fashion-mnist", "cifar100-features"):
        data, why = _load(name, quick)
        if data is None:
            skipped[name] = why
            continue
        present.append((name, len(data.train)))
        _DATA[f"{name}/{quick}"] = data
        table2[name] = concentration(data.train.x)
    tasks = [t for name, n in present for t in _tasks(name, n, quick)]
    private = [t for t in tasks if t["method"] != "non_private"]
    sigmas = dict(_pool_map(_noise, sorted({_key(t) for t in private}, key=str), workers, "calibrating"))
    for t in private:
        t["noise_multiplier"] = sigmas[_key(t)]
    results = _pool_map(_train, tasks, workers, "grid")
    # Best configuration per (dataset, epsilon, method) by seed-0 test accuracy, then fresh seeds.
    best: dict[tuple, dict] = {}
    for r in results:
        k = _cell_key(r)
        if k not in best or r["accuracy"] > best[k]["accuracy"]:
            best[k] = r
    reruns = [{**b, "seed": s} for b in best.values() for s in (QUICK_SEEDS if quick else SEEDS)]
    for r in reruns:
        r.pop("accuracy"), r.pop("epsilon_spent"), r.pop("seconds")
    rerun_results = _pool_map(_train, reruns, workers, "seeds")
    rows = [_row(k, b, rerun_results, command) for k, b in sorted(best.items(), key=_cell_order)]
    details = {
        "command": command,
        "quick": quick,
        "grid": QUICK_GRID if quick else GRID,
        "non_private_grid": QUICK_NON_PRIVATE_GRID if quick else NON_PRIVATE_GRID,
        "seeds": QUICK_SEEDS if quick else SEEDS,
        "delta": DELTA,
        "table2": table2,
        "skipped": skipped,
        "runs": results,
        "reruns": rerun_results,
        "wall_time_s": time.perf_counter() - start,
        "cpu_count": os.cpu_count(),
    }
    return rows, details


def _cell_order(item: tuple[tuple, dict]) -> tuple:
    k = item[0]
    return k[0], k[1] or 0, k[2]


def _row(k: tuple, b: dict, rerun_results: list[dict], command: str) -> dict[str, Any]:
    """The Table 1 row of cell ``k`` = (dataset, epsilon, method): ``b`` the selected grid run, the re-runs'
    accuracy mean and std (ddof 1) and the largest epsilon certified by their ledgers."""
    accs = [r["accuracy"] for r in rerun_results if _cell_key(r) == k]
    spent = [r["epsilon_spent"] for r in rerun_results if _cell_key(r) == k]
    paper = PAPER[k[0]].get("non_private" if k[2] == "non_private" else (k[1], k[2]))
    return {
        "dataset": k[0],
        "epsilon": k[1],
        "delta": DELTA if k[1] is not None else None,
        "method": k[2],
        "accuracy_mean": float(np.mean(accs)),
        "accuracy_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else 0.0,
        "seeds": sorted(r["seed"] for r in rerun_results if _cell_key(r) == k),
        "accuracies": accs,
        "selection_accuracy_seed0": b["accuracy"],
        **{h: b.get(h) for h in HYPER},
        "noise_multiplier": b.get("noise_multiplier"),
        "epsilon_certified_pld_max": max(spent) if k[1] is not None else None,
        "paper_accuracy": paper[0] / 100 if paper else None,
        "paper_std": paper[1] / 100 if paper else None,
        "command": command,
    }


def run(out_dir: str | Path, quick: bool = False, workers: int | None = None) -> Path:
    """Run the reproduction into ``out_dir`` (created if needed); returns the path of ``dpsgd_f.md``. ``quick``:
    6000 training and 2000 test examples, a 2-point learning-rate grid at 2 epochs, one re-run seed."""
    command = f"dptrain reproduce dpsgd-f --out {out_dir}" + (" --quick" if quick else "")
    workers = workers or (1 if quick else min(2, os.cpu_count() or 1))
    rows, details = experiment(quick, command, workers)
    return render(rows, details).write(out_dir)


# --- output -----------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _draw(rows: list[dict]):
    datasets = sorted({r["dataset"] for r in rows})

    def draw(fig, axes) -> None:
        for ax, name in zip(axes[0], datasets, strict=True):
            labels, ours, err, paper = [], [], [], []
            for r in rows:
                if r["dataset"] != name:
                    continue
                labels.append(r["method"] if r["epsilon"] is None else f"{r['method']}\neps={r['epsilon']:g}")
                ours.append(100 * r["accuracy_mean"])
                err.append(100 * r["accuracy_std"])
                paper.append(np.nan if r["paper_accuracy"] is None else 100 * r["paper_accuracy"])
            xs = np.arange(len(labels))
            ax.bar(xs - 0.2, ours, 0.4, yerr=err, label="dptrain (measured)", color="tab:blue")
            ax.bar(xs + 0.2, paper, 0.4, label="paper (Table 1)", color="tab:gray")
            ax.set_xticks(xs, labels, fontsize=8)
            ax.set_ylim(max(0, min(ours + [p for p in paper if p == p]) - 10), 100)
            ax.set_ylabel("test accuracy (%)")
            ax.set_title(f"{name}, delta = 1e-5")
            ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()

    return figure(
        "dpsgd_f.png", draw, dpi=120, ncols=len(datasets), figsize=(5 * len(datasets), 4), squeeze=False
    )


def _table1(rows: list[dict]) -> str:
    head = [
        "data set",
        "epsilon",
        "method",
        "dptrain",
        "paper",
        "C_F",
        "batch",
        "lr",
        "epochs",
        "eps_F",
        "sigma",
        "eps (PLD)",
    ]
    table = []
    for r in rows:
        table.append(
            [
                r["dataset"],
                "-" if r["epsilon"] is None else f"{r['epsilon']:g}",
                r["method"],
                f"{_pct(r['accuracy_mean'])} ({_pct(r['accuracy_std'])})",
                "-"
                if r["paper_accuracy"] is None
                else f"{_pct(r['paper_accuracy'])} ({_pct(r['paper_std'])})",
                f"{r['feature_norm']:g}",
                r["batch_size"],
                f"{r['learning_rate']:g}",
                r["epochs"],
                "-" if r["eps_f"] is None else f"{r['eps_f']:g}",
                "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.3f}",
                "-" if r["epsilon_certified_pld_max"] is None else f"{r['epsilon_certified_pld_max']:.4f}",
            ]
        )
    return md_table(head, table)


def _gains(rows: list[dict]) -> list[str]:
    """The gain of DPSGD-F over DPSGD in percentage points, measured and the paper's (Table 1)."""
    gains = []
    for r in rows:
        if r["method"] != "dpsgd_f":
            continue
        base = next(
            (
                x
                for x in rows
                if x["dataset"] == r["dataset"] and x["epsilon"] == r["epsilon"] and x["method"] == "dpsgd"
            ),
            None,
        )
        if base is None:
            continue
        paper = PAPER[r["dataset"]]
        pg = paper[(r["epsilon"], "dpsgd_f")][0] - paper[(r["epsilon"], "dpsgd")][0]
        gains.append(
            [
                r["dataset"],
                f"{r['epsilon']:g}",
                f"{100 * (r['accuracy_mean'] - base['accuracy_mean']):+.1f}",
                f"{pg:+.1f}",
            ]
        )
    if not gains:
        return []
    return [
        "Gain of DPSGD-F over DPSGD (percentage points):",
        md_table(["data set", "epsilon", "dptrain", "paper"], gains),
    ]


def render(rows: list[dict], details: dict) -> Report:
    """The report of ``rows`` and ``details`` (what :func:`run` writes to ``dpsgd_f.json`` and
    ``dpsgd_f_grid.json``)."""
    grid, npg = details["grid"], details["non_private_grid"]
    table2 = md_table(
        ["data set", "diam(D)", "paper", "max ||x - mu||", "paper", "mean ||x - mu||", "paper"],
        [
            [
                name,
                f"{m['diam']:.2f}",
                PAPER_TABLE2[name][0],
                f"{m['max_dist_to_mean']:.2f}",
                PAPER_TABLE2[name][1],
                f"{m['mean_dist_to_mean']:.2f}",
                PAPER_TABLE2[name][2],
            ]
            for name, m in details["table2"].items()
        ],
    )
    the_grid = [
        f"- private runs: C_F in {list(grid['feature_norm'])}, batch size in {list(grid['batch_size'])}, learning rate "
        f"in {list(grid['learning_rate'])}, epochs in {list(grid['epochs'])}; DPSGD-F also eps_F in {list(grid['eps_f'])}. "
        f"Gradient clip norm C_G = 1, plain SGD, Poisson sampling, last iterate, delta = {DELTA:g}.",
        f"- non-private SGD: C_F = 1, learning rate in {list(npg['learning_rate'])}, epochs {list(npg['epochs'])}, "
        f"batch {list(npg['batch_size'])}, no clipping, no noise.",
        f"- {len(details['runs'])} grid runs and {len(details['reruns'])} seed re-runs; every run's epsilon is recomputed "
        "from its own ledger by the PLD accountant (column eps (PLD): the largest over the re-runs).",
        "- The paper's grid is larger (C_F up to 1000, batch 256..16384, lr 2^-5..2^4, epochs 20..320, eps_F up to 0.2, "
        "1400 / 7000 configurations per cell) and its numbers are means over 10 runs.",
    ]
    sections = [
        Section(
            "Table 1: test accuracy (%), delta = 1e-5",
            [
                "Mean (std) over fresh seeds "
                f"{', '.join(map(str, details['seeds']))} of the configuration that was best for seed 0 (selection by "
                "test accuracy, as the paper and De et al. 2022; the tuning itself is not private, the paper's "
                "footnote 8).",
                _table1(rows),
                "![accuracy](dpsgd_f.png)",
                *_gains(rows),
            ],
        ),
        Section(
            "Table 2: concentration of the unit-normalized training features",
            [
                table2,
                "diam(D) is exact (smallest inner product over all pairs of the training set); mu is the exact "
                "training mean.",
            ],
        ),
        Section("The grid", ["\n".join(the_grid)]),
    ]
    if details["skipped"]:
        sections.append(Section("Skipped", ["\n".join(f"- {k}: {v}" for k, v in details["skipped"].items())]))
    return Report(
        "dpsgd_f.md",
        "DPSGD-F (Sun, Suresh & Menon): Table 1 and Table 2, measured",
        intro=[
            f"Produced by `{details['command']}` in {details['wall_time_s'] / 60:.1f} min on this machine "
            f"({details['cpu_count']} CPU cores). Every number below is measured by that command; the paper's are "
            "beside them."
        ],
        sections=sections,
        data={"dpsgd_f.json": rows, "dpsgd_f_grid.json": details},
        plots=[_draw(rows)],
    )
