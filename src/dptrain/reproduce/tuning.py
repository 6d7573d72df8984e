"""What private tuning buys (``dptrain reproduce tuning``): three ways to pick hyperparameters, at one total budget.

Fashion-MNIST, the default CNN (configs/cnn28_quick.toml: cnn28, one epoch, expected batch 256, clip norm 1, lr 2), total
epsilon 1 and 3 at delta 1e-5, several seeds:

- **default**: the untuned default config, calibrated to the whole budget (its defaults were themselves chosen by
  looking at test accuracy: not private, docs/cli.md says so);
- **tune**: ``dptrain tune`` with a geometric number of trials of mean 10 over the learning rate and the clip norm, the
  whole search calibrated to the same budget (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential
  Privacy", ICLR 2022): each trial gets more noise, and scores itself on a noisy held-out tenth of the training data;
- **common practice**: 10 trials from the same space, each at the FULL budget, the best chosen on test accuracy. Not
  certified: releasing the best of 10 models trained on the private data costs what releasing all 10 costs (the
  choice is a function of all of them), which the report prices as 10 trials composed (pld, else rdp).

Every run is seeded (a reproducible experiment, not a private run); the test accuracy is on Fashion-MNIST's separate,
public test set.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.reproduce import md_table, single_thread
from dptrain.reproduce.report import Report, Section, figure

REPORT, DATA_JSON, PLOT, PARTIAL = "tuning.md", "tuning.json", "tuning.png", "tuning.partial.json"
DELTA = 1e-5
EPSILONS = (1.0, 3.0)
SEEDS = 3
TRIALS = 10
SPACE = {"training.learning_rate": {"log_uniform": [0.25, 8.0]}, "privacy.max_grad_norm": {"log_uniform": [0.1, 3.0]}}
QUICK = {"epsilons": (3.0,), "seeds": 1, "trials": 2}


def base_config(epsilon: float, seed: int, quick: bool) -> dict:
    if quick:  # seconds: a tiny synthetic problem with a public test split
        data = {"name": "synthetic", "options": {"n": 600, "dim": 10, "num_classes": 2, "separation": 2.0},
                "test_is_public": True}
        model, training = {"name": "logistic"}, {"epochs": 1, "batch_size": 60, "learning_rate": 2.0}
    else:
        data, model = {"name": "fashion-mnist"}, {"name": "cnn28"}
        training = {"epochs": 1, "batch_size": 256, "learning_rate": 2.0}
    return {"seed": seed, "data": data, "model": model, "training": training,
            "privacy": {"target_epsilon": epsilon, "delta": DELTA, "max_grad_norm": 1.0}}


def _common_practice(raw: dict, epsilon: float, seed: int, trials: int, work: Path) -> dict:
    from dptrain.accounting import all_reports, tightest
    from dptrain.accounting.ledger import Ledger
    from dptrain.config import config_from_dict
    from dptrain.runs.run import run_training
    from dptrain.tuning.space import draw, parse_space, with_values

    cfg = config_from_dict({**raw, "tune": {"space": SPACE}})
    dims = parse_space(cfg)
    rng = np.random.default_rng(seed)
    runs = []
    for i in range(trials):
        values = draw(dims, rng.random(len(dims)))
        s = run_training(with_values(cfg, values), work / f"common-{i}", progress=False)
        runs.append((s["test_accuracy"], values, s))
    accuracy, values, chosen = max(runs, key=lambda r: r[0])
    trial = Ledger.load(work / "common-0" / "ledger.json")
    composed = Ledger(neighboring=trial.neighboring)
    for _ in range(trials):
        for e in trial.entries:
            composed.record(e.event, e.facts, e.count)
    best = tightest(all_reports(composed, DELTA)[0])
    return {"accuracy": accuracy, "values": values, "epsilon_each": chosen["epsilon"],
            "epsilon_if_accounted": best.epsilon, "accountant_if_accounted": best.accountant,
            "accuracies": [r[0] for r in runs]}


def one(epsilon: float, seed: int, trials: int, quick: bool, work: Path) -> list[dict]:
    from dptrain.config import config_from_dict
    from dptrain.runs.run import run_training
    from dptrain.runs.rundir import RunDirectory
    from dptrain.tuning.search import run_search

    raw = base_config(epsilon, seed, quick)
    default = run_training(config_from_dict(raw), work / "default", progress=False)
    tuned = run_search(
        config_from_dict({**raw, "tune": {"trials_mean": float(trials), "space": SPACE}}), work / "tune",
        progress=False, keep_trials=True,  # (this seeded experiment reads the number of trials, labelled not private)
    )
    best = RunDirectory(work / "tune" / "best").read_json("summary.json") if tuned["out"] else None
    common = _common_practice(raw, epsilon, seed, trials, work)
    base = {"target_epsilon": epsilon, "seed": seed}
    return [
        {**base, "method": "default", "accuracy": default["test_accuracy"], "epsilon": default["epsilon"],
         "certified": True, "values": {"training.learning_rate": 2.0, "privacy.max_grad_norm": 1.0}},
        {**base, "method": "tune", "accuracy": None if best is None else best["test_accuracy"],
         "epsilon": tuned["epsilon"], "certified": True, "values": tuned["best"], "score": tuned["best_score"],
         "trials_run": tuned["not_private"]["trials_run"], "epsilon_single_trial": tuned["epsilon_single_run"],
         "noise_multiplier": tuned["best_noise_multiplier"]},
        {**base, "method": "common practice", "accuracy": common["accuracy"], "epsilon": common["epsilon_if_accounted"],
         "certified": False, "values": common["values"], "epsilon_each": common["epsilon_each"],
         "accountant_if_accounted": common["accountant_if_accounted"], "accuracies": common["accuracies"]},
    ]


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for eps in sorted({r["target_epsilon"] for r in rows}):
        for method in ("default", "tune", "common practice"):
            pts = [r for r in rows if r["target_epsilon"] == eps and r["method"] == method]
            accs = [r["accuracy"] for r in pts if r["accuracy"] is not None]
            out.append({"target_epsilon": eps, "method": method, "accuracy_median": statistics.median(accs) if accs
                        else None, "accuracies": accs, "epsilon_median": statistics.median(r["epsilon"] for r in pts),
                        "certified": pts[0]["certified"]})
    return out


def findings(data: dict[str, Any]) -> list[str]:
    """What the measured rows say, in words (computed from them: a re-run with other numbers says other things)."""
    med = {(s["target_epsilon"], s["method"]): s["accuracy_median"] for s in data["summary"]}
    lines = []
    for eps in sorted({s["target_epsilon"] for s in data["summary"]}):
        default, tune, common = (med.get((eps, m)) for m in ("default", "tune", "common practice"))
        if None in (default, tune, common):
            continue
        tuned = [r for r in data["rows"] if r["target_epsilon"] == eps and r["method"] == "tune"]
        per_trial = statistics.median(r["epsilon_single_trial"] for r in tuned)
        trials = statistics.median(r["trials_run"] for r in tuned)
        priced = statistics.median(
            r["epsilon"] for r in data["rows"] if r["target_epsilon"] == eps and r["method"] == "common practice"
        )
        verdict = "loses to" if tune < default else "beats"
        lines.append(
            f"- Total epsilon {eps:g}: the certified search {verdict} the untuned default by "
            f"{abs(tune - default) * 100:.1f} points ({tune:.4f} against {default:.4f}): each trial ran at epsilon "
            f"{per_trial:.3f} (median {trials:g} trials: a private search keeps that number secret, this seeded experiment reads it), so every trial trained "
            f"with more noise than the default's single run. The common practice measured {common:.4f} "
            f"({(common - default) * 100:+.1f} points against the default) but is not certified at {eps:g}: its ten "
            f"full-budget runs composed cost epsilon {priced:.3f}."
        )
    if lines:
        lines.append(
            "- The default's own hyperparameters were chosen by looking at test accuracy (docs/cli.md): its row is the "
            "best case of an uncounted search, which a certified search has to beat with part of the budget."
        )
    return lines


def render(data: dict[str, Any]) -> Report:
    table = md_table(
        ["total epsilon", "method", "test accuracy (median)", "accuracies", "epsilon", "certified"],
        [[f"{s['target_epsilon']:g}", s["method"], "-" if s["accuracy_median"] is None else f"{s['accuracy_median']:.4f}",
          ", ".join(f"{a:.4f}" for a in s["accuracies"]), f"{s['epsilon_median']:.3f}",
          "yes" if s["certified"] else f"NO (priced as {data['trials']} runs composed)"] for s in data["summary"]],
    )

    def draw(fig, ax):
        for method, marker in (("default", "o"), ("tune", "s"), ("common practice", "^")):
            pts = [s for s in data["summary"] if s["method"] == method and s["accuracy_median"] is not None]
            ax.plot([s["target_epsilon"] for s in pts], [s["accuracy_median"] for s in pts], marker=marker, label=method)
        ax.set_xlabel("total budget epsilon (common practice: each trial's)")
        ax.set_ylabel("test accuracy (median over seeds)")
        ax.legend()

    return Report(
        REPORT,
        "What private hyperparameter tuning buys",
        intro=[__doc__.split("\n\n", 1)[1].strip(), f"Command: `{data['command']}` ({data['wall_time_s']:.0f} s)."],
        sections=[Section("Results", [table, "\n".join(findings(data))]), Section("Every run", [md_table(
            ["eps", "seed", "method", "accuracy", "epsilon", "chosen values"],
            [[f"{r['target_epsilon']:g}", r["seed"], r["method"], "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}",
              f"{r['epsilon']:.3f}", r["values"]] for r in data["rows"]])])],
        data={DATA_JSON: data},
        plots=[figure(PLOT, draw, figsize=(6, 4))],
    )


def run(out_dir: str | Path, quick: bool = False, seeds: int | None = None, epsilons: list[float] | None = None) -> Path:
    import tempfile

    cfg = QUICK if quick else {"epsilons": EPSILONS, "seeds": SEEDS, "trials": TRIALS}
    epsilons = tuple(epsilons or cfg["epsilons"])
    seeds = int(seeds or cfg["seeds"])
    command = f"dptrain reproduce tuning --out {Path(out_dir)}" + (" --quick" if quick else "")
    start = time.perf_counter()
    # Each finished (epsilon, seed) cell is kept in out_dir, so that an interrupted reproduction goes on where it
    # stopped (every run is seeded: a cell re-run gives the same rows).
    partial = Path(out_dir) / PARTIAL
    done = json.loads(partial.read_text()) if partial.exists() else []
    rows = [r for r in done if r["target_epsilon"] in epsilons and r["seed"] < seeds]
    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")  # seeded runs: a reproducible experiment
        ctx = single_thread() if quick else _null()
        with ctx:
            for eps in epsilons:
                for seed in range(seeds):
                    if any(r["target_epsilon"] == eps and r["seed"] == seed for r in rows):
                        continue
                    rows += one(eps, seed, cfg["trials"], quick, Path(tmp) / f"{eps}-{seed}")
                    partial.parent.mkdir(parents=True, exist_ok=True)
                    partial.write_text(json.dumps(rows))
    data = {"command": command, "quick": quick, "wall_time_s": time.perf_counter() - start, "rows": rows,
            "trials": cfg["trials"],
            "summary": summarize(rows)}
    written = render(data).write(out_dir)
    partial.unlink(missing_ok=True)
    return written


def _null():
    import contextlib

    return contextlib.nullcontext()
