"""Empirical privacy audit of dptrain's engine: one-run lower bounds against the certified epsilon.

Method: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023): m canaries, each
included with probability 1/2, one training run, canary scores turned into an epsilon lower bound by Theorem 5.2
(:mod:`dptrain.auditing.bounds`), run by :func:`dptrain.auditing.runner.audit_run` exactly as ``dptrain audit``.

``run(out_dir, quick=False)`` writes ``audit.md`` (the report), ``audit.json`` (every number) and
``audit_lower_bounds.png`` into ``out_dir``. Sections:

(a) DP-SGD (every iterate released) at certified epsilon 1, 2, 4, 8 (the pld accountant), white-box gradient
    canaries and black-box input canaries, on the real engine and on two deliberately broken ones: the noise
    stage adds a tenth of the noise the ledger records, or clipping is off (the clipped sum is the raw sum).
(b) Projected noisy SGD with full batches (only the last iterate released), certified by the last-iterate bound
    (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More Iterations without More Privacy
    Loss", Thm 3.1 and App. B), on the real engine and with the noise divided by 10 and by 100.

The bugs are those of ``dptrain audit --inject-bug`` (:mod:`dptrain.auditing.bugs`): the ledger records the
correct run. ``run(out_dir, power=True)`` measures the audit's power instead (:func:`run_power`): how often
``dptrain audit --config configs/audit.toml [--inject-bug BUG]`` flags each engine.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from dptrain.auditing.bounds import ceiling
from dptrain.auditing.runner import audit_run
from dptrain.config import config_from_dict
from dptrain.reproduce import md_table, single_thread
from dptrain.reproduce.report import Report, Section, figure

__all__ = [
    "BUGS",
    "dpsgd_config",
    "experiment",
    "projected_config",
    "render",
    "render_power",
    "run",
    "run_power",
    "summarize",
]

REPORT, DATA_JSON, PLOT = "audit.md", "audit.json", "audit_lower_bounds.png"
CANARIES = 1000
DELTA = 1e-5
CONFIDENCE = 0.95
EPSILONS = (1.0, 2.0, 4.0, 8.0)

#: setting -> the engines audited: "real" (as shipped) or a bug of ``dptrain audit --inject-bug``.
BUGS = {
    "dpsgd": ("real", "noise/10", "clipping-off"),
    "projected": ("real", "noise/10", "noise/100"),
}


def dpsgd_config(epsilon: float, seed: int) -> dict:
    """Logistic regression (5010 parameters) on 1000 synthetic 500-dimensional examples of 10 classes (Gaussian
    mixture, separation 3); Poisson batches of expected size 200, 20 epochs, SGD at learning rate 0.5, clip norm 1,
    sigma calibrated to ``epsilon`` at delta = 1e-5 by the pld accountant."""
    return {
        "seed": seed,
        "data": {
            "name": "synthetic",
            "options": {"n": 1250, "dim": 500, "num_classes": 10, "separation": 3.0},
        },
        "model": {"name": "logistic"},
        "privacy": {"target_epsilon": epsilon, "delta": DELTA, "max_grad_norm": 1.0, "accountant": "pld"},
        "training": {"epochs": 20, "batch_size": 200, "learning_rate": 0.5},
    }


def projected_config(epsilon: float, seed: int) -> dict:
    """L2-regularized logistic regression (l2 = 0.1, 1001 weights) by projected noisy SGD with full batches on 1000
    synthetic 1000-dimensional binary examples (features rescaled to norm 1), 1000 steps at learning rate 1 in a
    ball of diameter 1; sigma calibrated to ``epsilon`` by the last-iterate accountant."""
    return {
        "seed": seed,
        "data": {
            "name": "synthetic",
            "options": {"n": 1250, "dim": 1000, "num_classes": 2, "separation": 0.0},
        },
        "privacy": {"target_epsilon": epsilon, "delta": DELTA, "accountant": "last_iterate"},
        "training": {"algorithm": "projected_noisy_sgd", "steps": 1000, "learning_rate": 1.0},
        "convex": {"loss": "logistic", "feature_norm": 1.0, "l2": 0.1, "diameter": 1.0, "batching": "full"},
    }


# --- the experiment ---------------------------------------------------------------------------------------------


def one_audit(setting: str, kind: str, bug: str, epsilon: float, seed: int, m: int) -> dict[str, Any]:
    make = dpsgd_config if setting == "dpsgd" else projected_config
    start = time.perf_counter()
    result = audit_run(
        config_from_dict(make(epsilon, seed)),
        canaries=m,
        confidence=CONFIDENCE,
        kind=kind,
        inject_bug=None if bug == "real" else bug,
    )
    return {
        **result,
        "engine": bug,
        "target_epsilon": epsilon,
        "seed": seed,
        "exceeds": result["verdict"] == "violation",
        "seconds": time.perf_counter() - start,
    }


def plan(quick: bool) -> list[tuple[str, str, str, float]]:
    """(setting, kind, engine, target epsilon) of every audit."""
    eps = (1.0, 8.0) if quick else EPSILONS
    rows = [(s, k, b, e) for s in ("dpsgd",) for k in ("gradient", "input") for b in BUGS[s] for e in eps]
    kinds = ("gradient",) if quick else ("gradient", "input")
    eps = (2.0,) if quick else EPSILONS
    rows += [("projected", k, b, e) for k in kinds for b in BUGS["projected"] for e in eps]
    return rows


def experiment(quick: bool) -> dict[str, Any]:
    seeds = (0,) if quick else (0, 1, 2)
    audits = [
        one_audit(setting, kind, bug, eps, seed, CANARIES)
        for setting, kind, bug, eps in plan(quick)
        for seed in seeds
    ]
    top = ceiling(CANARIES, DELTA, CONFIDENCE)
    return {"canaries": CANARIES, "seeds": list(seeds), "ceiling": top, "audits": audits}


def summarize(audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setting, kind, engine, target epsilon), over the seeds."""
    groups: dict[tuple, list[dict]] = {}
    for a in audits:
        groups.setdefault((a["setting"], a["kind"], a["engine"], a["target_epsilon"]), []).append(a)
    rows = []
    for (setting, kind, bug, eps), runs in groups.items():
        lows = [r["epsilon_lower_bound"] for r in runs]
        rows.append(
            {
                "setting": setting,
                "kind": kind,
                "engine": bug,
                "target_epsilon": eps,
                "certified": max(r["epsilon_certified"] for r in runs),
                "accountant": runs[0]["accountant"],
                "lower_bounds": lows,
                "guesses": [f"{r['correct']}/{r['guesses']}" for r in runs],
                "exceeding": sum(r["exceeds"] for r in runs),
                "inconclusive": sum(r["verdict"] == "inconclusive" for r in runs),
                "runs": len(runs),
            }
        )
    return rows


# --- the report ---------------------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], setting: str) -> str:
    head = ["canaries", "engine", "certified eps", "lower bound (each seed)", "correct/guesses", "violation"]
    body = [
        [
            r["kind"],
            r["engine"],
            f"{r['certified']:.3f} ({r['accountant']})",
            ", ".join(f"{v:.3f}" for v in r["lower_bounds"]),
            ", ".join(r["guesses"]),
            f"{r['exceeding']}/{r['runs']}"
            + (" **caught**" if r["exceeding"] and r["engine"] != "real" else "")
            + (f" ({r['inconclusive']} inconclusive)" if r["inconclusive"] else ""),
        ]
        for r in rows
        if r["setting"] == setting
    ]
    return md_table(head, body)


def _verdict(rows: list[dict[str, Any]], ceiling_value: float, canaries: int) -> str:
    real = [r for r in rows if r["engine"] == "real"]
    real_ok = all(r["exceeding"] == 0 for r in real)
    caught = sorted(
        {(r["setting"], r["kind"], r["engine"], r["target_epsilon"]) for r in rows if r["engine"] != "real"}
        & {(r["setting"], r["kind"], r["engine"], r["target_epsilon"]) for r in rows if r["exceeding"]}
    )
    lines = [
        (
            "- Real engine: the lower bound stays below the certificate in every audit."
            if real_ok
            else "- Real engine: SOME LOWER BOUND EXCEEDS THE CERTIFICATE (a bug, or a 5% false alarm): see the table."
        ),
        "- Broken engines caught (setting, canaries, bug, target epsilon): "
        + ("; ".join(f"{s}, {k}, {b}, {e:g}" for s, k, b, e in caught) if caught else "none")
        + ".",
        f"- A one-run audit with m = {canaries} canaries at delta = {DELTA:g} cannot report more than "
        f"{ceiling_value:.2f} even if every guess is right, so a broken engine is only caught where its certificate "
        "is below that ceiling, and only if the bug makes the canaries distinguishable enough; where the "
        "certificate is at or above it the verdict is inconclusive.",
    ]
    return "\n".join(lines)


EXPLANATION = "\n".join(
    [
        "What the numbers mean:",
        "",
        "- If a run really is (epsilon, delta)-DP, its audit reports a lower bound above epsilon with "
        "probability at most 5%: a lower bound above the certificate refutes the certificate (the engine, or "
        "its accounting, does not do what the ledger says). A lower bound below it proves nothing: an audit "
        "can refute, never certify.",
        "- A one-run audit is loose by design: m canaries give at most m "
        "independent guesses, so even perfect guesses only reach the ceiling above, and DP-SGD's accounting "
        "covers an adversary who chooses worst-case neighbours and sees every iterate, which the canaries only "
        "approximate. Lower bounds far below the certificate on the real engine are expected.",
        "- What matters: the real engine never exceeds its certificate, and a broken one does. DP-SGD's gradient "
        "canaries sit on auxiliary coordinates of their own (no real example moves them), are scored on every "
        "released update, and have norm 4C before clipping: they test the noise and the clipping. Input canaries "
        "(random examples, random labels) are scored on the final model's loss: without clipping their gradients "
        "are unbounded and the model memorizes them.",
        "- Projected noisy SGD releases only the last iterate; its certificate (Altschuler & Talwar's "
        "last-iterate bound) is for the worst-case neighbour (replace adjacency, sensitivity 2L) and a "
        "contraction argument, while the canary (norm L) is observed through one Gaussian coordinate of w_T. "
        "The slack is large: a 10x noise bug stays inside it here, a 100x one is caught where the "
        "certificate is small enough.",
    ]
)


def _calibration_note(rows: list[dict[str, Any]]) -> str:
    """A note for the rows whose certified epsilon is below their target (the calibration chose more noise)."""
    low = sorted(
        {
            (r["setting"], r["target_epsilon"], r["certified"])
            for r in rows
            if r["certified"] < 0.99 * r["target_epsilon"]
        }
    )
    if not low:
        return ""
    which = "; ".join(f"{s} at target {t:g}: certified {c:.3f}" for s, t, c in low)
    return (
        f"Note: some runs are certified below their target epsilon ({which}): the calibration returned more noise "
        "than the target needs. The audit compares with what the run's accountant certifies for the noise it used."
    )


def _draw(rows: list[dict[str, Any]], ceiling_value: float, canaries: int):
    def draw(fig, axes) -> None:
        for ax, setting, title in (
            (axes[0], "dpsgd", "DP-SGD (every iterate released)"),
            (axes[1], "projected", "projected noisy SGD (last iterate)"),
        ):
            for i, ((kind, bug), style) in enumerate(_series(rows, setting)):
                pts = [r for r in rows if (r["setting"], r["kind"], r["engine"]) == (setting, kind, bug)]
                x = [r["certified"] for r in pts]
                y = [max(r["lower_bounds"]) for r in pts]
                ax.plot(x, y, style, color=f"C{i}", label=f"{kind}, {bug}", markersize=6)
            top = max([r["certified"] for r in rows if r["setting"] == setting] + [1.0])
            ax.plot([0, top], [0, top], "k--", linewidth=1, label="lower bound = certificate")
            ax.axhline(ceiling_value, color="grey", linestyle=":", label=f"one-run ceiling (m = {canaries})")
            ax.set_xlabel("certified epsilon")
            ax.set_ylabel("epsilon lower bound (95%, max over seeds)")
            ax.set_title(title)
            ax.legend(fontsize=7)
        fig.tight_layout()

    return draw


def _series(rows: list[dict[str, Any]], setting: str) -> list[tuple[tuple[str, str], str]]:
    keys = list(dict.fromkeys((r["kind"], r["engine"]) for r in rows if r["setting"] == setting))
    return [(k, "o-" if k[1] == "real" else "x--") for k in keys]


def render(data: dict[str, Any]) -> Report:
    """The report of ``data`` (what :func:`run` writes to ``audit.json``)."""
    rows, canaries, ceiling_value = data["summary"], data["canaries"], data["ceiling"]
    mode = (
        "QUICK mode (one seed, fewer settings; not the reported experiment)" if data["quick"] else "full run"
    )
    header = f"Produced by `{data['command']}`"
    return Report(
        REPORT,
        "Empirical privacy audit: one-run lower bounds vs certified epsilon",
        intro=[
            f"{header} ({mode}). Wall time {data['wall_time_s']:.0f} s. All numbers are in `{DATA_JSON}`; plot "
            f"`{PLOT}`.",
            'Method: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023): '
            f"m = {canaries} canaries, each included with probability 1/2 (secret bits from the run's canaries "
            f"stream), one training run with the real engine (`dptrain audit`), the epsilon lower bound of Theorem "
            f"5.2 at the run's delta = {DELTA:g} with {CONFIDENCE:.0%} confidence (best of 6 guess counts, "
            f"Bonferroni-corrected). Seeds {data['seeds']} (the audits are seeded experiments).",
        ],
        sections=[
            Section("Summary", [_verdict(rows, ceiling_value, canaries)]),
            Section(
                "(a) DP-SGD, every iterate released",
                [
                    "Setting: " + " ".join((dpsgd_config.__doc__ or "").split()),
                    f"{header}:",
                    _table(rows, "dpsgd"),
                ],
            ),
            Section(
                "(b) Projected noisy SGD, full batches, last iterate only",
                [
                    "Setting: " + " ".join((projected_config.__doc__ or "").split()),
                    f"{header}:",
                    _table(rows, "projected"),
                    f"![lower bound vs certified epsilon]({PLOT})",
                    _calibration_note(rows),
                    EXPLANATION,
                ],
            ),
        ],
        data={DATA_JSON: data},
        plots=[figure(PLOT, _draw(rows, ceiling_value, canaries), figsize=(11, 4.4), ncols=2)],
    )


def run(out_dir: str | Path, quick: bool = False, power: bool = False) -> Path:
    """Run the audits into ``out_dir`` (created if needed); returns the path of ``audit.md``. ``quick``: one seed,
    DP-SGD at certified epsilon 1 and 8 only, the projected setting at 2 with gradient canaries only. ``power``:
    the power measurement instead (:func:`run_power`, ``audit_power.md``)."""
    if power:
        return run_power(out_dir, quick)
    command = f"dptrain reproduce audit --out {Path(out_dir)}" + (" --quick" if quick else "")
    start = time.perf_counter()
    with single_thread(), warnings.catch_warnings():
        # every audit is seeded (a reproducible experiment, not a private run): silence the seed warnings
        warnings.simplefilter("ignore")
        exp = experiment(quick)
    rows = summarize(exp["audits"])
    wall = time.perf_counter() - start
    data = {"command": command, "quick": quick, "wall_time_s": wall, **exp, "summary": rows}
    return render(data).write(out_dir)


# --- the audit's power: dptrain reproduce audit --power -------------------------------------------------------------

POWER_REPORT, POWER_JSON = "audit_power.md", "audit_power.json"
#: configs/audit.toml (tests/test_audit.py checks that they are the same configuration).
POWER_CONFIG: dict[str, Any] = {
    "data": {"name": "synthetic", "options": {"n": 2000, "dim": 1000, "num_classes": 2, "separation": 3.0}},
    "model": {"name": "logistic"},
    "privacy": {"target_epsilon": 1.0, "delta": DELTA, "max_grad_norm": 1.0},
    "training": {"epochs": 5, "batch_size": 100, "learning_rate": 0.5},
}
#: The engines audited: None is the correct one, the others ``--inject-bug`` values.
POWER_ENGINES: tuple[str | None, ...] = (None, "noise/10", "noise/2", "clipping-off")
#: Further (engine, --canaries) pairs: what more canaries than the default buy (and cost: one row per canary).
POWER_MORE_CANARIES: tuple[tuple[str | None, int], ...] = ((None, 3000), ("noise/2", 3000))
POWER_SEEDS = 10
#: What the acceptance asks of the audit of configs/audit.toml: noise/10 flagged in at least 9 of 10 audits, the
#: correct engine in none, each audit under 60 s.
POWER_TARGETS = {"noise/10": 9, "real": 0, "seconds": 60.0}


def power_audit(engine: str | None, seed: int, canaries: int | None = None) -> dict[str, Any]:
    """One audit of :data:`POWER_CONFIG` with ``seed`` exactly as ``dptrain audit --config configs/audit.toml --set
    seed=SEED [--inject-bug ENGINE] [--canaries M]`` runs it, judged with every statistic of the same run (the
    command reports the runner's default one)."""
    from dptrain.auditing.runner import judge, observe

    start = time.perf_counter()
    seen = observe(config_from_dict({**POWER_CONFIG, "seed": seed}), canaries, "gradient", engine)
    judged = {s: judge(seen, s, CONFIDENCE) for s in seen.scores}
    seconds = time.perf_counter() - start
    first = next(iter(judged.values()))
    return {
        "engine": engine or "real",
        "seed": seed,
        "default_canaries": canaries is None,
        "seconds": seconds,
        "epsilon_certified": first["epsilon_certified"],
        "ceiling": first["ceiling"],
        "canaries": first["canaries"],
        "scores": {
            s: {k: r[k] for k in ("epsilon_lower_bound", "verdict", "correct", "guesses")} for s, r in judged.items()
        },
    }


def cli_seconds(engine: str | None) -> dict[str, Any]:
    """The end-to-end time of the command itself in a fresh process (imports, calibration, training, bound), with
    secret randomness as a user runs it: ``dptrain audit --config configs/audit.toml [--inject-bug ENGINE]``."""
    import json
    import subprocess
    import sys
    import tempfile

    from dptrain.config import config_to_toml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "audit.toml"
        path.write_text(config_to_toml(config_from_dict(POWER_CONFIG)))
        argv = [sys.executable, "-m", "dptrain", "audit", "--config", str(path), "--json"]
        argv += [] if engine is None else ["--inject-bug", engine]
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise RuntimeError(f"dptrain audit failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    result = json.loads(done.stdout)
    return {"engine": engine or "real", "seconds": seconds, "exit_code": done.returncode, "verdict": result["verdict"]}


def summarize_power(audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (engine, canaries, statistic): how many audits flagged a violation, over the seeds."""
    rows = []
    groups = list(dict.fromkeys((a["engine"], a["canaries"]) for a in audits))
    statistics = list(dict.fromkeys(s for a in audits for s in a["scores"]))
    for engine, m in groups:
        runs = [a for a in audits if (a["engine"], a["canaries"]) == (engine, m)]
        for statistic in statistics:
            judged = [a["scores"][statistic] for a in runs]
            rows.append(
                {
                    "engine": engine,
                    "canaries": m,
                    "default_canaries": runs[0]["default_canaries"],
                    "ceiling": runs[0]["ceiling"],
                    "score": statistic,
                    "flagged": sum(j["verdict"] == "violation" for j in judged),
                    "audits": len(runs),
                    "lower_bounds": [j["epsilon_lower_bound"] for j in judged],
                    "max_seconds": max(a["seconds"] for a in runs),
                    "mean_seconds": sum(a["seconds"] for a in runs) / len(runs),
                }
            )
    return rows


def _power_table(rows: list[dict[str, Any]], default: str) -> str:
    head = [
        "engine",
        "canaries (ceiling)",
        "score",
        "flagged (violation)",
        "lower bounds: min / median / max",
        "seconds: mean / max",
    ]
    body = []
    for r in rows:
        lows = sorted(r["lower_bounds"])
        body.append(
            [
                r["engine"],
                f"{r['canaries']}{'' if r['default_canaries'] else ' (--canaries)'} ({r['ceiling']:.2f})",
                r["score"] + (" (the command's)" if r["score"] == default else ""),
                f"{r['flagged']}/{r['audits']}",
                f"{lows[0]:.3f} / {lows[len(lows) // 2]:.3f} / {lows[-1]:.3f}",
                f"{r['mean_seconds']:.1f} / {r['max_seconds']:.1f}",
            ]
        )
    return md_table(head, body)


def _power_verdict(data: dict[str, Any]) -> str:
    rows = {(r["engine"], r["score"]): r for r in data["summary"] if r["default_canaries"]}
    default = data["default_score"]
    lines = []
    for engine, need in (("noise/10", f">= {POWER_TARGETS['noise/10']}"), ("real", "0")):
        r = rows.get((engine, default))
        if r is not None:
            lines.append(f"- {engine}: flagged in {r['flagged']} of {r['audits']} audits (acceptance: {need}).")
    slowest = max(a["seconds"] for a in data["audits"] if a["default_canaries"])
    lines.append(
        f"- Slowest audit: {slowest:.1f} s in this process (acceptance: under {POWER_TARGETS['seconds']:g} s)."
    )
    for c in data["cli"]:
        lines.append(
            f"- The command end to end in a fresh process, {c['engine']} engine, secret randomness: "
            f"{c['seconds']:.1f} s, verdict {c['verdict']} (exit code {c['exit_code']})."
        )
    return "\n".join(lines)


def _compact(config: dict[str, Any]) -> str:
    import json

    return json.dumps(config, separators=(", ", ": "))


def render_power(data: dict[str, Any]) -> Report:
    """The report of ``data`` (what :func:`run_power` writes to ``audit_power.json``)."""
    mode = "QUICK mode (2 seeds; not the reported experiment)" if data["quick"] else "full run"
    cert, top, m = data["epsilon_certified"], data["ceiling"], data["canaries"]
    return Report(
        POWER_REPORT,
        "The audit's power: how often `dptrain audit` flags a broken engine",
        intro=[
            f"Produced by `{data['command']}` ({mode}). Wall time {data['wall_time_s']:.0f} s. All numbers are in "
            f"`{POWER_JSON}`.",
            "Each audit is `dptrain audit --config configs/audit.toml --set seed=SEED [--inject-bug ENGINE]` "
            f"(seeds {data['seeds']}), the configuration `{_compact(data['config'])}`: a noise multiplier "
            f"certified at epsilon {cert:.4f} (delta = {DELTA:g}), m = {m} "
            f"gradient canaries on auxiliary coordinates scored on every released update, {CONFIDENCE:.0%} "
            f"confidence; the audit could report at most {top:.3f} (its ceiling). A bug changes what the engine "
            "does, never what its ledger records. Each run is judged by both statistics (the log-likelihood ratio "
            "`llr` and the plain `sum`); the command reports "
            f"`{data['default_score']}`. Timings on one thread (`single_thread`), the machine shared.",
        ],
        sections=[
            Section("Summary", [_power_verdict(data)]),
            Section("Flag rates", [_power_table(data["summary"], data["default_score"])]),
        ],
        data={POWER_JSON: data},
    )


def run_power(out_dir: str | Path, quick: bool = False) -> Path:
    """Audit :data:`POWER_CONFIG` (configs/audit.toml) with each of :data:`POWER_ENGINES` over :data:`POWER_SEEDS`
    seeds (2 with ``quick``), and :data:`POWER_MORE_CANARIES`, and time the command in a fresh process once per
    engine (neither with ``quick``); writes
    ``audit_power.md`` and ``audit_power.json`` into ``out_dir`` and returns the report's path."""
    from dptrain.auditing.runner import DEFAULT_STATISTIC

    command = f"dptrain reproduce audit --power --out {Path(out_dir)}" + (" --quick" if quick else "")
    seeds = range(2 if quick else POWER_SEEDS)
    start = time.perf_counter()
    with single_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded audits (reproducible experiments): silence the seed warnings
        audits = [power_audit(engine, seed) for seed in seeds for engine in POWER_ENGINES]
        if not quick:
            audits += [power_audit(engine, seed, m) for seed in seeds for engine, m in POWER_MORE_CANARIES]
    cli = [] if quick else [cli_seconds(engine) for engine in POWER_ENGINES]
    data = {
        "command": command,
        "quick": quick,
        "wall_time_s": time.perf_counter() - start,
        "seeds": list(seeds),
        "config": POWER_CONFIG,
        "default_score": DEFAULT_STATISTIC,
        "epsilon_certified": audits[0]["epsilon_certified"],  # (with more canaries, calibrated to the same target)
        "ceiling": audits[0]["ceiling"],
        "canaries": audits[0]["canaries"],
        "audits": audits,
        "cli": cli,
        "summary": summarize_power(audits),
    }
    return render_power(data).write(out_dir)
