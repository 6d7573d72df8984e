"""The report of ``dptrain reproduce recipes`` (:mod:`dptrain.reproduce.recipes`): the table, what the measured rows
say in words (computed from them, never written in advance) and one plot, accuracy against certified epsilon."""

from __future__ import annotations

from typing import Any

from dptrain.reproduce import md_table
from dptrain.reproduce.equal_privacy_text import seeds_separated
from dptrain.reproduce.report import Report, Section, figure

__all__ = ["PUBLISHED", "findings", "render"]

REPORT, DATA_JSON, RUNS_JSON, PLOT = "recipes.md", "recipes.json", "recipes_runs.json", "recipes.png"
#: Tramer & Boneh's published Fashion-MNIST accuracies at epsilon 3 ("Differentially Private Learning Needs Better
#: Features (or Much More Data)", Table 1; shuffled batches and an RDP conversion looser than pld's).
PUBLISHED = {"scatternet_linear": 0.897, "scatternet_cnn": 0.890, "cnn28": 0.860}


def _by(rows: list[dict], recipe: str, target: float) -> dict | None:
    return next((r for r in rows if r["recipe"] == recipe and r["target_epsilon"] == target), None)


def findings(data: dict[str, Any]) -> list[str]:
    rows, lines = data["rows"], []
    for target in sorted({r["target_epsilon"] for r in rows}):
        here = [r for r in rows if r["target_epsilon"] == target]
        best = max(here, key=lambda r: r["accuracy_median"])
        lines.append(
            f"- Epsilon {target:g}: the best is {best['recipe']} at {best['accuracy_median']:.4f} (median over "
            f"{len(best['accuracies'])} seeds, certified epsilon {best['certified_epsilon']:.4g} by pld)."
        )
        for recipe, published in PUBLISHED.items():
            r = _by(rows, recipe, target)
            if r is not None and target == 3.0:
                verdict = "above" if r["accuracy_median"] > published else "below"
                lines.append(
                    f"  - {recipe}: {r['accuracy_median']:.4f}, {verdict} Tramer & Boneh's published "
                    f"{published:.3f} at epsilon 3."
                )
    for r in rows:
        if not r["recipe"].endswith("+ema"):
            continue
        plain = _by(rows, r["recipe"][: -len("+ema")], r["target_epsilon"])
        if plain is not None:
            d = r["accuracy_median"] - plain["accuracy_median"]
            lines.append(
                f"- {plain['recipe']}, epsilon {r['target_epsilon']:g}: weight averaging (decay {r['ema']:g}) "
                f"{'gains' if d > 0 else 'loses' if d < 0 else 'changes'} {abs(d) * 100:.2f} points "
                f"({seeds_separated(r, plain)})."
            )
    for r in rows:
        if r["augment_multiplicity"] > 1 and not r["recipe"].endswith("+ema"):
            base = next(
                (b for b in rows if b["augment_multiplicity"] == 1 and b["model"] == r["model"]
                 and b["target_epsilon"] == r["target_epsilon"] and not b["recipe"].endswith("+ema")),
                None,
            )  # fmt: skip
            if base is not None:
                d = r["accuracy_median"] - base["accuracy_median"]
                lines.append(
                    f"- {r['model']}, epsilon {r['target_epsilon']:g}: augmentation multiplicity K = "
                    f"{r['augment_multiplicity']} {'gains' if d > 0 else 'loses'} {abs(d) * 100:.2f} points against "
                    f"K = 1 at the same setting ({seeds_separated(r, base)})."
                )
    return lines


def _draw(data: dict):
    def draw(fig, ax):
        recipes = list(dict.fromkeys(r["recipe"] for r in data["rows"] if not r["recipe"].endswith("+ema")))
        for i, recipe in enumerate(recipes):
            for suffix, style in (("", "-"), ("+ema", "--")):
                pts = sorted(
                    (r["certified_epsilon"], r["accuracy_median"]) for r in data["rows"] if r["recipe"] == recipe + suffix
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                            label=recipe + suffix)
        for recipe, acc in PUBLISHED.items():
            if recipe in recipes:
                ax.plot([3.0], [acc], "x", color=f"C{recipes.index(recipe)}", ms=9)
        ax.set_xscale("log")
        ax.set_xlabel("certified epsilon (delta = 1e-5)")
        ax.set_ylabel("test accuracy (median over seeds)")
        ax.set_title("Fashion-MNIST (x: Tramer & Boneh's published numbers at epsilon 3)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def render(data: dict[str, Any]) -> Report:
    cells = {(c["recipe"], c["target_epsilon"]): c for c in data["cells"]}
    table = md_table(
        ["recipe", "target epsilon", "test accuracy (median)", "accuracies", "certified epsilon", "z", "epochs",
         "batch", "K", "EMA decay", "learning rate"],
        [
            [
                r["recipe"],
                f"{r['target_epsilon']:g}",
                f"{r['accuracy_median']:.4f}",
                ", ".join(f"{a:.4f}" for a in r["accuracies"]),
                f"{r['certified_epsilon']:.4g}",
                f"{r['noise_multiplier']:.4g}",
                f"{r['epochs']:g}",
                r["batch_size"],
                r["augment_multiplicity"],
                "-" if r["ema"] is None else f"{r['ema']:g}",
                f"{r['learning_rate']:g}" + ("*" if cells[(r["recipe"], r["target_epsilon"])].get("at_reach") else ""),
            ]
            for r in data["rows"]
        ],
    )  # fmt: skip
    quick = (
        "**Quick mode: a tiny synthetic problem that checks the code path. These numbers are not the result.**"
        if data["quick"]
        else ""
    )
    note = (
        "A learning rate marked * is the end of the reach of the learning-rate rule: a better one may lie beyond. "
        f"Every rate tried and its held-out score: {RUNS_JSON}, 'cells'."
    )
    return Report(
        REPORT,
        "Recipes: accuracy at a certified budget",
        intro=[quick, data["about"], f"Command: `{data['command']}` ({data['wall_time_s']:.0f} s)."],
        sections=[Section("Results", [table, note, "\n".join(findings(data))])],
        data={DATA_JSON: data["rows"], RUNS_JSON: data},
        plots=[figure(PLOT, _draw(data), figsize=(7, 4.5))],
    )
