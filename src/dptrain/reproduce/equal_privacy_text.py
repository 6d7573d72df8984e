"""What the reports of the equal-privacy comparisons (``modelmix-decided``, ``bandmf``, ``recipes``) say the same way:
whether two rows' seeds overlap, and the plot of test accuracy against certified epsilon with one panel per model."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["per_model_plot", "seeds_separated"]

#: one line of a panel: its label, its (certified epsilon, accuracy) points, keyword arguments for ``ax.plot``
Series = tuple[str, list[tuple[float, float]], dict[str, Any]]


def seeds_separated(a: dict, b: dict) -> str:
    """Whether two rows' seeds overlap (with a few seeds, the only honest statement about noise)."""
    if len(a["accuracies"]) < 2:
        return "one seed: no spread measured"
    if min(a["accuracies"]) > max(b["accuracies"]) or max(a["accuracies"]) < min(b["accuracies"]):
        return "every seed on the same side"
    return "the seeds overlap"


def per_model_plot(
    rows: list[dict], series: Callable[[str], Iterable[Series]], ceiling_label: str
) -> tuple[Callable[[Any, Any], None], int]:
    """``draw(fig, axes)`` for :func:`dptrain.reproduce.report.figure` and its number of panels: one panel per model,
    the lines ``series(model)`` gives, the model's non-private row (``method == "non_private"``) as a dashed
    ceiling."""
    models = list(dict.fromkeys(r["model"] for r in rows))

    def draw(fig, axes) -> None:
        import numpy as np

        axes = np.atleast_1d(axes)
        for ax, model in zip(axes, models, strict=False):
            for label, pts, style in series(model):
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **style)
            ceiling = next((r for r in rows if r["model"] == model and r["method"] == "non_private"), None)
            if ceiling is not None:
                ax.axhline(ceiling["accuracy_median"], color="gray", ls="--", label=ceiling_label)
            ax.set_xscale("log")
            ax.set_xlabel("certified epsilon (delta = 1e-5)")
            ax.set_ylabel("test accuracy (median over seeds)")
            ax.set_title(model)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()

    return draw, len(models)
