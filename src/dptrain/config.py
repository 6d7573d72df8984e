"""Run configuration: TOML files validated into typed dataclasses at the edge.

The core only ever sees these objects. Every problem (unknown key, wrong type, impossible value) is a
one-line :class:`~dptrain.errors.ConfigError` naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import pkgutil
import re
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dptrain.accounting.base import check_accountant
from dptrain.accounting.checks import check_noise_multiplier
from dptrain.data.loaders import DATASET_NAMES
from dptrain.errors import ConfigError
from dptrain.models.builders import MODEL_NAMES
from dptrain.numbers import number_problem
from dptrain.preflight.buffers import BUFFER_UPDATES
from dptrain.stages.augmentation import check_fits, make_augmentation
from dptrain.stages.batch_selection import SAMPLING_NAMES
from dptrain.stages.clipping import CLIPPING_NAMES
from dptrain.stages.per_example import GRAD_SAMPLERS

#: Data-independent transforms of the examples (``data.features``).
FEATURES = ("none", "scatternet")


@dataclass(frozen=True)
class DataConfig:
    name: str = "fashion-mnist"
    path: str | None = None
    options: dict = field(default_factory=dict)  # loader options (test_fraction, n, dim, num_classes, ...)
    classes: list | None = None  # keep only these labels, relabelled 0..k-1 in this order (e.g. [2, 4])
    seed: int = 0  # train/test split and synthetic data: public, NOT the privacy randomness
    #: whether the evaluation data is public, so that its metrics may be written as shareable outputs; default: true
    #: only where the test set is a separate file (fashion-mnist, an .npz with x_test), false where it is split off
    #: the private training examples (then test metrics are written only with training.log_not_private, labelled)
    test_is_public: bool | None = None
    #: a data-independent transform of every example before training (no privacy cost): "none" or "scatternet"
    #: (Tramer & Boneh's ScatterNet features of greyscale images, computed once and cached in runs/cache)
    features: str = "none"


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
    clipping: str = "flat"  # flat | per_layer | l2_linf (L2 to C, then each coordinate to C/sqrt(linf_p))
    linf_p: int | None = None  # l2_linf's p (ModelMix, Algorithm 2); default 1
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
    #: buffers a training-mode forward writes from the batch: refuse the model, or not_private (train; the run is
    #: labelled not private, the buffers being released unnoised)
    buffer_updates: str = "refuse"
    #: bf16 | fp16: per-example forward/backward under autocast, norms, clipping and noise in float32
    mixed_precision: str | None = None
    algorithm: str = "dpsgd"  # dpsgd, or an algorithm a package registers (projected_noisy_sgd: [convex])
    update: str = "optimizer"  # optimizer (training.optimizer), or an update rule a package registers (modelmix)
    device: str = "auto"  # cpu | cuda | cuda:N | auto (cuda when this machine has a GPU, else cpu)
    #: augmentation multiplicity: { multiplicity = K, crop_padding = P, flip = true|false } (docs/recipes.md)
    augment: dict = field(default_factory=dict)
    ema: float | None = None  # decay of the weight average of the released iterates, e.g. 0.999 (docs/recipes.md)


@dataclass(frozen=True)
class NoiseConfig:
    """The noise stage (docs/bandmf.md): independent Gaussian noise (DP-SGD), or banded matrix factorization."""

    mechanism: str = "gaussian"  # gaussian | bandmf (noise correlated across steps, cyclic Poisson groups)
    bands: int | str | None = None  # bandmf: an integer >= 1, or "auto" (the default; needs privacy.target_epsilon)


#: The sections every run has; algorithms and stages register theirs (:func:`register_section`).
CORE_SECTIONS = {
    "data": DataConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "training": TrainingConfig,
    "noise": NoiseConfig,
}


@dataclass(frozen=True)
class Section:
    """A config section a package adds beside its algorithm or stage (e.g. ``[convex]``, ``[preprocessing]``).

    ``validate(cfg)`` runs for every config, after the core checks: it checks its own keys and how they combine
    with the rest. ``stage`` names (``"module:function"``) what the section adds to a DP-SGD job when it is
    active; the run resolves it lazily, so this module never imports torch."""

    name: str
    cls: type
    validate: Callable[[RunConfig], None]
    stage: str | None = None
    #: True when the section sets the run's noise from a budget of its own (then the config gives neither
    #: privacy.noise_multiplier nor privacy.target_epsilon)
    supplies_noise: Callable[[RunConfig], bool] | None = None


@dataclass(frozen=True)
class Algorithm:
    """A training algorithm (``training.algorithm``): its checks (run when it is selected) and the function
    (``"module:function"``) that builds its job."""

    name: str
    validate: Callable[[RunConfig], None]
    build: str


SECTIONS: dict[str, Section] = {}
ALGORITHMS: dict[str, Algorithm] = {}
OPTIMIZERS = ("sgd", "adam")
#: Update rules of DP-SGD (``training.update``): the optimizer, or one a package registers (ModelMix's mix).
UPDATES: list[str] = ["optimizer"]


def register_update(name: str) -> None:
    """Accept ``training.update = name`` (the package's section validates and builds it)."""
    if name not in UPDATES:
        UPDATES.append(name)


def register_section(section: Section) -> Section:
    if section.name in CORE_SECTIONS or section.name == "seed":
        raise ValueError(f"section name {section.name!r} is taken")
    SECTIONS[section.name] = section
    return section


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


@dataclass(frozen=True)
class RunConfig:
    seed: int | None = None  # None: secret randomness; an integer makes the run reproducible and NOT private
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    #: registered sections by name (``cfg.convex`` reads ``cfg.sections["convex"]``)
    sections: dict = field(default_factory=dict)

    def __getattr__(self, name: str):
        sections = self.__dict__.get("sections", {})
        if name in sections:
            return sections[name]
        if name in SECTIONS:
            return SECTIONS[name].cls()
        raise AttributeError(f"RunConfig has no section {name!r}")

    @property
    def steps_or_epochs(self) -> dict:
        t = self.training
        return {"steps": t.steps} if t.steps is not None else {"epochs": t.epochs}


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
    if isinstance(value, int | float) and not isinstance(value, bool) and (int in allowed or float in allowed):
        problem = number_problem(value)  # every number first: finite, of a size its arithmetic holds
        if problem is not None:
            raise ConfigError(f"{key} must be {problem}, got {value!r}")
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
    top = {"seed"} | set(CORE_SECTIONS) | set(SECTIONS)
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"unknown key '{unknown[0]}'; accepted top-level keys: {', '.join(sorted(top))}")
    seed = _coerce("seed", raw.get("seed"), int | None)
    core = {name: _section(name, cls, raw.get(name, {})) for name, cls in CORE_SECTIONS.items()}
    extra = {name: _section(name, s.cls, raw.get(name, {})) for name, s in SECTIONS.items()}
    cfg = RunConfig(seed=seed, sections=extra, **core)
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


def need(ok: bool, key: str, accepted: str, value: Any) -> None:
    """A one-line ConfigError naming ``key`` and what it accepts unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} must be {accepted}, got {value!r}")


def finite(v) -> bool:
    return v is not None and math.isfinite(v)


def validate(cfg: RunConfig) -> None:
    """Range checks that do not need the data (those that do are made when the run is built): the keys every
    run uses, then those of its algorithm, then each registered section's."""
    p, t = cfg.privacy, cfg.training
    need(cfg.seed is None or cfg.seed >= 0, "seed", "an integer >= 0 (or absent: secret randomness)", cfg.seed)
    need(cfg.data.seed >= 0, "data.seed", "an integer >= 0", cfg.data.seed)
    need(t.algorithm in ALGORITHMS, "training.algorithm", f"one of {', '.join(ALGORITHMS)}", t.algorithm)
    need(cfg.data.name in DATASET_NAMES, "data.name", f"one of {', '.join(DATASET_NAMES)}", cfg.data.name)
    need(cfg.data.features in FEATURES, "data.features", f"one of {', '.join(FEATURES)}", cfg.data.features)
    if cfg.data.classes is not None:
        labels = cfg.data.classes
        need(
            len(labels) >= 2
            and len(set(labels)) == len(labels)
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in labels),
            "data.classes",
            "a list of at least 2 distinct labels (integers >= 0)",
            labels,
        )
    if p.target_epsilon is not None:
        need(
            finite(p.target_epsilon) and p.target_epsilon > 0,
            "privacy.target_epsilon",
            "a finite number > 0",
            p.target_epsilon,
        )
    need(0 < p.delta < 1, "privacy.delta", "in (0, 1)", p.delta)
    check_accountant(p.accountant, "privacy.accountant")
    if t.steps is not None:
        need(t.steps >= 1, "training.steps", "an integer >= 1", t.steps)
    if t.steps is None or t.epochs is not None:  # (checked even where training.steps wins: never silently ignored)
        need(
            finite(t.epochs) and t.epochs > 0,
            "training.epochs",
            "a number > 0 (or set training.steps)",
            t.epochs,
        )
    need(t.batch_size >= 1, "training.batch_size", "an integer >= 1", t.batch_size)
    need(
        t.device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", t.device) is not None,
        "training.device",
        "cpu, cuda, cuda:N or auto",
        t.device,
    )
    need(
        finite(t.learning_rate) and t.learning_rate > 0,
        "training.learning_rate",
        "a number > 0",
        t.learning_rate,
    )
    if t.algorithm != "dpsgd" and (t.augment or t.ema is not None):
        raise ConfigError(
            f"training.augment and training.ema are stages of DP-SGD; training.algorithm = {t.algorithm!r} takes neither"
        )
    ALGORITHMS[t.algorithm].validate(cfg)
    _validate_noise(cfg)
    for section in SECTIONS.values():
        section.validate(cfg)


#: Accountants that certify a BandMF run from a config, and "auto" (pld; for DPSGD-F's Algorithm 2, whose private
#: quantile pld and rdp cannot read, the composition accountant, which covers a BandMF training phase).
BANDMF_ACCOUNTANTS = ("auto", "pld", "rdp")


def _validate_noise(cfg: RunConfig) -> None:
    """[noise]: the mechanism, its bands, and the combinations BandMF's certificate does not cover (docs/bandmf.md)."""
    n, p, t = cfg.noise, cfg.privacy, cfg.training
    need(n.mechanism in ("gaussian", "bandmf"), "noise.mechanism", "gaussian or bandmf", n.mechanism)
    if n.mechanism == "gaussian":
        if n.bands is not None:
            raise ConfigError('noise.bands goes with noise.mechanism = "bandmf"')
        return
    need(
        n.bands is None or n.bands == "auto" or (isinstance(n.bands, int) and n.bands >= 1),
        "noise.bands",
        'an integer >= 1 or "auto"',
        n.bands,
    )
    if n.bands in (None, "auto") and p.target_epsilon is None:
        raise ConfigError(
            'noise.bands = "auto" chooses b for privacy.target_epsilon: set it, or give noise.bands = B with '
            "privacy.noise_multiplier"
        )
    refusals = (
        (t.algorithm == "dpsgd", f'training.algorithm = "dpsgd" (its steps), not {t.algorithm!r}'),
        (t.update == "optimizer", f'training.update = "optimizer", not {t.update!r} (its accountant does not cover it)'),
        (p.sampling == "poisson", f'privacy.sampling = "poisson" (the groups are Poisson-sampled), not {p.sampling!r}'),
        (t.batch_growth == 0, "a constant expected batch size (training.batch_growth = 0)"),
        (p.accountant in BANDMF_ACCOUNTANTS, f"privacy.accountant in {', '.join(BANDMF_ACCOUNTANTS)}, not {p.accountant!r}"),
    )
    for ok, needed in refusals:
        if not ok:
            raise ConfigError(f'noise.mechanism = "bandmf" needs {needed}')


def section_is_default(cfg: RunConfig, name: str) -> bool:
    """True when the config leaves section ``name`` at its defaults (the section is not in use)."""
    return getattr(cfg, name) == SECTIONS[name].cls()


def _validate_dpsgd(cfg: RunConfig) -> None:
    """DP-SGD (the engine's own algorithm): model, noise, clipping, sampling, optimizer."""
    p, t = cfg.privacy, cfg.training
    need(cfg.model.name in MODEL_NAMES, "model.name", f"one of {', '.join(MODEL_NAMES)}", cfg.model.name)
    supplied = [s.name for s in SECTIONS.values() if s.supplies_noise is not None and s.supplies_noise(cfg)]
    if supplied:
        if p.noise_multiplier is not None or p.target_epsilon is not None:
            raise ConfigError(
                f"[{supplied[0]}] sets the noise from its own budget: remove privacy.noise_multiplier and "
                "privacy.target_epsilon"
            )
    elif (p.noise_multiplier is None) == (p.target_epsilon is None):
        raise ConfigError("set exactly one of privacy.noise_multiplier and privacy.target_epsilon")
    if p.noise_multiplier is not None:
        check_noise_multiplier(p.noise_multiplier, "privacy.noise_multiplier")
    need(
        finite(p.max_grad_norm) and p.max_grad_norm > 0,
        "privacy.max_grad_norm",
        "a finite number > 0",
        p.max_grad_norm,
    )
    need(p.sampling in SAMPLING_NAMES, "privacy.sampling", f"one of {', '.join(SAMPLING_NAMES)}", p.sampling)
    need(p.clipping in CLIPPING_NAMES, "privacy.clipping", f"one of {', '.join(CLIPPING_NAMES)}", p.clipping)
    if p.linf_p is not None:
        need(p.clipping == "l2_linf", "privacy.linf_p", 'set only with privacy.clipping = "l2_linf"', p.linf_p)
        need(
            isinstance(p.linf_p, int) and not isinstance(p.linf_p, bool) and p.linf_p >= 1,
            "privacy.linf_p",
            "an integer >= 1",
            p.linf_p,
        )
    need(
        finite(t.batch_growth) and t.batch_growth >= 0,
        "training.batch_growth",
        "a number >= 0 (0: constant)",
        t.batch_growth,
    )
    if t.batch_growth > 0:
        need(
            p.sampling == "poisson",
            "privacy.sampling",
            '"poisson" when training.batch_growth > 0',
            p.sampling,
        )
    if t.max_physical_batch_size is not None:
        need(
            t.max_physical_batch_size >= 1,
            "training.max_physical_batch_size",
            "an integer >= 1",
            t.max_physical_batch_size,
        )
    need(t.optimizer in OPTIMIZERS, "training.optimizer", f"one of {', '.join(OPTIMIZERS)}", t.optimizer)
    need(t.update in UPDATES, "training.update", f"one of {', '.join(UPDATES)}", t.update)
    need(0 <= t.momentum < 1, "training.momentum", "in [0, 1)", t.momentum)
    need(finite(t.weight_decay) and t.weight_decay >= 0, "training.weight_decay", "a finite number >= 0", t.weight_decay)
    need(
        t.grad_sampler in GRAD_SAMPLERS,
        "training.grad_sampler",
        f"one of {', '.join(GRAD_SAMPLERS)}",
        t.grad_sampler,
    )
    if t.eval_every is not None:
        need(t.eval_every >= 1, "training.eval_every", "an integer >= 1", t.eval_every)
    need(t.mixed_precision in (None, "bf16", "fp16"), "training.mixed_precision", "bf16 or fp16 (or absent)",
         t.mixed_precision)
    need(t.buffer_updates in BUFFER_UPDATES, "training.buffer_updates", f"one of {', '.join(BUFFER_UPDATES)}",
         t.buffer_updates)
    check_fits(make_augmentation(t.augment), cfg.data.name, cfg.data.features)
    if t.ema is not None:
        need(0 < t.ema < 1, "training.ema", "a decay in (0, 1), e.g. 0.999", t.ema)


register_algorithm(
    Algorithm("dpsgd", _validate_dpsgd, "dptrain.runs.job:build_dpsgd_job")
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
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_key(k: str) -> str:
    """A table key: bare where TOML allows, else quoted (a dotted config key such as "training.learning_rate")."""
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def config_to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that :func:`load_config` reads back to an equal object."""
    lines = [] if cfg.seed is None else [f"seed = {cfg.seed}"]
    for name in (*CORE_SECTIONS, *SECTIONS):
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(getattr(cfg, name)):
            v = getattr(getattr(cfg, name), f.name)
            if v is not None:  # None is TOML's absence; the default is None for every optional key
                lines.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def config_keys(cfg: RunConfig) -> dict[str, Any]:
    """Every key of a config as a dotted name -> value (tables such as ``data.options`` flattened too), for comparing
    two configs key by key."""
    out: dict[str, Any] = {"seed": cfg.seed}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for name in (*CORE_SECTIONS, *SECTIONS):
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            put(f"{name}.{f.name}", getattr(section, f.name))
    return out


def same_value(a: Any, b: Any) -> bool:
    """Whether two config values are the same setting: equal and of the same types, in lists and tables too (``8`` and
    ``8.0``, ``1`` and ``true`` compare equal in Python, but a model builder or a stage may read them differently)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def changed_keys(before: RunConfig, after: RunConfig) -> list[str]:
    """The dotted keys whose values differ between two configs, in value or in type (:func:`same_value`; a key present
    in one only counts as changed)."""
    a, b = config_keys(before), config_keys(after)
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same_value(a[k], b[k]))


def config_from_toml(text: str) -> RunConfig:
    """A config from TOML text (e.g. the copy a run keeps of the config it started with)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config is not valid TOML: {e}") from None
    return config_from_dict(raw)


def _register_packages() -> None:
    """Import every ``dptrain.<package>.config`` module: algorithms and stages register their sections there,
    beside their code (adding one needs no change here)."""
    import dptrain

    for info in pkgutil.iter_modules(dptrain.__path__):
        name = f"dptrain.{info.name}.config"
        if info.ispkg and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


_register_packages()
