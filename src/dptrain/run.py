"""A training job from a typed config: the Python function behind ``dptrain train``.

The run directory's files and who may write them are described in :mod:`dptrain.rundir`: shareable outputs
(config, metrics, ledger, summary, model) at the top, the secret checkpoint in ``private/``, one run at a time
under a lock. A step is atomic (:mod:`dptrain.interrupts`); Ctrl-C and SIGTERM checkpoint at the next step
boundary and stop, and ``resume=True`` continues into the same run an uninterrupted job would have produced.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dptrain.accounting import AUTO, Ledger, all_reports, steps_for_epochs, tightest
from dptrain.accounting.ledger import training_steps
from dptrain.accounting.proactive import increasing_sample_sizes
from dptrain.config import RunConfig, config_to_toml, load_config
from dptrain.data import ArrayDataset, DataSplit, load_dataset, select_classes
from dptrain.dpsgd_f import FeaturePreprocessing, prepare
from dptrain.engine import (
    Budget,
    PrivateTrainer,
    StepResult,
    ledger_noise_multiplier,
    make_private,
    make_private_with_epsilon,
)
from dptrain.errors import AccountingError, ConfigError, DataError
from dptrain.interrupts import Terminated, deferred_signals, terminate_as_exception
from dptrain.models import build_model
from dptrain.randomness import SEEDED_WARNING, Randomness
from dptrain.rundir import CONFIG, PLAN, PREPROCESSING, SUMMARY, RunDirectory

#: Wall-clock seconds between checkpoints when evaluations are further apart (bounds what kill -9 can lose).
CHECKPOINT_INTERVAL_S = 300.0
#: Seconds between recomputations of the epsilon the progress bar shows (an accountant call can take ~0.5 s).
EPSILON_REFRESH_S = 5.0


@dataclass
class Job:
    cfg: RunConfig
    data: DataSplit  # what the trainer sees (after any feature preprocessing)
    trainer: PrivateTrainer
    total_steps: int
    randomness: Randomness
    preprocessing: FeaturePreprocessing | None = None
    raw_test: ArrayDataset | None = None  # the test set before preprocessing (for the returned raw-feature model)


def build_optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    t = cfg.training
    if t.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=t.learning_rate, momentum=t.momentum, weight_decay=t.weight_decay
        )
    return torch.optim.Adam(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)


def load_data(cfg: RunConfig) -> DataSplit:
    """The run's data: the loader, then the class selection of data.classes if any."""
    data = load_dataset(cfg.data.name, cfg.data.path, seed=cfg.data.seed, **cfg.data.options)
    return data if cfg.data.classes is None else select_classes(data, list(cfg.data.classes))


def run_randomness(cfg: RunConfig) -> Randomness:
    """The run's streams (an explicit seed is announced by :func:`_announce_seed` once the run starts)."""
    return Randomness(cfg.seed, secure=cfg.privacy.secure_noise, warn=False)


def _announce_seed(cfg: RunConfig) -> None:
    """One warning line when a run starts with an explicit seed (the summary records it too)."""
    if cfg.seed is not None:
        print(f"dptrain: warning: seed = {cfg.seed}: {SEEDED_WARNING}", file=sys.stderr)


def _preprocess(cfg, data, model, fitted, randomness):
    """The DPSGD-F preprocessing stage (docs/dpsgd_f.md): fit it on the training set (recording its releases in a
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
        randomness=randomness,
        fitted=fitted,
    )
    tf = prepared.preprocessing.transform

    def part(ds: ArrayDataset) -> ArrayDataset:
        return ArrayDataset(tf(ds.x), ds.y, ds.num_classes, ds.name)

    what = (
        f"{pre.kind} preprocessing" if pre.kind != "none" else f"features normalized to {pre.feature_norm:g}"
    )
    return prepared, DataSplit(part(data.train), part(data.test), f"{data.description}, {what}")


def _resolve_accountant(trainer: PrivateTrainer, total: int) -> str:
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
    noise_multiplier: float | None = None,
    accountant: str | None = None,
    fitted: FeaturePreprocessing | None = None,
    data: DataSplit | None = None,
) -> Job:
    """Data, model, optimizer and private trainer for ``cfg``. ``noise_multiplier`` and ``accountant`` override
    calibration (a resumed run keeps those it was calibrated with); ``fitted`` is the released preprocessing of a
    run being resumed (never fitted, i.e. released, twice); ``data`` replaces the config's data (e.g. an audit's
    training set with canaries). Writes nothing."""
    randomness.seed_torch("init")
    data = load_data(cfg) if data is None else data
    model = build_model(cfg.model.name, data.train.input_shape, data.train.num_classes, **cfg.model.options)
    p, t = cfg.privacy, cfg.training
    prepared, raw_test = None, None
    if cfg.preprocessing.kind != "none" or cfg.preprocessing.feature_norm is not None:
        raw_test = data.test
        prepared, data = _preprocess(cfg, data, model, fitted, randomness)
        model = prepared.model
    optimizer = build_optimizer(cfg, model)
    settings = {"max_grad_norm": p.max_grad_norm, "accountant": accountant or p.accountant}
    if prepared is not None:
        settings.update(prepared.settings)
        if accountant is not None:
            settings["accountant"] = accountant
        if fitted is None:
            settings["ledger"] = prepared.ledger
    n = len(data.train)
    if t.batch_size > n and p.sampling == "poisson":
        raise ConfigError(f"training.batch_size must be <= the training set size {n}, got {t.batch_size}")
    common = dict(
        **settings,
        batch_size=t.batch_size,
        sampling=p.sampling,
        clipping=p.clipping,
        max_physical_batch_size=t.max_physical_batch_size,
        grad_sampler=t.grad_sampler,
        randomness=randomness,
        report_not_private=t.log_not_private,
    )
    if t.batch_growth > 0:  # increasing expected batch sizes (Proactive DP, App. B.4): theta = s_max/s_bar ~ 1 + p
        total = t.steps if t.steps is not None else steps_for_epochs(t.epochs, t.batch_size / n)
        common["sample_sizes"] = increasing_sample_sizes(t.batch_size, total, t.batch_growth, n)
    if p.target_epsilon is None or noise_multiplier is not None:
        budget = None if p.target_epsilon is None else Budget(p.target_epsilon, p.delta)
        sigma = p.noise_multiplier if noise_multiplier is None else noise_multiplier
        trainer = make_private(
            model, optimizer, data.train, noise_multiplier=sigma, delta=p.delta, budget=budget, **common
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
    total = trainer.steps_for(**cfg.steps_or_epochs)
    if trainer.accountant == AUTO:
        trainer.accountant = _resolve_accountant(trainer, total)
    return Job(cfg, data, trainer, total, randomness, None if prepared is None else prepared.preprocessing, raw_test)


class _Progress:
    """tqdm progress bar showing steps and epsilon spent (and the training loss, labelled not private, only when
    the config asks for non-private statistics)."""

    def __init__(self, total: int, initial: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)
        self.loss = math.nan

    def update(self, result: StepResult | None, eps: float | None) -> None:
        postfix = {} if eps is None else {"eps": f"{eps:.3f}"}
        loss = (result.not_private or {}).get("train_loss") if result is not None else None
        if loss is not None:
            self.loss = loss if math.isnan(self.loss) else 0.9 * self.loss + 0.1 * loss
            postfix["loss (not private)"] = f"{self.loss:.3f}"
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_training(
    cfg: RunConfig | None,
    out: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    plan: dict | None = None,
) -> dict:
    """Run (or resume) a job; returns the summary. ``stop_after`` ends this invocation after that many steps with a
    checkpoint (for time-sliced jobs); ``resume`` continues the run stored in ``out``; ``plan`` (from ``dptrain
    plan``) is checked against the data (its guarantee holds only for the data set size it was made for) and
    recorded in the run directory."""
    rd = RunDirectory(out)
    if resume:
        return _resume(rd, progress, stop_after)
    if cfg is None:
        raise ConfigError("a config is needed to start a run")
    if cfg.training.algorithm == "projected_noisy_sgd":
        if stop_after is not None or plan is not None:
            raise ConfigError(
                "projected noisy SGD runs cannot be cut with --stop-after or planned yet; run them whole (only the "
                "last iterate is released)"
            )
        return run_projected(cfg, rd, progress)
    rd.refuse_if_holding()  # early, before the work of building the job
    start = time.perf_counter()
    job = build_job(cfg, run_randomness(cfg))
    if plan is not None and int(plan.get("dataset_size", -1)) != len(job.data.train):
        raise ConfigError(
            f"the plan was made for a data set of {plan.get('dataset_size')} examples, but the training set has "
            f"{len(job.data.train)}; plan again with --dataset-size {len(job.data.train)}"
        )
    with rd.locked(create=True):
        rd.refuse_if_holding()  # authoritative: under the lock
        rd.write_text(CONFIG, config_to_toml(cfg))
        _announce_seed(cfg)
        if plan is not None:
            rd.write_json(PLAN, plan)
        if job.preprocessing is not None:  # released statistics (private mean, tau): part of the output
            rd.write_json(PREPROCESSING, job.preprocessing.to_dict())
        return _train(job, rd, progress, stop_after, elapsed=0.0, start=start)


def _resume(rd: RunDirectory, progress: bool, stop_after: int | None) -> dict:
    with rd.locked():
        cfg = load_config(rd / CONFIG)
        if cfg.training.algorithm == "projected_noisy_sgd":
            raise ConfigError("projected noisy SGD runs cannot be resumed; run them whole")
        previous = rd.read_json(SUMMARY)
        if previous is not None and previous.get("finished"):
            print(
                f"dptrain: the run in {rd.path} has finished ({previous.get('steps')} of "
                f"{previous.get('planned_steps')} steps); nothing to resume",
                file=sys.stderr,
            )
            return previous
        start = time.perf_counter()
        state = rd.load_checkpoint()
        ledger = Ledger.from_dict(state["ledger"])
        rd.check_ledger_copy(ledger)
        job = build_job(
            cfg,
            Randomness(cfg.seed, secure=cfg.privacy.secure_noise, warn=False),
            # sigma lives in the ledger (a run cut before its first step calibrates again: deterministic)
            noise_multiplier=ledger_noise_multiplier(ledger) if training_steps(ledger) else None,
            accountant=state["accountant"],
            fitted=_load_preprocessing(rd, cfg),
        )
        job.trainer.load_state_dict(state)
        rd.truncate_metrics(job.trainer.steps)
        return _train(job, rd, progress, stop_after, elapsed=float(state.get("elapsed_s", 0.0)), start=start)


def _train(job: Job, rd: RunDirectory, progress: bool, stop_after: int | None, elapsed: float, start: float):
    """The training loop of a run holding ``rd``'s lock: steps, evaluations, checkpoints, the summary."""
    trainer, cfg = job.trainer, job.cfg
    eval_every = cfg.training.eval_every or max(1, round(1 / trainer.sampling_rate))
    remaining = max(0, job.total_steps - trainer.steps)
    if stop_after is not None:
        remaining = min(remaining, stop_after)
    wall = lambda: elapsed + time.perf_counter() - start  # noqa: E731
    bar = _Progress(job.total_steps, trainer.steps, progress)
    eps, eps_time, last_checkpoint = None, -math.inf, time.perf_counter()
    try:
        with terminate_as_exception():
            for result in trainer.iter_steps(remaining):
                if progress and time.perf_counter() - eps_time > EPSILON_REFRESH_S:
                    eps, eps_time = trainer.epsilon().epsilon, time.perf_counter()
                bar.update(result, eps)
                evaluate = result.step % eval_every == 0 and result.step < job.total_steps
                if evaluate or time.perf_counter() - last_checkpoint > CHECKPOINT_INTERVAL_S:
                    with deferred_signals():
                        _checkpoint(rd, job, wall())
                        if evaluate:
                            _evaluate_and_log(rd, job, result)
                    last_checkpoint = time.perf_counter()
    except (KeyboardInterrupt, Terminated):
        bar.close()
        with deferred_signals():
            _checkpoint(rd, job, wall())
        print(
            f"\ninterrupted at step {trainer.steps}; continue with: dptrain train --resume {rd.path}",
            file=sys.stderr,
        )
        raise
    finally:
        bar.close()
    finished = trainer.steps >= job.total_steps or (
        trainer.allowed_steps() is not None and trainer.steps >= trainer.allowed_steps()
    )
    with deferred_signals():
        _checkpoint(rd, job, wall())
        final = _evaluate_and_log(rd, job, None)
        summary = _summary(job, rd, final, wall(), finished)
        if job.preprocessing is not None:
            summary.update(_save_raw_model(rd, job))
        else:
            rd.save_model(_model_payload(job))
        rd.write_json(SUMMARY, summary)
    trainer.close()
    return summary


def _checkpoint(rd: RunDirectory, job: Job, wall: float) -> None:
    rd.save_checkpoint({**job.trainer.state_dict(), "elapsed_s": wall}, job.trainer.ledger)


def _model_payload(job: Job) -> dict:
    cfg = job.cfg
    return {
        "state_dict": job.trainer.model.state_dict(),
        "model": cfg.model.name,
        "options": dict(cfg.model.options),
        "input_shape": list(job.data.train.input_shape),
        "num_classes": job.data.train.num_classes,
    }


def _load_preprocessing(rd: RunDirectory, cfg: RunConfig) -> FeaturePreprocessing | None:
    if cfg.preprocessing.kind == "none" and cfg.preprocessing.feature_norm is None:
        return None
    data = rd.read_json(PREPROCESSING)
    if data is None:
        raise DataError(
            f"{rd / PREPROCESSING} is missing or corrupt: the run's released preprocessing is needed to resume it"
        )
    try:
        return FeaturePreprocessing.from_dict(data)
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{rd / PREPROCESSING} is corrupt ({type(e).__name__})") from None


def _save_raw_model(rd: RunDirectory, job: Job) -> dict:
    """The returned model of a preprocessing run: the trained linear map with the bias mapped back, so it applies
    to raw examples (normalized inside). Written as ``model.pt``; its test accuracy on the raw test set is
    reported beside the trainer's (they agree: docs/dpsgd_f.md)."""
    prep = job.preprocessing
    model = prep.raw_model(job.trainer.model)
    rd.save_model({"state_dict": model.state_dict(), "preprocessing": prep.to_dict()})
    with torch.no_grad():
        acc = float((model(job.raw_test.x).argmax(1) == job.raw_test.y).float().mean())
    return {
        "preprocessing": {k: v for k, v in prep.to_dict().items() if k != "mean"},
        "test_accuracy_raw_model": acc,
    }


def _evaluate_and_log(rd: RunDirectory, job: Job, result: StepResult | None) -> dict:
    t = job.trainer
    report = t.epsilon()
    row = {
        "step": t.steps,
        "epoch": t.expected_epochs,
        "test_accuracy": t.evaluate(job.data.test.x, job.data.test.y),
        "epsilon": report.epsilon,
        "delta": report.delta,
    }
    if result is not None and result.not_private is not None:
        row["not_private"] = result.not_private  # asked for by training.log_not_private; labelled
    rd.append_metrics(row)
    return {"row": row, "report": report}


def accountant_table(ledger: Ledger, delta: float) -> dict:
    """Every accountant's answer for the run's ledger: {name: {epsilon, certified} or {refused: why}}."""
    reports, refusals = all_reports(ledger, delta)
    table = {k: {"epsilon": r.epsilon, "certified": r.certified} for k, r in reports.items()}
    table.update({k: {"refused": why} for k, why in refusals.items()})
    return table


def _summary(job: Job, rd: RunDirectory, final: dict, wall: float, finished: bool) -> dict:
    t, cfg, report = job.trainer, job.cfg, final["report"]
    summary = {
        "epsilon": report.epsilon,
        "delta": report.delta,
        "accountant": report.accountant,
        "certified": report.certified,
        "accountant_choice": "auto: the tightest certified" if cfg.privacy.accountant == AUTO else "config",
        "accountants": accountant_table(t.ledger, report.delta),
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
        "randomness": job.randomness.description,
        "secure_noise": job.randomness.secure,
        "wall_time_s": wall,
        "out": str(rd.path),
    }
    if "optimal_order" in report.details:
        summary["rdp_order"] = report.details["optimal_order"]
    return summary


def format_report(summary: dict) -> str:
    """The privacy/utility report printed at the end of ``dptrain train``."""
    cert = "" if summary["certified"] else "  (approximation, not certified)"
    target = "" if summary["target_epsilon"] is None else f" (target {summary['target_epsilon']:g})"
    others = ", ".join(
        f"{k} {v['epsilon']:.4f}" + ("" if v["certified"] else " (approx.)")
        for k, v in summary.get("accountants", {}).items()
        if "epsilon" in v and k != summary["accountant"]
    )
    rows = [
        ("privacy", f"epsilon = {summary['epsilon']:.4f}{target} at delta = {summary['delta']:g}{cert}"),
        ("accountant", summary["accountant"] + (f" (others: {others})" if others else "")),
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
        ("randomness", summary["randomness"]),
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


@dataclass
class ProjectedJob:
    """A projected noisy SGD run as ``dptrain train`` builds it (nothing trained, nothing written)."""

    cfg: RunConfig
    data: DataSplit
    run: object  # dptrain.last_iterate.ProjectedNoisySGD
    accountant: str
    randomness: Randomness


def build_projected(cfg: RunConfig, randomness: Randomness, data: DataSplit | None = None) -> ProjectedJob:
    """Projected noisy SGD for ``cfg`` (or on ``data``): the GLM, the steps, sigma (given, or calibrated by
    ``privacy.accountant``) and the accountant that certifies the run (``auto`` resolved to the tightest certified
    one for the planned ledger)."""
    from dptrain.accounting import calibrate
    from dptrain.last_iterate import ConvexGLM, ProjectedNoisySGD

    p, t, cv = cfg.privacy, cfg.training, cfg.convex
    data = load_data(cfg) if data is None else data
    glm = ConvexGLM(cv.loss, cv.feature_norm, fit_bias=cv.fit_bias, l2=cv.l2)
    n = len(data.train)
    b = n if cv.batching == "full" else t.batch_size
    steps = t.steps if t.steps is not None else steps_for_epochs(t.epochs, b / n)

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
            randomness=randomness,
        )

    sigma, accountant = cv.noise_std, p.accountant
    if sigma is None:
        cal = calibrate(p.target_epsilon, p.delta, lambda s: trainer(s).planned_ledger(), p.accountant)
        sigma, accountant = cal.noise_multiplier, cal.accountant
    run = trainer(sigma)
    if accountant == AUTO:
        best = tightest(all_reports(run.planned_ledger(), p.delta)[0])
        if best is None:
            raise AccountingError("no accountant certifies this projected run")
        accountant = best.accountant
    return ProjectedJob(cfg, data, run, accountant, randomness)


def run_projected(cfg: RunConfig, rd: RunDirectory, progress: bool = True) -> dict:
    """Projected noisy SGD on a convex GLM (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent").
    The budget is certified by ``privacy.accountant`` (``auto``: the tightest certified of composition by rdp/pld
    and, for full and cyclic batches where it is proven for both orderings of a neighbouring pair, the
    last-iterate bound); every other accountant is reported beside it, and for random batches the last-iterate
    bound is reported only, not certified (docs/last_iterate.md). Only the final iterate is written (``model.pt``,
    the release); no intermediate iterate is logged or checkpointed."""
    from dptrain.accounting import epsilon
    from dptrain.accounting.last_iterate import (
        NOT_CERTIFIED,
        certifiable,
        last_iterate_report,
        setting_from_ledger,
    )
    from dptrain.last_iterate import accuracy

    rd.refuse_if_holding()
    start = time.perf_counter()
    job = build_projected(cfg, run_randomness(cfg))
    p, cv, run, accountant, data = cfg.privacy, cfg.convex, job.run, job.accountant, job.data
    glm, steps, b, n = run.glm, run.steps, run.batch_size, run.n
    with rd.locked(create=True):
        rd.refuse_if_holding()
        rd.write_text(CONFIG, config_to_toml(cfg))
        _announce_seed(cfg)
        bar = _Progress(steps, 0, progress)
        try:
            w = run.train(callback=lambda _: bar.update(None, None))
        finally:
            bar.close()
        rd.save_model({"weights": w, "glm": dataclasses.asdict(glm)})
        run.ledger.save(rd / "ledger.json")
        certified = epsilon(run.ledger, p.delta, accountant)
        setting = setting_from_ledger(run.ledger)
        li = last_iterate_report(setting, p.delta)  # the last-iterate bound and the composition bound, side by side
        test_accuracy = accuracy(w, glm, data.test.x, data.test.y)
        rd.append_metrics(
            {
                "step": steps,
                "test_accuracy": test_accuracy,
                "epsilon": certified.epsilon,
                "delta": p.delta,
                "epsilon_last_iterate": li["epsilon"],
            }
        )
        summary = {
            "epsilon": certified.epsilon,
            "delta": p.delta,
            "accountant": accountant,
            "certified": certified.certified,
            "accountant_choice": "auto: the tightest certified" if p.accountant == AUTO else "config",
            "accountants": accountant_table(run.ledger, p.delta),
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
            "randomness": job.randomness.description,
            "secure_noise": job.randomness.secure,
            "wall_time_s": time.perf_counter() - start,
            "out": str(rd.path),
        }
        rd.write_json(SUMMARY, summary)
    return summary
