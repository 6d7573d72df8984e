"""What a resume may change: a run's configuration, and its data, are frozen when it starts.

The config a run starts with is kept, with its SHA-256, in every checkpoint (``private/``), beside a fingerprint of
its data (:func:`frozen`). ``dptrain train --resume`` reads ``config.toml`` again and refuses, in one line listing
the keys, any change that could change what the run releases or certifies (delta, the budget, the noise, the data,
the model, the batch size, the learning rate, the seed, ...); only :data:`RESUME_MAY_CHANGE` may differ. Data that
changed since the start (a file replaced) is refused too (:func:`check_data`). A search (``dptrain tune``) keeps its
config in its own state by the same functions (:data:`SEARCH_MAY_CHANGE`). What the run's stages released before
training (a private mean) is kept in the checkpoint too, so that a file lost in a crash comes back and an edited one
is refused; so is a finished run's summary (:func:`finished_summary`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dptrain.config import RunConfig, changed_keys, config_from_toml, load_config
from dptrain.errors import ConfigError, DataError
from dptrain.runs.rundir import CONFIG, METRICS, SUMMARY, RunDirectory


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


#: Config keys a resume may change: they cannot change what the run releases or certifies (how often the public test
#: set is evaluated, how a logical batch is cut into physical chunks) or, for the step count, only within the budget
#: the run started with (:func:`check_step_change`).
RESUME_MAY_CHANGE = ("training.eval_every", "training.max_physical_batch_size", "training.epochs", "training.steps")
STEP_KEYS = ("training.epochs", "training.steps")
#: What a resumed search, or a search's trial, may change: nothing. The step count plans every trial's ledger, hence
#: the search's certificate; and a key that changed half-way (how often the test set is evaluated, the physical chunk)
#: would show in ``best/`` (its metrics, its config, its gradient check) whether the best trial ran before or after the
#: resume, which places it among the secret trials.
SEARCH_MAY_CHANGE: tuple[str, ...] = ()


def frozen(config_text: str, data_sha256: str | None) -> dict[str, Any]:
    """What a checkpoint (a run's, or a search's state) keeps of how it started: the config as TOML, its SHA-256, and
    the fingerprint of its data (:func:`dptrain.data.datasets.fingerprint`)."""
    return {"config": config_text, "config_sha256": config_hash(config_text), "data_sha256": data_sha256}


#: Refusal of a checkpoint that keeps no record of how its run started (its config, its data's fingerprint): one
#: written by a dptrain from before those were kept, or edited. Nothing could hold a resume to its start, so none runs.
UNCHECKABLE = (
    "the checkpoint keeps no {what} (written by an older dptrain, or edited): a resume could not be held to how the "
    "run started; start a new run"
)


def frozen_config(state: dict) -> RunConfig:
    """The config a checkpoint's run started with; its hash is checked, so a damaged copy is refused rather than
    trusted, and a checkpoint without one is refused (:data:`UNCHECKABLE`)."""
    text = state.get("config")
    if text is None:
        raise DataError(UNCHECKABLE.format(what="copy of the run's config"))
    if not isinstance(text, str) or config_hash(text) != state.get("config_sha256"):
        raise DataError("the checkpoint's copy of the run's config does not match its hash: the checkpoint is damaged")
    return config_from_toml(text)


def resumed_config(
    rd: RunDirectory, state: dict, may_change: tuple[str, ...] = RESUME_MAY_CHANGE
) -> tuple[RunConfig, list[str]]:
    """The config a resume runs with, and the keys it changed: ``config.toml`` as it is now, which may differ from the
    config the run started with (kept in the checkpoint) only in ``may_change``; any other change is refused with one
    line listing the changed keys. A deleted ``config.toml`` is written back from the checkpoint."""
    path = rd / CONFIG
    frozen = frozen_config(state)
    if not path.exists():
        rd.write_text(CONFIG, state["config"])
        return frozen, []
    try:
        now = load_config(path)
    except ConfigError as e:
        raise ConfigError(
            f"{path} was edited since the run started and is no longer valid ({e}); restore it (the run's config is "
            "kept in its checkpoint) to resume"
        ) from None
    changed = changed_keys(frozen, now)
    refused = [k for k in changed if k not in may_change]
    if refused:
        raise ConfigError(
            f"{path} changed since the run started ({', '.join(refused)}): a resume may not change what the run "
            f"releases or certifies; restore {'that key' if len(refused) == 1 else 'those keys'} or start a new run "
            + (f"(a resume may change only {', '.join(may_change)})" if may_change else "(a resume may change none)")
        )
    return now, changed


def check_data(state: dict, data_sha256: str) -> None:
    """Refuse data that differ from those the run started with (a file replaced between --stop-after and --resume):
    the ledger's data set size and every rate it records are those of the data it started with. A checkpoint without
    the fingerprint is refused (:data:`UNCHECKABLE`)."""
    kept = state.get("data_sha256")
    if not isinstance(kept, str):
        raise DataError(UNCHECKABLE.format(what="fingerprint of the run's data"))
    if kept != data_sha256:
        raise DataError(
            "the data changed since the run started (their fingerprint differs from the one kept with the run's "
            "config): restore the data it started with, or start a new run"
        )


def finished_summary(rd: RunDirectory, state: dict) -> dict | None:
    """A finished run's summary as its checkpoint keeps it (None if the run has not finished: its checkpoint keeps no
    summary, whatever ``summary.json`` says): ``summary.json`` must be that summary; a lost one is written back, an edited one refused
    (the report printed on resume is never read from an editable file alone)."""
    kept = state.get("summary")
    if not isinstance(kept, dict) or not kept.get("finished"):
        return None
    on_disk = rd.read_json(SUMMARY)
    if on_disk is None and not (rd / SUMMARY).exists():
        rd.write_json(SUMMARY, kept)
    elif on_disk != json.loads(json.dumps(kept)):
        raise DataError(
            f"{rd / SUMMARY} does not match the finished run's checkpoint (edited, or from another run): restore or "
            "delete it to see the run's report"
        )
    return kept


def check_records(rd: RunDirectory, trainer) -> None:
    """The checkpoint a run resumes from against the shareable records the run wrote from it (``metrics.jsonl``,
    ``summary.json``; its ledger copy is :meth:`RunDirectory.check_ledger_copy`'s): a label "not private" a row records
    at a step the checkpoint has reached, or the summary of an earlier invocation, is never lifted, and rows of more than one evaluation beyond the checkpoint's step mean
    an older (restored) or edited checkpoint, whose resume would release those steps again, unaccounted (a kill between
    an evaluation's row and its checkpoint leaves one row ahead). Refused in one line, naming the files."""
    rows = rd.metrics_rows()
    labelled = [(METRICS, f"at step {r.get('step')}") for r in rows
                if r.get("private") is False and r.get("step", 0) <= trainer.steps]
    summary = rd.read_json(SUMMARY)
    if isinstance(summary, dict) and summary.get("private") is False:
        labelled.append((SUMMARY, f"at step {summary.get('steps')}"))
    if labelled and trainer.private:
        name, where = labelled[0]
        raise DataError(
            f"{rd / name} records this run not private {where}, but its checkpoint says private (edited, or from "
            "another run): a label is never lifted; restore the run's checkpoint"
        )
    ahead = [r.get("step") for r in rows if r.get("step", 0) > trainer.steps]
    if len(ahead) > 1:
        raise DataError(
            f"{rd / METRICS} records step {ahead[-1]}, beyond the checkpoint's step {trainer.steps} by more than one "
            "evaluation: the checkpoint is older than the run (restored, or edited), and resuming it would release "
            "those steps again unaccounted; restore the run's last checkpoint"
        )


def refuse_given_config(cfg, what: str = "run") -> None:
    """A resume takes no config (the Python API's ``cfg`` with ``resume=True``): it goes on with the one it started
    with, kept in its checkpoint; a config given with it was ignored without a word."""
    if cfg is not None:
        raise ConfigError(
            f"resume=True continues the {what} with the config it started with (kept in its checkpoint), and takes no "
            f"other: pass cfg=None (a {what}'s config.toml may differ only where a resume allows)"
        )


def check_step_change(trainer, changed: list[str]) -> None:
    """More (or fewer) steps on resume only within the budget the run started with: a target epsilon the trainer
    enforces, with a constant noise multiplier (a noise schedule or a batch-size schedule is planned for its length)."""
    if not any(k in STEP_KEYS for k in changed):
        return
    t = trainer
    if t.budget is None or t.noise_schedule is not None or t.noise_controller is not None or t.sampler.max_steps:
        raise ConfigError(
            "training.epochs/training.steps may change on resume only for a run with a privacy budget "
            "(privacy.target_epsilon) and a constant noise multiplier: here it would change what the run certifies; "
            "restore them or start a new run"
        )


def released_files(rd: RunDirectory, state: dict) -> dict[str, Any]:
    """What the run's stages released before training (a private mean, ...), as the checkpoint keeps it: a file lost
    in a crash before it was written is written back; a file that differs from the checkpoint's copy was edited."""
    kept = state.get("released_content")
    if kept is None:  # an older checkpoint: the files are the only copy
        return {name: rd.read_json(name) for name in state.get("released", [])}
    for name, content in kept.items():
        on_disk = rd.read_json(name)
        if on_disk is None and not (rd / name).exists():
            rd.write_json(name, content)
        elif on_disk != content:
            raise DataError(
                f"{rd / name} does not match the run's checkpoint (edited, or from another run): restore or delete it "
                "to resume"
            )
    return dict(kept)


__all__ = [
    "RESUME_MAY_CHANGE",
    "SEARCH_MAY_CHANGE",
    "check_data",
    "check_records",
    "check_step_change",
    "refuse_given_config",
    "config_hash",
    "finished_summary",
    "frozen",
    "frozen_config",
    "released_files",
    "resumed_config",
]
