"""The job of ``training.algorithm = "projected_noisy_sgd"`` (Altschuler & Talwar, "Privacy of Noisy Stochastic
Gradient Descent: More Iterations without More Privacy Loss"; docs/last_iterate.md): the run's GLM, steps and noise
(calibrated, given, or read from a resumed ledger), the accountant that certifies it, and the
:class:`dptrain.runs.job.Job` that evaluates and saves only the last iterate."""

from __future__ import annotations

from dataclasses import asdict

from dptrain.accounting import AUTO, RunNumbers, all_reports, calibrate, epsilon, tightest
from dptrain.accounting.last_iterate import (
    MECHANISM,
    NOT_CERTIFIED,
    certifiable,
    last_iterate_report,
    setting_from_ledger,
)
from dptrain.accounting.ledger import Ledger
from dptrain.errors import AccountingError
from dptrain.last_iterate.algorithm import _SAMPLERS, ProjectedNoisySGD
from dptrain.last_iterate.glm import ConvexGLM, accuracy
from dptrain.randomness.generators import Randomness
from dptrain.runs.job import Job, load_data


def build_projected(cfg, randomness: Randomness, data=None, ledger: Ledger | None = None):
    """(ProjectedNoisySGD, data, accountant) for ``cfg``: the GLM, the steps, sigma (read from a resumed run's
    ledger, given by convex.noise_std, or calibrated by ``privacy.accountant``) and the accountant that certifies
    the run (``auto`` resolved to the tightest certified one for the planned ledger)."""
    p, t, cv = cfg.privacy, cfg.training, cfg.convex
    data = load_data(cfg) if data is None else data
    glm = ConvexGLM(cv.loss, cv.feature_norm, fit_bias=cv.fit_bias, l2=cv.l2)
    n = len(data.train)
    b = n if cv.batching == "full" else t.batch_size
    steps = RunNumbers.planned(
        _SAMPLERS[cv.batching], dataset_size=n, batch_size=b, **cfg.steps_or_epochs
    ).steps

    def make(sigma: float) -> ProjectedNoisySGD:
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
    steps_done = [
        e for e in (ledger.entries if ledger is not None else []) if e.facts.get("mechanism") == MECHANISM
    ]
    if steps_done:
        sigma = float(steps_done[-1].facts["noise_std"])  # sigma lives in the ledger
    elif sigma is None:
        cal = calibrate(p.target_epsilon, p.delta, lambda s: make(s).planned_ledger(), p.accountant)
        sigma, accountant = cal.noise_multiplier, cal.accountant
    run = make(sigma)
    if accountant == AUTO:
        best = tightest(all_reports(run.planned_ledger(), p.delta)[0])
        if best is None:
            raise AccountingError("no accountant certifies this projected run")
        accountant = best.accountant
    run.trainer.accountant = accountant
    return run, data, accountant


def build_job(cfg, randomness: Randomness, *, ledger=None, accountant=None, resumed=None, data=None, checks=True):
    """The :class:`dptrain.runs.job.Job` of projected noisy SGD: the engine's trainer inside :class:`ProjectedNoisySGD`,
    evaluated and saved only at the end (the last iterate is the release), with the last-iterate bound and the
    composition bound side by side in the summary. (``checks``: a GLM's gradients are its closed form, which the model
    probe does not compare: nothing to skip.)"""
    run, data, chosen = build_projected(cfg, randomness, data, ledger)
    if accountant is not None:
        run.trainer.accountant = accountant
    glm = run.glm

    def save_model(rd) -> dict:
        rd.save_model({"weights": run.final_model(), "glm": asdict(glm)})
        return {}

    def extras() -> dict:
        setting = setting_from_ledger(run.ledger)
        li = last_iterate_report(setting, cfg.privacy.delta)
        return {
            "epsilon_last_iterate": li["epsilon"],
            "epsilon_composition": epsilon(run.ledger, cfg.privacy.delta, "rdp").epsilon,
            "last_iterate_certified": certifiable(setting),
            **({} if certifiable(setting) else {"last_iterate_note": NOT_CERTIFIED}),
            "burn_in_steps": li["burn_in_steps"],
            "noise_std": run.noise_std,
            "sampling": run.batching,
            "batch_size": run.batch_size,
            "max_grad_norm": None,
            "lipschitz": run.lipschitz,
            "smoothness": run.smoothness,
            "diameter": run.diameter,
        }

    return Job(
        cfg,
        data,
        run.trainer,
        run.steps,
        randomness,
        evaluate=lambda: accuracy(run.final_model(), glm, data.test.x, data.test.y),
        save_model=save_model,
        example_losses=lambda x, y: glm.per_example_losses(
            run.final_model(), glm.prepare_features(x, run.dtype), glm.prepare_labels(y, run.dtype)
        ),
        extras=[extras],
        description=f"{glm.loss} GLM (projected noisy SGD, last iterate; per-example gradients: closed form)",
    )
