"""The ``[schedule]`` section's stage of a DP-SGD job: the noise schedule's shape s_t for the planned steps, which the
engine turns into sigma_t = c s_t (:class:`dptrain.engine.trainer.PrivateTrainer`, ``noise_schedule``), and the summary
entry that says what it was. No torch (the engine does the drawing)."""

from __future__ import annotations

import numpy as np

from dptrain.errors import ConfigError
from dptrain.schedules.calibration import calibrate_shape
from dptrain.schedules.config import MAX_DEFAULT_LEVELS, levels_for
from dptrain.schedules.shapes import quantised_shape, read_influence, schedule_shape
from dptrain.schedules.spend import spent_rho


def shape_for(cfg, steps: int) -> np.ndarray:
    """The config's schedule shape for ``steps`` steps (largest value 1), rounded to its levels."""
    s = cfg.schedule
    params = dict(s.options)
    if isinstance(params.get("influence"), str):
        params["influence"] = read_influence(params["influence"], "schedule.options.influence")
    shape = schedule_shape(s.kind, steps, **params)
    levels = levels_for(cfg)
    if not levels and s.levels is None and np.unique(shape).size > MAX_DEFAULT_LEVELS:
        levels = MAX_DEFAULT_LEVELS  # a long full-batch run: a compact ledger by default
    return quantised_shape(shape, levels) if levels else shape


def stage(draft) -> None:
    cfg = draft.cfg
    if cfg.schedule.kind == "none":
        return
    if cfg.schedule.kind == "validation":
        from dptrain.schedules.validation import validation_noise

        public = cfg.data.test_is_public
        if not (draft.data.separate_test if public is None else public):
            raise ConfigError(
                'schedule.kind = "validation" reads the evaluation on the test split as public data, but '
                f"{cfg.data.name!r} splits its test set off the training examples (adding or removing one example moves "
                "others between the splits): give data with its own test set (fashion-mnist, or an .npz with x_test "
                "and y_test), or declare it public with data.test_is_public = true"
            )

        def controller(steps: int, sampling_rate: float):
            p = cfg.privacy
            return validation_noise(
                steps,
                p.target_epsilon,
                p.delta,
                sampling_rate=sampling_rate,
                calibration=cfg.schedule.calibration,
                **cfg.schedule.options,
            )

        draft.noise_controller = controller
    else:
        draft.noise_schedule = lambda steps: shape_for(cfg, steps)
        draft.schedule_calibration = cfg.schedule.calibration
        s = cfg.schedule
        if s.rho is not None or s.R is not None:  # a zCDP budget: the scale spends it exactly (Lemma 4.1's normalisation)
            draft.noise_scale = lambda shape: calibrate_shape(shape, rho=s.rho, R=s.R).scale / float(np.max(shape))
    draft.extras.append(lambda: summary(draft.trainer, cfg))


def summary(trainer, cfg) -> dict:
    """The summary entry of a run with a noise schedule: its kind, scale and the range of its noise multipliers."""
    if trainer.noise_controller is not None:
        return {"noise_schedule": _adaptive_summary(trainer, cfg)}
    shape = np.asarray(trainer.noise_schedule)
    c = trainer.noise_multiplier
    return {
        "noise_schedule": {
            "kind": cfg.schedule.kind,
            "options": {k: v for k, v in cfg.schedule.options.items() if not isinstance(v, list)},
            "scale": c,
            "calibration": _calibration(cfg),
            "levels": int(np.unique(shape).size),
            "first": c * float(shape[0]),
            "last": c * float(shape[-1]),
            "min": c * float(shape.min()),
            "max": c * float(shape.max()),
            "rho": spent_rho(c * shape),  # the paper's zCDP figure (no amplification by sampling)
        }
    }


def _adaptive_summary(trainer, cfg) -> dict:
    """The realized noise of an adaptive (validation) run, from its ledger."""
    from dptrain.accounting.ledger import event_noise_multiplier

    sigmas = [event_noise_multiplier(e, trainer.ledger.neighboring) for e in trainer.ledger.entries] or [
        trainer.noise_multiplier
    ]
    c, f = trainer.noise_controller, trainer.noise_controller.filter
    return {
        "kind": "validation",
        "options": dict(cfg.schedule.options),
        "calibration": f"privacy filter ({f.kind}{'' if f.order is None else f', order {f.order}'})",
        "levels": len(set(sigmas)),
        "first": sigmas[0],
        "last": sigmas[-1],
        "min": min(sigmas),
        "max": max(sigmas),
        "decays": c.decays,
        "filter_spent": f.spent(trainer.ledger),
        "filter_budget": f.budget,
    }


def _calibration(cfg) -> str:
    s = cfg.schedule
    if s.rho is not None or s.R is not None:
        return f"zCDP budget ({'rho' if s.rho is not None else 'R'} = {s.rho if s.rho is not None else s.R:g})"
    return s.calibration if cfg.privacy.target_epsilon is not None else "given"
