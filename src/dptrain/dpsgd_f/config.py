"""The ``[preprocessing]`` config section: DPSGD-F's private feature preprocessing before DP-SGD on a linear model
(Sun, Suresh & Menon, "The importance of feature preprocessing for differentially private linear optimization";
docs/dpsgd_f.md), a stage of DP-SGD jobs. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from dptrain.config import RunConfig, Section, finite, need, register_section, section_is_default
from dptrain.errors import ConfigError

KINDS = ("none", "private_mean", "dpsgd_f_theory")


@dataclass(frozen=True)
class PreprocessingConfig:
    """Private feature preprocessing before DP-SGD on a linear model (docs/dpsgd_f.md)."""

    kind: str = "none"  # none | private_mean (Alg. 3) | dpsgd_f_theory (Alg. 2)
    feature_norm: float | None = None  # C_F: every example is rescaled to this norm (no privacy cost)
    eps_f: float | None = None  # private_mean: the share of privacy.target_epsilon spent on the mean
    quantile_tail: int | None = None  # dpsgd_f_theory: points left above tau (default (100/eps) ln n)

    @property
    def active(self) -> bool:
        """True when the stage changes the data (a kind, or only the normalization to C_F)."""
        return self.kind != "none" or self.feature_norm is not None


def validate(cfg: RunConfig) -> None:
    """The section's keys, for DP-SGD runs (the only algorithm it applies to)."""
    pre, p = cfg.preprocessing, cfg.privacy
    if cfg.training.algorithm != "dpsgd":
        if not section_is_default(cfg, "preprocessing"):
            raise ConfigError(
                f'[preprocessing] is for DP-SGD (training.algorithm = "dpsgd"), not {cfg.training.algorithm!r}'
            )
        return
    need(pre.kind in KINDS, "preprocessing.kind", f"one of {', '.join(KINDS)}", pre.kind)
    if pre.feature_norm is not None:
        need(
            finite(pre.feature_norm) and pre.feature_norm > 0,
            "preprocessing.feature_norm",
            "a finite number > 0 (C_F)",
            pre.feature_norm,
        )
    if pre.active and cfg.training.augment:  # (refused before any private statistic: the trainer would see flat rows)
        what = "normalized" if pre.kind == "none" else "normalized and privately centered"
        raise ConfigError(
            f"training.augment views images, and [preprocessing] turns them into flat, {what} feature vectors "
            "before training: use one or the other"
        )
    if pre.kind == "none":
        for key in ("eps_f", "quantile_tail"):
            if getattr(pre, key) is not None:
                raise ConfigError(
                    f"preprocessing.{key} needs preprocessing.kind = private_mean or dpsgd_f_theory"
                )
        return
    if pre.feature_norm is None:
        raise ConfigError(f"preprocessing.kind = {pre.kind!r} needs preprocessing.feature_norm (C_F > 0)")
    if cfg.model.name != "logistic":
        raise ConfigError(
            f'preprocessing.kind = {pre.kind!r} needs a linear model (model.name = "logistic"): the bias is '
            f"mapped back through the linear map; got model.name = {cfg.model.name!r}"
        )
    if pre.kind == "private_mean":
        if pre.quantile_tail is not None:
            raise ConfigError("preprocessing.quantile_tail is for kind dpsgd_f_theory; private_mean has no quantile")
        need(
            pre.eps_f is not None and finite(pre.eps_f) and pre.eps_f > 0,
            "preprocessing.eps_f",
            "a number > 0",
            pre.eps_f,
        )
        if p.target_epsilon is not None:
            need(
                pre.eps_f < p.target_epsilon,
                "preprocessing.eps_f",
                f"smaller than privacy.target_epsilon = {p.target_epsilon:g}",
                pre.eps_f,
            )
        need(
            p.accountant in ("auto", "rdp", "pld"),
            "privacy.accountant",
            '"auto", "pld" or "rdp" with a private mean (they compose the Gaussian mean with the steps; the paper '
            "uses pld)",
            p.accountant,
        )
    else:
        if pre.eps_f is not None:
            raise ConfigError(
                "preprocessing.eps_f is for kind private_mean; dpsgd_f_theory splits the budget in thirds"
            )
        if p.target_epsilon is None:
            raise ConfigError(
                "preprocessing.kind = 'dpsgd_f_theory' needs privacy.target_epsilon (split in thirds)"
            )
        need(
            p.accountant in ("auto", "composition"),
            "privacy.accountant",
            '"auto" or "composition" for dpsgd_f_theory (its three phases are certified by basic composition, '
            "Alg. 2)",
            p.accountant,
        )
        if pre.quantile_tail is not None:
            need(pre.quantile_tail >= 0, "preprocessing.quantile_tail", "an integer >= 0", pre.quantile_tail)
    need(p.sampling == "poisson", "privacy.sampling", '"poisson" with preprocessing', p.sampling)


register_section(Section("preprocessing", PreprocessingConfig, validate, stage="dptrain.dpsgd_f.algorithm:stage"))
