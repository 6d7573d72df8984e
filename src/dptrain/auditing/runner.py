"""One-run privacy audit of a configuration: the Python function behind ``dptrain audit``.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), Algorithm 1: insert m
canaries, each included independently with probability 1/2 (the secrets, from the run's "canaries" stream), train
ONCE with the real engine exactly as ``dptrain train`` would run the configuration on the training set plus one row
per canary (an excluded canary's row contributes nothing, so the data set size does not depend on the secrets),
score every canary without looking at the secrets, and turn the best guesses into an epsilon lower bound
(:func:`dptrain.auditing.bounds.audit`: Theorem 5.2 at the run's delta, with a confidence level). The lower bound
is printed beside the certified epsilon of the same run (its own accountant on its own ledger) and beside the
audit's ceiling (:func:`dptrain.auditing.bounds.ceiling`: what it would report if every guess were right).

Verdict: ``violation`` when the lower bound exceeds the certificate (the engine or its accounting is broken, or
this is the 1 - confidence chance of a false alarm); ``inconclusive`` when the ceiling does not exceed the
certificate (this audit could not have refuted it, whatever the engine did); ``no_violation_found`` otherwise.

Settings (``setting`` in the result), each scoring the strongest observation its release policy allows:

- ``dpsgd``: the threat model of DP-SGD's accounting is "every iterate is released", so gradient canaries live on
  auxiliary coordinates of their own and are scored on every step's released update
  (:mod:`dptrain.auditing.auxiliary`); input canaries on the final model (minus the loss).
- ``projected``: projected noisy SGD releases only the last iterate w_T (Altschuler & Talwar, "Privacy of Noisy
  Stochastic Gradient Descent: More Iterations without More Privacy Loss", Thm 3.1), so canaries are scored on
  w_T alone: gradient canaries (full batches only) of norm L, the GLM's Lipschitz constant, on m distinct
  coordinates of w through the same per-example stage as DP-SGD's, score_i = -w_T[j_i]; input canaries by minus
  the loss of w_T.

``inject_bug`` trains with a deliberately broken stage (:mod:`dptrain.auditing.bugs`) while the ledger records the
correct run: the audit's check of its own power. Nothing is written: an audit is an experiment, not a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dptrain.accounting import all_reports, tightest
from dptrain.auditing.auxiliary import AuxiliaryCanaries
from dptrain.auditing.bounds import audit, ceiling
from dptrain.auditing.bugs import broken, check_bug, inject
from dptrain.auditing.canaries import (
    append_examples,
    check_options,
    dirac_coordinates,
    dirac_gradients,
    draw_inclusion,
    flat_size,
    placeholders,
    random_examples,
    with_canaries,
)
from dptrain.config import RunConfig
from dptrain.data.loaders import ArrayDataset, DataSplit
from dptrain.errors import ConfigError
from dptrain.runs import job as job_module

SETTINGS = ("dpsgd", "projected")
VERDICTS = ("violation", "no_violation_found", "inconclusive")
#: Canaries when none are asked for; scored on the last iterate, at most the number of trainable parameters.
DEFAULT_CANARIES = 1000
#: The statistic of gradient canaries in the dpsgd setting (:data:`dptrain.auditing.auxiliary.STATISTICS`): the
#: log-likelihood ratio, measured more powerful than the plain sum (docs/reproduction/audit/audit_power.md).
DEFAULT_STATISTIC = "llr"
#: Accountants whose analysis assumes that the privatized gradients are NOT released (ModelMix's credits the secret
#: mixing of the iterates): gradient canaries scored on those gradients are compared with the tightest other one.
ITERATES_ONLY = ("modelmix",)


@dataclass
class Observation:
    """What one audited run gives the auditor: the secrets (for the bound only), the scores of every statistic
    (higher = more likely included), the certificate and the numbers of the run."""

    setting: str
    kind: str
    included: torch.Tensor
    scores: dict[str, torch.Tensor]
    epsilon_certified: float
    accountant: str
    delta: float
    injected_bug: str | None
    #: why the audited run is not private whatever its epsilon (seeded, buffers released unnoised, an injected bug);
    #: empty: private
    not_private_because: list[str] = field(default_factory=list)


def audit_run(
    cfg: RunConfig,
    canaries: int | None = None,
    confidence: float = 0.95,
    kind: str = "gradient",
    inject_bug: str | None = None,
) -> dict:
    """Audit ``cfg`` with ``canaries`` canaries of ``kind`` ("gradient" | "input") in one training run.

    Returns epsilon_lower_bound (valid with probability >= ``confidence``), epsilon_certified (the run's own
    accountant on its own ledger, at the run's delta), ceiling (the largest lower bound this audit could report),
    verdict (:data:`VERDICTS`), confidence, canaries (m), guesses (r) and correct (v) of the best guess count, kind,
    score (the statistic), accountant, delta, setting ("dpsgd" | "projected") and injected_bug. ``canaries=None``:
    1000, or the number of trainable parameters where canaries sit on the model's own coordinates (the projected
    setting) and it is smaller. Epochs or steps, model, data, sigma or target_epsilon are the config's, as
    ``dptrain train`` uses them; the training set holds the real examples plus one row per canary (excluded ones
    contribute nothing). An explicit ``cfg.seed`` makes the audit reproducible."""
    _, confidence, _ = check_options(canaries, confidence, kind)
    seen = observe(cfg, canaries, kind, inject_bug)
    statistic = DEFAULT_STATISTIC if DEFAULT_STATISTIC in seen.scores else next(iter(seen.scores))
    return judge(seen, statistic, confidence)


def judge(seen: Observation, statistic: str, confidence: float = 0.95) -> dict:
    """The audit's result from an observation, scoring the canaries with ``statistic`` (one of ``seen.scores``)."""
    scores = seen.scores[statistic]
    m = len(scores)
    found = audit(scores.numpy(), seen.included.numpy().astype(bool), seen.delta, confidence)
    top = ceiling(m, seen.delta, confidence)
    low, cert = found["epsilon_lower_bound"], seen.epsilon_certified
    verdict = "violation" if low > cert else ("inconclusive" if top <= cert else "no_violation_found")
    return {
        "epsilon_lower_bound": low,
        "epsilon_certified": cert,
        "ceiling": top,
        "verdict": verdict,
        "confidence": confidence,
        "canaries": m,
        "guesses": found["guesses"],
        "correct": found["correct"],
        "kind": seen.kind,
        "score": statistic,
        "accountant": seen.accountant,
        "delta": seen.delta,
        "setting": seen.setting,
        "injected_bug": seen.injected_bug,
        "private": not seen.not_private_because,
        **({"not_private_because": list(seen.not_private_because)} if seen.not_private_because else {}),
    }


def _with_train(data: DataSplit, train: ArrayDataset) -> DataSplit:
    return DataSplit(train, data.test, data.description, data.separate_test)


def _build(cfg: RunConfig, data: DataSplit, rows):
    randomness = job_module.run_randomness(cfg)
    return job_module.build_job(cfg, randomness, data=_with_train(data, append_examples(data.train, *rows)))


def _rows(kind: str, m: int, train: ArrayDataset):
    if kind == "gradient":
        return placeholders(m, train)
    return random_examples(m, train.input_shape, train.num_classes, train.x.dtype)


def observe(cfg: RunConfig, canaries: int | None, kind: str, inject_bug: str | None = None) -> Observation:
    """One run with the canaries: the job is built exactly as ``dptrain train`` builds it (its algorithm, stages,
    calibration, accountant) on the real training set followed by one row per canary (placeholders for gradient
    canaries, the canary examples for input canaries), with ``inject_bug`` if any. What the scores read is what the
    run releases: every privatized update of DP-SGD, only the final model of a last-iterate run."""
    canaries, _, kind = check_options(canaries, 0.5, kind)
    bug = check_bug(inject_bug)
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"cfg must be a RunConfig (dptrain.config.load_config), got {type(cfg).__name__}")
    data = job_module.load_data(cfg)
    if not hasattr(data.train, "x"):
        raise ConfigError("the audit adds canaries to training data held in memory; remove data.options.mmap")
    if not torch.is_tensor(data.train.x):
        raise ConfigError(
            "the audit adds canaries to examples whose input is one tensor; a data set of structured inputs (text_files: "
            "token ids and attention masks) cannot be audited yet"
        )
    n = len(data.train)
    m = DEFAULT_CANARIES if canaries is None else canaries
    rows = _rows(kind, m, data.train)
    job = _build(cfg, data, rows)
    trainer = job.trainer
    every_iterate = trainer.release == "every_iterate"
    if kind == "gradient" and not every_iterate and m > flat_size(trainer.params) and canaries is None:
        m = max(2, flat_size(trainer.params))  # the default adapts to a small model: rebuild with m rows
        trainer.close()
        rows = _rows(kind, m, data.train)
        job = _build(cfg, data, rows)
        trainer = job.trainer
    if trainer.non_private:
        raise ConfigError("a non-private baseline adds no noise and certifies nothing: there is nothing to audit")
    included = draw_inclusion(m, job.randomness.stream("canaries"))
    inject(trainer, bug)
    setting = "dpsgd" if every_iterate else "projected"
    auxiliary, coordinates, chunk, dirac = None, None, trainer.max_physical_batch_size, None
    if kind == "gradient" and every_iterate:
        auxiliary = AuxiliaryCanaries(trainer, m)
        auxiliary.install()
        chunk, dirac = auxiliary.chunk, auxiliary.gradients
    elif kind == "gradient":
        coordinates = dirac_coordinates(m, flat_size(trainer.params))
        norm = trainer.clipping.sensitivity  # the per-example bound the accounting uses (L)

        def dirac(r):
            return dirac_gradients(coordinates[r], trainer.params, norm)

    trainer.per_example = with_canaries(trainer.per_example, n, included, chunk, dirac)
    try:
        for _ in trainer.iter_steps(job.total_steps):
            pass
    finally:
        if auxiliary is not None:
            auxiliary.remove()
        trainer.close()
    if kind == "input":
        scores = {"loss": -job.example_losses(*rows).to(torch.float64)}
    elif auxiliary is not None:
        scores = dict(auxiliary.scores.totals)
    else:
        final = torch.cat([p.detach().reshape(-1) for p in trainer.params.values()])  # the last iterate, released
        scores = {"final_iterate": -final[coordinates].to(torch.float64).cpu()}
    epsilon, accountant = _certificate(trainer, setting, kind)
    reasons = [*trainer.not_private_reasons, *([broken(bug)] if bug else [])]
    return Observation(setting, kind, included, scores, epsilon, accountant, cfg.privacy.delta, bug, reasons)


def _certificate(trainer, setting: str, kind: str) -> tuple[float, str]:
    """(certified epsilon, accountant) the audit is compared with: the run's own, unless the run's accountant does
    not cover what gradient canaries observe in the dpsgd setting (:data:`ITERATES_ONLY`: the privatized gradients
    are not released there), then the tightest accountant that does."""
    report = trainer.epsilon()
    if setting != "dpsgd" or kind != "gradient" or report.accountant not in ITERATES_ONLY:
        return report.epsilon, report.accountant
    reports, _ = all_reports(trainer.ledger, trainer.delta)
    best = tightest({k: r for k, r in reports.items() if k not in ITERATES_ONLY})
    if best is None:
        raise ConfigError(
            f"the {report.accountant} accountant does not cover the privatized gradients that gradient canaries "
            "observe, and no other accountant certifies this run: audit it with --kind input"
        )
    return best.epsilon, best.accountant


__all__ = ["DEFAULT_CANARIES", "SETTINGS", "VERDICTS", "Observation", "audit_run", "judge", "observe"]
