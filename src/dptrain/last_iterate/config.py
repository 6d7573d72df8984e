"""The ``[convex]`` config section and the ``projected_noisy_sgd`` algorithm: projected noisy SGD on a convex GLM,
releasing only the last iterate (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent: More
Iterations without More Privacy Loss"; docs/last_iterate.md). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config import (
    Algorithm,
    RunConfig,
    Section,
    finite,
    need,
    register_algorithm,
    register_section,
    section_is_default,
)
from dptrain.errors import ConfigError

LOSSES = ("logistic", "smoothed_hinge", "squared")


@dataclass(frozen=True)
class ConvexConfig:
    """Projected noisy SGD on a convex GLM; used when training.algorithm = "projected_noisy_sgd"."""

    loss: str = "logistic"  # logistic | smoothed_hinge | squared
    feature_norm: float = 1.0  # R: each example is rescaled to norm <= R (no privacy cost)
    fit_bias: bool = True
    l2: float = 0.0
    diameter: float = 10.0  # D: the iterates stay in an L2 ball of this diameter around 0
    noise_std: float | None = None  # sigma on the averaged gradient (paper's footnote 4), or privacy.target_epsilon
    batching: str = "random"  # random | cyclic | full
    lr_power: float = 0.0  # eta_t = learning_rate (t+1)^(-p)
    adjacency: str = "replace"  # replace (Delta = 2L) | remove (Delta = L)


def validate_section(cfg: RunConfig) -> None:
    """[convex] belongs to projected noisy SGD."""
    if cfg.training.algorithm != "projected_noisy_sgd" and not section_is_default(cfg, "convex"):
        raise ConfigError('[convex] is for training.algorithm = "projected_noisy_sgd"')


def validate_algorithm(cfg: RunConfig) -> None:
    """Projected noisy SGD (training.algorithm = "projected_noisy_sgd"): noise, loss, domain, batches."""
    p, cv = cfg.privacy, cfg.convex
    if p.noise_multiplier is not None:
        raise ConfigError(
            "privacy.noise_multiplier is for DP-SGD; projected noisy SGD takes convex.noise_std "
            "(or privacy.target_epsilon)"
        )
    if (cv.noise_std is None) == (p.target_epsilon is None):
        raise ConfigError("set exactly one of convex.noise_std and privacy.target_epsilon")
    if cv.noise_std is not None:
        need(
            finite(cv.noise_std) and cv.noise_std > 0,
            "convex.noise_std",
            "a finite number > 0",
            cv.noise_std,
        )
    need(cv.loss in LOSSES, "convex.loss", f"one of {', '.join(LOSSES)}", cv.loss)
    need(
        finite(cv.feature_norm) and cv.feature_norm > 0,
        "convex.feature_norm",
        "a number > 0",
        cv.feature_norm,
    )
    need(finite(cv.diameter) and cv.diameter > 0, "convex.diameter", "a number > 0", cv.diameter)
    need(cv.l2 >= 0, "convex.l2", "a number >= 0", cv.l2)
    need(
        cv.batching in ("random", "cyclic", "full"),
        "convex.batching",
        "one of random, cyclic, full",
        cv.batching,
    )
    need(cv.adjacency in ("replace", "remove"), "convex.adjacency", "one of replace, remove", cv.adjacency)
    need(0 <= cv.lr_power < 1, "convex.lr_power", "in [0, 1)", cv.lr_power)
    if cv.batching == "random":
        need(
            p.accountant in ("auto", "rdp"),
            "privacy.accountant",
            '"auto" or "rdp" for projected noisy SGD with random batches (the last-iterate bound is reported beside '
            "it but is not certified for random batches: docs/last_iterate.md)",
            p.accountant,
        )
    else:
        need(
            p.accountant in ("auto", "rdp", "last_iterate"),
            "privacy.accountant",
            '"auto", "rdp" or "last_iterate" for projected noisy SGD',
            p.accountant,
        )


register_section(Section("convex", ConvexConfig, validate_section))
register_algorithm(Algorithm("projected_noisy_sgd", validate_algorithm, "dptrain.last_iterate.job:build_job"))
