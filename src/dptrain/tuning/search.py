"""``dptrain tune``: a random search whose whole is certified, not only its final run.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022): run a private trial K
times, K drawn from a distribution fixed in advance (:class:`dptrain.accounting.tuning.TrialCount`), each trial with
hyperparameters drawn independently of the data and fresh secret randomness, and release only the best trial (its
model, its hyperparameters and its score). If every trial is (lambda, eps(lambda))-RDP, the search is
(lambda, eps'(lambda))-RDP (their Thm 2 for a truncated negative binomial K, Thm 6 for a Poisson K): the ``rdp``
accountant certifies ``RepeatAndSelectDpEvent(trial, mean, shape)``.

What a trial is here (docs/tuning.md has the argument):

- **its hyperparameters** are drawn from the secret "tuning" stream (public distributions, independent of the
  data); a trial whose ledger differs from the reference trial's (another batch size, more epochs) gets the smallest
  noise multiplier whose RDP is at most the reference's at every order the accountant reads, so the reference
  trial's event bounds every trial (a data-independent mixture of mechanisms has at most the largest RDP);
- **its score** is, by default, a noisy count of correct predictions on a secret random validation part of the
  private data: each example is held out with probability ``validation_fraction`` (independently, per trial), held
  out examples contribute nothing to the trial's training (as an excluded audit canary: the training data set, its
  size and every rate stay those of the whole data), and the count gets N(0, score_noise^2) noise. A trial's ledger
  is its DP-SGD steps followed by that Gaussian release of sensitivity 1 (sequential composition; the split would
  allow the maximum of the two, which we do not claim). With ``validation_is_public = true`` the score is the test
  accuracy, on data the user declares public, and releases nothing;
- **K and the other trials stay secret**: K is never written to a shareable file (the command's JSON gives it under
  ``not_private``), the other trials' directories live in ``private/`` and are deleted at the end unless
  ``--keep-trials``.

The search directory: ``config.toml``, ``ledger.json`` (the search, one event), ``summary.json``, ``best/`` (the
selected trial's run directory, reportable and resumable like any run), ``private/`` (the search's state and the
trials: secret). Interrupting and resuming continues the same search: the same K, the same draws, each trial resumed
from its own checkpoint, never re-run with fresh randomness.
"""

from __future__ import annotations

import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.accounting import epsilon as ledger_epsilon
from dptrain.accounting.standard import _SMALL_ORDERS as SMALL_ORDERS
from dptrain.accounting.standard import RDP_ORDERS
from dptrain.accounting.tuning import (
    TrialCount,
    search_ledger,
    search_rdp,
    trial_noise_for_search,
    with_score_release,
)
from dptrain.config import RunConfig, config_to_toml
from dptrain.data.batches import call_model
from dptrain.errors import ConfigError, DPTrainError, RunDirectoryError
from dptrain.models.losses import logits_of
from dptrain.randomness.generators import Randomness
from dptrain.runs import run as run_module
from dptrain.runs.rundir import CONFIG, LEDGER, SUMMARY, RunDirectory
from dptrain.tuning.space import Dimension, draw, parse_space, with_values

STATE = "search.pt"
BEST = "best"


@dataclass
class Trial:
    """One trial of the search (secret until the search ends: only the selected one is released)."""

    index: int
    values: dict[str, Any]
    split_seed: int
    noise_multiplier: float | None = None
    status: str = "pending"  # pending | done | failed
    score: float | None = None  # the released (noisy) score; -inf for a failed trial

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SearchState:
    """What a search keeps in ``private/search.pt``: everything a resume needs to continue the same search."""

    entropy_state: dict
    trials: list[Trial]
    reference_noise: float
    rng_state: dict
    done: bool = False
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "entropy_state": self.entropy_state,
            "trials": [t.to_dict() for t in self.trials],
            "reference_noise": self.reference_noise,
            "rng_state": self.rng_state,
            "done": self.done,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SearchState:
        return cls(d["entropy_state"], [Trial(**t) for t in d["trials"]], d["reference_noise"], d["rng_state"],
                   d["done"], d.get("extra", {}))


class Search:
    """A search over ``cfg``'s ``[tune.space]`` at its privacy budget (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        if cfg.privacy.target_epsilon is None:
            raise ConfigError("dptrain tune needs privacy.target_epsilon: the budget of the whole search")
        self.cfg, self.tune = cfg, cfg.tune
        self.dims: list[Dimension] = parse_space(cfg)
        self.trials = TrialCount.named(self.tune.trials_mean, self.tune.distribution, mean_key="tune.trials_mean",
                                       distribution_key="tune.distribution")
        self.data = run_module.load_data(cfg)
        self.n = len(self.data.train)
        if self.tune.validation_is_public and not len(self.data.test):
            raise ConfigError("tune.validation_is_public = true scores trials on the test set, which is empty")
        self._reference_planner = self._planner({})
        self._reference_trial_cache: dict = {}

    # -- the privacy of one trial -----------------------------------------------------------------------------
    def trial_config(self, values: dict, sigma: float) -> RunConfig:
        """The config of a trial: the base config with the trial's values and the noise multiplier ``sigma`` (the
        search's budget is spent by the search, not by the trial)."""
        return with_values(self.cfg, {**values, "privacy.target_epsilon": None, "privacy.noise_multiplier": sigma})

    def _planner(self, values: dict):
        """sigma -> the ledger of one trial with ``values`` (its steps and its score's release)."""
        job = run_module.build_job(self.trial_config(values, 1.0), Randomness(0, warn=False), data=self.data)
        trainer, total = job.trainer, job.total_steps
        trainer.close()
        score_noise = None if self.tune.validation_is_public else self.tune.score_noise

        def ledger(sigma: float):
            steps = trainer.ledger_after(total, sigma)
            return steps if score_noise is None else with_score_release(steps, score_noise)

        return ledger

    def reference_noise(self) -> float:
        """The per-trial noise multiplier of the reference trial (the base config's values) with which the whole
        search meets (target_epsilon, delta)."""
        if "reference" not in self._reference_trial_cache:
            p = self.cfg.privacy
            cal = trial_noise_for_search(p.target_epsilon, p.delta, self._reference_planner, self.trials)
            self._reference_trial_cache["reference"] = cal.noise_multiplier
        return self._reference_trial_cache["reference"]

    def noise_for(self, values: dict, reference: float) -> float:
        """The smallest noise multiplier (to 1e-4, rounded up) whose trial with ``values`` has RDP at most the
        reference trial's at every order the rdp accountant reads: the reference trial's event then bounds this one.
        Bisected on the orders up to 768 (fast), then checked, and raised if need be, on all of them."""
        ref_ledger = self._reference_planner(reference)
        planner = self._planner(values)
        if planner(reference).dp_event() == ref_ledger.dp_event():
            return reference

        def dominated(orders):
            bound = search_rdp(ref_ledger, orders) * (1 + 1e-12)
            return lambda s: bool(np.all(search_rdp(planner(s), orders) <= bound))

        ok, ok_all = dominated(SMALL_ORDERS), dominated(RDP_ORDERS)
        hi = reference
        while not ok(hi):
            hi *= 1.5
            if hi > 1e6:
                raise ConfigError(f"no noise multiplier makes the trial {values} as private as the reference trial")
        lo = hi / 1.5
        while ok(lo):
            hi, lo = lo, lo / 1.5
            if lo < 1e-6:
                break
        while hi / lo > 1 + 1e-4:
            mid = math.sqrt(lo * hi)
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        while not ok_all(hi):
            hi *= 1 + 1e-3
        return hi

    def search_ledger(self, reference: float):
        return search_ledger(self._reference_planner(reference), self.trials)

    # -- one trial ----------------------------------------------------------------------------------------------
    def held_out(self, trial: Trial) -> torch.Tensor:
        """The trial's secret validation part: each training example independently with probability
        validation_fraction (from the trial's secret seed); empty when validation is public."""
        if self.tune.validation_is_public:
            return torch.zeros(self.n, dtype=torch.bool)
        g = torch.Generator().manual_seed(trial.split_seed)
        return torch.rand(self.n, generator=g, dtype=torch.float64) < self.tune.validation_fraction

    def hooks(self, trial: Trial, captured: dict) -> run_module.RunHooks:
        held = self.held_out(trial)

        def prepare(job) -> None:
            stage = job.trainer.per_example

            def per_example(idx: torch.Tensor):  # a held-out example contributes nothing to training
                yield from stage(idx[~held[idx.cpu()].to(idx.device)])

            job.trainer.per_example = per_example
            captured["job"] = job

        return run_module.RunHooks(data=self.data, prepare=prepare)

    @torch.no_grad()
    def score(self, trial: Trial, model: torch.nn.Module, device, rng: np.random.Generator) -> float:
        """The trial's released score: the test accuracy (public validation), or (correct held-out predictions +
        N(0, score_noise^2)) / (expected held-out count), a release of sensitivity 1 that its ledger records."""
        if self.tune.validation_is_public:
            from dptrain.engine.evaluation import accuracy, evaluation_source

            return accuracy(model, evaluation_source(self.data.test.x, self.data.test.y), device)
        held = self.held_out(trial).nonzero().squeeze(1)
        model.eval()
        correct = 0
        for chunk in held.split(1024):
            x, y = self.data.train.x[chunk].to(device), self.data.train.y[chunk].to(device)
            correct += int((logits_of(call_model(model, x)).argmax(-1) == y).sum())
        noisy = correct + float(rng.normal(0.0, self.tune.score_noise))
        return noisy / (self.tune.validation_fraction * self.n)


def _trial_dir(rd: RunDirectory, trial: Trial) -> Path:
    return rd.path / "private" / "trials" / str(trial.index)


def _rng(state: dict) -> np.random.Generator:
    g = np.random.default_rng(0)
    g.bit_generator.state = state
    return g


def start_state(search: Search, randomness: Randomness) -> SearchState:
    """The search's secret draws: K, every trial's hyperparameters and split seed, from the "tuning" stream."""
    words = randomness.stream("tuning").words(4)
    rng = np.random.default_rng([int(w) for w in words])
    k = search.trials.draw(rng)
    trials = [
        Trial(i, draw(search.dims, rng.random(len(search.dims))), int(rng.integers(0, 2**63 - 1)))
        for i in range(k)
    ]
    return SearchState({}, trials, search.reference_noise(), rng.bit_generator.state)


def run_search(cfg: RunConfig | None, out: str | Path, *, resume: bool = False, progress: bool = True,
               keep_trials: bool = False) -> dict:
    """Run (or resume) the search of ``cfg`` in ``out``; returns its summary (module docstring)."""
    rd = RunDirectory(out)
    with rd.locked(create=not resume):
        if resume:
            if not (rd / CONFIG).exists():
                raise RunDirectoryError(f"{rd.path} holds no search to resume")
            previous = rd.read_json(SUMMARY)
            if previous is not None:
                print(f"dptrain: the search in {rd.path} has finished; nothing to resume", file=sys.stderr)
                return previous
            cfg = run_module.load_config(rd / CONFIG)
            search = Search(cfg)
            state = SearchState.from_dict(rd.load_private(STATE))
        else:
            if rd.holds_run() or (rd.path / "private" / STATE).exists():
                raise RunDirectoryError(f"output directory {rd.path} already holds a run; choose another --out")
            search = Search(cfg)
            state = start_state(search, run_module.run_randomness(cfg))
            rd.save_private(STATE, state.to_dict())
            rd.write_text(CONFIG, config_to_toml(cfg))
        return _run(search, state, rd, progress, keep_trials)


def _run(search: Search, state: SearchState, rd: RunDirectory, progress: bool, keep_trials: bool) -> dict:
    from tqdm import tqdm

    rng = _rng(state.rng_state)
    bar = tqdm(desc="trials", unit="trial", disable=not progress, initial=sum(t.status != "pending" for t in state.trials))
    try:
        for trial in state.trials:
            if trial.status != "pending":
                continue
            _one_trial(search, state, trial, rd, rng)
            state.rng_state = rng.bit_generator.state
            rd.save_private(STATE, state.to_dict())
            bar.update(1)
    finally:
        bar.close()
    return _finish(search, state, rd, keep_trials)


def _one_trial(search: Search, state: SearchState, trial: Trial, rd: RunDirectory, rng) -> None:
    """Train and score one trial; a trial that fails (a non-finite loss, a config its draw made illegal) is recorded
    with the worst score, never retried."""
    where = _trial_dir(rd, trial)
    captured: dict = {}
    try:
        if trial.noise_multiplier is None:
            trial.noise_multiplier = search.noise_for(trial.values, state.reference_noise)
            rd.save_private(STATE, state.to_dict())
        cfg = search.trial_config(trial.values, trial.noise_multiplier)
        hooks = search.hooks(trial, captured)
        resuming = RunDirectory(where).checkpoint.exists()
        where.parent.mkdir(parents=True, exist_ok=True)
        run_module.run_training(None if resuming else cfg, where, resume=resuming, progress=False, hooks=hooks)
        job = captured.get("job") or _finished_job(search, cfg, where)
        trial.score = search.score(trial, job.trainer.model, job.trainer.device, rng)
        trial.status = "done"
    except DPTrainError as e:
        trial.status, trial.score = "failed", -math.inf
        state.extra.setdefault("failures", {})[str(trial.index)] = str(e)


def _finished_job(search: Search, cfg: RunConfig, where: Path):
    """The job of a trial that finished training before an interruption: its released model from the checkpoint."""
    job = run_module.build_job(cfg, Randomness(0, warn=False), data=search.data)
    job.trainer.model.load_state_dict(RunDirectory(where).load_checkpoint()["model"])
    return job


def _finish(search: Search, state: SearchState, rd: RunDirectory, keep_trials: bool) -> dict:
    cfg = search.cfg
    ledger = search.search_ledger(state.reference_noise)
    ledger.private = cfg.seed is None
    report = ledger_epsilon(ledger, cfg.privacy.delta, "auto")
    single = ledger_epsilon(search._reference_planner(state.reference_noise), cfg.privacy.delta, "auto")
    scored = [t for t in state.trials if t.status == "done"]
    best = max(scored, key=lambda t: t.score) if scored else None
    out = None
    if best is not None:
        target = rd.path / BEST
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(_trial_dir(rd, best), target)
        out = str(target)
    summary = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "certified": bool(report.certified and ledger.private),
        "private": ledger.private,
        "accountant": report.accountant,
        "epsilon_single_run": single.epsilon,
        "single_run_accountant": single.accountant,
        **search.trials.to_dict(),
        "best": best.values if best else None,
        "best_score": best.score if best else None,
        "best_noise_multiplier": best.noise_multiplier if best else None,
        "score": "test accuracy (public)" if search.tune.validation_is_public else
        f"noisy held-out accuracy (noise std {search.tune.score_noise:g} examples)",
        "out": out,
        "not_private": {"trials_run": len(state.trials), "note": "secret: revealing the number of trials voids the "
                        "search's certificate (Papernot & Steinke's theorems assume it is not released)"},
    }
    if keep_trials:
        summary["not_private"]["trials"] = [t.to_dict() for t in state.trials]
    elif (rd.path / "private" / "trials").exists():
        shutil.rmtree(rd.path / "private" / "trials")
    if best is not None:
        best_rd = RunDirectory(rd.path / BEST)
        best_summary = best_rd.read_json(SUMMARY) or {}
        best_summary["search"] = {k: summary[k] for k in ("epsilon", "delta", "certified", "accountant")}
        best_summary["search"]["note"] = "this run was selected by a private search: its certificate is the search's"
        best_rd.write_json(SUMMARY, best_summary)
    state.done = True
    rd.save_private(STATE, state.to_dict())
    rd.write_json(LEDGER, ledger.to_dict())
    public = {k: v for k, v in summary.items() if k != "not_private"}  # K stays out of the shareable files
    rd.write_json(SUMMARY, public)
    return summary


__all__ = ["Search", "run_search"]
