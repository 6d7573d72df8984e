"""The report of the reproduction of "Proactive DP: A Multiple Target Optimization Framework for DP-SGD" (van Dijk
et al.; docs/proactive.md): each section's text and tables, the plots, and :func:`render`, which builds the whole
report from the data :func:`dptrain.reproduce.proactive.run` saves (``proactive.json``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from dptrain.reproduce import md_table
from dptrain.reproduce.proactive_setup import (
    CLASS_NAMES,
    DATA_JSON,
    EXPERIMENT,
    NEGATIVE_CLASS,
    POSITIVE_CLASS,
    REPORT,
)
from dptrain.reproduce.report import Plot, Report, Section, figure


def _section_a_md(rows: list[dict[str, Any]]) -> str:
    table = []
    for r in rows:
        p = r["paper"]
        for label, key, fmt in [
            ("eps_target (eq. (6) inverted)", "epsilon", "{:.4f}"),
            ("s_max (at T_min, eq. (8))", "s_max", "{:d}"),
            ("s_max_asym (at T_min_asym)", "s_max_asym", "{:d}"),
            ("eps_fDP at T_min", "eps_fdp", "{:.4f}"),
            ("eps_fDP at T_min_asym", "eps_fdp_asym", "{:.4f}"),
            ("eps_target / eps_fDP at T_min", "ratio", "{:.4f}"),
            ("eps_target / eps_fDP at T_min_asym", "ratio_asym", "{:.4f}"),
        ]:
            ours = r[key]
            diff = ours - p[key]
            table.append(
                [
                    r["name"],
                    label,
                    fmt.format(p[key]),
                    fmt.format(ours),
                    f"{diff:+d}" if isinstance(diff, int) else f"{diff:+.4f}",
                ]
            )
    certified = md_table(
        [
            "setting",
            "gamma (paper iteration)",
            "gamma* (fixed point)",
            "T_min paper",
            "T_min certified",
            "s_max paper",
            "s_max certified",
            "Thm 3.1 conditions failing at T_min",
        ],
        [
            [
                r["name"],
                f"{r['gamma_paper']:.4f}",
                f"{r['gamma_fixed_point']:.4f}",
                f"{r['T_min']:.1f}",
                f"{r['T_min_fixed_point']:.1f}",
                r["s_max"],
                r["s_max_fixed_point"],
                ", ".join(r["theorem_3_1_failed"]) or "none",
            ]
            for r in rows
        ],
    )
    asym = md_table(
        ["setting", "s_max_asym", "T = kN/s_max_asym", "paper eps_fDP", "ours", "ours with mu x sqrt(2)"],
        [
            [
                r["name"],
                r["s_max_asym"],
                f"{r['k'] * r['n'] / r['s_max_asym']:.1f}",
                f"{r['paper']['eps_fdp_asym']:.4f}",
                f"{r['eps_fdp_asym']:.4f}",
                f"{r['eps_fdp_asym_mu_sqrt2']:.4f}",
            ]
            for r in rows
        ],
    )
    return "\n\n".join(
        [
            md_table(["setting", "quantity", "paper", "ours", "ours - paper"], table),
            'eps_target, s_max and s_max_asym come from `dp_calculator_simple(sigma, N, k, gamma_mode="paper")` '
            "(App. D.4: delta = 1/N, the paper's gamma iteration from 2 with its signed stop rule, which returns "
            "the first iterate). eps_fDP is the CLT Gaussian-DP accountant with uniform subsampling, eq. (65) + "
            "eq. (64), with T = kN/s and p = s/N, solved at delta = 1/N.",
            "**T_min_asym column: not reproduced.** With T = kN/s_max_asym we get the values below, about 2/3 of the "
            "paper's; the paper's column is matched only if mu is multiplied by sqrt(2) (e.g. T doubled), which "
            "the paper does not explain. The ratio row for T_min_asym therefore differs too. Our values are what "
            "the stated method gives:",
            asym,
            "**Certified default.** The paper's iteration stops at gamma_1 = RHS(2), which is valid but larger "
            "than the smallest solution gamma* of gamma >= RHS(gamma) (Thm B.4 / Thm 3.1). dptrain's default "
            '(`gamma_mode="fixed_point"`, with the (B.3) first term as derived, sigma/(1 - a - 2 sqrt(a))) '
            "certifies the same eps_target with fewer rounds and larger batches:",
            certified,
            "A condition failing at T_min means Thm 3.1 itself does not apply (CIFAR10: eps = 0.5253 is not < 0.5); "
            "Thm B.4 has no such restriction and still certifies the run (the proactive accountant of section (b) "
            "uses Thm B.4).",
        ]
    )


def _section_b_md(rows: list[dict[str, Any]]) -> str:
    table = md_table(
        [
            "setting",
            "sigma",
            "s",
            "T",
            "closed-form eps",
            "proactive accountant eps",
            "PLD eps",
            "closed/PLD",
            "RDP eps",
        ],
        [
            [
                r["setting"],
                f"{r['sigma']:.5f}",
                r["s"],
                r["T"],
                f"{r['eps_closed_form']:.4f}",
                "refused"
                if r["eps_proactive_accountant"] is None
                else f"{r['eps_proactive_accountant']:.4f}",
                f"{r['eps_pld']:.4f}",
                f"{r['ratio_closed_over_pld']:.3f}",
                f"{r['eps_rdp']:.4f}",
            ]
            for r in rows
        ],
    )
    ratios = [r["ratio_closed_over_pld"] for r in rows]

    def span(tag: str, key: str = "ratio_closed_over_pld", fmt: str = "{:.2f}") -> str:
        vals = [r[key] for r in rows if tag in r["setting"]]
        return f"{fmt.format(min(vals))}-{fmt.format(max(vals))}"

    verdict = "never below" if min(ratios) >= 1 else "BELOW (this would be a bug)"
    return "\n\n".join(
        [
            table,
            "delta = 1/N everywhere. The ledger is T = ceil(kN/s) Poisson-sampled Gaussian steps with rate s/N "
            "(`dpsgd_ledger(sigma, s/N, T, dataset_size=N)`); PLD and RDP are dp_accounting's accountants. "
            "Our settings use sigma = eq. (6) at the target eps and `plan_proactive` (gamma at its fixed point, "
            "T = ceil(T_min), s = floor(kN/T)). The proactive accountant certifies the run's actual ledger, whose "
            "k = sT/N is slightly above the nominal k because T is rounded up, so it can exceed the closed form by "
            "a hair (CIFAR10 certified row).",
            f"The closed form is {verdict} the tight PLD epsilon: ratios {min(ratios):.2f} to {max(ratios):.2f}. "
            f"Paper settings (k = 5-7): {span('paper gamma')}x at the paper's s_max (gamma "
            f"{span('paper gamma', 'gamma')}), {span('certified')}x at the certified s_max (gamma* "
            f"{span('certified', 'gamma')}); the paper reports 3.9-4.7x against its f-DP CLT accountant. Our longer "
            f"runs (k = 20-100 epochs, gamma* {span('ours', 'gamma')}): {span('ours')}x. The looseness shrinks as "
            "gamma approaches 2, in line with the paper's Thm 3.2 (T_min cannot be divided by more than 2 gamma).",
        ]
    )


def _fmt_eps(v: float | None) -> str:
    return "refused" if v is None else f"{v:.4f}"


def _section_c_md(exp: dict[str, Any]) -> str:
    n, k = exp["n"], exp["k"]
    fp, pa = exp["calculator_fixed_point"], exp["calculator_paper"]
    conv_text = {
        "mean": "w <- w - eta_t U/s (the engine's average of the noisy sum; lr = eta_t)",
        "sum": "w <- w - eta_t U (Algorithm 1's sum read literally; lr = s eta_t on the average)",
    }
    parts = [
        f"Task: Fashion-MNIST **{CLASS_NAMES[NEGATIVE_CLASS]} ({NEGATIVE_CLASS}) vs {CLASS_NAMES[POSITIVE_CLASS]} "
        f"({POSITIVE_CLASS})**, label 1 = Shirt. Training set: the first {n // 2} training examples of each class "
        f"(N = {n}, balanced, deterministic); test set: all {exp['test_size']} test examples of the two classes. "
        "Why this pair: both suggested pairs (T-shirt/top vs Shirt, Pullover vs Coat) are hard for a linear "
        "model (non-private ~84-85% in a pilot run, a gap like the paper's 93% LIBSVM reference leaves), but at "
        "sigma = 19.3 and C = 0.1 T-shirt/top vs Shirt stays clearly above chance (pilot, one seed, s = 31: 0.78 "
        "vs 0.68 for Pullover vs Coat), so differences between batch sizes are visible.",
        f'Model: logistic regression (`build_model("logistic", (1, 28, 28), 2)`, 2 logits = binary logistic '
        f"regression), plain SGD. Table 3 parameters: sigma = {exp['sigma']}, C = {exp['clip']}, k = {k} epochs, "
        f"delta = 1/N, eta0 = {exp['eta0']}, beta = {exp['beta']} (plain-convex schedule eta_t = eta0/(1 + beta "
        "sqrt(t)), t = samples processed = i s at round i, via LambdaLR stepped once per round).",
        f"Budget: D.4 calculator at (sigma, N, k): eps = {fp['epsilon']:.4f} (delta = 1/N). Certified s_max "
        f"(gamma* = {fp['gamma']:.3f}) = **{fp['s_max']}**, paper-iteration s_max (gamma_1 = {pa['gamma']:.3f}) "
        f"= {pa['s_max']}. Every s <= s_max meets eq. (8) with T = ceil(kN/s) and shares the same certified "
        "budget. Each round is Poisson-sampled with rate s/N (expected batch s), per-example clipping to C, one "
        "N(0, C^2 sigma^2 I) draw on the sum.",
        'Step-size convention: the paper sums the clipped gradients and "discount[s] averaging the sum ... by '
        'scaling the step size inversely with s_i" (Sec. 2.2) without saying whether eta_t already includes '
        "the 1/s. We report both readings, same eta0 and beta: **mean** = "
        + conv_text["mean"]
        + "; **sum** = "
        + conv_text["sum"]
        + ".",
    ]
    for convention in ("mean", "sum"):
        summ = exp["summary"][convention]
        table = md_table(
            [
                "s",
                "T = ceil(kN/s)",
                f"test accuracy (mean +- std, {len(exp['seeds'])} seeds)",
                "per seed",
                "certified eps (proactive)",
                "PLD eps",
                "ms/step",
            ],
            [
                [
                    r["s"],
                    r["T"],
                    f"{r['mean']:.4f} +- {r['std']:.4f}",
                    ", ".join(f"{a:.3f}" for a in r["accuracies"]),
                    _fmt_eps(r["eps_proactive"]),
                    _fmt_eps(r["eps_pld"]),
                    f"{r['ms_per_step']:.2f}",
                ]
                for r in summ["rows"]
            ],
        )
        best = next(r for r in summ["rows"] if r["s"] == summ["best_s"])
        largest = summ["rows"][-1]
        if summ["largest_is_best"]:
            verdict = (
                f"The largest batch s = {largest['s']} (fewest rounds, T = {largest['T']}) gives the best "
                f"mean accuracy ({largest['mean']:.4f}), as the paper claims."
            )
        else:
            within = "within" if summ["largest_within_one_std_of_best"] else "NOT within"
            verdict = (
                f"The largest batch s = {largest['s']} is NOT the best: s = {best['s']} gives "
                f"{best['mean']:.4f} +- {best['std']:.4f} vs {largest['mean']:.4f} +- {largest['std']:.4f} "
                f"at s = {largest['s']} ({within} one std of the best)."
            )
        if convention == "sum":
            verdict += (
                " In this reading the step on the averaged gradient is s eta_t (up to "
                f"{exp['eta0'] * largest['s']:g} at s = {largest['s']}), so at large s the step size grows with s as "
                "well; eta0 and beta were kept at the paper's values, not re-tuned per convention (the paper tuned "
                "beta by grid search, Sec. 4.1)."
            )
        parts += [f"**Convention {convention}**:", table, verdict]
    ref = exp["references"]
    ref_rows = [
        [f"non-private, plain SGD, batch {fp['s_max']}, {label}", f"{np.mean(v):.4f} +- {np.std(v):.4f}"]
        for label, v in ref["nonprivate"].items()
    ]
    ref_rows.append(
        [
            f"clipping C = {exp['clip']}, no noise (sigma = 0), Poisson batch {fp['s_max']}, mean convention",
            f"{np.mean(ref['clip_only']):.4f} +- {np.std(ref['clip_only']):.4f}",
        ]
    )
    parts += [
        "References (same model, schedule and k; the paper's LIBSVM reference is 93%):",
        md_table(["run", "test accuracy"], ref_rows),
        'The certified eps is `trainer.epsilon(1/N, "proactive")` (Thm B.4 on the run\'s ledger) and the PLD '
        'eps `trainer.epsilon(1/N, "pld")`; both depend only on (s, T), identical across seeds and '
        "conventions. See `accuracy_vs_s.png`.",
    ]
    return "\n\n".join(parts)


def _draw_accuracy(exp: dict[str, Any]):
    def draw(fig, ax) -> None:
        for convention, marker in (("mean", "o"), ("sum", "s")):
            rows = exp["summary"][convention]["rows"]
            ax.errorbar(
                [r["s"] for r in rows],
                [r["mean"] for r in rows],
                yerr=[r["std"] for r in rows],
                marker=marker,
                capsize=3,
                label=f"DP-SGD, {convention} convention",
            )
        nonpriv = max(np.mean(v) for v in exp["references"]["nonprivate"].values())
        ax.axhline(nonpriv, color="k", linestyle="--", linewidth=1, label="non-private (best eta0)")
        ax.axhline(
            np.mean(exp["references"]["clip_only"]),
            color="gray",
            linestyle=":",
            linewidth=1,
            label="clipping only, no noise",
        )
        ax.axvline(
            exp["calculator_fixed_point"]["s_max"],
            color="g",
            linewidth=0.8,
            alpha=0.5,
            label="certified s_max",
        )
        ax.set_xscale("log")
        ax.set_xlabel("expected batch size s (T = ceil(kN/s))")
        ax.set_ylabel("test accuracy")
        ax.set_title(
            f"Proactive DP, logistic regression, sigma={exp['sigma']}, C={exp['clip']}, k={exp['k']}"
        )
        ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def graph_from_data(d: dict[str, Any]):
    """The :class:`~dptrain.proactive.utility_graph.UtilityGraph` of :func:`utility_graph_data`'s output (or of its JSON)."""
    from dptrain.proactive.utility_graph import UtilityGraph

    clips = [float(c) for c in d["clips"]]
    return UtilityGraph(
        clips=clips,
        sigmas=[float(v) for v in d["sigmas"]],
        base_accuracy={c: d["base_accuracy"][f"{c:g}"] for c in clips},
        fractions=np.asarray(d["fractions"], dtype=np.float64),
    )


def _section_d_md(d: dict[str, Any], exp: dict[str, Any]) -> str:
    g = graph_from_data(d)
    return "\n\n".join(
        [
            f"w* per C: the engine with noise multiplier 0 and clipping C, Poisson batch s = {d['s']}, the section (c) "
            "schedule (mean convention) and K = kN. Each cell adds N(0, C^2 sigma^2) to every parameter of a copy of "
            "w*; the table shows the mean accuracy fraction acc(w* + n)/acc(w*) over the draws (Sec. 3.3) and the "
            "largest sigma keeping it >= 0.9 (the 10% rule). NOT private: w* is trained on the private training data "
            "without noise (the paper suggests public or transferred data for this step). See `utility_graph.png`.",
            g.table(),
            _utility_verdict(d, exp),
        ]
    )


def _utility_verdict(d: dict[str, Any], exp: dict[str, Any]) -> str:
    g, sigma, clip = graph_from_data(d), EXPERIMENT["sigma"], EXPERIMENT["clip"]
    if clip not in g.clips:
        return ""
    i = g.clips.index(clip)
    best = g.largest_sigma(clip)
    near = min(range(len(g.sigmas)), key=lambda j: abs(g.sigmas[j] - sigma))
    frac = g.mean_fraction()[i, near]
    rows = exp["summary"]["mean"]["rows"]
    dp_acc, clip_acc = rows[-1]["mean"], float(np.mean(exp["references"]["clip_only"]))
    text = (
        f"With C = {clip:g} the 10% rule keeps sigma <= {best if best is not None else 'none'} on this grid; at "
        f"sigma = {g.sigmas[near]:g} the mean fraction is {frac:.2f}. DP-SGD itself, section (c) at sigma = "
        f"{sigma} and s = {rows[-1]['s']} (mean convention), reaches {dp_acc:.4f} against {clip_acc:.4f} "
        f"without noise (fraction {dp_acc / clip_acc:.2f})."
    )
    if best is None or best < sigma:
        text += (
            " So the graph read literally (one round's noise on the *sum*, C sigma per coordinate, added to "
            "the final weights) is far more pessimistic than training: in DP-SGD each round's noise is "
            "multiplied by the step size (and by 1/s in the mean convention), which the best-case reasoning "
            "leaves out. The paper's LIBSVM reading (C = 0.1 tolerates sigma in [18, 22]) does not carry over "
            "to this 1570-parameter model in this literal form."
        )
    return text


# --- driver -----------------------------------------------------------------------------------------------


def render(data: dict[str, Any]) -> Report:
    """The report of ``data`` (what :func:`run` writes to ``proactive.json``)."""
    header = f"Produced by `{data['command']}`"
    timings, exp, ug = data["timings_s"], data["logistic"], data["utility_graph"]
    mode = (
        "QUICK mode (reduced section (c)/(d); not the reported experiment)" if data["quick"] else "full run"
    )
    return Report(
        REPORT,
        "Proactive DP (van Dijk et al.): reproduction",
        intro=[
            f"{header} ({mode}). Wall time {timings['total']:.0f} s (a: {timings['a']:.1f} s, b: {timings['b']:.1f} "
            f"s, c: {timings['c']:.0f} s, d: {timings['d']:.0f} s). All numbers are in `proactive.json`."
        ],
        sections=[
            Section(
                "(a) Tables 9-11: DP calculator (App. D.4) vs tight f-DP accountant",
                [f"{header}:", _section_a_md(data["tables_9_11"])],
            ),
            Section(
                "(b) Closed-form epsilon vs tight accountants at T_min",
                [f"{header}:", _section_b_md(data["ratios"])],
            ),
            Section(
                "(c) Logistic regression, batch size sweep at fixed K = kN (Table 3 / Fig. 1 in spirit)",
                [f"{header}:", _section_c_md(exp)],
            ),
            Section(
                "(d) Utility graph (Sec. 3.3) for the task of (c)", [f"{header}:", _section_d_md(ug, exp)]
            ),
        ],
        data={DATA_JSON: data},
        plots=[
            figure("accuracy_vs_s.png", _draw_accuracy(exp), figsize=(6, 4)),
            Plot("utility_graph.png", graph_from_data(ug).plot),
        ],
    )
