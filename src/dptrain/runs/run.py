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
import importlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.accounting import AUTO, Ledger, RunNumbers, all_reports, tightest
from dptrain.accounting.ledger import ledger_noise_multiplier, training_steps
from dptrain.accounting.membership import compact, membership_inference
from dptrain.config import (
    ALGORITHMS,
    SECTIONS,
    RunConfig,
    config_to_toml,
    load_config,
)
from dptrain.data.datasets import fingerprint
from dptrain.data.loaders import DataSplit, load_dataset, select_classes
from dptrain.engine import distributed
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.engine.bandmf import noise_summary, run_bands
from dptrain.engine.interrupts import Terminated, deferred_signals, terminate_as_exception
from dptrain.engine.trainer import Budget, PrivateTrainer, StepResult
from dptrain.errors import AccountingError, ConfigError, RunDirectoryError
from dptrain.models.builders import build_model
from dptrain.preflight.sentinel import SentinelError
from dptrain.models.scatternet import scatternet_split
from dptrain.randomness.generators import SEEDED_WARNING, Randomness
from dptrain.runs.averaged import evaluate_averaged, save_averaged
from dptrain.runs.resume import (
    check_data,
    check_step_change,
    finished_summary,
    frozen,
    released_files,
    resumed_config,
)
from dptrain.runs.rundir import CONFIG, PLAN, SUMMARY, RunDirectory

#: Wall-clock seconds between checkpoints when evaluations are further apart (bounds what kill -9 can lose).
CHECKPOINT_INTERVAL_S = 300.0
#: Seconds between recomputations of the epsilon the progress bar shows (an accountant call can take ~0.5 s).
EPSILON_REFRESH_S = 5.0


@dataclass
class Job:
    """A run ready to train: the trainer and what the loop needs around it. An algorithm's builder makes it."""

    cfg: RunConfig
    data: DataSplit  # what the trainer sees (after any preprocessing)
    trainer: PrivateTrainer
    total_steps: int
    randomness: Randomness
    #: accuracy of the current model on the test set (only ever called on a released model)
    evaluate: Callable[[], float]
    #: writes the released model into the run directory; returns summary entries about it
    save_model: Callable[[RunDirectory], dict]
    #: per-example losses of the current model on raw examples (x, y): what a black-box attacker can score
    example_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    #: further summary entries of the algorithm and its stages (e.g. the last-iterate bound beside the certificate)
    extras: list[Callable[[], dict]] = field(default_factory=list)
    #: files a stage released before training (written once, read back on resume): name -> JSON-able
    released: dict[str, Any] = field(default_factory=dict)
    description: str = ""  # the model, for the report
    #: whether the test set may be treated as public (data.test_is_public, default: a separate test file); if not,
    #: its metrics are written only labelled not private, and only with training.log_not_private
    test_is_public: bool = True
    #: the config the run started with, as TOML: kept in every checkpoint; a resume may not change it
    frozen_config: str = ""
    #: the fingerprint of the data the run started with (dptrain.data.datasets.fingerprint), kept beside the config
    data_sha256: str | None = None


@dataclass
class Draft:
    """A DP-SGD job before its trainer is made: what the stages of registered sections may change (the data the
    trainer sees, the model, the trainer's options) and what they add to the job. ``resumed`` holds what the run
    directory kept of earlier releases (a stage never releases twice)."""

    cfg: RunConfig
    randomness: Randomness
    data: DataSplit
    model: nn.Module
    options: dict
    resumed: dict[str, Any]
    released: dict[str, Any] = field(default_factory=dict)
    extras: list[Callable[[], dict]] = field(default_factory=list)
    save_model: Callable[[RunDirectory, PrivateTrainer], dict] | None = None
    #: raw examples -> what the trainer sees (a preprocessing stage sets it)
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: (model, planned steps) -> the update rule, in the optimizer's place (an update stage sets it: ModelMix)
    make_optimizer: Callable[[nn.Module, int], torch.optim.Optimizer] | None = None
    #: planned steps -> the noise schedule's shape s_t (a noise stage sets it: dynamic noise schedules), and how
    #: its scale is calibrated (dptrain.schedules.scale.METHODS)
    noise_schedule: Callable[[int], Any] | None = None
    schedule_calibration: str = "tightest"
    #: noise schedule shape -> its scale, when a stage sets the noise from a budget of its own (a zCDP budget)
    noise_scale: Callable[[Any], float] | None = None
    #: (planned steps, sampling rate) -> adaptive noise under a privacy filter (the validation noise schedule)
    noise_controller: Callable[[int, float], Any] | None = None
    #: the trainer, once made (for the stages' summary entries)
    trainer: PrivateTrainer | None = None
    #: trainer -> a warning about the run as made (its accountant resolved), or None: each one said once on stderr
    #: when the job is built, and kept in the summary's ``notes``
    notices: list[Callable[[PrivateTrainer], str | None]] = field(default_factory=list)


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    t = cfg.training
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay
        )
    return torch.optim.Adam(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)


def tokenizer_directory(cfg: RunConfig) -> str | None:
    """The directory of the tokenizer a run's text is tokenized by (None: none): data.options.tokenizer, else, for text
    files without pre-tokenized ids, the Hugging Face model's directory when it holds a tokenizer."""
    if cfg.data.name != "text_files":
        return None
    options = cfg.data.options
    if "tokenizer" in options:
        return options["tokenizer"]
    model_dir = cfg.model.options.get("path") if cfg.model.name == "hf" else None
    if "vocab_size" not in options and model_dir:
        if any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            return model_dir
    return None


def load_data(cfg: RunConfig, progress: bool = False) -> DataSplit:
    """The run's data: the loader, then the class selection of data.classes if any. Text files for a Hugging Face
    model saved in a directory with its tokenizer are tokenized by that tokenizer unless data.options names one. With
    data.features = "scatternet", the examples become their ScatterNet features (cached; a bar while computed)."""
    options = dict(cfg.data.options)
    tokenizer = tokenizer_directory(cfg)
    if tokenizer is not None:
        options["tokenizer"] = tokenizer
    if cfg.data.features == "scatternet" and cfg.data.name in ("fashion-mnist", "mnist"):
        if options.setdefault("pixels", "raw") != "raw":  # ScatterNet's input: pixels in [0, 1] (Tramer & Boneh)
            raise ConfigError('data.features = "scatternet" reads pixels in [0, 1]: data.options.pixels must be "raw"')
    data = load_dataset(cfg.data.name, cfg.data.path, seed=cfg.data.seed, **options)
    data = data if cfg.data.classes is None else select_classes(data, list(cfg.data.classes))
    return scatternet_split(data, progress=progress) if cfg.data.features == "scatternet" else data


def test_is_public(cfg: RunConfig, data: DataSplit) -> bool:
    """Whether the run's test set may be treated as public: ``data.test_is_public``, by default true only where the
    test set is a separate file (not split off the private training examples)."""
    public = cfg.data.test_is_public
    return data.separate_test if public is None else public


def run_randomness(cfg: RunConfig) -> Randomness:
    """The run's streams (an explicit seed is announced by :func:`_announce_seed` once the run starts)."""
    entropy = distributed.shared_entropy(distributed.current(), cfg.seed)  # every rank of a data-parallel run
    return Randomness(cfg.seed, secure=cfg.privacy.secure_noise, warn=False, entropy=entropy)


def _announce_seed(cfg: RunConfig) -> None:
    """One warning line when a run starts with an explicit seed (the summary records it too)."""
    if cfg.seed is not None:
        print(f"dptrain: warning: seed = {cfg.seed}: {SEEDED_WARNING}", file=sys.stderr)


def resolve(path: str) -> Callable:
    """``"module:function"`` -> the function (algorithms and stages name their code this way, so that the config
    layer never imports it)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def resolve_accountant(trainer: PrivateTrainer, total: int) -> str:
    """``auto`` with a fixed noise multiplier: the accountant that certifies the planned run tightest."""
    reports, refusals = all_reports(trainer.ledger_after(total - trainer.steps), trainer.delta)
    best = tightest(reports)
    if best is None:
        raise AccountingError(
            "no accountant certifies this run: " + "; ".join(f"{k}: {v}" for k, v in refusals.items())
        )
    return best.accountant


def build_job(
    cfg: RunConfig,
    randomness: Randomness,
    *,
    ledger: Ledger | None = None,
    accountant: str | None = None,
    resumed: dict[str, Any] | None = None,
    data: DataSplit | None = None,
) -> Job:
    """The job of ``cfg``, built by its algorithm's registered builder. Resuming: ``ledger`` is the checkpoint's
    (sigma is read from it), ``accountant`` the one that certified the run, ``resumed`` the stages' released
    files. ``data`` replaces the config's data (e.g. an audit's training set with canaries). Writes nothing."""
    builder = resolve(ALGORITHMS[cfg.training.algorithm].build)
    job = builder(cfg, randomness, ledger=ledger, accountant=accountant, resumed=resumed or {}, data=data)
    job.test_is_public = test_is_public(cfg, job.data)
    job.frozen_config = config_to_toml(cfg)
    return job


def build_dpsgd_job(
    cfg: RunConfig,
    randomness: Randomness,
    *,
    ledger: Ledger | None,
    accountant: str | None,
    resumed: dict[str, Any],
    data: DataSplit | None,
) -> Job:
    """DP-SGD: data, model, the stages of the registered sections, optimizer, and the trainer (sigma calibrated
    for the planned steps, given, or read from a resumed run's ledger)."""
    randomness.seed_torch("init")
    data = load_data(cfg) if data is None else data
    model = build_model(cfg.model.name, data.train.input_shape, data.train.num_classes, **cfg.model.options)
    p, t = cfg.privacy, cfg.training
    draft = Draft(cfg, randomness, data, model, {"max_grad_norm": p.max_grad_norm, "accountant": p.accountant}, resumed)
    for section in SECTIONS.values():
        if section.stage is not None:
            resolve(section.stage)(draft)
    options = draft.options
    if accountant is not None:
        options["accountant"] = accountant
    data, model, n = draft.data, draft.model, len(draft.data.train)
    if t.batch_size > n and p.sampling != "full":
        raise ConfigError(f"training.batch_size must be <= the training set size {n}, got {t.batch_size}")
    common = dict(
        **options,
        batch_size=t.batch_size,
        sampling=p.sampling,
        clipping=p.clipping,
        linf_p=p.linf_p,
        max_physical_batch_size=t.max_physical_batch_size,
        grad_sampler=t.grad_sampler,
        randomness=randomness,
        report_not_private=t.log_not_private,
        buffer_updates=t.buffer_updates,
        mixed_precision=t.mixed_precision,
        device=t.device,
        augment=t.augment or None,
        ema=t.ema,
    )
    # The run's numbers, computed once here: steps from epochs, the batch-size schedule (growing batches: Proactive
    # DP, App. B.4, theta = s_max/s_bar ~ 1 + p). The trainer, the calibration and the summary read them.
    numbers = RunNumbers.planned(
        p.sampling,
        dataset_size=n,
        batch_size=t.batch_size,
        batch_growth=t.batch_growth,
        clip_norm=p.max_grad_norm,
        **cfg.steps_or_epochs,
    )
    common["sample_sizes"] = numbers.sample_sizes
    if cfg.noise.mechanism != "gaussian":  # correlated noise (docs/bandmf.md); a resumed run's bands are its ledger's
        common.update(noise=cfg.noise.mechanism, bands=run_bands(cfg.noise.bands, ledger))
    if draft.noise_schedule is not None:
        common["noise_schedule"] = draft.noise_schedule(numbers.steps)
    optimizer = (
        build_optimizer(cfg, model) if draft.make_optimizer is None else draft.make_optimizer(model, numbers.steps)
    )
    resuming = ledger is not None and training_steps(ledger) > 0
    adaptive = draft.noise_controller is not None
    if adaptive or p.target_epsilon is None or resuming:
        if adaptive:  # adaptive noise: its own filter is the budget (its state comes from a checkpoint)
            rate = t.batch_size / n if p.sampling == "poisson" else 1.0
            controller = draft.noise_controller(numbers.steps, rate)
            common.update(accountant="filter", noise_controller=controller)
            budget, sigma = None, controller.sigma
        else:
            budget = None if p.target_epsilon is None else Budget(p.target_epsilon, p.delta)
            if resuming:
                sigma = ledger_noise_multiplier(ledger)
            elif p.noise_multiplier is None and draft.noise_scale is not None:
                sigma = draft.noise_scale(common["noise_schedule"])
            else:
                sigma = p.noise_multiplier
        planned = {"planned_steps": numbers.steps} if "bands" in common else {}
        trainer = make_private(
            model, optimizer, data.train, noise_multiplier=sigma, delta=p.delta, budget=budget, **common, **planned
        )
    else:
        trainer = make_private_with_epsilon(
            model,
            optimizer,
            data.train,
            target_epsilon=p.target_epsilon,
            target_delta=p.delta,
            steps=numbers.steps,
            schedule_calibration=draft.schedule_calibration,
            **common,
        )
    draft.trainer = trainer
    if trainer.accountant == AUTO:
        trainer.accountant = resolve_accountant(trainer, numbers.steps)
    notes = [n for n in (notice(trainer) for notice in draft.notices) if n]
    for note in notes:
        print(f"dptrain: warning: {note}", file=sys.stderr)
    if notes:
        draft.extras.append(lambda: {"notes": notes})
    save = draft.save_model or (lambda rd, tr: _save_module(rd, tr, cfg, data))
    return Job(
        cfg,
        data,
        trainer,
        numbers.steps,
        randomness,
        evaluate=lambda: trainer.evaluate(data.test.x, data.test.y),
        save_model=lambda rd: save(rd, trainer),
        example_losses=lambda x, y: model_losses(trainer, draft.transform(x) if draft.transform else x, y),
        extras=draft.extras,
        released=draft.released,
        description=f"{cfg.model.name} (per-example gradients: {trainer.grad_sampler.name})",
    )


@torch.no_grad()
def model_losses(trainer: PrivateTrainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example losses of the trainer's current model (evaluation mode) on (x, y)."""
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        return trainer.loss_fn(trainer.model(x.to(trainer.device)), y.to(trainer.device)).cpu()
    finally:
        trainer.model.train(was_training)


def _save_module(rd: RunDirectory, trainer: PrivateTrainer, cfg: RunConfig, data: DataSplit) -> dict:
    rd.save_model(
        {
            "state_dict": trainer.model.state_dict(),
            "model": cfg.model.name,
            "options": dict(cfg.model.options),
            "input_shape": list(data.train.input_shape),
            "num_classes": data.train.num_classes,
        }
    )
    return _save_hf(rd, trainer.model, cfg) if cfg.model.name == "hf" else {}


def _save_hf(rd: RunDirectory, model: nn.Module, cfg: RunConfig) -> dict:
    """A Hugging Face model's ``save_pretrained`` directories (:mod:`dptrain.models.hf_save`), with the run's tokenizer;
    their paths for the summary."""
    from dptrain.data.text_files import load_tokenizer
    from dptrain.models import hf_save

    directory = tokenizer_directory(cfg)
    tokenizer = None if directory is None else load_tokenizer(directory)
    saved = {}
    if not hf_save.is_peft(model) or hf_save.can_merge(model):
        path = rd.save_directory(hf_save.MODEL_DIR, lambda d: hf_save.save_model_directory(model, d, tokenizer))
        saved["hf_model"] = str(path)
    if hf_save.is_peft(model):
        base = cfg.model.options.get("path")
        final = (rd / hf_save.ADAPTER_DIR).resolve()
        base_path = str(Path(base).resolve()) if base is not None else str(final / hf_save.BASE_DIR)
        path = rd.save_directory(
            hf_save.ADAPTER_DIR,
            lambda d: hf_save.save_adapter_directory(model, d, base_path, tokenizer, save_base=base is None),
        )
        saved["hf_adapter"] = str(path)
    return saved


class _Progress:
    """tqdm progress bar showing steps and epsilon spent (and the training loss, labelled not private, only when
    the config asks for non-private statistics)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
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
        """The epsilon after the last step (:meth:`update` is given one refreshed on a timer: at the end it would
        show a value some steps old)."""
        self.postfix["eps"] = f"{eps:.3f}"
        self.bar.set_postfix(self.postfix)

    def close(self) -> None:
        self.bar.close()


@dataclass
class RunHooks:
    """What a command running jobs inside its own (a tuning search) adds to each: the data, already loaded, and a
    function called with the built job before it trains (e.g. to hold some examples out of its per-example stage)."""

    data: DataSplit | None = None
    prepare: Callable[[Job], None] | None = None

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
    job.data_sha256 = fingerprint(data)
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
        ledger = Ledger.from_dict(state["ledger"])
        rd.check_ledger_copy(ledger)
        previous = finished_summary(rd, state)
        if previous is None and "summary" not in state:  # (a checkpoint from before dptrain kept the summary)
            previous = rd.read_json(SUMMARY)
            previous = previous if previous is not None and previous.get("finished") else None
        if previous is not None:
            print(f"dptrain: the run in {rd.path} has finished; nothing to resume", file=sys.stderr)
            return previous
        cfg, changed = resumed_config(rd, state)
        resumed = released_files(rd, state)
        data = load_data(cfg, progress and main) if hooks.data is None else hooks.data
        check_data(state, fingerprint(data))
        job = hooks.ready(
            build_job(cfg, run_randomness(cfg), ledger=ledger, accountant=state["accountant"], resumed=resumed, data=data)
        )
        job.data_sha256 = fingerprint(data)
        check_step_change(job.trainer, changed)
        if "config" in state:
            job.frozen_config = state["config"]  # (the config the run started with stays the reference)
        job.trainer.load_state_dict(state)
        rd.truncate_metrics(job.trainer.steps)
        return _train(job, rd, progress, stop_after, elapsed=float(state.get("elapsed_s", 0.0)), start=start)


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
    eps, eps_time, eps_step, last_checkpoint = None, -math.inf, None, time.perf_counter()
    refresh, logged = EPSILON_REFRESH_S, None
    try:
        with terminate_as_exception():
            for result in trainer.iter_steps(remaining):
                if progress and time.perf_counter() - eps_time > refresh:
                    asked = time.perf_counter()
                    eps, eps_time, eps_step = trainer.epsilon().epsilon, time.perf_counter(), trainer.steps
                    # an accountant call on a ledger of many distinct steps can take seconds: keep it under ~5%
                    refresh = max(EPSILON_REFRESH_S, 20 * (eps_time - asked))
                bar.update(result, eps)
                evaluate = every_iterate and result.step % eval_every == 0 and result.step < job.total_steps
                if evaluate or time.perf_counter() - last_checkpoint > CHECKPOINT_INTERVAL_S:
                    with deferred_signals():
                        if evaluate:  # first: adaptive noise reads the evaluation, and the checkpoint holds that
                            logged = _evaluate_and_log(rd, job, result)
                        _checkpoint(rd, job, wall())
                    last_checkpoint = time.perf_counter()
            if progress and eps_step is not None and eps_step != trainer.steps:
                bar.show_epsilon(trainer.epsilon().epsilon)
    except SentinelError:  # the run goes on record as it stands: not private, its summary and checkpoint saying so
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
        summary = _summary(job, rd, final, wall(), finished)
        if released:
            summary.update(job.save_model(rd))
            summary.update(save_averaged(job, rd))
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
    except AccountingError as e:  # e.g. a ledger with no release yet
        return {"tpr_at_fpr_1pct": None, "tpr_at_fpr_10pct": None, "no_profile": str(e)}


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
        "wall_time_s": wall,
        "out": str(rd.path),
    }
    if "optimal_order" in report.details:
        summary["rdp_order"] = report.details["optimal_order"]
    return summary
