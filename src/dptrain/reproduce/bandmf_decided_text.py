"""The report of ``dptrain reproduce bandmf`` (:mod:`dptrain.reproduce.bandmf_decided`): the table, the accountants'
choice of b, the verdict in words (computed from the measured rows, never written in advance) and one plot, accuracy
against certified epsilon."""

from __future__ import annotations

from typing import Any

from dptrain.reproduce import md_table
from dptrain.reproduce.equal_privacy_text import per_model_plot, seeds_separated
from dptrain.reproduce.report import Report, Section, figure

__all__ = ["findings", "render", "verdict"]

REPORT, DATA_JSON, RUNS_JSON, PLOT = "decided.md", "decided.json", "decided_runs.json", "decided.png"
LABELS = {"dpsgd": "DP-SGD (pld)", "bandmf": "BandMF, auto bands (pld)", "non_private": "non-private"}


def _row(rows: list[dict], model: str, epochs, target, method: str) -> dict | None:
    return next(
        (
            r
            for r in rows
            if r["model"] == model and r["epochs"] == epochs and r["target_epsilon"] == target and r["method"] == method
        ),
        None,
    )


def _cells(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(bandmf row, dpsgd row) of every (model, epochs, target) measured."""
    out = []
    for r in rows:
        if r["method"] == "bandmf":
            other = _row(rows, r["model"], r["epochs"], r["target_epsilon"], "dpsgd")
            if other is not None:
                out.append((r, other))
    return out


def verdict(rows: list[dict]) -> dict[str, Any]:
    """The decision, from the rows: in how many (model, epochs, target) cells BandMF's median beats DP-SGD's, and with
    every seed on its side; the mean difference in points."""
    cells = _cells(rows)
    wins = sum(b["accuracy_median"] > d["accuracy_median"] for b, d in cells)
    losses = sum(b["accuracy_median"] < d["accuracy_median"] for b, d in cells)
    clear = sum(
        len(b["accuracies"]) > 1 and min(b["accuracies"]) > max(d["accuracies"]) for b, d in cells
    )
    diff = [100 * (b["accuracy_median"] - d["accuracy_median"]) for b, d in cells]
    return {
        "cells": len(cells),
        "bandmf_wins": wins,
        "bandmf_loses": losses,
        "bandmf_wins_every_seed": clear,
        "mean_difference_points": sum(diff) / len(diff) if diff else None,
    }


def findings(data: dict[str, Any]) -> list[str]:
    """Where BandMF is ahead of DP-SGD or behind it, and by how much, from the measured rows."""
    rows, lines = data["rows"], []
    v = verdict(rows)
    if v["cells"]:
        if v["bandmf_wins"] == v["cells"]:
            head = f"BandMF beats DP-SGD at the same certified epsilon in every cell ({v['cells']} of {v['cells']})"
        elif v["bandmf_wins"] == 0:
            head = f"BandMF does not beat DP-SGD at the same certified epsilon in any cell (0 of {v['cells']})"
        else:
            head = f"BandMF beats DP-SGD at the same certified epsilon in {v['bandmf_wins']} of {v['cells']} cells"
        lines.append(
            f"- **Verdict**: {head}, loses in {v['bandmf_loses']}; every seed on BandMF's side in "
            f"{v['bandmf_wins_every_seed']}; mean difference of the medians {v['mean_difference_points']:+.2f} "
            "points."
        )
    for b, d in _cells(rows):
        a, c = b["accuracy_median"], d["accuracy_median"]
        word = "is ahead" if a > c else "is behind" if a < c else "ties"
        lines.append(
            f"- {b['model']}, {b['epochs']:g} epochs, epsilon {b['target_epsilon']:g}: BandMF ({b['bands']} bands, "
            f"predicted RMSE x{b['rmse_ratio']:.3f}) {word}: {a:.4f} against DP-SGD's {c:.4f} "
            f"({100 * (a - c):+.2f} points, {seeds_separated(b, d)}); noise multiplier {b['noise_multiplier']:.3f} against "
            f"{d['noise_multiplier']:.3f}."
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        ceiling = next((r for r in rows if r["model"] == model and r["method"] == "non_private"), None)
        if ceiling is not None:
            lines.append(f"- {model}, non-private ceiling: {ceiling['accuracy_median']:.4f}.")
    return lines


def _settings_section(data: dict) -> Section:
    rows = []
    for s in data["settings"]:
        b = s["bandmf"]
        candidates = ", ".join(f"{k}: {v:.3f}" for k, v in b["candidates"].items())
        rows.append(
            [
                f"{s['epochs']:g}",
                s["steps"],
                f"{s['target_epsilon']:g}",
                f"{s['dpsgd']['noise_multiplier']:.4f}",
                b["bands"],
                f"{b['noise_multiplier']:.4f}",
                f"{b['certified_epsilon']:.4f}",
                f"{b['rmse_ratio']:.3f}",
                candidates,
            ]
        )
    head = [
        "epochs",
        "steps",
        "target",
        "DP-SGD z (pld)",
        "bands",
        "BandMF z (pld)",
        "its certificate",
        "RMSE ratio",
        "ratio per candidate b",
    ]
    s0 = data["settings"][0] if data["settings"] else {}
    return Section(
        "The accountants' choice (before any training)",
        [
            md_table(head, rows),
            f"q = {s0.get('sampling_rate', 0):g}, expected batch {s0.get('expected_batch_size', 0):g}, C = "
            f"{s0.get('max_grad_norm', 0):g}, delta = {data['delta']:g}. b is the candidate (1, 2, 4, ... with b q <= 1)"
            " whose RMSE of the prefix sums relative to DP-SGD at the target is least (both noises by pld; "
            "dptrain.accounting.choose_bands): public quantities only. BandMF's run is certified as ceil(T/b) DP-SGD "
            "steps at rate b q.",
        ],
    )


def _grid_text(data: dict) -> str:
    c = data["config"]
    np_ = c["non_private"]
    return (
        f"Hyperparameters, the same for both private methods: learning rates {c['learning_rates']} (plain SGD), seed 0 "
        f"at each, the best on {c['validation']} held-out training examples kept for the other seeds; while the best "
        f"is the smallest (largest) rate tried, half (twice) it is tried too, up to {c.get('grid_extension', 0)} times "
        f"each way (every rate tried and its held-out accuracy: {RUNS_JSON}, 'cells'; a rate marked * is the end of "
        f"that reach). Non-private: batch {np_['batch_size']}, momentum {np_['momentum']}, {np_['epochs']} epochs, "
        f"cosine learning rate from {np_['learning_rates']} (chosen the same way), no clipping. Every run is seeded: a "
        "reproducible experiment (the certified epsilons are what the same runs spend with secret randomness; the "
        "selection on held-out examples is not accounted, for either method)."
    )


def _draw(data: dict):
    rows = data["rows"]

    def series(model: str):
        epochs = sorted({r["epochs"] for r in rows if r["model"] == model and r["method"] != "non_private"})
        for e, style in zip(epochs, ("-", "--", ":"), strict=False):
            for method, marker in (("dpsgd", "o"), ("bandmf", "s")):
                pts = sorted(
                    (r["certified_epsilon"], r["accuracy_median"])
                    for r in rows
                    if r["model"] == model and r["method"] == method and r["epochs"] == e
                )
                yield f"{LABELS[method]}, {e:g} epochs", pts, {"marker": marker, "ls": style}

    return per_model_plot(rows, series, LABELS["non_private"])


def render(data: dict[str, Any]) -> Report:
    table = md_table(
        [
            "model",
            "epochs",
            "target epsilon",
            "method",
            "bands",
            "test accuracy (median)",
            "accuracies",
            "certified epsilon",
            "z",
            "RMSE ratio",
            "learning rate",
        ],
        [
            [
                r["model"],
                f"{r['epochs']:g}",
                "-" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}",
                r["method"],
                r["bands"] if r["bands"] is not None else "-",
                f"{r['accuracy_median']:.4f}",
                ", ".join(f"{a:.4f}" for a in r["accuracies"]),
                "-" if r["certified_epsilon"] is None else f"{r['certified_epsilon']:.4g}",
                f"{r['noise_multiplier']:.4g}",
                "-" if r["rmse_ratio"] is None else f"{r['rmse_ratio']:.3f}",
                f"{c['learning_rate']:g}" + ("*" if c.get("at_reach") else ""),
            ]
            for r, c in zip(data["rows"], data["cells"], strict=True)
        ],
    )
    draw, panels = _draw(data)
    quick = (
        "**Quick mode: a tiny synthetic problem that checks the code path. These numbers are not the result.**"
        if data["quick"]
        else ""
    )
    return Report(
        REPORT,
        "BandMF, decided: accuracy at equal certified privacy",
        intro=[quick, data["about"], f"Command: `{data['command']}` ({data['wall_time_s']:.0f} s)."],
        sections=[
            Section("Results", [table, "\n".join(findings(data)), _grid_text(data)]),
            _settings_section(data),
        ],
        data={DATA_JSON: data["rows"], RUNS_JSON: {**data, "verdict": verdict(data["rows"])}},
        plots=[figure(PLOT, draw, ncols=panels, figsize=(5.5 * panels, 4))],
    )
