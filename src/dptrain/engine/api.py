"""The front doors of the engine: a model, its optimizer and data made private with a fixed noise multiplier
(:func:`make_private`) or with the smallest one that meets a budget (:func:`make_private_with_epsilon`). Both build a
:class:`~dptrain.engine.trainer.PrivateTrainer`; options the trainer does not take are refused in one line."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from dptrain.accounting import AUTO, calibrate
from dptrain.engine import bandmf
from dptrain.engine.trainer import Budget, PrivateTrainer
from dptrain.errors import ConfigError


def _check_options(options: dict, function: str, taken: tuple[str, ...]) -> None:
    """A one-line ConfigError for an option ``function`` does not take (instead of Python's TypeError)."""
    fixed = ("self", "model", "optimizer", "data", *taken)
    accepted = [p for p in inspect.signature(PrivateTrainer.__init__).parameters if p not in fixed]
    unknown = sorted(k for k in options if k not in accepted)
    if unknown:
        raise ConfigError(f"{function}() takes no option {unknown[0]!r}; its options: {', '.join(accepted)}")


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    noise_multiplier: float,
    max_grad_norm: float = 1.0,
    batch_size: float | None = None,
    **options,
) -> PrivateTrainer:
    """Wrap a model, its optimizer and training data into a DP-SGD run with a fixed noise multiplier.

    ``batch_size`` is the expected logical batch size (Poisson sampling rate q = batch_size / len(data)).
    Options: noise_schedule (a shape s_t, t = 1..T: step t adds noise of multiplier noise_multiplier x s_t, and the
    run has at most T steps; :mod:`dptrain.schedules`), sampling ("poisson" | "full" | "fixed_size" | "cyclic" | "shuffled": :mod:`dptrain.stages.batch_selection`), delta, accountant (default "auto": the tightest certified one),
    clipping ("flat" | "per_layer" | "l2_linf", with linf_p: Algorithm 2 of ModelMix), loss_fn (per-example losses), max_physical_batch_size (default: automatic,
    per-example gradients of a chunk within 256 MiB), grad_sampler ("auto" | "func" | "layerwise"),
    seed (None: secret randomness from the operating system; an integer makes the run reproducible and NOT
    private), secure_noise (AES-CTR noise, :mod:`dptrain.randomness.secure`), budget (a :class:`Budget` the run
    must not exceed), ledger (to continue an earlier one), check_independence (default True: refuse models
    that mix examples, :mod:`dptrain.preflight.gradient_check`), report_not_private (per-step loss and clip statistics,
    NOT private), non_private (a baseline for experiments: the same sampling, clipping and optimizer with
    noise_multiplier=0, nothing recorded in the ledger, no epsilon: NOT private), augment (augmentation multiplicity
    for images, e.g. ``{"multiplicity": 8, "crop_padding": 4, "flip": True}``: each example's gradient the mean over
    its views before clipping, :mod:`dptrain.stages.augmentation`), ema (e.g. 0.999: the weight average of the
    released iterates, ``trainer.weight_average``, :mod:`dptrain.engine.weight_averaging`; docs/recipes.md), noise
    ("gaussian" or "bandmf": banded matrix factorization, noise correlated across steps over cyclic Poisson groups,
    docs/bandmf.md) with bands (an integer; "auto" needs a budget: :func:`make_private_with_epsilon`) and planned_steps (the run's
    length, for which BandMF's coefficients are optimized).
    """
    _check_options(options, "make_private", ("noise_multiplier", "max_grad_norm", "batch_size"))
    trainer = PrivateTrainer(
        model,
        optimizer,
        data,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        **options,
    )
    if trainer.noise_schedule is not None and trainer.budget is not None:
        # A schedule cut short by its budget never takes its low-noise steps: refuse it before the first step.
        allowed, total = trainer.allowed_steps(), trainer.max_steps
        if allowed < total:
            raise ConfigError(
                f"the noise schedule has {total} steps but the budget epsilon={trainer.budget.epsilon:g} at "
                f"delta={trainer.budget.delta:g} allows only {allowed} of them at noise multiplier "
                f"{trainer.noise_multiplier:g}; raise the noise multiplier (make_private_with_epsilon calibrates "
                "it) or shorten the schedule"
            )
    return trainer


def make_private_with_epsilon(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: float | None = None,
    steps: int | None = None,
    max_grad_norm: float = 1.0,
    batch_size: float | None = None,
    accountant: str = AUTO,
    schedule_calibration: str = "tightest",
    **options,
) -> PrivateTrainer:
    """Like :func:`make_private`, but calibrates the smallest noise multiplier that lets ``epochs`` (or
    ``steps``) steps meet (target_epsilon, target_delta), and enforces that budget during training. With
    ``accountant="auto"`` every accountant that certifies the run is tried and the one needing the least noise
    certifies it (``trainer.accountant`` names it).

    With ``noise_schedule`` (a shape s_t, or a :class:`dptrain.schedules.calibration.Schedule`) the noise multiplier is
    the schedule's scale c (sigma_t = c s_t), calibrated by :func:`dptrain.schedules.scale.calibrate_scale`;
    ``schedule_calibration="zcdp"`` calibrates it as the paper does (sum_t 1/(2 sigma_t^2) = rho).

    With ``noise="bandmf"`` (docs/bandmf.md) the coefficients are optimized for the ``epochs`` (``steps``) planned, and
    ``bands="auto"`` (the default) chooses b before training from public quantities (steps, sampling rate, budget,
    the optimizer's momentum) by the smallest error relative to DP-SGD at this budget
    (:func:`dptrain.accounting.choose_bands`); the noise is then calibrated for that b."""
    _check_options(
        options,
        "make_private_with_epsilon",
        ("noise_multiplier", "max_grad_norm", "batch_size", "delta", "accountant", "planned_steps"),
    )
    noise, bands = options.pop("noise", "gaussian"), options.pop("bands", None)
    bandmf.check_noise(noise, bands, None)
    trainer = PrivateTrainer(
        model,
        optimizer,
        data,
        noise_multiplier=1.0,  # replaced by the calibrated value below, before any step
        max_grad_norm=max_grad_norm,
        batch_size=batch_size,
        delta=target_delta,
        accountant=accountant,
        **options,
    )
    total = trainer.steps_for(steps, epochs)
    if total < 1:
        raise ConfigError(f"steps must be an integer >= 1, got {total}")
    if noise == "bandmf":  # b chosen (or given) for this budget, installed before the calibration reads its ledger
        trainer.bandmf = bandmf.for_budget(trainer, bands, total, target_epsilon, target_delta)
    if trainer.noise_schedule is None:
        cal = calibrate(
            target_epsilon, target_delta, lambda sigma: trainer.ledger_after(total, sigma), accountant
        )
    else:  # one scale for the whole schedule (sigma_t = c s_t), by the schedule's own calibration
        from dptrain.schedules.scale import calibrate_scale

        cal = calibrate_scale(
            target_epsilon,
            target_delta,
            lambda c: trainer.ledger_after(total, c),
            trainer.noise_schedule[trainer.steps : trainer.steps + total],
            trainer.sampling_rate,
            accountant=accountant,
            method=schedule_calibration,
            sampling=trainer.sampler.scheme,
        )
    trainer._noise_multiplier = cal.noise_multiplier
    trainer.accountant = cal.accountant
    trainer.calibration = cal
    trainer.budget = Budget(target_epsilon, target_delta)
    # calibrate() certified the planned run, so it may take exactly its planned steps (no search for the last
    # step the budget would allow).
    trainer._allowed_steps = trainer.steps + total
    return trainer


__all__ = ["make_private", "make_private_with_epsilon"]
