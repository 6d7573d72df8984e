"""A search's secret state, and what a resume holds it to: nothing in it is trusted that the search can recompute.

A search keeps in ``private/search.pt`` what it cannot recompute: the config it started with (frozen, with its hash
and its data's fingerprint: :func:`dptrain.runs.resume.frozen`), the secret *origin* of its draws (the state of its
"tuning" stream before the first one), and the outcome of each trial (its status, its released score, its labels).
Everything else it keeps is derived, and a resume (:func:`check_resumed`) recomputes it and refuses, in one line, a
state that disagrees:

- **the draws**: the number of trials K, every trial's hyperparameters and the key of its own stream (its held-out
  split, then its score's noise) are drawn again from the origin and must be the trials the state lists, in order. A
  trial deleted from the list, added, reordered or given other values would make the search select among other
  trials than the ones it drew (Papernot & Steinke's theorems assume K drawn from its distribution, independently of
  the trials' outcomes);
- **the noise**: the reference trial's noise multiplier is calibrated again from the frozen config, and every trial
  that started must have a noise multiplier whose ledger is dominated by the reference trial's at every order the
  accountant reads (:meth:`dptrain.tuning.search.Search.dominated`): the search's certificate is computed from the
  reference trial, so a noise edited in the state (raised 1.89 -> 5.66 after a trial ran at 1.89: epsilon 0.83
  certified for a search whose trial alone spent more) would certify what did not run;
- **the trials' directories**: a trial marked done must have its directory, finished, holding the config the search
  gives it (:func:`check_trial_config`) and the search's mark of that trial (:func:`owner`: a secret token from the
  trial's key, kept in its checkpoint), so that a finished trial of another search, with the same config, is never
  taken for one of this search's.

What no check can tell: a trial's score edited in the state (it chooses the released trial by hand, as editing a
run's checkpoint changes its model). ``private/`` is the operator's; the checks hold a resume to what the search
started, against mistakes and mixed-up directories.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dptrain.config import RunConfig, changed_keys
from dptrain.errors import ConfigError, DataError, RunDirectoryError
from dptrain.randomness.generators import open_unit
from dptrain.randomness.streams import Stream
from dptrain.runs.resume import frozen_config
from dptrain.runs.rundir import PRIVATE, RunDirectory
from dptrain.tuning.release import TRIALS
from dptrain.tuning.space import draw

#: How far a kept noise multiplier may be from the one calibrated again: the calibration stops at a relative 1e-9,
#: and another machine or library version may land elsewhere within it (a change this small moves epsilon by as much).
RTOL = 1e-6


@dataclass
class Trial:
    """One trial of the search (secret until the search ends: only the selected one is released)."""

    index: int
    values: dict[str, Any]
    split_key: list[int]  # four secret words: the trial's own stream (its held-out split, then its score's noise)
    noise_multiplier: float | None = None
    status: str = "pending"  # pending | done | failed
    score: float | None = None  # the released (noisy) score; -inf for a failed trial
    not_private_because: list[str] = field(default_factory=list)  # the trial's own labels (empty: private)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def listed(self) -> dict:
        """What ``--keep-trials`` lists (not private): everything but the key of its stream."""
        return {k: v for k, v in self.__dict__.items() if k != "split_key"}

    def drawn(self) -> tuple:
        """What the search's origin decides of the trial (:func:`draw_trials`)."""
        return self.index, self.values, [int(w) for w in self.split_key]


@dataclass
class SearchState:
    """What a search keeps in ``private/search.pt`` (module docstring): the config it started with, the origin of
    its draws, the trials, the reference trial's noise, and once it has finished what it released (its summary and
    ledger: a resume prints those, and refuses edited copies)."""

    frozen: dict
    trials: list[Trial]
    reference_noise: float
    origin: dict | None  # (None: a finished search of an older dptrain, which only prints what it released)
    done: bool = False
    extra: dict = field(default_factory=dict)
    summary: dict | None = None
    ledger: dict | None = None

    def to_dict(self) -> dict:
        return {
            **self.frozen,
            "trials": [t.to_dict() for t in self.trials],
            "reference_noise": self.reference_noise,
            "origin": self.origin,
            "done": self.done,
            "extra": self.extra,
            "summary": self.summary,
            "ledger": self.ledger,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SearchState:
        kept = {k: d.get(k) for k in ("config", "config_sha256", "data_sha256")}
        return cls(kept, [Trial(**t) for t in d["trials"]], d["reference_noise"], d.get("origin"), d["done"],
                   d.get("extra", {}), d.get("summary"), d.get("ledger"))


def draw_trials(search, stream: Stream) -> list[Trial]:
    """K (by inversion of its distribution at a secret uniform number), then every trial's hyperparameters and the
    key of its own stream, all from ``stream`` (the search's "tuning" stream, from its origin)."""
    k = search.trials.draw(open_unit(stream))
    trials = []
    for i in range(k):
        values = draw(search.dims, stream.uniform((len(search.dims),), dtype=torch.float64).tolist())
        trials.append(Trial(i, values, [int(w) for w in stream.words(4)]))
    return trials


def trial_dir(path: Path, trial: Trial) -> Path:
    """Where a trial runs: inside the search's secret ``private/`` (its index is in the path)."""
    return Path(path) / PRIVATE / TRIALS / str(trial.index)


def owner(trial: Trial) -> str:
    """The search's mark on a trial's run, kept in its (secret) checkpoint: a hash of the trial's secret key, which no
    other trial of this or another search shares."""
    return "search:" + hashlib.sha256(repr([int(w) for w in trial.split_key]).encode()).hexdigest()


def check_trial_config(where: Path, cfg: RunConfig) -> dict:
    """The config a started trial's checkpoint keeps must be the one the search gives it (from the search's frozen
    config, the trial's secret draw and its noise): any difference is refused in one line listing the keys (its
    ``config.toml`` is held to the checkpoint's by the run's own resume, with nothing allowed to change). Returns the
    checkpoint."""
    state = RunDirectory(where).load_checkpoint()
    changed = changed_keys(cfg, frozen_config(state))
    if changed:
        raise ConfigError(
            f"the checkpoint of a trial in {where.parent} holds another config than the search gives it "
            f"({', '.join(changed)}): the search's private/ was edited or mixed with another search's; restore it"
        )
    return state


def _edited(what: str) -> DataError:
    return DataError(
        f"the search's private/search.pt {what} (edited, or from another search): a resume continues only the search "
        "that started; restore its private/ or start a new search"
    )


def check_resumed(search, state: SearchState, path: Path, stream: Stream) -> None:
    """Hold a resumed search's state to what its frozen config and its origin give (module docstring); ``stream`` is
    a "tuning" stream of the search's kind (its state is set to the origin here)."""
    try:
        stream.set_state(state.origin)
    except (ValueError, KeyError, TypeError, RuntimeError):
        raise _edited("holds no origin of its draws that its stream can take") from None
    if [t.drawn() for t in draw_trials(search, stream)] != [t.drawn() for t in state.trials]:
        raise _edited("lists other trials than its origin draws (deleted, added, reordered or changed)")
    reference = search.reference_noise()
    if not math.isclose(state.reference_noise, reference, rel_tol=RTOL):
        raise _edited(f"holds the reference noise multiplier {state.reference_noise:.6g}, its config gives "
                      f"{reference:.6g}")
    for trial in state.trials:
        if trial.noise_multiplier is None:  # (not started, or failed before: no noise made its trial as private)
            if trial.status == "done":
                raise _edited("marks a trial done that never started")
            continue
        if not search.dominated(trial.values, trial.noise_multiplier, state.reference_noise):
            raise _edited(f"holds a trial's noise multiplier {trial.noise_multiplier:.6g}, less than the search's "
                          "certificate allows it")
        if trial.status != "done":
            continue
        where = trial_dir(path, trial)
        if not where.is_dir():
            raise RunDirectoryError(
                f"a finished trial's directory is missing from {where.parent}: the search selects among its trials "
                "when all have run; restore the search's private/ or start a new search"
            )
        kept = check_trial_config(where, search.trial_config(trial.values, trial.noise_multiplier))
        if kept.get("owner") != owner(trial):
            raise RunDirectoryError(f"a trial in {where.parent} is not this search's (another search's trial, or "
                                    "another trial's directory, was put there): restore the search's private/")
        if not (isinstance(kept.get("summary"), dict) and kept["summary"].get("finished")):
            raise _edited("marks a trial done whose run has not finished")


__all__ = [
    "RTOL", "SearchState", "Trial", "check_resumed", "check_trial_config", "draw_trials", "owner",
    "trial_dir",
]
