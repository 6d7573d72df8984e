"""A job from a typed config: the data, the model, the optimizer and the trainer of one run, built by the algorithm's
builder (``dptrain train``'s; :mod:`dptrain.runs.run` trains it). One pipeline for every algorithm
(docs/architecture.md): the config names the algorithm (``training.algorithm``: ``dpsgd``, or one a package registers,
like ``projected_noisy_sgd``) and the stages (registered config sections, like DPSGD-F's ``[preprocessing]``), which
edit a :class:`Draft` before the trainer is made; the builder returns a :class:`Job` around a
:class:`~dptrain.engine.trainer.PrivateTrainer`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain.accounting import AUTO, Ledger, RunNumbers, all_reports, tightest
from dptrain.accounting.ledger import ledger_noise_multiplier, training_steps
from dptrain.config import (
    ALGORITHMS,
    SECTIONS,
    RunConfig,
    config_to_toml,
)
from dptrain.data.loaders import DataSplit, load_dataset, select_classes
from dptrain.engine import distributed
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.engine.bandmf import run_bands
from dptrain.engine.trainer import Budget, PrivateTrainer
from dptrain.errors import AccountingError, ConfigError
from dptrain.models.builders import build_model
from dptrain.models.scatternet import scatternet_split
from dptrain.randomness.generators import SEEDED_WARNING, Randomness
from dptrain.runs.rundir import RunDirectory


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
    #: the command that owns the run, kept in every checkpoint ("search": a trial of a hyperparameter search, which
    #: only its search may continue); None for a run of its own
    part_of: str | None = None
    #: the owner's secret mark on this run (a search's trial: a hash of the trial's key), kept in every checkpoint:
    #: a resume by the owner refuses a run that does not carry its mark (another search's trial put in its place)
    owner: str | None = None


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
    checks: bool = True,
) -> Job:
    """The job of ``cfg``, built by its algorithm's registered builder. Resuming: ``ledger`` is the checkpoint's
    (sigma is read from it), ``accountant`` the one that certified the run, ``resumed`` the stages' released
    files. ``data`` replaces the config's data (e.g. an audit's training set with canaries). ``checks=False`` skips
    the model's probe before the first step, only for a job that never trains (a search's planner, which reads the
    ledger a trial will record: the probe changes no release). Writes nothing."""
    builder = resolve(ALGORITHMS[cfg.training.algorithm].build)
    job = builder(cfg, randomness, ledger=ledger, accountant=accountant, resumed=resumed or {}, data=data,
                  checks=checks)
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
    checks: bool = True,
) -> Job:
    """DP-SGD: data, model, the stages of the registered sections, optimizer, and the trainer (sigma calibrated
    for the planned steps, given, or read from a resumed run's ledger; ``checks``: :func:`build_job`)."""
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
        check_independence=checks,
        check_gradients=checks,
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
            if resuming and p.noise_multiplier is None:  # (calibrated when the run started: its ledger keeps it)
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
