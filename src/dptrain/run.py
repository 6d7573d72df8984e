"""A training job from a typed config: the Python function behind ``dptrain train``.

Writes into the output directory:
- ``config.toml``: the resolved config (what ran, defaults included),
- ``metrics.jsonl``: one JSON line per evaluation (step, epoch, test accuracy, epsilon, loss),
- ``ledger.json``: the privacy ledger (also inside every checkpoint),
- ``checkpoint.pt``: internal state to resume (model, optimizer, RNG states, ledger),
- ``summary.json``: the final privacy/utility report;
- with ``[preprocessing]`` (seed 004): ``preprocessing.json`` (the released mean / tau) and ``model.pt`` (the
  linear model mapped back to raw examples).
Files are replaced atomically, so an interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dptrain.accounting.ledger import Ledger, write_json_atomic
from dptrain.accounting.proactive import increasing_sample_sizes
from dptrain.config import RunConfig, config_to_toml, load_config
from dptrain.data import ArrayDataset, DataSplit, load_dataset, select_classes
from dptrain.dpsgd_f import FeaturePreprocessing, prepare
from dptrain.engine import Budget, PrivateTrainer, make_private, make_private_with_epsilon
from dptrain.errors import ConfigError, DataError
from dptrain.models import build_model

CHECKPOINT, LEDGER, CONFIG, METRICS, SUMMARY, PREPROCESSING = (
    "checkpoint.pt",
    "ledger.json",
    "config.toml",
    "metrics.jsonl",
    "summary.json",
    "preprocessing.json",
)


@dataclass
class Job:
    cfg: RunConfig
    data: DataSplit  # what the trainer sees (after any feature preprocessing)
    trainer: PrivateTrainer
    total_steps: int
    preprocessing: FeaturePreprocessing | None = None
    raw_test: ArrayDataset | None = (
        None  # the test set before preprocessing (for the returned raw-feature model)
    )


def build_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = cfg.training
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay
        )
    return torch.optim.Adam(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)


def load_data(cfg: RunConfig) -> DataSplit:
    """The run's data: the loader, then the class selection of data.classes if any."""
    data = load_dataset(cfg.data.name, cfg.data.path, seed=cfg.seed, **cfg.data.options)
    return data if cfg.data.classes is None else select_classes(data, list(cfg.data.classes))


def _preprocess(cfg: RunConfig, data: DataSplit, model: torch.nn.Module, fitted: FeaturePreprocessing | None):
    """Seed 004's preprocessing stage (docs/dpsgd_f.md): fit it on the training set (recording its releases in a
    ledger) or reuse a fitted one (resume), and return the transformed data the trainer sees."""
    pre = cfg.preprocessing
    prepared = prepare(
        model,
        data.train.x,
        kind=pre.kind,
        feature_norm=pre.feature_norm,
        delta=cfg.privacy.delta,
        eps_f=pre.eps_f,
        epsilon=cfg.privacy.target_epsilon,
        quantile_tail=pre.quantile_tail,
        seed=cfg.seed,
        fitted=fitted,
    )
    tf = prepared.preprocessing.transform

    def part(ds: ArrayDataset) -> ArrayDataset:
        return ArrayDataset(tf(ds.x), ds.y, ds.num_classes, ds.name)

    what = (
        f"{pre.kind} preprocessing" if pre.kind != "none" else f"features normalized to {pre.feature_norm:g}"
    )
    return prepared, DataSplit(part(data.train), part(data.test), f"{data.description}, {what}")


def build_job(
    cfg: RunConfig, noise_multiplier: float | None = None, fitted: FeaturePreprocessing | None = None
) -> Job:
    """Data, model, optimizer and private trainer for ``cfg``. ``noise_multiplier`` overrides calibration
    (a resumed run keeps the sigma it was calibrated with); ``fitted`` is the released preprocessing of a run being
    resumed (never fitted, i.e. released, twice)."""
    torch.manual_seed(cfg.seed)
    data = load_data(cfg)
    model = build_model(cfg.model.name, data.train.input_shape, data.train.num_classes, **cfg.model.options)
    p, t = cfg.privacy, cfg.training
    prepared, raw_test = None, None
    if cfg.preprocessing.kind != "none" or cfg.preprocessing.feature_norm is not None:
        raw_test = data.test
        prepared, data = _preprocess(cfg, data, model, fitted)
        model = prepared.model
    optimizer = build_optimizer(cfg, model)
    settings = {"max_grad_norm": p.max_grad_norm, "accountant": p.accountant}
    if prepared is not None:
        settings.update(prepared.settings)
        if fitted is None:
            settings["ledger"] = prepared.ledger
    common = dict(
        **settings,
        batch_size=t.batch_size,
        sampling=p.sampling,
        clipping=p.clipping,
        max_physical_batch_size=t.max_physical_batch_size,
        grad_sampler=t.grad_sampler,
        seed=cfg.seed,
    )
    if t.batch_size > len(data.train) and p.sampling == "poisson":
        raise ConfigError(
            f"training.batch_size must be <= the training set size {len(data.train)}, got {t.batch_size}"
        )
    if t.batch_growth > 0:  # increasing expected batch sizes (seed 002 App. B.4): theta = s_max/s_bar ~ 1 + p
        n = len(data.train)
        total = t.steps if t.steps is not None else max(1, round(t.epochs * max(1, round(n / t.batch_size))))
        common["sample_sizes"] = increasing_sample_sizes(t.batch_size, total, t.batch_growth, n)
    if p.target_epsilon is None:
        trainer = make_private(
            model, optimizer, data.train, noise_multiplier=p.noise_multiplier, delta=p.delta, **common
        )
    elif noise_multiplier is not None:
        trainer = make_private(
            model,
            optimizer,
            data.train,
            noise_multiplier=noise_multiplier,
            delta=p.delta,
            budget=Budget(p.target_epsilon, p.delta),
            **common,
        )
    else:
        trainer = make_private_with_epsilon(
            model,
            optimizer,
            data.train,
            target_epsilon=p.target_epsilon,
            target_delta=p.delta,
            **cfg.steps_or_epochs,
            **common,
        )
    return Job(
        cfg,
        data,
        trainer,
        trainer.steps_for(**cfg.steps_or_epochs),
        None if prepared is None else prepared.preprocessing,
        raw_test,
    )


def _save_checkpoint(out: Path, trainer: PrivateTrainer) -> None:
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(trainer.state_dict(), tmp)
    os.replace(tmp, out / CHECKPOINT)
    trainer.ledger.save(out / LEDGER)


def load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, weights_only=True)
        Ledger.from_dict(state["ledger"])
        return state
    except FileNotFoundError:
        raise DataError(f"checkpoint {path} does not exist: is this a dptrain run directory?") from None
    except Exception as e:  # a truncated or foreign file can fail in many ways inside torch.load
        raise DataError(
            f"checkpoint {path} is corrupt or not a dptrain checkpoint ({type(e).__name__})"
        ) from None


class _Progress:
    """tqdm progress bar showing steps, loss and epsilon spent (updated a few dozen times per run)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
        self.loss = math.nan

    def update(self, loss: float, eps: float | None) -> None:
        self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
        if eps is not None:
            self.bar.set_postfix(loss=f"{self.loss:.3f}", eps=f"{eps:.3f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_training(
    cfg: RunConfig | None,
    out: str | os.PathLike,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    plan: dict | None = None,
) -> dict:
    """Run (or resume) a job; returns the summary. ``stop_after`` ends this invocation after that many
    steps with a checkpoint (for time-sliced jobs); ``resume`` continues the run stored in ``out``; ``plan`` (from
    ``dptrain plan``) is checked against the data (its guarantee holds only for the data set size it was made for)
    and recorded in the summary."""
    out = Path(out)
    start = time.perf_counter()
    algorithm = (cfg if cfg is not None else load_config(out / CONFIG)).training.algorithm
    if algorithm == "projected_noisy_sgd":
        if resume or stop_after is not None or plan is not None:
            raise ConfigError(
                "projected noisy SGD runs cannot be resumed, cut with --stop-after or planned yet; "
                "run them whole (only the last iterate is released)"
            )
        return run_projected(cfg, out, progress)
    if resume:
        cfg = load_config(out / CONFIG)
        state = load_checkpoint(out / CHECKPOINT)
        job = build_job(cfg, noise_multiplier=state["noise_multiplier"], fitted=_load_preprocessing(out, cfg))
        job.trainer.load_state_dict(state)
        previous = _read_summary_time(out)
    else:
        if cfg is None:
            raise ConfigError("a config is needed to start a run")
        if (out / CHECKPOINT).exists() or (out / LEDGER).exists():
            raise ConfigError(
                f"output directory {out} already holds a run; continue it with --resume {out} "
                "or choose another --out"
            )
        job = build_job(cfg)
        if plan is not None and int(plan.get("dataset_size", -1)) != len(job.data.train):
            raise ConfigError(
                f"the plan was made for a data set of {plan.get('dataset_size')} examples, but the "
                f"training set has {len(job.data.train)}; plan again with --dataset-size "
                f"{len(job.data.train)}"
            )
        out.mkdir(parents=True, exist_ok=True)
        if plan is not None:
            write_json_atomic(out / "plan.json", plan)
        if job.preprocessing is not None:  # released statistics (private mean, tau): part of the output
            write_json_atomic(out / PREPROCESSING, job.preprocessing.to_dict())
        (out / CONFIG).write_text(config_to_toml(cfg))
        previous = 0.0
    trainer, cfg = job.trainer, job.cfg
    steps_per_epoch = trainer.sampler.steps_per_epoch
    eval_every = cfg.training.eval_every or steps_per_epoch
    remaining = max(0, job.total_steps - trainer.steps)
    if stop_after is not None:
        remaining = min(remaining, stop_after)
    eps_every = max(1, job.total_steps // 25)
    bar = _Progress(job.total_steps, trainer.steps, progress)
    eps = None
    try:
        for result in trainer.iter_steps(remaining):
            if result.step % eps_every == 0 or eps is None:
                eps = trainer.epsilon().epsilon
            bar.update(result.loss, eps)
            if result.step % eval_every == 0 and result.step < job.total_steps:
                _evaluate_and_log(out, job, result.loss)
                _save_checkpoint(out, trainer)
    except KeyboardInterrupt:
        bar.close()
        _save_checkpoint(out, trainer)
        print(f"\ninterrupted at step {trainer.steps}; continue with: dptrain train --resume {out}")
        raise
    finally:
        bar.close()
    _save_checkpoint(out, trainer)
    finished = trainer.steps >= job.total_steps or (
        trainer.allowed_steps() is not None and trainer.steps >= trainer.allowed_steps()
    )
    summary = _summary(
        job, out, _evaluate_and_log(out, job, math.nan), previous + time.perf_counter() - start, finished
    )
    if job.preprocessing is not None:
        summary.update(_save_raw_model(out, job))
    write_json_atomic(out / SUMMARY, summary)
    trainer.close()
    return summary


def _load_preprocessing(out: Path, cfg: RunConfig) -> FeaturePreprocessing | None:
    if cfg.preprocessing.kind == "none" and cfg.preprocessing.feature_norm is None:
        return None
    try:
        return FeaturePreprocessing.from_dict(json.loads((out / PREPROCESSING).read_text()))
    except FileNotFoundError:
        raise DataError(
            f"{out / PREPROCESSING} is missing: the run's released preprocessing is needed to resume it"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{out / PREPROCESSING} is corrupt ({type(e).__name__})") from None


def _save_raw_model(out: Path, job: Job) -> dict:
    """The returned model of a preprocessing run: the trained linear map with the bias mapped back, so it applies
    to raw examples (normalized inside). Written as ``model.pt``; its test accuracy on the raw test set is
    reported beside the trainer's (they agree: docs/dpsgd_f.md)."""
    prep = job.preprocessing
    model = prep.raw_model(job.trainer.model)
    torch.save({"state_dict": model.state_dict(), "preprocessing": prep.to_dict()}, out / "model.pt")
    with torch.no_grad():
        acc = float((model(job.raw_test.x).argmax(1) == job.raw_test.y).float().mean())
    return {
        "preprocessing": {k: v for k, v in prep.to_dict().items() if k != "mean"},
        "test_accuracy_raw_model": acc,
    }


def _read_summary_time(out: Path) -> float:
    try:
        return float(json.loads((out / SUMMARY).read_text())["wall_time_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def _evaluate_and_log(out: Path, job: Job, loss: float) -> dict:
    t = job.trainer
    report = t.epsilon()
    row = {
        "step": t.steps,
        "epoch": t.expected_epochs,
        "test_accuracy": t.evaluate(job.data.test.x, job.data.test.y),
        "epsilon": report.epsilon,
        "delta": report.delta,
        "train_loss": None if math.isnan(loss) else loss,
    }
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(row) + "\n")
    return {"row": row, "report": report}


def _summary(job: Job, out: Path, final: dict, wall: float, finished: bool) -> dict:
    t, cfg, report = job.trainer, job.cfg, final["report"]
    summary = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "accountant": report.accountant,
        "certified": report.certified,
        "test_accuracy": final["row"]["test_accuracy"],
        "steps": t.steps,
        "planned_steps": job.total_steps,
        "finished": finished,
        "epochs": t.expected_epochs,
        "noise_multiplier": t.noise_multiplier,
        "sampling_rate": t.sampling_rate,
        "sampling": t.sampler.scheme,
        "max_grad_norm": cfg.privacy.max_grad_norm,
        "batch_size": cfg.training.batch_size,
        "target_epsilon": cfg.privacy.target_epsilon,
        "dataset": job.data.description,
        "train_size": len(job.data.train),
        "model": cfg.model.name,
        "grad_sampler": t.grad_sampler.name,
        "wall_time_s": wall,
        "out": str(out),
    }
    if "optimal_order" in report.details:
        summary["rdp_order"] = report.details["optimal_order"]
    return summary


def format_report(summary: dict) -> str:
    """The privacy/utility report printed at the end of ``dptrain train``."""
    cert = "" if summary["certified"] else "  (approximation, not certified)"
    target = "" if summary["target_epsilon"] is None else f" (target {summary['target_epsilon']:g})"
    rows = [
        ("privacy", f"epsilon = {summary['epsilon']:.4f}{target} at delta = {summary['delta']:g}{cert}"),
        ("accountant", summary["accountant"]),
        *([_last_iterate_row(summary)] if "epsilon_last_iterate" in summary else []),
        ("test accuracy", f"{summary['test_accuracy']:.4f}"),
        *([_preprocessing_row(summary)] if "preprocessing" in summary else []),
        ("steps", f"{summary['steps']} of {summary['planned_steps']} ({summary['epochs']:.2f} epochs)"),
        (
            "noise multiplier" if "noise_std" not in summary else "noise std (on averaged gradient)",
            f"{summary['noise_multiplier']:.4f}",
        ),
        (
            "sampling rate",
            f"{summary['sampling_rate']:.6g} ({summary['sampling']}, expected batch {summary['batch_size']})",
        ),
        ("clip norm", f"{summary['max_grad_norm']:g}")
        if summary["max_grad_norm"] is not None
        else (
            "Lipschitz / diameter",
            f"L = {summary.get('lipschitz', 0):.4g}, D = {summary.get('diameter', 0):g}",
        ),
        ("data", summary["dataset"]),
        ("model", f"{summary['model']} (per-example gradients: {summary['grad_sampler']})"),
        ("wall time", f"{summary['wall_time_s']:.1f} s"),
        ("outputs", summary["out"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


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


def _preprocessing_row(summary: dict) -> tuple[str, str]:
    pre = summary["preprocessing"]
    text = f"{pre['kind']}, features normalized to C_F = {pre['feature_norm']:g}"
    if pre.get("noise_multiplier") is not None:
        text += f", private mean sigma_F = {pre['noise_multiplier']:.4g}"
    if pre.get("eps_f") is not None:
        text += f" (eps_F = {pre['eps_f']:g})"
    if pre.get("tau") is not None:
        text += f", tau = {pre['tau']:.4g}"
    text += f"; model.pt on raw examples: test accuracy {summary['test_accuracy_raw_model']:.4f}"
    return "preprocessing", text


def run_projected(cfg: RunConfig, out: Path, progress: bool = True) -> dict:
    """Projected noisy SGD on a convex GLM (seed 003). The budget is certified by ``privacy.accountant``: composition
    (rdp), or the last-iterate bound itself for full and cyclic batches (where it is proven for both orderings of a
    neighbouring pair). The other one is reported beside it; for random batches the last-iterate bound is reported
    only, not certified (docs/last_iterate.md). Only the final iterate is written (``model.pt``, the release); no
    intermediate iterate is logged or checkpointed."""
    from dptrain.accounting import calibrate_noise, epsilon
    from dptrain.accounting.last_iterate import (
        NOT_CERTIFIED,
        certifiable,
        last_iterate_report,
        setting_from_ledger,
    )
    from dptrain.last_iterate import ConvexGLM, ProjectedNoisySGD, accuracy

    if (out / LEDGER).exists() or (out / "model.pt").exists():
        raise ConfigError(f"output directory {out} already holds a run; choose another --out")
    start = time.perf_counter()
    p, t, cv = cfg.privacy, cfg.training, cfg.convex
    data = load_data(cfg)
    glm = ConvexGLM(cv.loss, cv.feature_norm, fit_bias=cv.fit_bias, l2=cv.l2)
    n = len(data.train)
    b = n if cv.batching == "full" else t.batch_size
    steps = t.steps if t.steps is not None else max(1, round(t.epochs * n / b))

    def trainer(sigma: float) -> ProjectedNoisySGD:
        return ProjectedNoisySGD(
            glm,
            (data.train.x, data.train.y),
            noise_std=sigma,
            learning_rate=t.learning_rate,
            steps=steps,
            batch_size=b,
            batching=cv.batching,
            diameter=cv.diameter,
            lr_power=cv.lr_power,
            adjacency=cv.adjacency,
            seed=cfg.seed,
        )

    sigma = cv.noise_std
    if sigma is None:
        sigma = calibrate_noise(
            p.target_epsilon, p.delta, lambda s: trainer(s).planned_ledger(), p.accountant
        )
    run = trainer(sigma)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(config_to_toml(cfg))
    bar = _Progress(steps, 0, progress)
    try:
        w = run.train(callback=lambda _: bar.update(math.nan, None))
    finally:
        bar.close()
    torch.save({"weights": w, "glm": dataclasses.asdict(glm)}, out / "model.pt")
    run.ledger.save(out / LEDGER)
    certified = epsilon(run.ledger, p.delta, p.accountant)  # the budget's accountant
    setting = setting_from_ledger(run.ledger)
    li = last_iterate_report(
        setting, p.delta
    )  # the last-iterate bound and the composition bound, side by side
    test_accuracy = accuracy(w, glm, data.test.x, data.test.y)
    row = {
        "step": steps,
        "test_accuracy": test_accuracy,
        "epsilon": certified.epsilon,
        "delta": p.delta,
        "epsilon_last_iterate": li["epsilon"],
    }
    with open(out / METRICS, "a") as f:
        f.write(json.dumps(row) + "\n")
    summary = {
        "epsilon": certified.epsilon,
        "delta": p.delta,
        "accountant": p.accountant,
        "certified": certified.certified,
        "epsilon_last_iterate": li["epsilon"],
        "epsilon_composition": epsilon(run.ledger, p.delta, "rdp").epsilon,
        "last_iterate_certified": certifiable(setting),
        **({} if certifiable(setting) else {"last_iterate_note": NOT_CERTIFIED}),
        "burn_in_steps": li["burn_in_steps"],
        "test_accuracy": test_accuracy,
        "steps": steps,
        "planned_steps": steps,
        "finished": True,
        "epochs": steps * b / n,
        "noise_multiplier": run.noise_std,
        "noise_std": run.noise_std,
        "sampling_rate": b / n,
        "sampling": cv.batching,
        "max_grad_norm": None,
        "batch_size": b,
        "target_epsilon": p.target_epsilon,
        "dataset": data.description,
        "train_size": n,
        "model": f"{cv.loss} GLM (projected noisy SGD, last iterate)",
        "grad_sampler": "closed form",
        "lipschitz": run.lipschitz,
        "smoothness": run.smoothness,
        "diameter": cv.diameter,
        "wall_time_s": time.perf_counter() - start,
        "out": str(out),
    }
    write_json_atomic(out / SUMMARY, summary)
    return summary
