"""The ``[tune]`` config section: what ``dptrain tune`` searches over and how (docs/tuning.md). Imports no torch.

    [tune]
    trials_mean = 10                  # mean number of trials (the number itself is drawn secretly)
    distribution = "geometric"        # geometric | logarithmic | poisson | tnb:SHAPE (truncated negative binomial)
    validation_fraction = 0.1         # each trial scores itself on a secret random tenth of the private data ...
    score_noise = 10.0                # ... with a noisy count of correct predictions (std in examples)
    validation_is_public = false      # true: score on the test set instead, declared public (no noise, no split)

    [tune.space]                      # any config key: log_uniform, uniform (two bounds) or choice (a list)
    "training.learning_rate" = { log_uniform = [0.05, 8.0] }
    "privacy.max_grad_norm" = { log_uniform = [0.1, 2.0] }
    "training.batch_size" = { choice = [128, 256, 512] }

``dptrain train`` ignores the section (it trains the base config).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain.accounting.tuning import TrialCount
from dptrain.config import RunConfig, Section, finite, need, register_section, section_is_default


@dataclass(frozen=True)
class TuneConfig:
    trials_mean: float = 10.0
    distribution: str = "geometric"
    validation_fraction: float = 0.1
    score_noise: float = 10.0
    validation_is_public: bool = False
    space: dict = field(default_factory=dict)


def validate(cfg: RunConfig) -> None:
    t = cfg.tune
    if section_is_default(cfg, "tune"):
        return
    need(finite(t.trials_mean) and t.trials_mean >= 1, "tune.trials_mean", "a number >= 1", t.trials_mean)
    # (one rule for the distributions, the accountant's: dptrain.accounting.tuning.TrialCount)
    TrialCount.named(t.trials_mean, t.distribution, mean_key="tune.trials_mean", distribution_key="tune.distribution")
    need(finite(t.validation_fraction) and 0 < t.validation_fraction < 1, "tune.validation_fraction", "in (0, 1)",
         t.validation_fraction)
    need(finite(t.score_noise) and t.score_noise > 0, "tune.score_noise", "a finite number > 0", t.score_noise)


register_section(Section("tune", TuneConfig, validate))
