"""A training job from a typed config: the Python function behind ``dptrain train``.

One pipeline for every algorithm (docs/architecture.md): the config names the algorithm (``training.algorithm``:
``dpsgd``, or one a package registers, like ``projected_noisy_sgd``) and the stages (registered config sections,
like DPSGD-F's ``[preprocessing]``); the algorithm's builder returns a :class:`Job` around a
:class:`~dptrain.engine.trainer.PrivateTrainer`, and one loop trains it, evaluates, checkpoints and writes one summary. The
trainer's release policy decides what the loop may show: every iterate (DP-SGD) or only the last one.

The run directory's files and who may write them are described in :mod:`dptrain.runs.rundir`: shareable outputs
(config, metrics, ledger, summary, model) at the top, the secret checkpoint in ``private/``, one run at a time
under a lock. A step is atomic (:mod:`dptrain.engine.interrupts`); Ctrl-C and SIGTERM checkpoint at the next step
boundary and stop, and ``resume=True`` continues into the same run an uninterrupted job would have produced.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dptrain.accounting import AUTO, Ledger, all_reports
from dptrain.accounting.membership import compact, membership_inference, no_profile
from dptrain.config import (
    RunConfig,
    load_config,
)
from dptrain.data.datasets import fingerprint
from dptrain.data.loaders import DataSplit
from dptrain.engine import distributed
from dptrain.engine.bandmf import noise_summary
from dptrain.engine.interrupts import Terminated, deferred_signals, terminate_as_exception
from dptrain.engine.trainer import StepResult
from dptrain.errors import AccountingError, ConfigError, NonFiniteError, RunDirectoryError
from dptrain.preflight.sentinel import SentinelError
from dptrain.runs.averaged import evaluate_averaged, save_averaged
from dptrain.runs.job import (
    Job,
    _announce_seed,
    build_job,
    load_data,
    run_randomness,
)
from dptrain.runs.progress import step_bar
from dptrain.runs.resume import (
    RESUME_MAY_CHANGE,
    check_data,
    check_records,
    check_step_change,
    finished_summary,
    frozen,
    refuse_given_config,
    released_files,
    resumed_config,
)
from dptrain.runs.rundir import CONFIG, PLAN, SUMMARY, RunDirectory

#: Wall-clock seconds between checkpoints when evaluations are further apart (bounds what kill -9 can lose).
CHECKPOINT_INTERVAL_S = 300.0


class _Progress:
    """tqdm progress bar showing steps and epsilon spent (and the training loss, labelled not private, only when
    the config asks for non-private statistics)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = step_bar(total, initial, enabled)  # (no time: tests/test_clock_not_released.py)
        self.loss = math.nan
        self.postfix: dict[str, str] = {}

    def update(self, result: StepResult | None, eps: float | None) -> None:
        self.postfix = {} if eps is None else {"eps": f"{eps:.3f}"}
        loss = (result.not_private or {}).get("train_loss") if result is not None else None
        if loss is not None:
            self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
            self.postfix["loss (not private)"] = f"{self.loss:.3f}"
        if self.postfix:
            self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def show_epsilon(self, eps: float) -> None:
        """The epsilon after the last step (:meth:`update` is given the last evaluation's: at the end it would
        show a value some steps old)."""
        self.postfix["eps"] = f"{eps:.3f}"
        self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        self.bar.close()


@dataclass
class RunHooks:
    """What a command running jobs inside its own (a tuning search) adds to each: the data, already loaded, a
    function called with the built job before it trains (e.g. to hold some examples out of its per-example stage),
    the name of the owner kept in the run's checkpoints (a run started by an owner is resumed only by it, and a run of
    its own never by an owner), the owner's secret mark on this run (kept in its checkpoints and required on resume:
    a run of the same kind made by another owner, say another search's trial with the same config, is not this one),
    and the config keys a resume may change (an owner may allow none)."""

    data: DataSplit | None = None
    prepare: Callable[[Job], None] | None = None
    part_of: str | None = None
    owner: str | None = None
    may_change: tuple[str, ...] = RESUME_MAY_CHANGE

    def ready(self, job: Job) -> Job:
        if self.prepare is not None:
            self.prepare(job)
        return job


def run_training(
    cfg: RunConfig | None,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    plan: dict | None = None,
    hooks: RunHooks | None = None,
) -> dict:
    """Run (or resume) a job; returns the summary. ``hooks`` (:class:`RunHooks`): another command's run inside its own
    (a tuning search's trial). ``stop_after`` ends this invocation after that many steps with a
    checkpoint (for time-sliced jobs); ``resume`` continues the run stored in ``out`` with the config it started with
    (:func:`resumed_config`: a resume may not change what the run releases or certifies); ``plan`` (from ``dptrain
    plan``) is checked against the data (its guarantee holds only for the data set size it was made for) and
    recorded in the run directory."""
    rd = RunDirectory(out)
    group = distributed.from_environment(cfg.training.device if cfg is not None else "auto")
    main = group is None or group.main
    if not main:  # rank 0 alone writes the run directory
        rd, progress = distributed.FollowerDirectory(rd), False
    hooks = hooks or RunHooks()
    if resume:
        refuse_given_config(cfg)
        return _resume(rd, progress, stop_after, main, hooks)
    if cfg is None:
        raise ConfigError("a config is needed to start a run")
    rd.refuse_if_holding()  # early, before the work of building the job
    return _start(cfg, rd, progress, stop_after, plan, main, hooks)


def _start(
    cfg: RunConfig,
    rd: RunDirectory,
    progress: bool,
    stop_after: int | None,
    plan: dict | None,
    main: bool,
    hooks: RunHooks,
    holding_lock: bool = False,
) -> dict:
    """A new run in ``rd``: the job, then (holding the lock) a checkpoint at step 0 before any other file, so that the
    directory is resumable from its first moment, then the config and the stages' released files, then training."""
    start = time.perf_counter()
    data = load_data(cfg, progress and main) if hooks.data is None else hooks.data
    job = hooks.ready(build_job(cfg, run_randomness(cfg), data=data))
    job.data_sha256, job.part_of, job.owner = fingerprint(data), hooks.part_of, hooks.owner
    _agree(job)
    if plan is not None and int(plan.get("dataset_size", -1)) != len(job.data.train):
        raise ConfigError(
            f"the plan was made for a data set of {plan.get('dataset_size')} examples, but the training set has "
            f"{len(job.data.train)}; plan again with --dataset-size {len(job.data.train)}"
        )
    with contextlib.nullcontext(rd) if holding_lock else rd.locked(create=True):
        rd.refuse_if_holding()  # authoritative: under the lock
        if main and rd.discard_unreleased():
            print(
                f"dptrain: {rd.path} held a run that stopped before its first step (nothing was released); "
                "starting afresh",
                file=sys.stderr,
            )
        _checkpoint(rd, job, 0.0)
        rd.write_text(CONFIG, job.frozen_config)
        _announce_seed(cfg)
        if plan is not None:
            rd.write_json(PLAN, plan)
        for name, content in job.released.items():  # released statistics (a private mean, ...): shareable
            rd.write_json(name, content)
        return _train(job, rd, progress, stop_after, elapsed=0.0, start=start)


def _resume(rd: RunDirectory, progress: bool, stop_after: int | None, main: bool, hooks: RunHooks) -> dict:
    with rd.locked():
        rd.refuse_search()  # (a search's directory: dptrain tune --resume)
        if not rd.checkpoint.exists() and not rd.released_anything():
            if not (rd / CONFIG).exists():
                raise RunDirectoryError(
                    f"{rd.path} holds no run to resume; start one there with dptrain train --config FILE --out {rd.path}"
                )
            # Stopped before its first checkpoint (by an older dptrain, or killed within its first moments): nothing
            # was released, so the run starts afresh from its config, as a run of 0 steps would continue.
            return _start(load_config(rd / CONFIG), rd, progress, stop_after, rd.read_json(PLAN), main, hooks, True)
        start = time.perf_counter()
        state = rd.load_checkpoint()
        _check_owner(rd, state, hooks)
        ledger = Ledger.from_dict(state["ledger"])
        rd.check_ledger_copy(ledger)
        # Every file the run released is held to its checkpoint's copy, finished or not: a finished run may change
        # nothing (its config.toml says what ran), and its report is the checkpoint's summary.
        finished = isinstance(state.get("summary"), dict) and bool(state["summary"].get("finished"))
        cfg, changed = resumed_config(rd, state, () if finished else hooks.may_change)
        resumed = released_files(rd, state)
        previous = finished_summary(rd, state)
        if previous is not None:
            print(f"dptrain: the run in {rd.path} has finished; nothing to resume", file=sys.stderr)
            return previous
        data = load_data(cfg, progress and main) if hooks.data is None else hooks.data
        check_data(state, fingerprint(data))
        job = hooks.ready(
            build_job(cfg, run_randomness(cfg), ledger=ledger, accountant=state["accountant"], resumed=resumed, data=data)
        )
        job.data_sha256, job.part_of, job.owner = fingerprint(data), hooks.part_of, hooks.owner
        check_step_change(job.trainer, changed)
        job.frozen_config = state["config"]  # (the config the run started with stays the reference)
        job.trainer.load_state_dict(state)
        check_records(rd, job.trainer)
        rd.check_metrics_copy(state.get("metrics"))  # (its evaluations are the ones this checkpoint's run released)
        _agree(job)
        rd.truncate_metrics(job.trainer.steps)
        return _train(job, rd, progress, stop_after, elapsed=float(state.get("elapsed_s", 0.0)), start=start)


def _agree(job: Job) -> None:
    """A data-parallel run's ranks hold the same config, data and released statistics, or it is refused on every rank
    before anything is written (:func:`distributed.agree`; their trainers' states are compared before their first
    step: :func:`distributed.agree_on`)."""
    if job.trainer.group is not None:
        distributed.agree(job.trainer.group, {
            "config": job.frozen_config, "data": job.data_sha256, "released statistics": job.released,
        })


def _check_owner(rd: RunDirectory, state: dict, hooks: RunHooks) -> None:
    """A run started by an owner (a search's trial, in its secret ``private/``) is resumed by that owner only: its
    scoring, its held-out examples and its frozen config are the owner's; and an owner resumes only its own runs."""
    owner = state.get("part_of")
    if owner == hooks.part_of:
        if hooks.owner is not None and state.get("owner") != hooks.owner:
            raise RunDirectoryError(
                f"{rd.path} is not this {hooks.part_of}'s (another {hooks.part_of}'s run, or another of its runs, was put "
                "there)"
            )
        return
    if hooks.part_of is None:
        raise RunDirectoryError(
            f"{rd.path} is a trial of a hyperparameter {owner} (secret, inside its private/): only its {owner} continues "
            f"it, with dptrain tune --resume on the {owner}'s directory"
        )
    raise RunDirectoryError(f"{rd.path} is not a run of this {hooks.part_of} (another run's directory was put there)")


def _train(job: Job, rd: RunDirectory, progress: bool, stop_after: int | None, elapsed: float, start: float):
    """The training loop of a run holding ``rd``'s lock: steps, evaluations, checkpoints, the summary. A
    last-iterate run is evaluated only at its end (an intermediate iterate is not a release)."""
    trainer, cfg = job.trainer, job.cfg
    every_iterate = trainer.release == "every_iterate"
    eval_every = cfg.training.eval_every or max(1, round(1 / trainer.sampling_rate))
    remaining = max(0, job.total_steps - trainer.steps)
    if stop_after is not None:
        remaining = min(remaining, stop_after)
    wall = lambda: elapsed + time.perf_counter() - start  # noqa: E731
    bar = _Progress(job.total_steps, trainer.steps, progress)
    eps, eps_step, last_checkpoint, logged = None, None, time.perf_counter(), None
    try:
        with terminate_as_exception():
            steps = trainer.iter_steps(remaining)
            while True:
                # A step, its evaluation and its checkpoint are one unit: a signal during the step waits for all three
                # (adaptive noise reads the evaluation of that step: a checkpoint without it resumes into another run)
                with deferred_signals():
                    result = next(steps, None)
                    if result is None:
                        break
                    evaluate = every_iterate and result.step % eval_every == 0 and result.step < job.total_steps
                    if evaluate or time.perf_counter() - last_checkpoint > CHECKPOINT_INTERVAL_S:
                        if evaluate:  # first: adaptive noise reads the evaluation, and the checkpoint holds that
                            logged = _evaluate_and_log(rd, job, result)
                            eps, eps_step = logged["report"].epsilon, trainer.steps
                        _checkpoint(rd, job, wall())
                        last_checkpoint = time.perf_counter()
                    # (epsilon as of the last evaluation: shown at steps the clock does not choose)
                    bar.update(result, eps)
            if progress and eps_step != trainer.steps:
                bar.show_epsilon(trainer.epsilon().epsilon)
    except (SentinelError, NonFiniteError):
        if trainer.sentinel.stopped is None:  # (stopped before its first release: nothing to label)
            raise
        # the run goes on record as it stands: not private, its summary and checkpoint saying so
        bar.close()
        with deferred_signals():
            _checkpoint(rd, job, wall())
            rd.write_json(SUMMARY, _summary(job, rd, None, wall(), False))
        raise
    except (KeyboardInterrupt, Terminated):
        bar.close()
        with deferred_signals():
            _checkpoint(rd, job, wall())
        print(
            f"\ninterrupted at step {trainer.steps}; continue with: "
            f"{'torchrun ... ' if trainer.group is not None else ''}dptrain train --resume {rd.path}",
            file=sys.stderr,
        )
        raise
    finally:
        bar.close()
    finished = trainer.steps >= job.total_steps or not trainer.can_step()
    with deferred_signals():
        _checkpoint(rd, job, wall())
        released = every_iterate or finished  # a last-iterate run releases its model only at the end
        if logged is not None and logged["row"]["step"] == trainer.steps:  # a budget that ended at an evaluation
            final = logged
        else:
            final = _evaluate_and_log(rd, job, None) if released else None
        # the model is written before the summary is computed: a failure there never takes the trained model with it
        saved = {**job.save_model(rd), **save_averaged(job, rd)} if released else {}
        summary = _summary(job, rd, final, wall(), finished)
        summary.update(saved)
        if released:
            for extra in job.extras:
                summary.update(extra())
        _label_test_metrics(job, summary, final)
        if finished:  # the checkpoint keeps the finished run's summary: a resume prints it, never an edited file
            _checkpoint(rd, job, wall(), summary)
        rd.write_json(SUMMARY, summary)
    trainer.close()
    return summary


def _label_test_metrics(job: Job, summary: dict, final: dict | None) -> None:
    """A test split cut from the private data is not public: every test metric of the summary (``test_accuracy*``,
    the stages' ones included) moves under ``not_private`` with training.log_not_private, and is dropped without it."""
    if job.test_is_public:
        return
    metrics = {k: summary.pop(k) for k in [k for k in summary if k.startswith("test_accuracy")]}
    if final is not None:
        metrics["test_accuracy"] = final["row"].get("not_private", {}).get("test_accuracy")
        if "test_accuracy_ema" in metrics:
            metrics["test_accuracy_ema"] = final["row"].get("not_private", {}).get("test_accuracy_ema")
    summary["test_accuracy"] = None
    kept = {k: v for k, v in metrics.items() if v is not None}
    if job.cfg.training.log_not_private and kept:
        summary["not_private"] = kept


def _checkpoint(rd: RunDirectory, job: Job, wall: float, summary: dict | None = None) -> None:
    state = {
        **job.trainer.state_dict(),
        "elapsed_s": wall,
        "released": sorted(job.released),
        "released_content": job.released,
        **frozen(job.frozen_config, job.data_sha256),
        **({"part_of": job.part_of} if job.part_of else {}),
        **({"owner": job.owner} if job.owner else {}),
        "metrics": rd.metrics_hash(),  # (what it released so far: a resume holds metrics.jsonl to it)
        **({"summary": summary} if summary is not None else {}),
    }
    rd.save_checkpoint(state, job.trainer.ledger)


def _evaluate_and_log(rd: RunDirectory, job: Job, result: StepResult | None) -> dict:
    """Evaluate the released model, append a metrics row, and return {row, report, accuracy}. The test accuracy is
    written as a shareable metric only when the test set is public (``job.test_is_public``); a test split cut from the
    private training examples is evaluated only with training.log_not_private, under the ``not_private`` key."""
    t = job.trainer
    report = t.epsilon()
    row = {
        "step": t.steps,
        "epoch": t.expected_epochs,
        "epsilon": report.epsilon,
        "delta": report.delta,
        "private": t.private,  # False: seeded, or buffers released unnoised (summary.json says why)
    }
    not_private = dict(result.not_private) if result is not None and result.not_private is not None else {}
    accuracy = None
    if job.test_is_public:
        accuracy = row["test_accuracy"] = job.evaluate()
    elif job.cfg.training.log_not_private:
        not_private["test_accuracy"] = job.evaluate()  # a split of the private data: labelled
    averaged = evaluate_averaged(job, row, not_private)  # (the weight average of the released iterates, if any)
    if not_private:
        row["not_private"] = not_private  # asked for by training.log_not_private; labelled
    rd.append_metrics(row)
    if result is not None and accuracy is not None:  # adaptive noise reads the published evaluation (public data)
        t.observe_validation(accuracy)
    return {"row": row, "report": report, "accuracy": accuracy, "accuracy_ema": averaged}


def accountant_table(ledger: Ledger, delta: float) -> dict:
    """Every accountant's answer for the run's ledger: {name: {epsilon, certified} or {refused: why}} (``certified``:
    a proven bound on the recorded mechanism; whether the run is private at all is the summary's ``private``)."""
    reports, refusals = all_reports(ledger, delta)
    table = {k: {"epsilon": r.epsilon, "certified": r.certified} for k, r in reports.items()}
    table.update({k: {"refused": why} for k, why in refusals.items()})
    return table


def attacker_bound(ledger: Ledger, delta: float) -> dict:
    """The bound on any membership-inference attacker against the run (:mod:`dptrain.accounting.membership`): the
    highest true-positive rate at a false-positive rate of 1% and 10%, or why there is none."""
    try:
        return compact(membership_inference(ledger, delta))
    except AccountingError as e:  # (membership_inference's own refusals name no profile: its delta, for one)
        return compact(no_profile(str(e)))


def _summary(job: Job, rd: RunDirectory, final: dict | None, wall: float, finished: bool) -> dict:
    """One summary format for every algorithm (its extras are added by the loop)."""
    t, cfg = job.trainer, job.cfg
    report = final["report"] if final is not None else t.epsilon()
    summary = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "accountant": report.accountant,
        "certified": report.certified,
        "private": t.private,
        **({"not_private_because": t.not_private_reasons} if not t.private else {}),
        "accountant_choice": "auto: the tightest certified" if cfg.privacy.accountant == AUTO else "config",
        "accountants": accountant_table(t.ledger, report.delta),
        "membership_inference": attacker_bound(t.ledger, report.delta),
        "test_accuracy": final["accuracy"] if final is not None else None,
        **({"test_accuracy_ema": final and final["accuracy_ema"]} if t.weight_average is not None else {}),
        "test_is_public": job.test_is_public,
        "steps": t.steps,
        "planned_steps": job.total_steps,
        "finished": finished,
        "release": t.release,
        "epochs": t.expected_epochs,
        "noise_multiplier": t.noise_multiplier,
        "sampling_rate": t.sampling_rate,
        "sampling": t.sampler.scheme,
        **noise_summary(t, report.delta, cfg.privacy.target_epsilon),
        "max_grad_norm": cfg.privacy.max_grad_norm,
        "batch_size": cfg.training.batch_size,
        "target_epsilon": cfg.privacy.target_epsilon,
        "dataset": job.data.description,
        "train_size": len(job.data.train),
        "model": job.description,
        **({"gradient_check": t.gradient_check.to_dict()} if t.gradient_check is not None else {}),
        "randomness": job.randomness.description,
        "secure_noise": job.randomness.secure,
        "out": str(rd.path),
    }
    if "optimal_order" in report.details:
        summary["rdp_order"] = report.details["optimal_order"]
    return summary
