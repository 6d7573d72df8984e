"""The text, tables and plots of the last-iterate report (:mod:`dptrain.reproduce.last_iterate`), built from the
data its experiments return: section (a) from ``curves``, sections (b) and (c) from ``training_experiment``."""

from __future__ import annotations

from typing import Any

import numpy as np

from dptrain.reproduce import md_table
from dptrain.reproduce.last_iterate_setup import (
    ALPHA,
    CERTIFICATIONS,
    CLASS_NAMES,
    DELTA,
    NEGATIVE_CLASS,
    POSITIVE_CLASS,
    TABLE_T,
)

__all__ = ["draw_curves", "draw_training", "section_a", "section_b", "section_c"]


def draw_curves(cv: dict[str, Any]):
    def draw(fig, axes) -> None:
        colors = {"reference": "C0", "full_batch": "C1", "strongly_convex": "C2"}
        widths = {"reference": 4.0, "full_batch": 1.5, "strongly_convex": 1.5}  # A and full batch overlap
        for name, s in cv["settings"].items():
            t = [r["T"] for r in s["rows"]]
            style = {
                "color": colors[name],
                "linewidth": widths[name],
                "alpha": 0.55 if name == "reference" else 1,
            }
            axes[0].plot(t, [r["rdp"] for r in s["rows"]], label=s["label"], **style)
            axes[0].plot(t, [r["rdp_composition"] for r in s["rows"]], "--", color=colors[name], linewidth=1)
            axes[1].plot(t, [r["epsilon"] for r in s["rows"]], label=s["label"], **style)
            axes[1].plot(
                t, [r["epsilon_composition"] for r in s["rows"]], "--", color=colors[name], linewidth=1
            )
        axes[0].set_xscale("log")
        axes[0].set_yscale("log")
        axes[0].set_xlabel("T (steps)")
        axes[0].set_ylabel(f"RDP at order {ALPHA:g}")
        axes[0].set_title("last-iterate bound (solid) vs composition (dashed)")
        axes[1].set_xscale("log")
        axes[1].set_yscale("log")
        axes[1].set_xlabel("T (steps)")
        axes[1].set_ylabel(f"eps at delta = {DELTA:g} (Lemma 2.5)")
        axes[1].set_title("DP epsilon (solid) vs composition (dashed)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()

    return draw


def section_a(cv: dict[str, Any], header: str) -> str:
    parts = [f"{header}:"]
    for s in cv["settings"].values():
        by_t = {r["T"]: r for r in s["rows"]}
        rows = []
        for t in TABLE_T:
            if t not in by_t:
                continue
            r = by_t[t]
            rows.append(
                [
                    f"{t:,}",
                    f"{r['rdp']:.5e}",
                    f"{r['rdp_composition']:.5e}",
                    "composition" if r["window"] is None else f"{r['window']:,}",
                    "-" if r["noise_split"] is None else f"{r['noise_split']:.3f}",
                    f"{r['epsilon']:.4f}",
                    f"{r['epsilon_composition']:.4f}",
                    f"{r['order']:g}",
                ]
            )
        parts += [
            f"**{s['label']}** (c = {s['contraction']:g}; burn-in reported by `last_iterate_report`: "
            f"**{s['burn_in_steps']:,} steps**; plateau RDP at order 8 = {s['plateau_rdp']:.5e} with window "
            f"{s['plateau_window']:,}):",
            md_table(
                [
                    "T",
                    "RDP(8), last iterate",
                    "RDP(8), composition",
                    "window Tt",
                    "sigma1/sigma",
                    "eps (last iterate)",
                    "eps (composition)",
                    "best order",
                ],
                rows,
            ),
        ]
    checks = cv["checks"]
    parts += [
        f"Grid: {len(cv['T'])} values of T from {cv['T'][0]} to {cv['T'][-1]:,}; the table shows a subset. "
        "RDP at order 8 from `rdp_bound(setting, 8)` (its `.rdp` and `.composition`); eps at delta = 1e-5 from "
        "`last_iterate_report(setting, 1e-5)` (`epsilon`, `epsilon_composition`), both minimized over the "
        "accountant's orders 1.25..256 (Lemma 2.5). The composition column charges every step (the tau = 0 term "
        "of (B.2), T S_alpha(b/n, b sigma/(2L)), or T alpha (2L)^2/(2 n^2 sigma^2) for full batch). Window "
        "'composition' means the composition branch is the minimum. See `epsilon_vs_T.png`.",
        "**Reference checks** (values computed from the paper's closed forms; 4 significant digits):",
        md_table(
            ["check", "expected", "got", "result"],
            [
                [c["name"], f"{c['expected']:.6g}", f"{c['got']:.6g}", "PASS" if c["passed"] else "FAIL"]
                for c in checks
            ],
        ),
        "Properties over the whole grid: last-iterate bound <= composition at every T: "
        + ", ".join(f"{n} {'PASS' if s['below_composition'] else 'FAIL'}" for n, s in cv["settings"].items())
        + "; non-decreasing in T: "
        + ", ".join(f"{n} {'PASS' if s['non_decreasing'] else 'FAIL'}" for n, s in cv["settings"].items())
        + f"; strongly convex <= convex at every T: {'PASS' if cv['strongly_convex_below_convex'] else 'FAIL'}.",
        "Independent re-evaluation of (B.2)/(B.3) (`paper_bound_rdp` in this module, same S_alpha, noise split "
        "on a 49-point grid) against `rdp_bound`, relative difference at order 8: "
        + ", ".join(f"{r['setting']} T = {r['T']:,}: {r['rel_diff']:+.1e}" for r in cv["rederivation"])
        + ".",
        "Full batch: `rdp_bound` takes the smaller of (B.1) and (B.2) with b = n; (B.2) has no D~ inflation and "
        f"gives the plateau {cv['settings']['full_batch']['plateau_rdp']:.6g}, (B.1) alone gives "
        f"{cv['full_batch_b1']['b1_plateau']:.6g} = 4 alpha L D~/(n eta sigma^2) with D~ = D + 2 eta L/n = "
        f"{cv['full_batch_b1']['d_tilde']:.6g} (window D~ n/(2 eta L) = {cv['full_batch_b1']['window']:.0f}). "
        "The burn-in of `last_iterate_report` is where the bound stops growing: the plateau window plus one step, "
        "or where the composition line reaches the plateau, whichever is later; for Example A that is "
        f"{cv['settings']['reference']['burn_in_steps']:,} steps, twice the paper's Tbar = Dn/(L eta) = 10,000 "
        "(the linear regime meets the plateau at 2 Dn/(L eta), derived from (B.1)-(B.2)).",
    ]
    return "\n\n".join(parts)


def draw_training(exp: dict[str, Any]):
    def draw(fig, axes) -> None:
        for cert, marker in zip(CERTIFICATIONS, ("o", "s", "^"), strict=True):
            rs = [r for r in exp["rows"] if r["certification"] == cert]
            e = [r["epochs"] for r in rs]
            axes[0].errorbar(
                e, [r["mean"] for r in rs], yerr=[r["std"] for r in rs], marker=marker, capsize=3, label=cert
            )
            axes[1].plot(e, [r["sigma"] for r in rs], marker=marker, label=cert)
        key = f"D={exp['diameter']:g}"
        axes[0].axhline(
            np.mean(exp["nonprivate"][key]), color="k", linestyle="--", linewidth=1, label="non-private"
        )
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("epochs (T = epochs x ceil(n/b))")
        axes[0].set_ylabel("test accuracy of the last iterate")
        axes[1].set_yscale("log")
        axes[1].set_ylabel("calibrated sigma at (eps, delta) = (1, 1e-5)")
        axes[0].set_title("Fashion-MNIST T-shirt/top vs Pullover")
        axes[0].legend(fontsize=7)
        fig.tight_layout()

    return draw


def _verdict(exp: dict[str, Any]) -> str:
    """Which certification gives the better final model at the budget: at equal T, and best over T (a
    difference within one standard deviation over seeds is called a tie)."""
    rows = exp["rows"]
    by = {(r["certification"], r["epochs"]): r for r in rows}

    def cmp(a: dict[str, Any], b: dict[str, Any]) -> str:
        gap = a["mean"] - b["mean"]
        if abs(gap) <= max(a["std"], b["std"]):
            return "tie (within one std)"
        return "last iterate better" if gap > 0 else "composition better"

    same = sorted(e for (c, e) in by if c == "composition" and ("last_iterate", e) in by)
    best = {
        c: max((r for r in rows if r["certification"] == c), key=lambda r: r["mean"]) for c in CERTIFICATIONS
    }
    li, comp = best["last_iterate"], best["composition"]
    parts = [
        "At equal T: "
        + "; ".join(
            f"{e} epoch{'s' if e > 1 else ''}: {by[('last_iterate', e)]['mean']:.4f} (last iterate, sigma "
            f"{by[('last_iterate', e)]['sigma']:.4g}) vs {by[('composition', e)]['mean']:.4f} (composition, sigma "
            f"{by[('composition', e)]['sigma']:.4g}): {cmp(by[('last_iterate', e)], by[('composition', e)])}"
            for e in same
        )
        + ".",
        "Best over T: "
        + "; ".join(
            f"{c}: {r['mean']:.4f} +- {r['std']:.4f} at {r['epochs']} epoch{'s' if r['epochs'] > 1 else ''}"
            for c, r in best.items()
        )
        + f"; last iterate vs composition: **{cmp(li, comp)}**.",
    ]
    return "\n\n".join(parts)


def _why(exp: dict[str, Any]) -> str:
    """The mechanism behind the table, with its numbers."""
    comp = sorted((r for r in exp["rows"] if r["certification"] == "composition"), key=lambda r: r["epochs"])
    li = sorted((r for r in exp["rows"] if r["certification"] == "last_iterate"), key=lambda r: r["epochs"])
    c = exp["contraction"]
    key = f"D={exp['diameter']:g}"
    b_li, b_comp = max(li, key=lambda r: r["mean"]), max(comp, key=lambda r: r["mean"])
    tie = abs(b_li["mean"] - b_comp["mean"]) <= max(b_li["std"], b_comp["std"])
    return (
        f"Reading: with c = {c:.4f} the iteration forgets its start within about 1/(1 - c) = {1 / (1 - c):.0f} "
        f"steps, so the final iterate is near its stationary accuracy after one epoch (non-private: "
        f"{np.mean(exp['nonprivate_1_epoch']):.4f} after 1 epoch vs {np.mean(exp['nonprivate'][key]):.4f} after "
        f"{exp['nonprivate_epochs']}), and the accuracy is then set by sigma. Composition must raise sigma with T "
        f"({comp[0]['sigma']:.4g} at {comp[0]['epochs']} epoch to {comp[-1]['sigma']:.4g} at {comp[-1]['epochs']} "
        f"epochs) and loses accuracy; the last-iterate certification keeps sigma flat after its burn-in "
        f"({li[-1]['sigma']:.4g} from {min(r['epochs'] for r in li if r['sigma'] == li[-1]['sigma'])} epochs on), "
        "so T can be chosen freely at no privacy cost. "
        + (
            "On this task, though, extra iterations buy no accuracy, so the best model over T is about as good "
            "under either certification; the gain is robustness to the choice of T (and, with the conservative "
            "variant, it survives the correction of section (c))."
            if tie
            else "The best model over T differs between the certifications (see above)."
        )
    )


def section_b(exp: dict[str, Any], header: str) -> str:
    c = exp["constants"]
    table = md_table(
        [
            "certification",
            "T (steps)",
            "epochs",
            "sigma",
            "b sigma/(2L)",
            "eps last_iterate",
            "eps composition (rdp)",
            "eps conservative",
            f"test accuracy (mean +- std, {len(exp['seeds'])} seed{'s' if len(exp['seeds']) > 1 else ''})",
            "ms/step (incl. setup)",
        ],
        [
            [
                r["certification"],
                f"{r['steps']:,}",
                r["epochs"],
                f"{r['sigma']:.5f}",
                f"{r['noise_multiplier']:.3f}",
                f"{r['eps_last_iterate']:.4f}",
                f"{r['eps_composition']:.4f}",
                f"{r['eps_conservative']:.4f}",
                f"{r['mean']:.4f} +- {r['std']:.4f}",
                f"{r['ms_per_step']:.2f}",
            ]
            for r in exp["rows"]
        ],
    )
    ref_rows = [
        [
            f"projected SGD, sigma = 1e-12, {k}, {exp['nonprivate_epochs']} epochs",
            f"{np.mean(v):.4f} +- {np.std(v):.4f}",
        ]
        for k, v in exp["nonprivate"].items()
    ]
    burn = exp["burn_in_sigma_0.02"]
    parts = [
        f"{header}:",
        f"Task: Fashion-MNIST **{CLASS_NAMES[NEGATIVE_CLASS]} ({NEGATIVE_CLASS}) vs {CLASS_NAMES[POSITIVE_CLASS]} "
        f"({POSITIVE_CLASS})**, label 1 = Pullover; n = {exp['n']:,} training examples"
        + (f" (QUICK: the first {exp['n'] // 2} of each class)" if exp["quick"] else " (all of both classes)")
        + f", all {exp['test_size']:,} test examples of the two classes. Why this pair: T-shirt/top vs Trouser is "
        "nearly separable (no room to see differences); in a pilot (non-private projected SGD, 20 epochs, D = 10, "
        "b = 64, this feature scaling) Pullover vs Coat reached 0.72 and T-shirt/top vs Shirt 0.80, so the noise "
        "effects drown in a weak model, while T-shirt/top vs Pullover reached 0.95: decent, not perfect.",
        f'Model: `ConvexGLM("logistic", feature_norm=1, fit_bias=True, l2={exp["l2"]:g})`: features flattened '
        f"(d = {exp['dim']} with the bias) and rescaled per example to norm <= 1, so L = sqrt(2) = {c['L']:.4f} "
        f"(of the unregularized loss, Sec 5.4), M = 2/4 + l2 = {c['M']:.4g}, m = l2 = {c['m']:g}. Domain K: the ball "
        f"of diameter D = {exp['diameter']:g} around 0 (w_0 = 0). Batch b = {exp['batch_size']} drawn uniformly "
        f"without replacement each step (eq 3.1), one epoch = ceil(n/b) = {exp['epoch_steps']} steps. Step size "
        f"eta = 2/(M + m) = {exp['learning_rate']:.4f} (< 2/M; it minimizes the contraction "
        f"c = max(|1 - eta m|, |1 - eta M|) = {exp['contraction']:.4f}, App. B.3). Replace adjacency, Delta = 2L.",
        "Certifications, each at (eps, delta) = (1, 1e-5): **composition**: `calibrate_noise(1, 1e-5, ledger_for, "
        '"rdp")` on the run\'s ledger (every step a Gaussian on the averaged gradient, noise multiplier '
        "b sigma/(2L), sampled without replacement: dp_accounting's RDP accountant), the only CERTIFIED one; "
        "**last_iterate**: the paper's bound as published ((B.3), since m = l2 > 0, with Def 2.10's direction of "
        "S, which section (c) shows can fail), calibrated by bisection; **conservative**: dptrain's `last_iterate` "
        "accountant, (B.3) with the dominating per-step direction (max of both), calibrated by bisection: "
        "reported, NOT certified (the paper's coupling argument is not re-proven for both orderings). The eps "
        "columns apply the three to the ledger the trainer recorded (identical for every seed).",
        "**Only the composition rows are private guarantees.** The last_iterate and conservative rows show what "
        "the last-iterate analyses would allow; comparisons with them below are about that analysis, not about a "
        "certified budget (the 1-epoch last_iterate row, certified 83.8 by composition, is the defect of section "
        "(c) at work).",
        table,
        "Non-private reference (same model, eta, b and projection):",
        md_table(["run", "test accuracy"], ref_rows),
        _verdict(exp),
        _why(exp),
        "**Only the last iterate is released**: `ProjectedNoisySGD.train()` returns w_T alone, and every accuracy "
        "above is computed from that final model on the test set; no intermediate iterate, average or training "
        "loss is used or reported.",
        f"Why the last-iterate bound pays off here: with m = l2 = {exp['l2']:g} and eta = 2/(M + m) the "
        f"contraction c = {exp['contraction']:.4f} makes (B.3) saturate after "
        f"{burn['strongly_convex']:,} steps (burn-in of `last_iterate_report` at sigma = 0.02, i.e. "
        f"{burn['strongly_convex'] / exp['epoch_steps']:.1f} epochs). Declaring the loss merely convex (m = 0, a "
        f"weaker but valid assumption) the burn-in is {burn['convex_only']:,} steps "
        f"({burn['convex_only'] / exp['epoch_steps']:.0f} epochs, about D n/(L eta), Thm 3.1): at 100 epochs and "
        f"sigma = 0.02 the convex reading certifies eps = {burn['convex_only_epsilon']:.3f} against "
        f"{burn['strongly_convex_epsilon']:.3f} with m = l2. So in this experiment the gain comes from the "
        "strongly convex analysis (Sec 5.1), not from the diameter argument of Thm 3.1.",
    ]
    if exp["diameter_sweep"]:
        parts += [
            "Diameter sweep (100 epochs, last-iterate certifications; same eta, b, l2; the non-private column is "
            "projected SGD with sigma = 1e-12 for 20 epochs in the same ball):",
            md_table(
                ["D", "certification", "sigma", "test accuracy", "non-private, same D"],
                [
                    [
                        f"{r['diameter']:g}",
                        r["certification"],
                        f"{r['sigma']:.5f}",
                        f"{r['mean']:.4f} +- {r['std']:.4f}",
                        f"{r['nonprivate']:.4f}",
                    ]
                    for r in exp["diameter_sweep"]
                ],
            ),
        ]
    parts.append("See `training.png`.")
    return "\n\n".join(parts)


def section_c(exp: dict[str, Any], header: str) -> str:
    s = exp["soundness"]
    comp1 = min((r for r in exp["rows"] if r["certification"] == "composition"), key=lambda r: r["epochs"])
    rows = [
        [
            f"{r['sigma']:g}",
            f"{r['noise_multiplier']:.3f}",
            f"{r['eps_last_iterate']:.4f}",
            f"{r['delta_lower_at_eps_last_iterate']:.3e}",
            f"{r['delta_lower_at_eps_1']:.3e}",
            f"{r['eps_rdp']:.3f}",
            f"{r['eps_conservative']:.3f}",
        ]
        for r in s["rows"]
    ]
    verdict = (
        "**The certificate is violated**: the lower bound on the true delta at the certified eps exceeds "
        f"delta = {DELTA:g}."
        if s["violated"]
        else "No violation found on this pair."
    )
    return "\n\n".join(
        [
            f"{header}:",
            "Def 2.10 (and hence the paper's (B.2)/(B.3)) uses S_alpha(q, s) = "
            "D_alpha(N(0, s^2) || (1-q) N(0, s^2) + q N(1, s^2)), the direction with the pure Gaussian first "
            "(Lemma 2.6). That direction is bounded by log(1/(1-q)) for every s, because the mixture is at least "
            "(1-q) N(0, s^2); so for small noise the accountant's per-step cost stops depending on sigma. RDP "
            "(Def 2.4) must hold for both orderings of a neighbouring pair, and the reverse direction "
            "D_alpha(mixture || N(0)) grows without bound as s -> 0.",
            f"Explicit check, T = 1 with the constants of section (b) (n = {exp['n']:,}, b = {exp['batch_size']}, "
            f"q = {s['q']:.4f}, L = sqrt(2), D = {exp['diameter']:g}, eta = {exp['learning_rate']:.4f}, "
            f"m = {exp['l2']:g}), in d = 1: F_i(w) = (l2/2) w^2 for every i vs. the same with F_i*(w) = L w + "
            "(l2/2) w^2 (convex, the unregularized part L-Lipschitz and 0-smooth, so every assumption of the "
            "ledger holds). The released w_1 = Proj_K[-eta (G + Z)] is N(0, eta^2 sigma^2) under one dataset and "
            "the mixture with probability q of the shift eta L/b under the other; threshold events give a lower "
            "bound on the true delta(eps) (Def 2.2):",
            md_table(
                [
                    "sigma",
                    "b sigma/L",
                    "eps by the paper's bound (Def 2.10 direction)",
                    "true delta at that eps >=",
                    "true delta at eps = 1 >=",
                    "eps (rdp accountant)",
                    "eps (dptrain last_iterate, dominating direction)",
                ],
                rows,
            ),
            verdict
            + f" The same defect shows in section (b) below the burn-in, where the last-iterate bound is the "
            f"composition branch in the paper's direction: the composition-calibrated {comp1['epochs']}-epoch run "
            f"(dp_accounting: eps = {comp1['eps_composition']:.3f}) gets eps = "
            f"{comp1['eps_last_iterate']:.3f} from the paper's bound, a gap due only to the direction of S."
            + " The `rdp` accountant (dp_accounting, both directions) and dptrain's `last_iterate` accountant, which "
            "takes the dominating direction D_alpha(mixture || N(0)) >= S_alpha per step (docs/last_iterate.md), do not "
            "give these runs a small epsilon. Using the dominating direction fixes this one defect; it is not a "
            "proof. The paper's coupling (Sec. 3.2) must be re-checked for both orderings before the last-iterate "
            "bound can certify anything, so dptrain reports it as NOT certified. In Example A (section (a), b sigma/(2L) "
            "= 20) the two directions differ by 0.04% (S_8 = 1.001027e-6 vs 1.001400e-6), which is why the "
            "reference values are unaffected; in section (b) the noise multipliers are ~1, where they differ by "
            "orders of magnitude.",
        ]
    )
