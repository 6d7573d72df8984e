"""``dptrain tune``: a random search whose whole is certified, not only its final run.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022): run a private trial K
times, K drawn from a distribution fixed in advance (:class:`dptrain.accounting.tuning.TrialCount`), each trial with
hyperparameters drawn independently of the data and fresh secret randomness, and release only the best trial (its
model, its hyperparameters and its score). If every trial is (lambda, eps(lambda))-RDP, the search is
(lambda, eps'(lambda))-RDP (their Thm 2 for a truncated negative binomial K, Thm 6 for a Poisson K): the ``rdp``
accountant certifies ``RepeatAndSelectDpEvent(trial, mean, shape)``.

What a trial is here (docs/tuning.md has the argument):

- **its hyperparameters** are drawn from the secret "tuning" stream (public distributions, independent of the
  data), like K and a key per trial, whose own stream draws its held-out split and then its score's noise
  (AES-256-CTR with ``privacy.secure_noise``); a resume draws them again from their origin and holds the search's
  state to them (:mod:`dptrain.tuning.state`); a trial whose ledger differs from the reference trial's (another
  batch size, more epochs) gets the smallest
  noise multiplier whose RDP is at most the reference's at every order the accountant reads, so the reference
  trial's event bounds every trial (a data-independent mixture of mechanisms has at most the largest RDP);
- **its score** is, by default, a noisy count of correct predictions on a secret random validation part of the
  private data: each example is held out with probability ``validation_fraction`` (independently, per trial), held
  out examples contribute nothing to the trial's training (as an excluded audit canary: the training data set, its
  size and every rate stay those of the whole data), and the count gets N(0, score_noise^2) noise. A trial's ledger
  is its DP-SGD steps followed by that Gaussian release of sensitivity 1 (sequential composition; the split would
  allow the maximum of the two, which we do not claim). With ``validation_is_public = true`` the score is the test
  accuracy, on data the user declares public, and releases nothing;
- **K and the other trials stay secret**: nothing shareable depends on K or on the best trial's index
  (:mod:`dptrain.tuning.release`: no private path, no trial count, no file time that dates the trials; a clock, not a
  trial count, on stderr, and each trial's own messages captured: :mod:`dptrain.tuning.quiet`). The other trials'
  directories live in ``private/`` and are deleted at the end unless ``--keep-trials`` (which also lists them, and K,
  in the command's output, labelled not private).
- **the search is private only if every trial is**: a trial labelled not private (seeded, buffers released unnoised)
  makes the search not private, and not certified.

The search directory: ``config.toml``, ``ledger.json`` (the search, one event), ``summary.json``, ``best/`` (the
selected trial's released files, without its secret state), ``private/`` (the search's state and the trials:
secret). The search's config and a fingerprint of its data are frozen in its state when it starts, by the run's own
mechanism (:mod:`dptrain.runs.resume`): ``dptrain tune --resume`` refuses any change in one line listing the keys
(the seed included; nothing may change, :data:`~dptrain.runs.resume.SEARCH_MAY_CHANGE`), and so does a trial's resume
(a trial is a run owned by its search, ``RunHooks.part_of``: ``dptrain train`` refuses it, and the search's
directory). Interrupting and resuming continues the same search: the same K, the same draws, each
trial resumed from its own checkpoint, never re-run with fresh randomness.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch

from dptrain.accounting import Ledger
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
from dptrain.data.datasets import fingerprint
from dptrain.engine.distributed import one_process
from dptrain.engine.evaluation import example_scores
from dptrain.engine.interrupts import Terminated
from dptrain.errors import AccountingError, ConfigError, DPTrainError, RunDirectoryError
from dptrain.randomness.generators import SEEDED_WARNING, Randomness, keyed_stream
from dptrain.randomness.streams import Stream
from dptrain.runs import job as job_module
from dptrain.runs import run as run_module
from dptrain.runs.resume import (
    SEARCH_MAY_CHANGE,
    check_data,
    frozen,
    frozen_config,
    refuse_given_config,
    resumed_config,
)
from dptrain.runs.rundir import CONFIG, PRIVATE, SEARCH_STATE, RunDirectory
from dptrain.tuning.quiet import Elapsed, captured
from dptrain.tuning.release import TRIALS, finished, publish, summarize
from dptrain.tuning.space import Dimension, parse_space, with_values
from dptrain.tuning.state import (
    SearchState,
    Trial,
    check_resumed,
    check_trial_config,
    draw_trials,
    owner,
    trial_dir,
)

STATE = SEARCH_STATE


class NotCovered(AccountingError):
    """A trial recorded releases its search's certificate does not cover (:meth:`Search.check_covered`)."""


class Search:
    """A search over ``cfg``'s ``[tune.space]`` at its privacy budget (see the module docstring)."""

    def __init__(self, cfg: RunConfig):
        if cfg.privacy.target_epsilon is None:
            raise ConfigError("dptrain tune needs privacy.target_epsilon: the budget of the whole search")
        if cfg.training.algorithm != "dpsgd":
            # a trial runs at the noise multiplier the search gives it: DP-SGD's privacy.noise_multiplier
            raise ConfigError(
                f'dptrain tune searches DP-SGD trials (training.algorithm = "dpsgd"), not {cfg.training.algorithm!r}, '
                "whose noise is not set by privacy.noise_multiplier: train it with dptrain train"
            )
        if cfg.noise.mechanism == "bandmf" and cfg.noise.bands in (None, "auto"):
            # a trial runs at the noise multiplier the search gives it, with no budget of its own to choose b for
            raise ConfigError(
                'dptrain tune with noise.mechanism = "bandmf" needs noise.bands = B (an integer; [tune.space] may '
                'vary it): bands = "auto" chooses b for one run\'s budget, and a trial\'s noise is set by the search'
            )
        self.cfg, self.tune = cfg, cfg.tune
        self.dims: list[Dimension] = parse_space(cfg)
        self.trials = TrialCount.named(self.tune.trials_mean, self.tune.distribution, mean_key="tune.trials_mean",
                                       distribution_key="tune.distribution")
        self.data = job_module.load_data(cfg)
        self.n = len(self.data.train)
        if self.tune.validation_is_public and not job_module.test_is_public(cfg, self.data):
            raise ConfigError(
                "tune.validation_is_public = true selects trials on the test set, which here is split off the private "
                "training examples: score on a secret held-out part instead (validation_is_public = false), or give a "
                "test set that is public (a separate test file, or data.test_is_public = true for one that is)"
            )
        if self.tune.validation_is_public and not len(self.data.test):
            raise ConfigError("tune.validation_is_public = true scores trials on the test set, which is empty")
        self._last_plan: tuple = (None, None)
        self._reference_planner = self._planner({})
        self._reference_trial_cache: dict = {}

    # -- the privacy of one trial -----------------------------------------------------------------------------
    def trial_config(self, values: dict, sigma: float) -> RunConfig:
        """The config of a trial: the base config with the trial's values and the noise multiplier ``sigma`` (the
        search's budget is spent by the search, not by the trial)."""
        return with_values(self.cfg, {**values, "privacy.target_epsilon": None, "privacy.noise_multiplier": sigma})

    def _planner(self, values: dict):
        """sigma -> the ledger of one trial with ``values`` (its steps and its score's release). What building a
        trial's job says (a stage's warning about the config) is said once, for the reference trial, when the search
        is made; for any other trial it is dropped (the trial's own run says it again, captured with its messages):
        a line per trial, wherever the search plans one (a resume checks every started trial), would count them."""
        key = repr(sorted(values.items()))
        if self._last_plan[0] == key:  # (one trial's plan, built once for its noise and its checks: one model kept)
            return self._last_plan[1]
        # (never trained: the model's probe runs when the trial itself is built)
        with contextlib.nullcontext() if not values else captured([]):
            job = job_module.build_job(self.trial_config(values, 1.0), Randomness(0, warn=False), data=self.data,
                                       checks=False)
        trainer, total = job.trainer, job.total_steps
        trainer.close()
        score_noise = None if self.tune.validation_is_public else self.tune.score_noise

        def ledger(sigma: float):
            steps = trainer.ledger_after(total, sigma)
            return steps if score_noise is None else with_score_release(steps, score_noise)

        self._last_plan = (key, ledger)
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
        ok = self._dominated_by(ref_ledger, planner, SMALL_ORDERS)
        ok_all = self._dominated_by(ref_ledger, planner, RDP_ORDERS)
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

    def dominated(self, values: dict, sigma: float, reference: float) -> bool:
        """Whether the trial with ``values`` at noise ``sigma`` has RDP at most the reference trial's (at noise
        ``reference``) at every order the rdp accountant reads: what :meth:`noise_for` guarantees, and what a resume
        holds every started trial to (:func:`dptrain.tuning.state.check_resumed`)."""
        ref_ledger = self._reference_planner(reference)
        planner = self._planner(values)
        if planner(sigma).dp_event() == ref_ledger.dp_event():
            return True
        return self._dominated_by(ref_ledger, planner, RDP_ORDERS)(sigma)

    @staticmethod
    def _dominated_by(ref_ledger, planner, orders):
        bound = search_rdp(ref_ledger, orders) * (1 + 1e-12)
        return lambda s: bool(np.all(search_rdp(planner(s), orders) <= bound))

    def check_covered(self, trial: Trial, ledger: Ledger) -> None:
        """What a trial's run recorded (``ledger``, then its score's release) must be what the search planned for it
        (:meth:`_planner` at its noise), whose RDP the reference trial's bounds: the search's certificate is built
        from the plans, so a release a trial recorded beyond its plan (a stage that spends at run time, a step
        recorded at another noise) would not be covered. Refused in one line (the search releases nothing), never
        taken for a failed trial."""
        actual = ledger if self.tune.validation_is_public else with_score_release(ledger, self.tune.score_noise)
        if actual.dp_event() != self._planner(trial.values)(trial.noise_multiplier).dp_event():
            raise NotCovered(
                "a trial recorded other releases than the search planned for it (its ledger differs from the plan its "
                "noise was chosen for): the search's certificate would not cover it, and nothing is released"
            )

    def search_ledger(self, reference: float):
        return search_ledger(self._reference_planner(reference), self.trials)

    # -- one trial ----------------------------------------------------------------------------------------------
    def trial_stream(self, trial: Trial) -> Stream:
        """The trial's own secret stream, keyed by the four words drawn for it at the search's start (AES-256-CTR with
        privacy.secure_noise): first its held-out split, then its score's noise. Each is a function of the trial's key
        alone, so a trial scored again after an interruption releases the same score, never a second draw."""
        return keyed_stream(trial.split_key, self.cfg.privacy.secure_noise)

    def held_out(self, trial: Trial, stream: Stream | None = None) -> torch.Tensor:
        """The trial's secret validation part: each training example independently with probability
        validation_fraction (the first draws of the trial's stream); empty when validation is public."""
        if self.tune.validation_is_public:
            return torch.zeros(self.n, dtype=torch.bool)
        stream = self.trial_stream(trial) if stream is None else stream
        return stream.uniform((self.n,), dtype=torch.float64) < self.tune.validation_fraction

    def hooks(self, trial: Trial, captured_job: dict) -> run_module.RunHooks:
        held = self.held_out(trial)

        def prepare(job) -> None:
            stage = job.trainer.per_example

            def per_example(idx: torch.Tensor):  # a held-out example contributes nothing to training
                yield from stage(idx[~held[idx.cpu()].to(idx.device)])

            job.trainer.per_example = per_example
            captured_job["job"] = job

        return run_module.RunHooks(data=self.data, prepare=prepare, part_of="search", owner=owner(trial),
                                   may_change=SEARCH_MAY_CHANGE)

    @torch.no_grad()
    def score(self, trial: Trial, job) -> float:
        """The trial's released score: its test accuracy as its run reports it (public validation), or (the held-out
        examples' correct predictions + N(0, score_noise^2)) / (expected held-out count), a release of sensitivity 1
        that its ledger records, the noise drawn from the trial's own stream after its split (:meth:`trial_stream`). An
        example counts its share of correct predictions, in [0, 1] (of its tokens, for a sequence:
        :func:`~dptrain.engine.evaluation.example_scores`), so one example moves the sum by at most 1 whatever the task; the sum and its noise are kept
        in float64 (float32 would round a sum of shares by more than that). The examples are read as the trial's
        training read them (the trainer's own source: a preprocessing stage's transform applied, memory-mapped or
        text data alike)."""
        if self.tune.validation_is_public:
            return float(job.evaluate())
        stream = self.trial_stream(trial)
        held = self.held_out(trial, stream).nonzero().squeeze(1)
        trainer = job.trainer
        correct = float(example_scores(trainer.model, trainer.data, held, trainer.device,
                                       loss_fn=trainer.loss_fn).sum())
        noisy = float(stream.add_gaussian(torch.tensor([correct], dtype=torch.float64), self.tune.score_noise)[0])
        return noisy / (self.tune.validation_fraction * self.n)


def start_state(search: Search, randomness: Randomness) -> SearchState:
    """The search's secret draws, all from the "tuning" stream (:func:`~dptrain.tuning.state.draw_trials`), and the
    stream's state before them, the origin a resume draws them again from."""
    stream = randomness.stream("tuning")
    origin = stream.get_state()
    trials = draw_trials(search, stream)
    text = config_to_toml(search.cfg)
    return SearchState(frozen(text, fingerprint(search.data)), trials, search.reference_noise(), origin)


def run_search(cfg: RunConfig | None, out: str | Path, *, resume: bool = False, progress: bool = True,
               keep_trials: bool = False) -> dict:
    """Run (or resume) the search of ``cfg`` in ``out``; returns its summary (module docstring), with K and every
    trial under ``not_private`` only if ``keep_trials``."""
    one_process("a search")  # (each rank would draw its own number of trials)
    rd = RunDirectory(out)
    with rd.locked(create=not resume):
        if resume:
            refuse_given_config(cfg, "search")
            saved = _saved_state(rd)
            resumed_config(rd, saved, SEARCH_MAY_CHANGE)  # (any change of config.toml refused, in value or type)
            cfg = frozen_config(saved)  # the search goes on with the config it started with, exactly
            state = SearchState.from_dict(saved)
            if state.done:
                summary = finished(state, rd, keep_trials)  # (an edited summary.json or ledger.json: refused)
                _announce_seed(cfg)
                print(f"dptrain: the search in {rd.path} has finished; nothing to resume", file=sys.stderr)
                return summary
            search = Search(cfg)
            check_data(saved, fingerprint(search.data))
            # (nothing the state holds that the search can recompute is trusted: its draws, its noise, its trials)
            check_resumed(search, state, rd.path, job_module.run_randomness(cfg).stream("tuning"))
        else:
            if rd.holds_run() or (rd.path / PRIVATE / STATE).exists():
                raise RunDirectoryError(f"output directory {rd.path} already holds a run; choose another --out")
            search = Search(cfg)
            state = start_state(search, job_module.run_randomness(cfg))
            rd.save_private(STATE, state.to_dict())  # (first: the frozen config, as a run's step-0 checkpoint)
            rd.write_text(CONFIG, state.frozen["config"])
        _announce_seed(cfg)
        _run(search, state, rd, progress)
        if state.summary is None:  # what the search releases, kept in its secret state before any file is written
            state.summary, state.ledger, state.extra["best_index"] = summarize(search, state, rd)
            state.done = True
            rd.save_private(STATE, state.to_dict())
        return publish(state, rd, keep_trials)


def _saved_state(rd: RunDirectory) -> dict:
    if not (rd.path / PRIVATE / STATE).exists():
        raise RunDirectoryError(f"{rd.path} holds no search to resume")
    saved = rd.load_private(STATE)
    if not isinstance(saved, dict) or "config" not in saved or ("origin" not in saved and not saved.get("done")):
        raise RunDirectoryError(
            f"the search in {rd.path} was started by an older dptrain, whose state does not keep the config it started "
            "with and the origin of its draws: start the search again in a new directory"
        )
    return saved


def _announce_seed(cfg: RunConfig) -> None:
    """One warning line for the whole search (its trials' own lines are captured: one per trial would count them)."""
    if cfg.seed is not None:
        print(f"dptrain: warning: seed = {cfg.seed}: {SEEDED_WARNING}", file=sys.stderr)


def _run(search: Search, state: SearchState, rd: RunDirectory, progress: bool) -> None:
    """Every pending trial, each with its messages captured, under a clock (never a trial count) on stderr; an
    interruption says how to continue the search, not the trial."""
    try:
        with Elapsed("dptrain tune: searching (the number of trials is secret)", enabled=progress):
            for trial in state.trials:
                if trial.status != "pending":
                    continue
                messages: list[str] = []
                try:
                    with captured(messages):
                        _one_trial(search, state, trial, rd)
                finally:
                    if messages:
                        state.extra.setdefault("messages", {}).setdefault(str(trial.index), []).extend(messages)
                rd.save_private(STATE, state.to_dict())
    except (KeyboardInterrupt, Terminated):
        rd.save_private(STATE, state.to_dict())
        print(f"\ninterrupted; continue the same search with: dptrain tune --resume {rd.path}", file=sys.stderr)
        raise


def _one_trial(search: Search, state: SearchState, trial: Trial, rd: RunDirectory) -> None:
    """Train and score one trial; a trial that fails (a non-finite loss, a config its draw made illegal) is recorded
    with the worst score, never retried. A trial that had started is resumed from its checkpoint with exactly the
    config the search gives it (:func:`~dptrain.tuning.state.check_trial_config`), and whatever its resume refuses (an edited config, ledger or
    summary, other data) refuses the search's resume: it is no failure of the trial. The trial's own not-private
    labels are kept (the search's flag reads them)."""
    where = trial_dir(rd.path, trial)
    job_of: dict = {}
    summary: dict = {}
    resuming = RunDirectory(where).checkpoint.exists()
    if trial.noise_multiplier is not None and not where.is_dir():  # (its directory is made before it is marked started)
        raise RunDirectoryError(
            f"a started trial's directory is missing from {where.parent}: a search runs each trial once (run again with "
            "fresh randomness, it would select among more trials than its certificate counts); restore the search's "
            "private/ or start a new search"
        )
    try:
        if trial.noise_multiplier is None:
            where.mkdir(parents=True, exist_ok=True)
            trial.noise_multiplier = search.noise_for(trial.values, state.reference_noise)
            rd.save_private(STATE, state.to_dict())
        cfg = search.trial_config(trial.values, trial.noise_multiplier)
        hooks = search.hooks(trial, job_of)
        if resuming:
            check_trial_config(where, cfg)
        where.parent.mkdir(parents=True, exist_ok=True)
        summary = run_module.run_training(None if resuming else cfg, where, resume=resuming, progress=False,
                                          hooks=hooks)
        job = job_of.get("job") or _finished_job(search, cfg, where)
        search.check_covered(trial, job.trainer.ledger)
        trial.score = search.score(trial, job)
        trial.status = "done"
    except DPTrainError as e:
        if isinstance(e, NotCovered) or (resuming and "job" not in job_of):  # (refused: not a failed trial)
            raise unnamed(e) from None
        trial.status, trial.score = "failed", -math.inf
        state.extra.setdefault("failures", {})[str(trial.index)] = str(e)
    finally:
        if "job" in job_of:  # (built and trained here: its trainer's labels, seeded or buffers released)
            trial.not_private_because = list(job_of["job"].trainer.not_private_reasons)
        elif summary:  # (finished before an interruption: its kept summary's)
            trial.not_private_because = list(summary.get("not_private_because", []))


def unnamed(error: DPTrainError) -> DPTrainError:
    """``error`` with every trial's directory in its message named without its index (``private/trials/<a trial>``):
    a search's messages on stderr never bound the secret number of trials, a refusal included."""
    text = re.sub(rf"({re.escape(PRIVATE)}{re.escape(os.sep)}{TRIALS}{re.escape(os.sep)})\d+", r"\1<a trial>",
                  str(error))
    return type(error)(text)


def _finished_job(search: Search, cfg: RunConfig, where: Path):
    """The job of a trial that finished training before an interruption: its released model from the checkpoint, its
    stages' releases (a private mean) the ones it made, never made again."""
    state = RunDirectory(where).load_checkpoint()
    job = job_module.build_job(cfg, Randomness(0, warn=False), data=search.data, ledger=Ledger.from_dict(state["ledger"]),
                               accountant=state["accountant"], resumed=dict(state.get("released_content") or {}))
    job.trainer.model.load_state_dict(state["model"])
    return job


__all__ = ["NotCovered", "Search", "SearchState", "Trial", "run_search", "start_state", "trial_dir", "unnamed"]
