"""Banded matrix factorization (BandMF) in the engine: the stages a trainer swaps in, the facts it records, its secret
state, and what it refuses.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023). A BandMF trainer is a DP-SGD trainer with two stages replaced:

- batch selection: cyclic Poisson over b secret groups (:class:`dptrain.stages.cyclic_poisson.CyclicPoissonSampling`),
  the groups drawn from the sampling stream when the stage is installed, before the first step;
- noise: std * (C^{-1} Z)_t, streamed from the b - 1 previous noise vectors
  (:class:`dptrain.stages.correlated_noise.BandedNoise`);

and each step recorded as :func:`dptrain.accounting.bandmf_ledger.bandmf_step` writes it (one participation at the
group rate min(1, b q); pld and rdp compose it ceil(T/b) times). The coefficients c are optimized before training for
the planned steps T and the optimizer's workload (:func:`workload_for`), from public quantities only. The step's index
t within the BandMF run, which sets its group (t mod b) and whether the noise has a history (t > 0), is read from the
ledger (:func:`dptrain.accounting.bandmf_ledger.bandmf_step_index`), so the engine's groups and noise always match
what the ledger certifies. docs/bandmf.md is the user's page.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dptrain.accounting import (
    PREFIX_SUMS,
    Workload,
    bandmf_ledger,
    bandmf_step,
    bandmf_step_index,
    epsilon,
    get_accountant,
    momentum_workload,
    optimal_coefficients,
    reported_rmse_ratio,
)
from dptrain.accounting.base import AUTO
from dptrain.accounting.ledger import training_steps
from dptrain.errors import AccountingError, ConfigError, DataError
from dptrain.stages.correlated_noise import BandedNoise
from dptrain.stages.cyclic_poisson import CyclicPoissonSampling

#: The noise mechanisms of the engine (``make_private(noise=...)``, config ``[noise] mechanism``).
NOISE_MECHANISMS = ("gaussian", "bandmf")
AUTO_BANDS = "auto"
#: What a BandMF step records instead of DP-SGD's facts; how it is certified.
CERTIFIED_BY = "pld and rdp (as ceil(T/b) DP-SGD steps at rate min(1, b q), Choquette-Choo et al., Thm 4)"


def check_noise(noise: str, bands, planned_steps) -> str:
    """``noise`` validated, with the options that go with it (one-line ConfigError otherwise)."""
    if noise not in NOISE_MECHANISMS:
        raise ConfigError(f"noise must be one of {', '.join(NOISE_MECHANISMS)}, got {noise!r}")
    if noise == "gaussian" and (bands is not None or planned_steps is not None):
        given = "bands" if bands is not None else "planned_steps"
        raise ConfigError(f"{given} is an option of correlated noise: it goes with noise='bandmf'")
    return noise


def check_bands(bands, key: str = "bands", auto: bool = True) -> int | str:
    """An integer >= 1, or "auto" where ``auto`` is allowed; a one-line ConfigError otherwise."""
    if auto and bands == AUTO_BANDS:
        return bands
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        accepted = 'an integer >= 1 or "auto"' if auto else "an integer >= 1"
        raise ConfigError(f"{key} must be {accepted}, got {bands!r}")
    return bands


def workload_for(optimizer: torch.optim.Optimizer) -> Workload:
    """What the coefficients are optimized for: SGD with momentum beta > 0 (the same in every parameter group): the
    momentum workload (:func:`dptrain.accounting.momentum_workload`); any other optimizer, prefix sums (SGD's
    iterates: Adam and other adaptive optimizers are not linear in the gradients, and the paper's proxy is the prefix
    sum). Only the noise's utility depends on it, never its privacy."""
    if isinstance(optimizer, torch.optim.SGD):
        betas = {float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
        if len(betas) == 1:
            beta = betas.pop()
            if 0 < beta < 1:
                return momentum_workload(beta)
    return PREFIX_SUMS


def workload_name(workload: Workload) -> str:
    return f"momentum {workload.momentum:g}" if workload.kind == "momentum" else "prefix sums"


def _refusal(trainer) -> str | None:
    """Why the trainer's other stages cannot be certified with BandMF (None: they can)."""
    if trainer.non_private:
        return "a non_private baseline adds no noise: it takes noise='gaussian'"
    if trainer.noise_schedule is not None:
        return "a noise schedule changes sigma from step to step; BandMF's certificate is for one noise multiplier"
    if trainer.noise_controller is not None:
        return "adaptive noise (a validation schedule) is certified by a privacy filter, which does not cover BandMF"
    if trainer.release != "every_iterate" or trainer.release_facts is not None:
        return "this run records its own mechanism (e.g. last-iterate projected noisy SGD), not DP-SGD's steps"
    if getattr(trainer.optimizer, "release_facts", None) is not None:
        return "this update rule (e.g. ModelMix) has its own accountant, which does not cover correlated noise"
    if trainer.sampler.scheme != "poisson" or trainer.sampler.max_steps is not None:
        return (
            f"BandMF samples its groups by Poisson sampling at a constant rate (sampling='poisson'), not "
            f"{trainer.sampler.scheme}" + (" with a batch-size schedule" if trainer.sampler.max_steps else "")
        )
    if trainer.ledger.neighboring != "add_or_remove_one":
        return f"BandMF is certified under add/remove-one adjacency, not {trainer.ledger.neighboring}"
    if trainer.accountant != AUTO and not getattr(get_accountant(trainer.accountant), "covers_bandmf", False):
        return f"the {trainer.accountant} accountant cannot certify it; {CERTIFIED_BY} do"
    return None


class BandMF:
    """What a BandMF trainer holds besides DP-SGD's state: b, the coefficients and their workload, the planned steps,
    the noise stage (also ``trainer.noise_stage``) and the sampler (also ``trainer.sampler``)."""

    def __init__(self, trainer, bands: int, planned_steps: int, workload: Workload):
        self.trainer, self.bands, self.planned_steps, self.workload = trainer, bands, planned_steps, workload
        self.coefficients = tuple(float(x) for x in optimal_coefficients(planned_steps, bands, workload))
        self.sampler = CyclicPoissonSampling(trainer.sampler.dataset_size, trainer.sampling_rate, bands)
        self.noise = BandedNoise(self.coefficients, self.index)
        #: set by make_private_with_epsilon when it chose b (``bands="auto"``): the candidates' RMSE ratios
        self.choice = None
        #: (epsilon, delta) -> (RMSE ratio or None, why not)
        self._ratio: dict[tuple, tuple[float | None, str | None]] = {}

    # -- the record --
    def release_event(self, noise_multiplier: float):
        """(event, facts) of a step at ``noise_multiplier``: :func:`bandmf_step` with the trainer's public facts."""
        t = self.trainer
        return bandmf_step(
            noise_multiplier,
            self.sampler.sampling_rate,
            self.coefficients,
            dataset_size=self.sampler.dataset_size,
            clip_norm=t.clipping.sensitivity,
            **getattr(t.clipping, "facts", {}),
        )

    def index(self) -> int:
        """t of the next step within its BandMF run (from the ledger); it must be the trainer's step count (every
        training step of the ledger is this run's: a BandMF trainer continues only its own ledger)."""
        t = self.trainer
        index = bandmf_step_index(t.ledger, *t.release_event())
        if index != t.steps:
            raise DataError(
                f"the ledger holds {t.steps} training steps but its BandMF run is at step {index}: a BandMF trainer "
                "continues only its own run's ledger (with its checkpoint)"
            )
        return index

    # -- what a run reports --
    def summary(self, delta: float, target_epsilon: float | None) -> dict[str, Any]:
        """The summary's entries: the mechanism, b, the RMSE ratio against DP-SGD at the run's epsilon (the target,
        or what pld certifies for the planned steps at this noise), the coefficients and the memory
        of the noise history. Where the ratio cannot be computed (:func:`dptrain.accounting.reported_rmse_ratio`) it
        is None and ``rmse_ratio_note`` says why: a prediction beside the certificate never ends a run that trained."""
        eps, why = target_epsilon, None
        if eps is None:
            ledger = bandmf_ledger(self.trainer.noise_multiplier, self.sampler.sampling_rate, self.planned_steps,
                                   self.coefficients)
            try:
                eps = epsilon(ledger, delta, "pld").epsilon
            except AccountingError as e:
                eps, why = math.inf, f"no RMSE ratio: the planned run has no epsilon ({e})"
        key = (eps, delta)
        if key not in self._ratio:
            q = self.sampler.sampling_rate
            self._ratio[key] = reported_rmse_ratio(self.planned_steps, q, eps, delta, self.bands, self.workload)
        ratio, why = self._ratio[key][0], why or self._ratio[key][1]
        return {
            "noise_mechanism": "bandmf",
            "bands": self.bands,
            "rmse_ratio": ratio,
            "bandmf": {
                "coefficients": list(self.coefficients),
                "workload": workload_name(self.workload),
                "rmse_ratio_at_epsilon": eps if math.isfinite(eps) else None,
                **({"rmse_ratio_note": why} if why else {}),
                "planned_steps": self.planned_steps,
                "noise_history_bytes": history_bytes(self.trainer, self.bands),
                "groups": "secret: each example's group drawn independently and uniformly (private checkpoint only)",
            },
        }

    # -- the private checkpoint --
    def state_dict(self) -> dict:
        return {"bands": self.bands, "noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the noise history (the groups come back with the sampler's state) and check that the ledger's run
        is at the step the history was left at."""
        t = self.trainer
        if state is None:
            if training_steps(t.ledger):
                raise DataError("the checkpoint holds no BandMF noise state: it is not a BandMF run's checkpoint")
            return
        if state.get("bands") != self.bands:
            raise DataError(f"the checkpoint's BandMF run has {state.get('bands')} bands, this run {self.bands}")
        self.noise.load_state_dict(state["noise"], t.device)
        index = self.index()
        if index and index != self.noise.count:
            raise DataError(
                f"the checkpoint's BandMF noise history holds {self.noise.count} steps, its ledger {index}"
            )


def history_bytes(trainer, bands: int) -> int:
    """The noise history's memory: b - 1 vectors of the trainable parameters' size (float64 with secure noise)."""
    per = 8 if trainer.randomness.secure else None
    return (bands - 1) * sum(p.numel() * (per or p.element_size()) for p in trainer.params.values())


def install(trainer, bands, planned_steps) -> BandMF:
    """Make ``trainer`` (just built, no step taken) a BandMF run of ``bands`` bands whose coefficients are optimized
    for ``planned_steps`` steps: checks what cannot be certified (one line each), draws the groups, swaps in the
    sampler and the noise stage."""
    if bands == AUTO_BANDS:
        raise ConfigError(
            'bands="auto" chooses b for a privacy budget: use make_private_with_epsilon (a target epsilon), or give '
            "an integer number of bands with a fixed noise multiplier"
        )
    bands = check_bands(bands, auto=False)
    if isinstance(planned_steps, bool) or not isinstance(planned_steps, int) or planned_steps < 1:
        raise ConfigError(
            "noise='bandmf' optimizes its coefficients for the run's length: give planned_steps (an integer >= 1; "
            f"make_private_with_epsilon takes it from steps or epochs), got {planned_steps!r}"
        )
    why = _refusal(trainer)
    if why is not None:
        raise ConfigError(f"noise='bandmf' cannot be certified here: {why}")
    q = trainer.sampling_rate
    if bands > planned_steps:
        raise ConfigError(f"bands ({bands}) must be at most the planned steps ({planned_steps}): every group takes part")
    if bands * q > 1 + 1e-12:
        raise ConfigError(
            f"bands x sampling rate must be <= 1 (each group holds n/b examples on average: beyond, the batch would "
            f"shrink below the batch size asked and lose its amplification), got {bands} x {q:.4g}"
        )
    state = BandMF(trainer, bands, planned_steps, workload_for(trainer.optimizer))
    event, facts = state.release_event(trainer.noise_multiplier)
    if training_steps(trainer.ledger) != bandmf_step_index(trainer.ledger, event, facts):
        raise ConfigError(
            "a BandMF trainer continues only its own run's ledger: this ledger holds training steps of another run"
        )
    state.sampler.draw_groups(trainer.randomness.stream("sampling"))
    trainer.sampler, trainer.noise_stage = state.sampler, state.noise
    return state




def for_budget(trainer, bands, steps: int, target_epsilon: float, target_delta: float) -> BandMF:
    """:func:`install` for a run calibrated to (target_epsilon, target_delta) over ``steps`` steps: ``bands`` an
    integer, or "auto" (default None too): the b of :func:`dptrain.accounting.choose_bands` (public quantities only:
    steps, sampling rate, budget, the optimizer's workload), whose candidates' ratios are kept in ``choice``."""
    from dptrain.accounting import choose_bands

    bands = check_bands(AUTO_BANDS if bands is None else bands)
    choice = None
    if bands == AUTO_BANDS:
        why = _refusal(trainer)  # (before the search: the refusal of what cannot be certified comes first)
        if why is not None:
            raise ConfigError(f"noise='bandmf' cannot be certified here: {why}")
        choice = choose_bands(steps, trainer.sampling_rate, target_epsilon, target_delta, workload_for(trainer.optimizer))
        bands = choice.bands
    state = install(trainer, bands, steps)
    if choice is not None:
        state.choice = choice
        state._ratio[(target_epsilon, target_delta)] = (choice.rmse_ratio, None)
    return state


def run_bands(bands, ledger) -> int | str:
    """The bands of a run from its config's ``noise.bands`` (None: "auto"); a resumed run's from its ledger (the
    ledger is where a run's public numbers live, like its sigma: "auto" chose them when the run started)."""
    from dptrain.accounting.bandmf_ledger import is_bandmf

    recorded = [e.facts["bands"] for e in (ledger.entries if ledger is not None else ()) if is_bandmf(e)]
    return recorded[-1] if recorded else (AUTO_BANDS if bands is None else bands)


def noise_summary(trainer, delta: float, target_epsilon: float | None) -> dict[str, Any]:
    """A run summary's entries about its noise: the mechanism; for BandMF also b and the RMSE ratio (:meth:`BandMF.summary`)."""
    if trainer.bandmf is None:
        return {"noise_mechanism": "gaussian"}
    return trainer.bandmf.summary(delta, target_epsilon)


__all__ = [
    "AUTO_BANDS",
    "BandMF",
    "NOISE_MECHANISMS",
    "check_bands",
    "check_noise",
    "for_budget",
    "install",
    "noise_summary",
    "run_bands",
    "workload_for",
]
