"""What a search releases, and how: its certificate, the best trial, and nothing that depends on the number of trials.

A search releases the best trial (its model, hyperparameters and noisy score) under the search's certificate
(Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022, Thm 2 / Thm 6). Their
theorems assume the number of trials K stays secret, and with it the best trial's index. So nothing shareable may
depend on either:

- ``summary.json`` and ``ledger.json`` (the search as one event) hold the search's certificate and the best trial's
  values, never K; the command's JSON adds K and every trial only with ``--keep-trials``, under ``not_private``;
- ``best/`` is what the selected trial released, copied without its file times and without its secret ``private/``,
  every path to the trial's directory in its files rewritten to ``best/`` (:func:`moved_paths`):
  every privacy number in it is the search's (its ``ledger.json`` is the search's ledger, its ``summary.json`` shows
  the search's certificate and attacker bound first, the trial's own certificate nested under ``trial_alone``,
  labelled; its ``metrics.jsonl`` rows without the trial's epsilon), the rest of the trial's summary only by a list of
  keys that are neither privacy numbers nor times (a key not on it is left out), its ``config.toml`` the trial's
  config with the search's ``[tune]`` section as it was;
- every shareable file of the search is written (again) when it finishes, and every shareable file and directory
  it wrote (:data:`OWN`; a file the user put in its directory is left as it is) ends with one and the same
  modification time, that moment: no file dates the start of the search or the best
  trial among the others. What the file system keeps of the directory itself (its own creation, its ``.lock`` and
  ``private/``) dates the search's start: share the files, not the directory (docs/tuning.md).

The search is private, and certified, only if every trial was (a trial labelled not private, seeded or releasing
buffers unnoised, labels the search). What is released is kept in the search's secret state before any file is
written: a resume of a finished search prints that, writes back a file lost in a crash and refuses an edited one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from dptrain.accounting import Ledger
from dptrain.accounting import epsilon as ledger_epsilon
from dptrain.errors import DataError
from dptrain.runs.averaged import AVERAGE_SUFFIX
from dptrain.runs.rundir import CONFIG, LEDGER, LOCK, METRICS, PRIVATE, SEARCH_STATE, SUMMARY, RunDirectory

#: The selected trial's run directory, inside the search's; the trials' directories, inside its private/.
BEST, TRIALS = "best", "trials"
#: The keys of a run's summary that make its certificate: in ``best/summary.json`` they are the search's, the trial's
#: own moved under ``trial_alone``.
CERTIFICATE_KEYS = (
    "epsilon", "delta", "accountant", "certified", "private", "not_private_because", "accountant_choice",
    "accountants", "target_epsilon", "rdp_order", "membership_inference",
)
#: The other keys of a trial's summary ``best/summary.json`` keeps: neither a privacy number (those are the search's)
#: nor a time (it would date or place the trial among the others). A key not listed is left out.
PUBLIC_RUN_KEYS = (
    "test_accuracy", "test_is_public", "not_private", "steps", "planned_steps", "finished",
    "release", "epochs", "noise_multiplier", "noise_mechanism", "bands", "rmse_ratio", "sampling_rate", "sampling",
    "max_grad_norm", "batch_size", "dataset", "train_size", "model", "gradient_check", "randomness", "secure_noise",
    "notes", "preprocessing", "hf_model", "hf_adapter",
)


def public_key(key: str) -> bool:
    """Whether ``best/summary.json`` keeps the selected trial's entry ``key`` (PUBLIC_RUN_KEYS, or the weight
    average's entry of one of them: ``model_ema``, ``hf_model_ema``, ``test_accuracy_ema`` are kept exactly when the
    last iterate's ``model``, ``hf_model``, ``test_accuracy`` are)."""
    return key in PUBLIC_RUN_KEYS or (key.endswith(AVERAGE_SUFFIX) and key[: -len(AVERAGE_SUFFIX)] in PUBLIC_RUN_KEYS)


def summarize(search, state, rd: RunDirectory) -> tuple[dict, dict, int | None]:
    """(summary, ledger, the best trial's index) of a search whose trials have all run: the search's certificate
    (private only if every trial was), the best trial's values, score and noise. Nothing in the summary or the ledger
    depends on K or on the index (which stays in the secret state)."""
    from dptrain.runs.run import attacker_bound

    cfg = search.cfg
    ledger = search.search_ledger(state.reference_noise)
    reasons = sorted({r for t in state.trials for r in t.not_private_because})
    if cfg.seed is not None and not reasons:  # (no trial ran: a Poisson K of 0)
        reasons = ["seeded randomness: the number of trials and the draws can be recomputed from the seed"]
    ledger.private = not reasons
    report = ledger_epsilon(ledger, cfg.privacy.delta, "auto")
    single = ledger_epsilon(search._reference_planner(state.reference_noise), cfg.privacy.delta, "auto")
    scored = [t for t in state.trials if t.status == "done"]
    best = max(scored, key=lambda t: t.score) if scored else None
    summary = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "certified": bool(report.certified and ledger.private),
        "private": ledger.private,
        **({"not_private_because": [f"a trial is not private: {r}" for r in reasons]} if reasons else {}),
        "accountant": report.accountant,
        "target_epsilon": cfg.privacy.target_epsilon,
        "membership_inference": attacker_bound(ledger, cfg.privacy.delta),
        "epsilon_single_run": single.epsilon,
        "single_run_accountant": single.accountant,
        **search.trials.to_dict(),
        "best": best.values if best else None,
        "best_score": best.score if best else None,
        "best_noise_multiplier": best.noise_multiplier if best else None,
        "score": "test accuracy (public)" if search.tune.validation_is_public else
        f"noisy held-out accuracy (noise std {search.tune.score_noise:g} examples)",
        "out": None if best is None else str(rd.path / BEST),
    }
    return summary, ledger.to_dict(), None if best is None else best.index


def publish(state, rd: RunDirectory, keep_trials: bool) -> dict:
    """Release a search whose state holds what it releases (:func:`summarize`, kept in the secret state before any file
    is written); returns the summary (:func:`returned`)."""
    _publish(state, rd, keep_trials)
    return returned(state, keep_trials)


def finished(state, rd: RunDirectory, keep_trials: bool) -> dict:
    """A finished search's summary, from its secret state: ``summary.json`` and ``ledger.json`` must be what it
    released (a file lost in a crash is published again; an edited one is refused). A search interrupted while it
    published (its state does not say ``published``) publishes everything again: a file left with its own time would
    date the search's start or its length."""
    if not state.extra.get("published"):  # (interrupted while it published: published again, all of it)
        _publish(state, rd, keep_trials)
        return returned(state, keep_trials)
    for name, kept in ((SUMMARY, state.summary), (LEDGER, state.ledger)):
        on_disk = rd.read_json(name)
        if on_disk is None and not (rd / name).exists():
            _publish(state, rd, keep_trials)
            break
        if on_disk != json.loads(json.dumps(kept)):
            raise DataError(
                f"{rd / name} does not match the finished search's state (edited, or from another search): restore "
                "or delete it to see the search's report"
            )
    return returned(state, keep_trials)


def returned(state, keep_trials: bool) -> dict:
    """What run_search returns: the public summary, and K with every trial only when asked (``--keep-trials``)."""
    out = dict(state.summary)
    if keep_trials:
        out["not_private"] = {
            "trials_run": len(state.trials),
            "trials": [t.listed() for t in state.trials],
            "note": "secret: revealing the number of trials voids the search's certificate (Papernot & Steinke's "
            "theorems assume it is not released)",
        }
    return out


def _publish(state, rd: RunDirectory, keep_trials: bool) -> None:
    """Write what the search releases (idempotent: a resume after a crash in the middle publishes again): ``best/``
    from the selected trial's directory while it exists, then the trials removed (unless kept), ``ledger.json`` and
    ``summary.json``, and last the same modification time on every shareable file and directory."""
    index = state.extra.get("best_index")
    trials = rd.path / PRIVATE / TRIALS
    if index is not None and (trials / str(index)).exists():
        _copy_best(state, rd, trials / str(index))
    if not keep_trials:
        for trial in state.trials:  # (each trial's directory, where trials/ is: a link to another place too)
            remove(trials / str(trial.index))
        remove(trials)
    rd.write_json(LEDGER, state.ledger)
    rd.write_json(SUMMARY, state.summary)
    for stale in rd.path.glob(".*.tmp"):  # (a temporary file a crash left dates that crash among the trials)
        if stale.is_file():
            stale.unlink()
    fresh_files(rd)
    same_times(rd)
    if not state.extra.get("published"):  # (until this is kept, a resume publishes everything again)
        state.extra["published"] = True
        rd.save_private(SEARCH_STATE, state.to_dict())


def _copy_best(state, rd: RunDirectory, source) -> None:
    """``best/``: what the selected trial released (its files copied without their times and without its secret
    ``private/``), every privacy number in it the search's (module docstring). Its files are held to the trial's
    checkpoint: ``config.toml`` is the config the trial ran with (an edited copy would misstate the selected
    hyperparameters), and metrics rows that are not the ones it released are refused in one line."""
    kept = RunDirectory(source).load_checkpoint()
    RunDirectory(source).check_metrics_copy(kept.get("metrics"))
    target = rd.path / BEST
    remove(target)
    # (not its secret private/, nor a hidden file: its .lock, or a temporary file a crash left, which would say that
    # the selected trial was the one running when the search was interrupted)
    shutil.copytree(source, target, copy_function=shutil.copy, ignore=shutil.ignore_patterns(PRIVATE, ".*"))
    best = RunDirectory(target)
    trial = kept.get("summary") or best.read_json(SUMMARY) or {}
    best.write_text(CONFIG, kept["config"])
    best.write_json(LEDGER, state.ledger)
    best.write_json(SUMMARY, selected_summary(state.summary, trial, str(target), state.ledger))
    if (target / METRICS).exists():  # each evaluation's epsilon was the trial's: the search's is the summary's
        rows = [json.loads(line) for line in (target / METRICS).read_text().splitlines() if line.strip()]
        private = state.summary["private"]
        best.write_text(METRICS, "".join(
            json.dumps({**{k: v for k, v in r.items() if k not in ("epsilon", "delta")}, "private": private}) + "\n"
            for r in rows
        ))  # fmt: skip
    moved_paths(source, target, rd.path / PRIVATE)


def remove(path: Path) -> None:
    """Remove an entry the search wrote as an entry: a link is unlinked, never followed (``best`` made a link to a
    directory of the user's, which would have been emptied, or ``private/trials`` moved elsewhere and linked)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def moved_paths(source: Path, target: Path, secret: Path) -> None:
    """Every file under ``target`` (a copy of the run in ``source``) names ``target`` wherever it named ``source``: a
    run's files may hold their own directory's path (its summary's ``hf_model`` and ``hf_adapter``, a peft adapter's
    ``base_model_name_or_path``), and the selected trial's, ``.../private/trials/6``, is the best trial's index, hence
    a bound on K (and a path to files that are deleted). Then no file under ``target`` may name ``secret`` (the
    search's private/) at all: one that still does (a binary file, or a path written another way) is refused in one
    line, never released."""
    pairs = []
    for a, b in ((source.resolve(), target.resolve()), (Path(os.path.abspath(source)), Path(os.path.abspath(target))),
                 (source, target)):
        for old, new in ((str(a), str(b)), (json.dumps(str(a))[1:-1], json.dumps(str(b))[1:-1])):
            if (old.encode(), new.encode()) not in pairs:
                pairs.append((old.encode(), new.encode()))
    forbidden = {str(x).encode() for x in (secret.resolve(), Path(os.path.abspath(secret)))}
    for root, _, files in os.walk(target):
        for name in files:
            path = Path(root) / name
            if path.is_symlink():
                continue
            data = original = path.read_bytes()
            try:
                data.decode()
            except UnicodeDecodeError:
                pass
            else:
                for old, new in pairs:
                    data = data.replace(old, new)
            if any(f in data for f in forbidden):
                raise DataError(
                    f"{path} names the search's secret directory {secret} (the selected trial's path would tell where it "
                    "ran among the secret trials): it cannot be released"
                )
            if data != original:
                path.write_bytes(data)


def selected_summary(search: dict, trial: dict, out: str, ledger: dict) -> dict[str, Any]:
    """``best/summary.json``: the search's certificate and attacker bound first (the model was selected by the
    search: its certificate is the search's), the selected trial's own certificate nested under ``trial_alone`` and
    labelled, then the trial's entries of PUBLIC_RUN_KEYS (a run's summary holds no time)."""
    from dptrain.runs.run import attacker_bound

    rest = {k: v for k, v in trial.items() if public_key(k)}
    own = {k: trial[k] for k in CERTIFICATE_KEYS if k in trial}
    return {
        **{k: search[k] for k in ("epsilon", "delta", "accountant", "certified", "private") if k in search},
        **({"not_private_because": search["not_private_because"]} if "not_private_because" in search else {}),
        "certificate": "the search's: this model was selected by a private hyperparameter search (Papernot & "
        "Steinke, Thm 2 / Thm 6), whose certificate covers it; see the search's summary.json",
        "membership_inference": attacker_bound(Ledger.from_dict(ledger), search["delta"]),
        "target_epsilon": search["target_epsilon"],
        "search": {
            k: search[k]
            for k in ("tuning_distribution", "tuning_mean", "best", "best_score", "score", "epsilon_single_run")
        },
        "trial_alone": {
            "note": "this trial alone, NOT the certificate of the released model (it was selected among secret trials)",
            **own,
        },
        **rest,
        "out": out,
    }


#: What a search writes at the top of its directory besides its secret ``private/``: the only entries its end writes
#: again and gives one time (a file the user put there is left as it is).
OWN = (CONFIG, LEDGER, SUMMARY, LOCK, BEST)


def fresh_files(rd: RunDirectory) -> None:
    """Write the search's own shareable files (not ``best/``'s, copied at the end already) anew, so that none was born
    when the search started (a file system records birth times and allocates inode numbers in order, which set mtimes
    do not change): its config.toml among the summary and the ledger written at the end."""
    for name in (CONFIG, LEDGER, SUMMARY):
        path = rd.path / name
        if path.is_file() and not path.is_symlink():
            rd.write_bytes(name, path.read_bytes())


def same_times(rd: RunDirectory, when: float | None = None) -> None:
    """One modification (and access) time, ``when`` (default: now), on the search's directory and every file and
    directory it wrote there (:data:`OWN`, ``best/`` with all it holds), never its secret ``private/``: the search's
    start, its length and where the best trial ran among the others are not written in the file system."""
    when = time.time() if when is None else when
    for name in OWN:
        top = rd.path / name
        if top.is_dir() and not top.is_symlink():
            for root, dirs, files in os.walk(top, topdown=False):
                for entry in (*files, *dirs):
                    os.utime(os.path.join(root, entry), (when, when), follow_symlinks=False)
        if top.is_symlink() or top.exists():
            os.utime(top, (when, when), follow_symlinks=False)
    os.utime(rd.path, (when, when))


__all__ = [
    "BEST", "TRIALS", "finished", "fresh_files", "moved_paths", "publish", "remove", "returned", "same_times",
    "selected_summary", "summarize",
]
