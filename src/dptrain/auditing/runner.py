"""One-run privacy audit of a configuration: the Python function behind ``dptrain audit``.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023), Algorithm 1: insert m
canaries, each included independently with probability 1/2 (the secrets, from the run's "canaries" stream), train
ONCE with the real engine exactly as ``dptrain train`` would run the configuration on the training set plus one row
per canary (an excluded canary's row contributes nothing, so the data set size does not depend on the secrets),
score every canary without looking at the secrets, and turn the best guesses into an epsilon
lower bound (:func:`dptrain.auditing.bounds.audit`: Theorem 5.2 at the run's delta, with a confidence level).
The lower bound is printed beside the certified epsilon of the same run (its own accountant on its own ledger).

A correct engine keeps the lower bound below the certificate (with the stated confidence); a broken one (noise
too small, clipping off) can push it above. A one-run audit is loose: with m canaries and delta = 1e-5 it cannot
exceed about 5 (m = 1000) to 6.4 (any m), so it catches a broken engine only where the certificate is smaller.

Settings (``setting`` in the result):

- ``dpsgd``: the threat model of DP-SGD's accounting is "every iterate is released", so gradient canaries are
  scored on every step's privatized gradient (score_i = sum over steps of its coordinate j_i); input canaries on
  the final model (minus the loss).
- ``projected``: projected noisy SGD releases only the last iterate w_T (Altschuler & Talwar, "Privacy of Noisy
  Stochastic Gradient Descent: More Iterations without More Privacy Loss", Thm 3.1), so canaries are scored on
  w_T alone: gradient canaries (full batches only) of norm L, the GLM's Lipschitz constant, through the same
  per-example stage as DP-SGD's, score_i = -w_T[j_i]; input canaries by minus the loss of w_T.

Nothing is written: an audit is an experiment, not a run (its model is trained on canaries).
"""

from __future__ import annotations

import torch

from dptrain import run as run_module
from dptrain.auditing.bounds import audit
from dptrain.auditing.canaries import (
    ReleasedCoordinates,
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
from dptrain.data import ArrayDataset, DataSplit
from dptrain.errors import ConfigError

SETTINGS = ("dpsgd", "projected")


def audit_run(cfg: RunConfig, canaries: int = 1000, confidence: float = 0.95, kind: str = "gradient") -> dict:
    """Audit ``cfg`` with ``canaries`` canaries of ``kind`` ("gradient" | "input") in one training run.

    Returns epsilon_lower_bound (valid with probability >= ``confidence``), epsilon_certified (the run's own
    accountant on its own ledger, at the run's delta), confidence, canaries (m), guesses (r) and correct (v) of the
    best guess count, kind, accountant, delta and setting ("dpsgd" | "projected"). Epochs or steps, model, data,
    sigma or target_epsilon are the config's, as ``dptrain train`` uses them; the training set holds the real
    examples plus one row per canary (excluded ones contribute nothing). An explicit ``cfg.seed`` makes the audit reproducible."""
    m, confidence, kind = check_options(canaries, confidence, kind)
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"cfg must be a RunConfig (dptrain.config.load_config), got {type(cfg).__name__}")
    randomness = run_module.run_randomness(cfg)
    included = draw_inclusion(m, randomness.stream("canaries"))
    setting, scores, report = _audited_run(cfg, randomness, included, kind)
    delta = cfg.privacy.delta
    found = audit(scores.numpy(), included.numpy().astype(bool), delta, confidence)
    return {
        "epsilon_lower_bound": found["epsilon_lower_bound"],
        "epsilon_certified": report.epsilon,
        "confidence": confidence,
        "canaries": m,
        "guesses": found["guesses"],
        "correct": found["correct"],
        "kind": kind,
        "accountant": report.accountant,
        "delta": delta,
        "setting": setting,
    }


def _with_train(data: DataSplit, train: ArrayDataset) -> DataSplit:
    return DataSplit(train, data.test, data.description, data.separate_test)


def _audited_run(cfg: RunConfig, randomness, included: torch.Tensor, kind: str):
    """(setting, scores, certified PrivacyReport) of one run with the canaries. The job is built exactly as
    ``dptrain train`` builds it (its algorithm, stages, calibration, accountant) on the real training set followed
    by one row per canary (placeholders for gradient canaries, the canary examples for input canaries). What the
    scores may read is what the run releases: every privatized gradient of DP-SGD, only the final model of a
    last-iterate run."""
    m = len(included)
    data = run_module.load_data(cfg)
    if not hasattr(data.train, "x"):
        raise ConfigError("the audit adds canaries to training data held in memory; remove data.options.mmap")
    n = len(data.train)
    if kind == "gradient":
        rows = placeholders(m, data.train)
    else:
        rows = random_examples(m, data.train.input_shape, data.train.num_classes, data.train.x.dtype)
    job = run_module.build_job(cfg, randomness, data=_with_train(data, append_examples(data.train, *rows)))
    trainer = job.trainer
    every_iterate = trainer.release == "every_iterate"
    dirac, released = None, None
    if kind == "gradient":
        coordinates = dirac_coordinates(m, flat_size(trainer.params))
        norm = trainer.clipping.sensitivity  # the per-example bound the accounting uses (C, or L)

        def dirac(r):
            return dirac_gradients(coordinates[r], trainer.params, norm)

        if every_iterate:
            released = ReleasedCoordinates(trainer.optimizer, trainer.params, coordinates)
    trainer.per_example = with_canaries(trainer.per_example, n, included, trainer.max_physical_batch_size, dirac)
    try:
        for _ in trainer.iter_steps(job.total_steps):
            pass
    finally:
        if released is not None:
            released.remove()
        trainer.close()
    setting = "dpsgd" if every_iterate else "projected"
    if kind == "input":
        return setting, -job.example_losses(*rows).to(torch.float64), trainer.epsilon()
    if released is not None:
        return setting, released.total, trainer.epsilon()
    final = torch.cat([p.detach().reshape(-1) for p in trainer.params.values()])  # the last iterate, released
    return setting, -final[coordinates].to(torch.float64), trainer.epsilon()


__all__ = ["SETTINGS", "audit_run"]
