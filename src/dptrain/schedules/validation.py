"""The ``validation`` noise schedule: lower the noise when a validation metric stops improving, under a privacy filter.

NOT from "On Dynamic Noise Influence in Differential Private Learning": that paper only mentions such schedules; the
form is Yu et al. 2019 ("Differentially Private Model Publishing for Deep Learning"): every time the validation metric
has not improved by ``min_delta`` for ``patience`` evaluations in a row, sigma is multiplied by ``factor`` (< 1).

Because the noise of later steps depends on what the run released (through the validation metric), the run cannot be
calibrated in advance nor certified by composing its realized steps. It runs under a privacy filter fixed before the
first step (:mod:`dptrain.accounting.filters`): every step is accounted at the sigma it used, and the run stops
before a step would take it past the budget (Algorithm 1 of the paper, with a non-strict check). Fully adaptive
composition makes the whole run private at the filter's (epsilon, delta) whatever the signal was, adversarial
included.

The validation signal must not be private data, or its use must be accounted: dptrain's runs feed it the evaluation
they already publish (accuracy on the held-out test split, which dptrain treats as public). Noise choices are then
post-processing of released iterates and public data.

The first sigma is ``initial`` times the constant sigma that would spend the budget in the planned T steps: with
``initial`` = 1 a run that never lowers its noise takes exactly T steps; every decay makes it end earlier.

No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dptrain.accounting.filters import PrivacyFilter, ledger_filter, make_filter
from dptrain.accounting.ledger import FILTER_FACT, Ledger, gaussian_step_event
from dptrain.errors import ConfigError
from dptrain.schedules.bounds_constants import R_from_eps_delta, rho_from_R

#: The validation kind's parameters and their defaults.
DEFAULTS = {"factor": 0.8, "patience": 1, "min_delta": 0.0, "initial": 1.5, "floor": 0.5, "order": None}


@dataclass
class ValidationNoise:
    """Adaptive noise for the engine (:class:`dptrain.engine.trainer.PrivateTrainer`, ``noise_controller``)."""

    filter: PrivacyFilter
    initial: float
    factor: float = DEFAULTS["factor"]
    patience: int = DEFAULTS["patience"]
    min_delta: float = DEFAULTS["min_delta"]
    #: the lowest sigma (0: none)
    floor: float = 0.0
    #: the state (checkpointed)
    sigma: float = field(init=False)
    best: float = field(init=False, default=-math.inf)
    stale: int = field(init=False, default=0)
    decays: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.sigma = self.initial

    @property
    def facts(self) -> dict[str, Any]:
        """Recorded beside every step: the filter (the filter accountant certifies the run with it)."""
        return {FILTER_FACT: self.filter.to_fact()}

    def allows(self, ledger: Ledger, event) -> bool:
        """Whether the filter allows one more release ``event`` (the next step's, as it will be recorded) after
        ``ledger``."""
        return self.filter.allows(ledger, event)

    def observe(self, value: float) -> None:
        """One validation result (higher is better: pass minus a loss). A non-finite value counts as no improvement."""
        value = float(value)
        if math.isfinite(value) and value > self.best + self.min_delta:
            self.best, self.stale = value, 0
            return
        self.stale += 1
        if self.stale >= self.patience and self.sigma > self.floor:
            self.sigma = max(self.floor, self.sigma * self.factor)
            if self.sigma > 0:
                self.decays += 1
            else:  # underflow: keep the last positive sigma
                self.sigma = self.floor or math.ulp(0.0)
            self.stale = 0

    def state_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "best": self.best, "stale": self.stale, "decays": self.decays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sigma, self.best = float(state["sigma"]), float(state["best"])
        self.stale, self.decays = int(state["stale"]), int(state["decays"])


def _check(params: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ConfigError(
            f"{unknown[0]} is not a parameter of schedule kind 'validation'; it takes {', '.join(DEFAULTS)}"
        )
    p = {**DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    order = p.pop("order")
    if order is not None and (isinstance(order, bool) or not isinstance(order, int) or order < 2):
        raise ConfigError(f"validation schedule order must be an integer >= 2 (the rdp filter's Renyi order), got {order!r}")
    checks = {
        "factor": (lambda v: 0 < v < 1, "a number in (0, 1) (the noise is multiplied by it)"),
        "patience": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
        "min_delta": (lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
        "initial": (lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
        "floor": (lambda v: 0 < v <= p["initial"], "a number in (0, initial] (the lowest sigma, as initial is)"),
    }
    for key, (ok, accepted) in checks.items():
        value = p[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise ConfigError(f"validation schedule {key} must be {accepted}, got {value!r}")
    return {**p, "order": order}


def validation_noise(
    steps: int,
    epsilon: float,
    delta: float,
    *,
    sampling_rate: float = 1.0,
    calibration: str = "tightest",
    **params: Any,
) -> ValidationNoise:
    """A validation schedule for a run of (at most) ``steps`` planned steps within (epsilon, delta). The filter:
    ``gdp`` for full batches (exact), ``rdp`` for Poisson sampling at one ``order``; with ``calibration="zcdp"`` the
    paper's zCDP budget (Lemma B.3's rho). ``params``: factor, patience, min_delta, initial, floor, order (see the
    module doc). sigma starts at ``initial`` and never falls below ``floor``, both times the constant sigma u that
    spends the budget in ``steps`` steps.

    The rdp filter prices every step at its one order, and at a high order a subsampled Gaussian with a lower sigma
    costs much more than its own best order would charge (reviewed: at q = 0.01, T = 1000, epsilon 1 the plan's
    order 17 makes one step at 0.8 u cost more than the whole budget). So the default order is the best one for
    spending the whole budget at the floor (floor x u for as many steps as that affords), where a run that keeps
    lowering its noise ends up; noisier steps are then priced a little above their best order's charge. Any order
    fixed before the run is valid."""
    from dptrain.schedules.calibration import calibrate_schedule

    p = _check(params)
    if not (isinstance(steps, int) and steps >= 1):
        raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
    if calibration == "zcdp":  # the paper's Algorithm 1: a residual zCDP budget, rho by Lemma B.3
        rho = rho_from_R(R_from_eps_delta(epsilon, delta))
        filt = make_filter("zcdp", epsilon, delta, sampling_rate=sampling_rate, rho=rho)
    elif sampling_rate >= 1:
        filt = make_filter("gdp", epsilon, delta)
    else:  # a Renyi filter at the order that is best for the planned constant-noise run (fixed before the run)
        def plan(n: int):
            return calibrate_schedule(
                "uniform", n, epsilon=epsilon, delta=delta, accountant="rdp", sampling_rate=sampling_rate
            )

        order = p["order"]
        if order is None:  # the best order of the most steps at the floor sigma the budget affords
            low = p["floor"] * plan(steps).scale
            lo, hi = 1, steps  # plan(n).scale grows with n: the largest n with plan(n).scale <= low
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if plan(mid).scale <= low else (lo, mid - 1)
            order = plan(lo).details["rdp_search_order"]
        filt = make_filter("rdp", epsilon, delta, sampling_rate=sampling_rate, order=order)
    uniform = _uniform_sigma(filt, steps)
    return ValidationNoise(filt, p["initial"] * uniform, p["factor"], p["patience"], p["min_delta"], p["floor"] * uniform)


def _uniform_sigma(filt: PrivacyFilter, steps: int) -> float:
    """The smallest constant sigma whose ``steps`` steps the filter allows (bisection in sigma, on the filter's own
    test of the last step: the steps before it are one ledger entry)."""

    q = filt.sampling_rate

    def fits(s: float) -> bool:
        cost = filt.cost(gaussian_step_event(s, "poisson" if q < 1 else "full", sampling_rate=q))
        return math.fsum([(steps - 1) * cost, cost]) <= filt.budget

    lo = hi = 1.0
    while not fits(hi):
        hi *= 2
    while fits(lo):
        lo /= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def check_controller(controller, trainer, *, budget=None, release_facts=None) -> None:
    """Refuse (one-line ConfigError) adaptive noise on a run it cannot price: its privacy filter is the whole budget
    (no noise schedule, budget or custom release facts, a private run), prices Poisson or full-batch steps under
    add/remove-one adjacency at the sampling rate it was planned for, and continues only a ledger recorded under it."""
    if trainer.noise_schedule is not None or trainer.non_private or release_facts is not None or budget is not None:
        raise ConfigError(
            "adaptive noise (noise_controller) runs under its own privacy filter: it takes no noise_schedule, "
            "no budget, no custom release facts, and a private run"
        )
    if trainer.sampler.scheme not in ("poisson", "full") or trainer.ledger.neighboring != "add_or_remove_one":
        raise ConfigError(
            "adaptive noise needs Poisson or full-batch sampling (add/remove-one adjacency): its privacy "
            f"filter prices those steps only, got sampling {trainer.sampler.scheme!r}"
        )
    planned, rate = controller.filter.sampling_rate, trainer.sampling_rate
    if not math.isclose(planned, rate, rel_tol=1e-9):
        raise ConfigError(
            f"the noise controller's filter was planned for sampling rate {planned:g}, this run samples at "
            f"{rate:g}: make it with sampling_rate={rate:g}"
        )
    if trainer.ledger.releases and ledger_filter(trainer.ledger) != controller.filter:
        raise ConfigError("adaptive noise continues only a ledger recorded under its own privacy filter")


__all__ = ["DEFAULTS", "ValidationNoise", "check_controller", "validation_noise"]
