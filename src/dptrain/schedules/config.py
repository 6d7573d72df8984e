"""The ``[schedule]`` config section: DP-SGD with a noise schedule sigma_t = c s_t ("On Dynamic Noise Influence in
Differential Private Learning", anonymous ICLR 2021 submission; docs/schedules.md), a stage of DP-SGD jobs. Imports
no torch.

    [privacy]
    target_epsilon = 2.0          # the scale c is calibrated so that the whole schedule spends exactly this
    delta = 1e-5

    [schedule]
    kind = "gd-optimal"           # see dptrain.schedules.names.KINDS (dptrain schedule --help)
    options = { kappa = 10 }      # the kind's parameters (influence: a file name or a list of T numbers)
    calibration = "tightest"      # or "zcdp": the paper's calibration (sum_t 1/(2 sigma_t^2) = rho)
    levels = 16                   # optional: round the shape to that many geometric levels (0: the exact shape)

With ``privacy.noise_multiplier`` instead of ``target_epsilon``, that number is the scale c (the largest sigma_t:
every shape's largest value is 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.config import RunConfig, Section, finite, need, register_section, section_is_default
from dptrain.errors import ConfigError
from dptrain.schedules.names import KIND_PARAMS
from dptrain.schedules.names import KINDS as SHAPE_KINDS

#: The kinds: the shapes of dptrain.schedules.names (read without scipy) and the adaptive one.
KINDS = (*SHAPE_KINDS, "validation")
#: Levels a Poisson-sampled run's shape is rounded to by default: few enough for the pld accountant, which is
#: the tightest for subsampled steps (dptrain.schedules.spend.PLD_MAX_LEVELS).
DEFAULT_POISSON_LEVELS = 16
#: A full-batch run keeps its exact shape by default, up to this many distinct levels (beyond, the shape is rounded
#: to them, so that a 10^5-step schedule keeps a small ledger; the gdp accountant stays exact for the rounded steps).
MAX_DEFAULT_LEVELS = 1024
#: dptrain.schedules.scale.METHODS
CALIBRATIONS = ("tightest", "zcdp")


@dataclass(frozen=True)
class ScheduleConfig:
    """A noise schedule for DP-SGD (docs/schedules.md)."""

    kind: str = "none"  # none (constant noise) | uniform | influence | gd-optimal | momentum | exponential | ...
    options: dict = field(default_factory=dict)  # the kind's parameters (kappa, gamma, beta, influence, rate, ...)
    calibration: str = "tightest"  # tightest (the accountant that certifies the run) | zcdp (the paper's)
    levels: int | None = None  # None: 16 for Poisson, the exact shape (<= 1024 levels) for full batches; 0: exact; N
    rho: float | None = None  # a zCDP budget instead of privacy.target_epsilon: sum_t 1/(2 sigma_t^2) = rho
    R: float | None = None  # the paper's budget, R = 2 rho (sum_t sigma_t^-2 = R)  # noqa: N815


def validate(cfg: RunConfig) -> None:
    s, p, t = cfg.schedule, cfg.privacy, cfg.training
    if s.kind == "none":
        if not section_is_default(cfg, "schedule"):
            raise ConfigError(f"[schedule] needs schedule.kind (one of {', '.join(KINDS)})")
        return
    need(s.kind in KINDS, "schedule.kind", f"one of none, {', '.join(KINDS)}", s.kind)
    from dptrain.schedules.validation import DEFAULTS

    takes = tuple(DEFAULTS) if s.kind == "validation" else KIND_PARAMS[s.kind]
    for key in s.options:
        if key not in takes:
            accepted = f"it takes {', '.join(takes)}" if takes else "it takes none"
            raise ConfigError(f"schedule.options.{key} is not a parameter of schedule kind {s.kind!r}; {accepted}")
    need(s.calibration in CALIBRATIONS, "schedule.calibration", f"one of {', '.join(CALIBRATIONS)}", s.calibration)
    if s.calibration != "tightest" and p.target_epsilon is None:
        raise ConfigError("schedule.calibration applies when privacy.target_epsilon is set (it calibrates the scale)")
    if s.levels is not None:
        need(s.levels >= 0, "schedule.levels", "an integer >= 0 (0: the exact shape)", s.levels)
    if s.rho is not None or s.R is not None:
        if s.rho is not None and s.R is not None:
            raise ConfigError("give schedule.rho or schedule.R (= 2 rho), not both")
        key, value = ("schedule.rho", s.rho) if s.rho is not None else ("schedule.R", s.R)
        need(finite(value) and value > 0, key, "a finite number > 0", value)
        if s.kind == "validation":
            raise ConfigError('schedule.kind = "validation" takes privacy.target_epsilon, not a zCDP budget')
        if s.calibration != "tightest":
            raise ConfigError(f"{key} is a zCDP budget: the scale is the paper's (zCDP) by definition; drop schedule.calibration")
    if s.kind == "validation":
        if p.target_epsilon is None:
            raise ConfigError(
                'schedule.kind = "validation" needs privacy.target_epsilon: its noise is chosen during the run, under '
                "a privacy filter for that budget"
            )
        if s.levels is not None:
            raise ConfigError('schedule.levels does not apply to schedule.kind = "validation" (its noise is adaptive)')
    if cfg.noise.mechanism != "gaussian":
        raise ConfigError(f"[schedule] changes sigma from step to step: it needs independent Gaussian noise, not noise.mechanism = {cfg.noise.mechanism!r}")
    if t.algorithm != "dpsgd":
        raise ConfigError(f'[schedule] is a noise stage of DP-SGD (training.algorithm = "dpsgd"), not {t.algorithm!r}')
    if t.update != "optimizer":
        raise ConfigError(
            f"[schedule] with training.update = {t.update!r} is not supported: that update rule's accountant analyses "
            "one noise multiplier"
        )
    if p.sampling not in ("poisson", "full"):
        raise ConfigError(f'[schedule] needs privacy.sampling = "poisson" or "full", got {p.sampling!r}')
    if t.batch_growth:
        raise ConfigError("[schedule] needs a constant expected batch size (training.batch_growth = 0)")


def levels_for(cfg: RunConfig) -> int:
    """The levels the shape is rounded to (0: none)."""
    s = cfg.schedule
    if s.levels is not None:
        return s.levels
    return DEFAULT_POISSON_LEVELS if cfg.privacy.sampling == "poisson" else 0


def supplies_noise(cfg: RunConfig) -> bool:
    return cfg.schedule.kind != "none" and (cfg.schedule.rho is not None or cfg.schedule.R is not None)


register_section(
    Section("schedule", ScheduleConfig, validate, stage="dptrain.schedules.stage:stage", supplies_noise=supplies_noise)
)
