"""The report of the ModelMix training experiments (Xiao, Wan & Devadas, "Differentially Private Deep Learning with
ModelMix"): Table I's rows beside the paper's numbers and Fig. 2's same-noise curves, from the data that
:mod:`dptrain.reproduce.modelmix_training` returns."""

from __future__ import annotations

#: Table I, Fashion-MNIST (test accuracy %, delta = 1e-5): epsilon -> (DP-SGD [Tramer & Boneh], DP-SGD + ModelMix).
PAPER_TABLE1 = {0.2: (53.4, 83.9), 0.4: (74.0, 85.7), 0.6: (81.5, 86.1), 0.8: (84.5, 87.9), 1.0: (85.6, 88.8)}
PAPER_NON_PRIVATE = 91.2


def _paper_accuracy(row: dict) -> str:
    if row["method"] == "non_private":
        return f"{PAPER_NON_PRIVATE}"
    paper = PAPER_TABLE1.get(row["epsilon"])
    return "" if paper is None else f"{paper[0 if row['method'] == 'dpsgd' else 1]}"


def _recipe(r: dict) -> str:
    """The non-private recipe in words."""
    return (
        f"shuffled batches of {r['batch_size']}, SGD with momentum {r['momentum']}, {r['epochs']} epochs, cosine "
        f"learning rate from {r['learning_rate']} (chosen on held-out examples by `dptrain reproduce "
        "modelmix-decided`), no clipping"
    )


def _table1_section(table: dict):
    from dptrain.reproduce import md_table
    from dptrain.reproduce.report import Section

    head = ["epsilon", "method", "noise calibrated by", "accuracy % (median)", "seeds", "paper %", "z",
            "certified epsilon", "modelmix accountant (certified / paper's method)"]
    rows = []
    for r in table["rows"]:
        mm = r.get("modelmix")
        calibrated = {
            "certified": f"{r['accountant']} (certified)",
            "paper_method": "the paper's method (**not certified**)",
            None: "no noise",
        }[r["calibration"]]
        rows.append(
            [
                "inf" if r["epsilon"] is None else f"{r['epsilon']:g}",
                r["method"],
                calibrated,
                f"{100 * r['accuracy_median']:.1f}",
                ", ".join(str(s) for s in r["seeds"]),
                _paper_accuracy(r),
                f"{r['noise_multiplier']:.3f}",
                "" if r["certified_epsilon"] is None else f"{r['certified_epsilon']:.3f} ({r['certified_by']})",
                "" if mm is None else f"{mm['epsilon']:.3f} / {mm['epsilon_paper_method']:.3f}",
            ]
        )
    s = table["settings"]
    return Section(
        f"Table I, Fashion-MNIST ({'quick' if table['quick'] else 'full'}: {table['n_train']} training examples, "
        f"{table['steps']} steps, expected batch {table['expected_batch_size']:.0f})",
        [
            md_table(head, rows),
            f"DP-SGD: C = {s['dpsgd']['max_grad_norm']}, learning rate {s['dpsgd']['learning_rate']}; ModelMix: C = "
            f"{s['modelmix']['max_grad_norm']}, learning rate {s['modelmix']['learning_rate']}, tau phases "
            f"{s['modelmix']['tau']} (multiples of the learning rate); plain SGD, Poisson sampling at q = "
            f"{table['sampling_rate']:.5f}, delta = {table['delta']:g}. Non-private: "
            + _recipe(s["non_private"])
            + f". Model: {table['model']} on ScatterNet "
            "features (J = 2, 81 x 7 x 7). 'certified epsilon' is the tightest epsilon any accountant proves for "
            "the run (`auto`); the last column is the modelmix accountant's certified value and the paper's method "
            "for the same run.",
            "Input normalisation: the paper normalises the ScatterNet features with private data statistics and "
            "spends epsilon = 0.695 on them (which its Table I does not fit below that); here every example is "
            "normalised on its own (GroupNorm over its 81 channels in 27 groups, the first layer of the model), which "
            "reads no other example, so it costs no privacy and the whole budget goes to training.",
            table["note"],
        ],
    )


def _fig2_section(fig: dict, png: str = "fig2.png"):
    from dptrain.reproduce import md_table
    from dptrain.reproduce.report import Section

    rows = []
    for r in fig["runs"]:
        eps = r["epsilon"]
        rows.append(
            [
                r["name"],
                f"{r['learning_rate']:g}",
                f"{100 * r['final_accuracy']:.1f}",
                f"{r['final_loss']:.3f}",
                *(
                    "" if eps.get(n) is None else f"{eps[n]['epsilon']:.2f}"
                    for n in ("rdp", "pld", "modelmix")
                ),
            ]
        )
    return Section(
        f"Fig. 2, C = {fig['max_grad_norm']:g}: the same noise (z = {fig['noise_multiplier']:.4f}, "
        f"{fig['calibrated_by']} epsilon "
        f"{fig['target_epsilon']:g} for plain DP-SGD), {fig['steps']} steps at q = {fig['sampling_rate']:g}",
        [
            md_table(["run", "learning rate", "test accuracy %", "test loss", "rdp eps", "pld eps", "modelmix eps"],
                     rows),
            f"C = {fig['max_grad_norm']}, eta = {fig['eta']:g}, ModelMix tau = {fig['runs'][-1]['tau_over_lr']} x "
            f"learning rate; one seed (the same initial model for the three runs). Curves: {png}.",
        ],
    )


def _draw_fig2(fig: dict):
    def draw(figure, axes):
        for r in fig["runs"]:
            axes[0].plot(r["curve"]["steps"], [100 * a for a in r["curve"]["accuracy"]], label=r["name"])
            axes[1].plot(r["curve"]["steps"], r["curve"]["loss"], label=r["name"])
        axes[0].set_ylabel("test accuracy (%)")
        axes[1].set_ylabel("test loss")
        for ax in axes:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        figure.suptitle(f"Same noise z = {fig['noise_multiplier']:.3f}: DP-SGD at eta and 2 eta vs ModelMix at 2 eta")
        figure.tight_layout()

    return draw


def render_sections(training: dict):
    """(sections, plots, JSON files) of the training experiments for the ModelMix report."""
    from dptrain.reproduce.report import figure

    sections, plots, files = [], [], {}
    if training.get("table1") is not None:
        sections.append(_table1_section(training["table1"]))
        keys = ("dataset", "epsilon", "method", "calibration", "accuracy_median", "accuracies", "seeds",
                "certified_epsilon", "accountant", "certified_by", "noise_multiplier")
        files["table1.json"] = [{k: r[k] for k in keys} for r in training["table1"]["rows"]]
    # "fig2": the paper's settings; other "fig2_*" keys: the same experiment at other settings (fig2(**setting))
    for key in sorted(k for k in training if k.startswith("fig2") and training[k] is not None):
        fig, png = training[key], key.replace("_", "-") + ".png"
        sections.append(_fig2_section(fig, png))
        plots.append(figure(png, _draw_fig2(fig), ncols=2, figsize=(11, 4)))
    return sections, plots, files
