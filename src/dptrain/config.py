"""Run configuration: TOML files validated into typed dataclasses at the edge.

The core only ever sees these objects. Every problem (unknown key, wrong type, impossible value) is a
one-line :class:`~dptrain.errors.ConfigError` naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from dptrain.accounting.base import check_accountant
from dptrain.accounting.checks import check_noise_multiplier
from dptrain.errors import ConfigError


@dataclass(frozen=True)
class DataConfig:
    name: str = "fashion-mnist"
    path: str | None = None
    options: dict = field(default_factory=dict)  # loader options (test_fraction, n, dim, num_classes, ...)
    classes: list | None = None  # keep only these labels, relabelled 0..k-1 in this order (e.g. [2, 4])
    seed: int = 0  # train/test split and synthetic data: public, NOT the privacy randomness


@dataclass(frozen=True)
class ModelConfig:
    name: str = "cnn28"
    options: dict = field(default_factory=dict)  # model options (hidden, activation, groups, ...)


@dataclass(frozen=True)
class PrivacyConfig:
    noise_multiplier: float | None = None  # give this ...
    target_epsilon: float | None = None  # ... or this (sigma is then calibrated before training)
    delta: float = 1e-5
    max_grad_norm: float = 1.0
    accountant: str = "auto"  # auto: the tightest accountant that certifies the run
    sampling: str = "poisson"
    clipping: str = "flat"
    secure_noise: bool = False  # AES-256-CTR noise with a hardened Gaussian sampler (docs/privacy.md)


@dataclass(frozen=True)
class TrainingConfig:
    epochs: float | None = 1.0
    steps: int | None = None
    batch_size: int = 256  # expected logical batch size; Poisson rate q = batch_size / n
    batch_growth: float = 0.0  # p: expected batch s_i ~ (i+1)^p with mean batch_size (0 constant, 1 linear)
    max_physical_batch_size: int | None = None  # default: automatic (per-example gradients <= 256 MiB)
    optimizer: str = "sgd"
    learning_rate: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_sampler: str = "auto"
    eval_every: int | None = None  # steps between evaluations/checkpoints; default: once per epoch
    log_not_private: bool = False  # write the training loss and clip statistics (NOT private) to metrics.jsonl
    algorithm: str = "dpsgd"  # dpsgd | projected_noisy_sgd (convex GLMs, last iterate only: see [convex])


@dataclass(frozen=True)
class ConvexConfig:
    """Projected noisy SGD on a convex GLM (seed 003); used when training.algorithm = "projected_noisy_sgd"."""

    loss: str = "logistic"  # logistic | smoothed_hinge | squared
    feature_norm: float = 1.0  # R: each example is rescaled to norm <= R (no privacy cost)
    fit_bias: bool = True
    l2: float = 0.0
    diameter: float = 10.0  # D: the iterates stay in an L2 ball of this diameter around 0
    noise_std: float | None = (
        None  # sigma on the averaged gradient (paper's footnote 4), or privacy.target_epsilon
    )
    batching: str = "random"  # random | cyclic | full
    lr_power: float = 0.0  # eta_t = learning_rate (t+1)^(-p)
    adjacency: str = "replace"  # replace (Delta = 2L) | remove (Delta = L)


@dataclass(frozen=True)
class PreprocessingConfig:
    """Private feature preprocessing before DP-SGD on a linear model (seed 004, DPSGD-F; docs/dpsgd_f.md)."""

    kind: str = "none"  # none | private_mean (Alg. 3) | dpsgd_f_theory (Alg. 2)
    feature_norm: float | None = None  # C_F: every example is rescaled to this norm (no privacy cost)
    eps_f: float | None = None  # private_mean: the share of privacy.target_epsilon spent on the mean
    quantile_tail: int | None = None  # dpsgd_f_theory: points left above tau (default (100/eps) ln n)


@dataclass(frozen=True)
class RunConfig:
    seed: int | None = None  # None: secret randomness; an integer makes the run reproducible and NOT private
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    convex: ConvexConfig = field(default_factory=ConvexConfig)
    preprocessing: PreprocessingConfig = field(default_factory=PreprocessingConfig)

    @property
    def steps_or_epochs(self) -> dict:
        t = self.training
        return {"steps": t.steps} if t.steps is not None else {"epochs": t.epochs}


SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "training": TrainingConfig,
    "convex": ConvexConfig,
    "preprocessing": PreprocessingConfig,
}
ALGORITHMS = ("dpsgd", "projected_noisy_sgd")
OPTIMIZERS = ("sgd", "adam")


# --- parsing ----------------------------------------------------------------------------------------------


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a table",
        bool: "true/false",
        list: "a list",
    }
    return " or ".join(names.get(a, getattr(a, "__name__", str(a))) for a in args)


def _coerce(key: str, value: Any, tp) -> Any:
    allowed = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    if value is None and type(None) in allowed:
        return None
    for a in allowed:
        if a is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if a in (str, dict, bool, list) and isinstance(value, a):
            return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")


def _section(name: str, cls, table: Any):
    if not isinstance(table, dict):
        raise ConfigError(f"[{name}] must be a table")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(table) - set(hints))
    if unknown:
        raise ConfigError(f"unknown key '{name}.{unknown[0]}'; accepted keys in [{name}]: {', '.join(hints)}")
    return cls(**{k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in table.items()})


def config_from_dict(raw: dict) -> RunConfig:
    """Validate a parsed TOML document into a :class:`RunConfig`."""
    top = {"seed"} | set(SECTIONS)
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"unknown key '{unknown[0]}'; accepted top-level keys: {', '.join(sorted(top))}")
    seed = _coerce("seed", raw.get("seed"), int | None)
    parts = {name: _section(name, cls, raw.get(name, {})) for name, cls in SECTIONS.items()}
    cfg = RunConfig(seed=seed, **parts)
    validate(cfg)
    return cfg


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """``privacy.noise_multiplier=1.2`` -> (["privacy", "noise_multiplier"], 1.2); values are TOML values,
    and anything that is not one is taken as a string."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set takes key=value (e.g. privacy.noise_multiplier=1.2), got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key.strip().split("."), value


def apply_overrides(raw: dict, assignments: list[str]) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for assignment in assignments:
        path, value = parse_override(assignment)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {assignment}: '{part}' is not a table")
        node[path[-1]] = value
    return raw


def load_config(
    path: str | os.PathLike | None, overrides: list[str] = (), unset: tuple[str, ...] = ()
) -> RunConfig:
    raw: dict = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {os.fspath(path)} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {os.fspath(path)} is not valid TOML: {e}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {os.fspath(path)} is a directory; give a .toml file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {os.fspath(path)} cannot be read ({type(e).__name__})") from None
    for key in unset:  # e.g. a plan replaces a config's target_epsilon by its own noise multiplier
        section, _, name = key.rpartition(".")
        (raw.get(section, {}) if section else raw).pop(name, None)
    return config_from_dict(apply_overrides(raw, list(overrides)))


# --- values -----------------------------------------------------------------------------------------------


def _need(ok: bool, key: str, accepted: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {accepted}, got {value!r}")


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def validate(cfg: RunConfig) -> None:
    """Range checks that do not need the data (those that do are made when the run is built): the keys every
    run uses, then those of its algorithm."""
    from dptrain.data import DATASET_NAMES

    p, t = cfg.privacy, cfg.training
    _need(cfg.seed is None or cfg.seed >= 0, "seed", "an integer >= 0 (or absent: secret randomness)", cfg.seed)
    _need(cfg.data.seed >= 0, "data.seed", "an integer >= 0", cfg.data.seed)
    _need(t.algorithm in ALGORITHMS, "training.algorithm", f"one of {', '.join(ALGORITHMS)}", t.algorithm)
    _need(cfg.data.name in DATASET_NAMES, "data.name", f"one of {', '.join(DATASET_NAMES)}", cfg.data.name)
    if cfg.data.classes is not None:
        labels = cfg.data.classes
        _need(
            len(labels) >= 2
            and len(set(labels)) == len(labels)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in labels),
            "data.classes",
            "a list of at least 2 distinct labels (integers >= 0)",
            labels,
        )
    if p.target_epsilon is not None:
        _need(
            _finite(p.target_epsilon) and p.target_epsilon > 0,
            "privacy.target_epsilon",
            "a finite number > 0",
            p.target_epsilon,
        )
    _need(0 < p.delta < 1, "privacy.delta", "in (0, 1)", p.delta)
    check_accountant(p.accountant, "privacy.accountant")
    if t.steps is not None:
        _need(t.steps >= 1, "training.steps", "an integer >= 1", t.steps)
    else:
        _need(
            _finite(t.epochs) and t.epochs > 0,
            "training.epochs",
            "a number > 0 (or set training.steps)",
            t.epochs,
        )
    _need(t.batch_size >= 1, "training.batch_size", "an integer >= 1", t.batch_size)
    _need(
        _finite(t.learning_rate) and t.learning_rate > 0,
        "training.learning_rate",
        "a number > 0",
        t.learning_rate,
    )
    if t.algorithm == "projected_noisy_sgd":
        _validate_convex(cfg)
    else:
        _validate_dpsgd(cfg)
        _validate_preprocessing(cfg)


def _validate_preprocessing(cfg: RunConfig) -> None:
    from dptrain.dpsgd_f import KINDS

    pre, p = cfg.preprocessing, cfg.privacy
    _need(pre.kind in KINDS, "preprocessing.kind", f"one of {', '.join(KINDS)}", pre.kind)
    if pre.feature_norm is not None:
        _need(
            _finite(pre.feature_norm) and pre.feature_norm > 0,
            "preprocessing.feature_norm",
            "a finite number > 0 (C_F)",
            pre.feature_norm,
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
        _need(
            pre.eps_f is not None and _finite(pre.eps_f) and pre.eps_f > 0,
            "preprocessing.eps_f",
            "a number > 0",
            pre.eps_f,
        )
        if p.target_epsilon is not None:
            _need(
                pre.eps_f < p.target_epsilon,
                "preprocessing.eps_f",
                f"smaller than privacy.target_epsilon = {p.target_epsilon:g}",
                pre.eps_f,
            )
        _need(
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
        _need(
            p.accountant in ("auto", "composition"),
            "privacy.accountant",
            '"auto" or "composition" for dpsgd_f_theory (its three phases are certified by basic composition, '
            "Alg. 2)",
            p.accountant,
        )
        if pre.quantile_tail is not None:
            _need(pre.quantile_tail >= 0, "preprocessing.quantile_tail", "an integer >= 0", pre.quantile_tail)
    _need(p.sampling == "poisson", "privacy.sampling", '"poisson" with preprocessing', p.sampling)


def _validate_dpsgd(cfg: RunConfig) -> None:
    from dptrain.batch_selection import SAMPLING_NAMES
    from dptrain.clipping import CLIPPING_NAMES
    from dptrain.models import MODEL_NAMES
    from dptrain.per_example import GRAD_SAMPLERS

    p, t = cfg.privacy, cfg.training
    _need(cfg.model.name in MODEL_NAMES, "model.name", f"one of {', '.join(MODEL_NAMES)}", cfg.model.name)
    if (p.noise_multiplier is None) == (p.target_epsilon is None):
        raise ConfigError("set exactly one of privacy.noise_multiplier and privacy.target_epsilon")
    if p.noise_multiplier is not None:
        check_noise_multiplier(p.noise_multiplier, "privacy.noise_multiplier")
    _need(
        _finite(p.max_grad_norm) and p.max_grad_norm > 0,
        "privacy.max_grad_norm",
        "a finite number > 0",
        p.max_grad_norm,
    )
    _need(p.sampling in SAMPLING_NAMES, "privacy.sampling", f"one of {', '.join(SAMPLING_NAMES)}", p.sampling)
    _need(p.clipping in CLIPPING_NAMES, "privacy.clipping", f"one of {', '.join(CLIPPING_NAMES)}", p.clipping)
    _need(
        _finite(t.batch_growth) and t.batch_growth >= 0,
        "training.batch_growth",
        "a number >= 0 (0: constant)",
        t.batch_growth,
    )
    if t.batch_growth > 0:
        _need(
            p.sampling == "poisson",
            "privacy.sampling",
            '"poisson" when training.batch_growth > 0',
            p.sampling,
        )
    if t.max_physical_batch_size is not None:
        _need(
            t.max_physical_batch_size >= 1,
            "training.max_physical_batch_size",
            "an integer >= 1",
            t.max_physical_batch_size,
        )
    _need(t.optimizer in OPTIMIZERS, "training.optimizer", f"one of {', '.join(OPTIMIZERS)}", t.optimizer)
    _need(0 <= t.momentum < 1, "training.momentum", "in [0, 1)", t.momentum)
    _need(_finite(t.weight_decay) and t.weight_decay >= 0, "training.weight_decay", "a finite number >= 0", t.weight_decay)
    _need(
        t.grad_sampler in GRAD_SAMPLERS,
        "training.grad_sampler",
        f"one of {', '.join(GRAD_SAMPLERS)}",
        t.grad_sampler,
    )
    if t.eval_every is not None:
        _need(t.eval_every >= 1, "training.eval_every", "an integer >= 1", t.eval_every)


def _validate_convex(cfg: RunConfig) -> None:
    from dptrain.last_iterate import LOSSES

    p, cv = cfg.privacy, cfg.convex
    if cfg.preprocessing != PreprocessingConfig():
        raise ConfigError(
            '[preprocessing] is for DP-SGD (training.algorithm = "dpsgd"); projected noisy SGD normalizes with '
            "convex.feature_norm"
        )
    if p.noise_multiplier is not None:
        raise ConfigError(
            "privacy.noise_multiplier is for DP-SGD; projected noisy SGD takes convex.noise_std "
            "(or privacy.target_epsilon)"
        )
    if (cv.noise_std is None) == (p.target_epsilon is None):
        raise ConfigError("set exactly one of convex.noise_std and privacy.target_epsilon")
    if cv.noise_std is not None:
        _need(
            _finite(cv.noise_std) and cv.noise_std > 0,
            "convex.noise_std",
            "a finite number > 0",
            cv.noise_std,
        )
    _need(cv.loss in LOSSES, "convex.loss", f"one of {', '.join(LOSSES)}", cv.loss)
    _need(
        _finite(cv.feature_norm) and cv.feature_norm > 0,
        "convex.feature_norm",
        "a number > 0",
        cv.feature_norm,
    )
    _need(_finite(cv.diameter) and cv.diameter > 0, "convex.diameter", "a number > 0", cv.diameter)
    _need(cv.l2 >= 0, "convex.l2", "a number >= 0", cv.l2)
    _need(
        cv.batching in ("random", "cyclic", "full"),
        "convex.batching",
        "one of random, cyclic, full",
        cv.batching,
    )
    _need(cv.adjacency in ("replace", "remove"), "convex.adjacency", "one of replace, remove", cv.adjacency)
    _need(0 <= cv.lr_power < 1, "convex.lr_power", "in [0, 1)", cv.lr_power)
    if cv.batching == "random":
        _need(
            p.accountant in ("auto", "rdp"),
            "privacy.accountant",
            '"auto" or "rdp" for projected noisy SGD with random batches (the last-iterate bound is reported beside '
            "it but is not certified for random batches: docs/last_iterate.md)",
            p.accountant,
        )
    else:
        _need(
            p.accountant in ("auto", "rdp", "last_iterate"),
            "privacy.accountant",
            '"auto", "rdp" or "last_iterate" for projected noisy SGD',
            p.accountant,
        )


# --- writing ----------------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def config_to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that :func:`load_config` reads back to an equal object."""
    lines = [] if cfg.seed is None else [f"seed = {cfg.seed}"]
    for name in SECTIONS:
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(getattr(cfg, name)):
            v = getattr(getattr(cfg, name), f.name)
            if v is not None:  # None is TOML's absence; the default is None for every optional key
                lines.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"
