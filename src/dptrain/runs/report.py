"""The privacy/utility report ``dptrain train`` prints at the end of a run: one table read from its summary."""

from __future__ import annotations


def format_report(summary: dict) -> str:
    """The privacy/utility report printed at the end of ``dptrain train``."""
    private = summary.get("private", True)
    cert = "" if summary["certified"] else "  (approximation, not certified)" if private else "  (NOT private)"
    target = "" if summary["target_epsilon"] is None else f" (target {summary['target_epsilon']:g})"
    others = ", ".join(
        f"{k} {v['epsilon']:.4f}" + ("" if v["certified"] else " (approx.)")
        for k, v in summary.get("accountants", {}).items()
        if "epsilon" in v and k != summary["accountant"]
    )
    rows = [
        ("privacy", f"epsilon = {summary['epsilon']:.4f}{target} at delta = {summary['delta']:g}{cert}"),
        ("accountant", summary["accountant"] + (f" (others: {others})" if others else "")),
        *([("attacker", attacker_text(summary["membership_inference"]))] if "membership_inference" in summary else []),
        *([_search_row(summary)] if "trial_alone" in summary else []),
        *([_last_iterate_row(summary)] if "epsilon_last_iterate" in summary else []),
        *([("NOT private", "; ".join(summary["not_private_because"]))] if not private else []),
        *(("note", note) for note in summary.get("notes", [])),
        ("test accuracy", _accuracy_text(summary)),
        *([("test accuracy (EMA)", _averaged_text(summary))] if "model_ema" in summary else []),
        *([_preprocessing_row(summary)] if "preprocessing" in summary else []),
        ("steps", f"{summary['steps']} of {summary['planned_steps']} ({summary['epochs']:.2f} epochs)"),
        (
            "noise multiplier" if "noise_std" not in summary else "noise std (on averaged gradient)",
            f"{summary.get('noise_std', summary['noise_multiplier']):.4f}",
        )
        if "noise_schedule" not in summary
        else _schedule_row(summary["noise_schedule"]),
        *([_bandmf_row(summary)] if summary.get("noise_mechanism") == "bandmf" else []),
        (
            "sampling rate",
            f"{summary['sampling_rate']:.6g} ({summary['sampling']}, expected batch {summary['batch_size']})",
        ),
        ("clip norm", f"{summary['max_grad_norm']:g}")
        if "lipschitz" not in summary
        else (
            "Lipschitz / diameter",
            f"L = {summary['lipschitz']:.4g}, D = {summary['diameter']:g}",
        ),
        ("randomness", summary["randomness"]),
        ("data", summary["dataset"]),
        ("model", summary["model"] + _checked(summary.get("gradient_check"))),
        ("outputs", summary["out"]),
        *([_hugging_face_row(summary)] if "hf_model" in summary or "hf_adapter" in summary else []),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def attacker_text(bound: dict) -> str:
    """The membership-inference bound in words (docs/privacy.md, "What a budget means to an attacker")."""
    if bound.get("tpr_at_fpr_1pct") is None:
        return f"no bound on a membership-inference attacker ({bound.get('no_profile')})"
    how = f"mu-GDP, mu = {bound['mu_gdp']:.3g}" if bound.get("mu_gdp") is not None else bound["accountant"]
    if bound.get("tightened_by"):
        how += f", or {bound['tightened_by']['accountant']}'s epsilon {bound['tightened_by']['epsilon']:.4g} where lower"
    if bound.get("certified") is False:  # (a run that is not private: what its ledger's mechanism would give)
        how += "; NOT private: not a bound on this run, what it would be with secret randomness"
    return (
        f"membership inference: TPR <= {100 * bound['tpr_at_fpr_1pct']:.3g}% at FPR 1%, "
        f"<= {100 * bound['tpr_at_fpr_10pct']:.3g}% at FPR 10% ({how})"
    )


def _hugging_face_row(summary: dict) -> tuple[str, str]:
    """The save_pretrained directories of a Hugging Face model (dptrain.models.hf_save)."""
    parts = []
    if "hf_model" in summary:
        parts.append(f"{summary['hf_model']} (transformers: from_pretrained)")
    if "hf_adapter" in summary:
        parts.append(f"{summary['hf_adapter']} (peft adapter: from_pretrained)")
    return "hugging face", "; ".join(parts)


def _search_row(summary: dict) -> tuple[str, str]:
    """A run selected by a private search (``best/`` of ``dptrain tune``): the certificate above is the search's."""
    s, own = summary["search"], summary["trial_alone"]
    alone = f"{own['epsilon']:.4f}" if own.get("epsilon") is not None else "-"
    return (
        "selected by",
        f"a private search ({s['tuning_distribution']} number of trials, mean {s['tuning_mean']:g}, how many ran is "
        f"secret): the certificate above is the search's; this trial alone, NOT this model's certificate: epsilon "
        f"{alone}",
    )


def _accuracy_text(summary: dict) -> str:
    accuracy = summary["test_accuracy"]
    if accuracy is not None:
        return f"{accuracy:.4f}"
    if not summary.get("test_is_public", True):
        logged = summary.get("not_private", {}).get("test_accuracy")
        if logged is not None:
            return f"{logged:.4f} (NOT private: the test split is cut from the private training data)"
        return (
            "not written: the test split is cut from the private training data (data.test_is_public = true declares "
            "it public; training.log_not_private = true writes it labelled not private)"
        )
    return "not released yet (last iterate only)"


def _averaged_text(summary: dict) -> str:
    """The weight average's test accuracy (``training.ema``), written as the last iterate's is."""
    accuracy = summary.get("test_accuracy_ema")
    logged = summary.get("not_private", {}).get("test_accuracy_ema")
    text = f"{accuracy:.4f}" if accuracy is not None else "not written" if logged is None else f"{logged:.4f} (NOT private)"
    files = ", ".join([summary["model_ema"]["file"], *(summary[k] for k in ("hf_model_ema", "hf_adapter_ema") if k in summary)])
    return f"{text} ({files}: weight average of the released iterates, decay {summary['model_ema']['decay']:g})"


def _last_iterate_row(summary: dict) -> tuple[str, str]:
    if summary["accountant"] == "last_iterate":
        return (
            "composition",
            f"epsilon = {summary['epsilon_composition']:.4f} if every step were charged (rdp)",
        )
    why = "certified (deterministic batches)" if summary["last_iterate_certified"] else "NOT certified"
    return (
        "last iterate",
        f"epsilon = {summary['epsilon_last_iterate']:.4f} by the paper's bound (burn-in {summary['burn_in_steps']} "
        f"steps): {why}, see docs/last_iterate.md",
    )


def _bandmf_row(summary: dict) -> tuple[str, str]:
    """Banded matrix factorization's noise (docs/bandmf.md): the bands and the RMSE ratio against DP-SGD."""
    ratio = summary.get("rmse_ratio")
    at = summary["bandmf"]["rmse_ratio_at_epsilon"]
    text = f"bandmf, {summary['bands']} bands (noise correlated across steps; {summary['bands']} secret groups)"
    if ratio is not None:
        text += (
            f"; rmse_ratio {ratio:.3f}: RMSE of the iterates ({summary['bandmf']['workload']}) over DP-SGD's at "
            f"epsilon {at:.3g}"
        )
    elif summary["bandmf"].get("rmse_ratio_note"):
        text += f"; {summary['bandmf']['rmse_ratio_note']}"
    return "noise", text


def _schedule_row(schedule: dict) -> tuple[str, str]:
    s = schedule
    return (
        "noise schedule",
        f"{s['kind']}: sigma {s['first']:.4g} at the first step, {s['last']:.4g} at the last (range {s['min']:.4g} to "
        f"{s['max']:.4g}, {s['levels']} levels; "
        + (s["calibration"] if s["kind"] == "validation" else f"scale: {s['calibration']}")
        + ")",
    )


def _preprocessing_row(summary: dict) -> tuple[str, str]:
    pre = summary["preprocessing"]
    text = f"{pre['kind']}, features normalized to C_F = {pre['feature_norm']:g}"
    if pre.get("noise_multiplier") is not None:
        text += f", private mean sigma_F = {pre['noise_multiplier']:.4g}"
    if pre.get("eps_f") is not None:
        text += f" (eps_F = {pre['eps_f']:g})"
    if pre.get("tau") is not None:
        text += f", tau = {pre['tau']:.4g}"
    raw = summary.get("test_accuracy_raw_model")
    if raw is not None:
        text += f"; model.pt on raw examples: test accuracy {raw:.4f}"
    return "preprocessing", text


def _checked(check: dict | None) -> str:
    """How the per-example gradients were verified on the model before training (dptrain.preflight.gradient_check)."""
    if check is None:
        return ""
    moved = f"; moved to torch.func: {', '.join(check['moved_to_func'])}" if check["moved_to_func"] else ""
    return f"; checked against single-example passes on {check['examples']} examples{moved}"
