"""The report of ``dptrain reproduce modelmix-decided`` (:mod:`dptrain.reproduce.modelmix_decided`): the table, the
accountants' choice of tau, what the measured rows say in words (computed from them, never written in advance) and
one plot, accuracy against certified epsilon."""

from __future__ import annotations

from typing import Any

from dptrain.reproduce import md_table
from dptrain.reproduce.equal_privacy_text import per_model_plot, seeds_separated
from dptrain.reproduce.report import Report, Section, figure

__all__ = ["findings", "render"]

REPORT, DATA_JSON, RUNS_JSON, PLOT = "decided.md", "decided.json", "decided_runs.json", "decided.png"
LABELS = {
    "dpsgd": "DP-SGD (pld)",
    "modelmix": "ModelMix (modelmix accountant)",
    "same_variance": "DP-SGD, ModelMix's variance (pld)",
    "non_private": "non-private",
}


def _row(rows: list[dict], model: str, target, method: str) -> dict | None:
    return next(
        (r for r in rows if r["model"] == model and r["target_epsilon"] == target and r["method"] == method),
        None,
    )


def _points(a: float, b: float) -> str:
    return f"{abs(a - b) * 100:.1f} points"


def findings(data: dict[str, Any]) -> list[str]:
    """Where ModelMix helps or hurts, and by how much, from the measured rows."""
    rows, lines = data["rows"], []
    wins = losses = 0
    for model in dict.fromkeys(r["model"] for r in rows):
        for target in sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] is not None}):
            mix, sgd, same = (_row(rows, model, target, m) for m in ("modelmix", "dpsgd", "same_variance"))
            if None in (mix, sgd, same):
                continue
            a, b, c = mix["accuracy_median"], sgd["accuracy_median"], same["accuracy_median"]
            wins, losses = wins + (a > b), losses + (a < b)
            verdict = "helps" if a > b else "hurts" if a < b else "changes nothing"
            lines.append(
                f"- {model}, epsilon {target:g}: ModelMix {verdict}: {a:.4f} against DP-SGD's {b:.4f} at the same "
                f"certified budget ({_points(a, b)}, {seeds_separated(mix, sgd)}); it ran at z = "
                f"{mix['noise_multiplier']:.3f} with tau/eta = {mix['tau_over_lr']:g} where DP-SGD needs z = "
                f"{sgd['noise_multiplier']:.3f}. Gaussian noise of ModelMix's total variance (z_eq = "
                f"{same['noise_multiplier']:.2f}, certified epsilon {same['certified_epsilon']:.3g} by pld) reached "
                f"{c:.4f}: the mixing hurt accuracy {'less than' if a > c else 'more than' if a < c else 'as much as'} "
                f"that noise ({_points(a, c)}, {seeds_separated(mix, same)})."
            )
        ceiling = _row(rows, model, None, "non_private")
        if ceiling is not None:
            short = (
                " (below the 90% that Tramer & Boneh's ScatterNet CNN reaches without privacy: the recipe falls short)"
                if model == "scatternet_cnn" and ceiling["accuracy_median"] < 0.9
                else ""
            )
            lines.append(f"- {model}, non-private ceiling: {ceiling['accuracy_median']:.4f}{short}.")
    if wins + losses:
        lines.insert(
            0,
            f"- ModelMix beats DP-SGD at the same certified epsilon in {wins} of {wins + losses} "
            "(model, budget) cells and loses in the rest."
            if wins
            else f"- ModelMix loses to DP-SGD at the same certified epsilon in every (model, budget) cell "
            f"({losses} of {losses}).",
        )
    return lines


def _settings_section(data: dict) -> Section:
    rows = []
    for s in data["settings"]:
        m = s["modelmix"]
        floor = ", ".join(f"{c['tau_over_lr']:g}: {c['epsilon_at_floor']:.2f}" for c in s["tau_candidates"])
        rows.append(
            [
                f"{s['target_epsilon']:g}",
                f"{s['dpsgd']['noise_multiplier']:.4f}",
                f"{m['tau_over_lr']:g}",
                f"{m['width']:.3g}",
                f"{m['noise_multiplier']:.4f}",
                f"{m['certified_epsilon']:.4f}",
                f"{m['pld_epsilon_same_noise']:.3g}",
                f"{s['same_variance']['noise_multiplier']:.3f}",
                f"{s['same_variance']['certified_epsilon']:.3g}",
                floor,
            ]
        )
    head = [
        "target",
        "DP-SGD z (pld)",
        "tau/eta",
        "w = (tau/eta) B/C",
        "ModelMix z (modelmix)",
        "its certificate",
        "pld at that z",
        "z_eq",
        "pld at z_eq",
        "modelmix certificate at z = 0.3, per tau/eta",
    ]
    s0 = data["settings"][0] if data["settings"] else {}
    return Section(
        "The accountants' choice (before any training)",
        [
            md_table(head, rows),
            f"q = {s0.get('sampling_rate', 0):g}, {s0.get('steps', 0)} steps, expected batch B = "
            f"{s0.get('expected_batch_size', 0):g}, C = {s0.get('max_grad_norm', 0):g}, p = {s0.get('linf_p', 0)}, delta = "
            f"{data['delta']:g}. tau/eta is the largest of {data['taus']} whose modelmix certificate at the noise floor "
            "z = 0.3 exceeds the target (the last column; the search stops at the first that does), so the calibrated "
            "noise is certifiable; 'pld at that z' is what DP-SGD's accountant certifies for the same noise without the "
            "mixing's credit. z_eq = sqrt(z^2 + w^2/12): the same-variance control's noise multiplier.",
        ],
    )


def _grid_text(data: dict) -> str:
    c = data["config"]
    np_ = c["non_private"]
    return (
        f"Hyperparameters, the same for every private method: learning rates {c['learning_rates']} (plain SGD; "
        f"ModelMix refuses momentum), seed 0 at each, the best on {c['validation']} held-out training examples kept "
        f"for the other seeds; while the best is the smallest (largest) rate tried, half (twice) it is tried too, "
        f"up to {c.get('grid_extension', 0)} times each way (every rate tried and its held-out accuracy: "
        f"{RUNS_JSON}, 'cells'; a rate marked * is the end of that reach, so a better one may lie beyond). "
        f"Non-private: batch {np_['batch_size']}, momentum {np_['momentum']}, {np_['epochs']} "
        f"epochs, cosine learning rate from {np_['learning_rates']} (chosen the same way), no clipping. Every run is "
        "seeded: a reproducible experiment (the certified epsilons are what the same runs spend with secret "
        "randomness; the selection on held-out examples is not accounted, for any method)."
    )


def _draw(data: dict):
    rows = data["rows"]

    def series(model: str):
        for method, marker in (("dpsgd", "o"), ("modelmix", "s"), ("same_variance", "^")):
            pts = sorted(
                (r["certified_epsilon"], r["accuracy_median"])
                for r in rows
                if r["model"] == model and r["method"] == method
            )
            yield LABELS[method], pts, {"marker": marker}

    return per_model_plot(rows, series, LABELS["non_private"])


def render(data: dict[str, Any]) -> Report:
    table = md_table(
        [
            "model",
            "target epsilon",
            "method",
            "test accuracy (median)",
            "accuracies",
            "certified epsilon",
            "accountant",
            "z",
            "tau/eta",
            "p",
            "learning rate",
        ],
        [
            [
                r["model"],
                "-" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}",
                r["method"],
                f"{r['accuracy_median']:.4f}",
                ", ".join(f"{a:.4f}" for a in r["accuracies"]),
                "-" if r["certified_epsilon"] is None else f"{r['certified_epsilon']:.4g}",
                r["accountant"] or "-",
                f"{r['noise_multiplier']:.4g}",
                "-" if r["tau_over_lr"] is None else f"{r['tau_over_lr']:g}",
                r["linf_p"] or "-",
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
        "ModelMix, decided: accuracy at equal certified privacy",
        intro=[
            quick,
            data["about"],
            f"Command: `{data['command']}` ({data['wall_time_s']:.0f} s)." + (f" {data['note']}" if "note" in data else ""),
        ],
        sections=[
            Section("Results", [table, _grid_text(data), "\n".join(findings(data))]),
            _settings_section(data),
        ],
        data={DATA_JSON: data["rows"], RUNS_JSON: data},
        plots=[figure(PLOT, draw, ncols=panels, figsize=(5.5 * panels, 4))],
    )
