"""Reproduction of Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix" (docs/modelmix.md).

Two commands:

- ``dptrain reproduce modelmix-accounting`` (minutes): Fig. 3 (the nine epsilons at q = 0.02 and the q = 0.04
  curves), the transfer-learning epsilon of Sec. 5.3, each under the paper's method and under the certified
  accountant (both orderings), and the numerical soundness review of the paper's proof
  (:mod:`dptrain.reproduce.modelmix_review`);
- ``dptrain reproduce modelmix`` (hours on CPU): all of the above plus Table I's Fashion-MNIST row (ScatterNet
  features, DP-SGD vs DP-SGD + ModelMix at several epsilons, 3 seeds) and the same-noise curves of Fig. 2
  (:mod:`dptrain.reproduce.modelmix_training`).

The paper's method: the forward divergence only, fractional orders for p = 1 and integer orders for p > 1, its
Thm 2.2 conversion; the plain DP-SGD noise of Fig. 3 calibrated with the same conversion on TF Privacy's order grid
(1.1, 1.2, ..., 10.9, 12, ..., 63) and exact fractional-order RDP of the sampled Gaussian (the width-0 limit of
the ModelMix integral), which gives z = 0.36328 for epsilon = 200.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from dptrain.accounting.modelmix import Phase, modelmix_epsilon, step_rdp
from dptrain.errors import ConfigError
from dptrain.reproduce import md_table
from dptrain.reproduce.report import Report, Section, figure

__all__ = ["PAPER_FIG3", "accounting", "render", "run", "run_accounting"]

DELTA = 1e-5
STEPS = 5000
CLIP, N = 20.0, 50_000
#: TF Privacy's / Opacus's order grid, with which the paper's plain DP-SGD calibration is reproduced.
TF_ORDERS = tuple([round(1 + x / 10.0, 1) for x in range(1, 100)] + list(range(12, 64)))
#: Fig. 3 (q = 0.02, plain DP-SGD epsilon 200): tau/eta -> (ModelMix, + p = 25, + p = 100).
PAPER_FIG3 = {0.075: (57.2, 17.9, 15.3), 0.15: (40.4, 9.0, 7.9), 0.3: (31.7, 5.4, 4.8)}
TAUS = (0.075, 0.15, 0.3)
PS = (1, 25, 100)


def _paper_dpsgd_epsilon(q: float, z: float, steps: int) -> float:
    rdp = steps * step_rdp(q, z, 0.0, TF_ORDERS)
    return float(np.min(rdp + math.log(1 / DELTA) / (np.asarray(TF_ORDERS) - 1)))


def paper_noise(q: float, target: float = 200.0, steps: int = STEPS) -> float:
    """The plain DP-SGD noise multiplier with epsilon = ``target`` under the paper's accounting."""
    return float(optimize.brentq(lambda z: _paper_dpsgd_epsilon(q, z, steps) - target, 0.2, 2.0, xtol=1e-6))


def _curve(q: float, z: float, width: float, p: int, steps: list[int]) -> dict[str, list[float]]:
    """epsilon after each number of steps in ``steps``: the paper's method and the certified value."""
    paper, certified = [], []
    for t in steps:
        r = modelmix_epsilon([Phase(t, q, z, width, p)], DELTA)
        paper.append(r["epsilon_paper_method"])
        certified.append(r["epsilon"])
    return {"paper_method": paper, "certified": certified}


def accounting(quick: bool = False) -> dict[str, Any]:
    """Fig. 3 at q = 0.02 and 0.04 and the transfer-learning check, as JSON-able data."""
    out: dict[str, Any] = {"delta": DELTA, "steps": STEPS, "clip_norm": CLIP, "dataset_size": N, "fig3": []}
    curve_steps = [250, 500, 1000, 2000, 3000, 4000, 5000] if not quick else [1000, 5000]
    for q in (0.02, 0.04) if not quick else (0.02,):
        z = paper_noise(q)
        batch = q * N
        block = {"sampling_rate": q, "noise_multiplier": z, "batch_size": batch, "cells": []}
        from dptrain.accounting import dpsgd_ledger, epsilon

        block["dpsgd_rdp_certified"] = epsilon(dpsgd_ledger(z, q, STEPS), DELTA, "rdp").epsilon
        for tau in TAUS if not quick else (0.3,):
            width = tau * batch / CLIP
            for p in PS:
                r = modelmix_epsilon([Phase(STEPS, q, z, width, p)], DELTA)
                cell = {
                    "tau_over_lr": tau,
                    "width_over_sensitivity": width,
                    "linf_p": p,
                    "epsilon_paper_method": r["epsilon_paper_method"],
                    "epsilon_paper_direction": r["epsilon_paper_direction"],
                    "epsilon_reverse_one_hot_not_a_bound": r["epsilon_reverse_one_hot_not_a_bound"],
                    "epsilon_forward_certified": r["epsilon_forward_certified"],
                    "epsilon_reverse_certified": r["epsilon_reverse_certified"],
                    "epsilon_certified": r["epsilon"],
                    "binding_direction": r["binding_direction"],
                    "in_certified_range": r["in_certified_range"],
                }
                if q == 0.02:
                    cell["paper"] = PAPER_FIG3[tau][PS.index(p)]
                cell["curve"] = {"steps": curve_steps, **_curve(q, z, width, p, curve_steps)}
                block["cells"].append(cell)
        out["fig3"].append(block)
    phases = [Phase(500, 1024 / 50_000, 2.04, t * 1024 / 0.1, 1) for t in (0.0075, 0.005, 0.0025)]
    r = modelmix_epsilon(phases, DELTA)
    out["transfer"] = {
        "setting": "q = 1024/50000, B = 1024, C = 0.1, z = 0.85 x 2.40, 1500 steps in 3 phases tau/eta = "
        "0.0075, 0.005, 0.0025, p = 1",
        "paper": 0.64,
        "epsilon_paper_method": r["epsilon_paper_method"],
        "epsilon_certified": r["epsilon"],
        "in_certified_range": r["in_certified_range"],
    }
    return out


def _fig3_table(block: dict) -> str:
    rows = []
    for c in block["cells"]:
        rows.append(
            [
                f"{c['tau_over_lr']:g} eta",
                c["linf_p"],
                f"{c['width_over_sensitivity']:g}",
                c.get("paper", "-"),
                f"{c['epsilon_paper_method']:.2f}",
                f"{c['epsilon_paper_direction']:.2f}",
                "-" if c.get("epsilon_reverse_one_hot_not_a_bound") is None
                else f"{c['epsilon_reverse_one_hot_not_a_bound']:.2f}",
                f"{c['epsilon_forward_certified']:.2f}",
                f"{c['epsilon_reverse_certified']:.2f}",
                f"**{c['epsilon_certified']:.2f}**" + ("" if c["in_certified_range"] else " (not certified)"),
            ]
        )
    head = ["tau", "p", "w/s", "paper", "paper's method", "forward (fractional)", "reverse (one-hot, no bound)",
            "forward (integer)", "reverse bound", "certified"]
    return md_table(head, rows)


def _draw_fig3(data: dict):
    def draw(fig, axes):
        axes = np.atleast_1d(axes)
        for ax, block in zip(axes, data["fig3"], strict=False):
            for c in block["cells"]:
                if c["linf_p"] == 1 and c["tau_over_lr"] != TAUS[-1]:
                    continue
                label = f"tau={c['tau_over_lr']:g}eta, p={c['linf_p']}"
                steps = c["curve"]["steps"]
                line = ax.plot(steps, c["curve"]["certified"], label=f"{label} certified")[0]
                ax.plot(steps, c["curve"]["paper_method"], ls="--", color=line.get_color())
            ax.set_yscale("log")
            ax.set_xlabel("steps")
            ax.set_ylabel("epsilon (delta = 1e-5)")
            ax.set_title(f"q = {block['sampling_rate']:g}, z = {block['noise_multiplier']:.4f}")
        axes[0].legend(fontsize=6)
        fig.tight_layout()

    return draw


def _section_review(review: dict | None) -> Section:
    if review is None:
        return Section("Soundness review", ["(not run)"])
    rows = [
        [c["name"], c["claim"], c["checked"], f"{c['worst_margin']:.3g}", "yes" if c["holds"] else "**no**"]
        for c in review["checks"]
    ]
    return Section(
        "Soundness review (numerical)",
        [
            md_table(["check", "claim", "cases", "worst margin", "holds"], rows),
            "A margin is (lhs - rhs) / max(|lhs|, |rhs|) for a claim lhs <= rhs: negative holds. The certificate uses "
            "only what holds (docs/modelmix.md, Soundness review): integer moments (F), the width argument (B), "
            "the norm (D) and the power-moment sup (H); the convex-order reductions (C, E) fail for w > 0 and the "
            "pairwise RDP reduction (C_rdp) fails for the reverse ordering: none of them is used.",
        ],
    )


def render(data: dict) -> Report:
    sections = []
    for block in data["accounting"]["fig3"]:
        sections.append(
            Section(
                f"Fig. 3, q = {block['sampling_rate']:g} (z = {block['noise_multiplier']:.5f}: plain DP-SGD epsilon "
                f"200 under the paper's accounting; {block['dpsgd_rdp_certified']:.1f} under dp_accounting's rdp)",
                [_fig3_table(block)],
            )
        )
    t = data["accounting"]["transfer"]
    sections.append(
        Section(
            "Transfer learning (Sec. 5.3)",
            [
                f"{t['setting']}: paper {t['paper']}, paper's method {t['epsilon_paper_method']:.3f}, certified "
                f"{t['epsilon_certified']:.3f}"
                + ("" if t["in_certified_range"] else " (outside the reviewed range: not certified)")
            ],
        )
    )
    sections.append(_section_review(data.get("review")))
    plots = [figure("fig3.png", _draw_fig3(data["accounting"]), ncols=len(data["accounting"]["fig3"]),
                    figsize=(11, 4))]
    files: dict[str, Any] = {}
    training = data.get("training")
    if training is not None:
        render_training = importlib.import_module("dptrain.reproduce.modelmix_training_text").render_sections
        more_sections, more_plots, files = render_training(training)
        sections += more_sections
        plots += more_plots
    intro = [
        "Columns: the paper's number; the paper's method (its divergence direction, fractional orders for p = 1, "
        "integer orders for p > 1, its Thm 2.2 conversion); with the improved RDP conversion: the forward direction "
        "at fractional orders and the exact reverse at the one-hot shift (reported: no bound, split shifts give "
        "more), the forward direction at integer orders and the reverse bound valid for every shift (certified), "
        "and the certified epsilon "
        "(the larger of the two). docs/modelmix.md explains the difference. Command: `" + data["command"] + "`.",
        *([data["note"]] if data.get("note") else []),
    ]
    return Report(
        "modelmix.md",
        "ModelMix (Xiao, Wan & Devadas): reproduction",
        intro,
        sections,
        data={"modelmix.json": data, **files},
        plots=plots,
    )


def run_accounting(out_dir: str | Path, quick: bool = False) -> Path:
    """``dptrain reproduce modelmix-accounting``: Fig. 3, transfer and the soundness review."""
    review = importlib.import_module("dptrain.reproduce.modelmix_review").review(quick=quick)
    data = {
        "command": "dptrain reproduce modelmix-accounting" + (" --quick" if quick else ""),
        "accounting": accounting(quick),
        "review": review,
    }
    return render(data).write(out_dir)


def run(
    out_dir: str | Path, quick: bool = False, seeds: int = 3, epsilons: str | tuple = (0.2, 0.6, 1.0)
) -> Path:
    """``dptrain reproduce modelmix``: the accounting part and the training experiments (hours on CPU: Table I
    takes about 12 minutes a run on 2 cores). ``seeds``: seeds 0..seeds-1; ``epsilons``: Table I's targets (a
    comma-separated string from the CLI). Table I's rows so far are written to ``out_dir/table1-partial.json``
    as they finish."""
    from dptrain.reproduce import json_default

    training = importlib.import_module("dptrain.reproduce.modelmix_training")
    if isinstance(epsilons, str):
        try:
            epsilons = tuple(float(e) for e in epsilons.split(","))
        except ValueError:
            raise ConfigError(f"--epsilons takes comma-separated numbers, got {epsilons!r}") from None
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"--seeds takes a number of seeds >= 1, got {seeds!r}")
    if not epsilons or not all(math.isfinite(e) and e > 0 for e in epsilons):
        raise ConfigError(f"--epsilons takes positive numbers, got {epsilons!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def save(rows: list) -> None:
        (out / "table1-partial.json").write_text(json.dumps(rows, indent=1, default=json_default) + "\n")

    command = "dptrain reproduce modelmix" + (" --quick" if quick else "")
    if seeds != 3:
        command += f" --seeds {seeds}"
    if tuple(epsilons) != (0.2, 0.6, 1.0):
        command += " --epsilons " + ",".join(f"{e:g}" for e in epsilons)
    review = importlib.import_module("dptrain.reproduce.modelmix_review").review(quick=quick)
    data = {
        "command": command,
        "accounting": accounting(quick),
        "review": review,
        "training": {
            "table1": training.table1(quick, seeds=tuple(range(seeds)), epsilons=tuple(epsilons), on_row=save),
            "fig2": training.fig2(quick),
        },
    }
    return render(data).write(out_dir)
