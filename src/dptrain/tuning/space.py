"""The search space of ``dptrain tune``: config keys and how each is drawn (``[tune.space]``, docs/tuning.md).

A key is any config key (``training.learning_rate``, ``privacy.max_grad_norm``, ``model.options.hidden``, a paper's
knob such as ``modelmix.tau`` or ``schedule.kind``) except those that fix what the search is certified for or on:
the data, the privacy budget (delta, target epsilon, noise multiplier, accountant), the randomness and the search
itself. A spec is one of

- ``{ log_uniform = [a, b] }``: exp of a uniform draw on [ln a, ln b] (0 < a < b);
- ``{ uniform = [a, b] }``: uniform on [a, b] (a < b);
- ``{ choice = [v1, v2, ...] }``: one of the values, each equally likely.

Bounds that are both integers draw integers (rounded). Before any trial runs, every bound and every choice is applied
to the base config alone and validated, so a range that would give an illegal config is refused in one line.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from typing import Any

from dptrain.config import RunConfig, config_from_dict, config_keys, config_to_toml
from dptrain.errors import ConfigError

KINDS = ("log_uniform", "uniform", "choice")
#: Keys a search may not vary: the data, the budget it is certified for, the randomness, the search itself.
FIXED_PREFIXES = ("data.", "seed", "tune.")
FIXED_KEYS = (
    "privacy.delta",
    "privacy.target_epsilon",
    "privacy.noise_multiplier",
    "privacy.accountant",
    "privacy.secure_noise",
)


@dataclass(frozen=True)
class Dimension:
    key: str
    kind: str
    values: tuple

    def candidates(self) -> tuple:
        """The values checked before the search: both bounds, or every choice."""
        return self.values

    def draw(self, uniform: float) -> Any:
        """The value for a uniform number in [0, 1)."""
        if self.kind == "choice":
            return self.values[min(int(uniform * len(self.values)), len(self.values) - 1)]
        a, b = self.values
        if self.kind == "log_uniform":
            value = math.exp(math.log(a) + uniform * (math.log(b) - math.log(a)))
        else:
            value = a + uniform * (b - a)
        if isinstance(a, int) and isinstance(b, int):
            return min(b, max(a, round(value)))
        return value


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _dimension(key: str, spec: Any) -> Dimension:
    where = f"tune.space.{key!r}"
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ConfigError(f"{where} must be one of {{ log_uniform = [a, b] }}, {{ uniform = [a, b] }}, {{ choice = [...] }}")
    kind, values = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: choice must be a non-empty list of values")
        return Dimension(key, kind, tuple(values))
    if not (isinstance(values, list) and len(values) == 2 and all(_number(v) for v in values) and values[0] < values[1]):
        raise ConfigError(f"{where}: {kind} must be two finite numbers [a, b] with a < b")
    if kind == "log_uniform" and values[0] <= 0:
        raise ConfigError(f"{where}: log_uniform bounds must be > 0")
    return Dimension(key, kind, tuple(values))


def _raw(cfg: RunConfig) -> dict:
    return tomllib.loads(config_to_toml(cfg))


def with_values(base: RunConfig, values: dict[str, Any]) -> RunConfig:
    """``base`` with each dotted key set to its value (None: the key removed), validated. The ``[tune]`` section stays
    as the search's (``dptrain train`` ignores it): a trial's config.toml, the selected one's in ``best/`` included,
    shows the search it belongs to as it was."""
    raw = _raw(base)
    for key, value in values.items():
        node, parts = raw, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    return config_from_dict(raw)


def parse_space(cfg: RunConfig) -> list[Dimension]:
    """The dimensions of ``cfg.tune.space``, checked: known keys that a search may vary, valid specs, and a valid
    config at every bound and every choice (each applied alone to the base config)."""
    space = cfg.tune.space
    if not space:
        raise ConfigError('[tune.space] is empty: give at least one key to search, e.g. "training.learning_rate" = '
                          "{ log_uniform = [0.05, 8.0] }")
    known = config_keys(cfg)
    dims = []
    for key, spec in space.items():
        if key.startswith(FIXED_PREFIXES) or key in FIXED_KEYS:
            raise ConfigError(
                f"tune.space cannot vary {key!r}: the search is certified for the config's data, privacy budget and "
                "randomness"
            )
        parent = key.rpartition(".")[0]
        if key not in known and not parent.endswith(".options") and parent not in ("model.options", "data.options"):
            raise ConfigError(f"tune.space: unknown config key {key!r}")
        dims.append(_dimension(key, spec))
    for dim in dims:
        for value in dim.candidates():
            try:
                with_values(cfg, {dim.key: value})
            except ConfigError as e:
                raise ConfigError(f"tune.space.{dim.key!r} = {value!r} gives an illegal config: {e}") from None
    return dims


def draw(dims: list[Dimension], uniforms) -> dict[str, Any]:
    """One point of the space from len(dims) uniform numbers in [0, 1)."""
    return {d.key: d.draw(float(u)) for d, u in zip(dims, uniforms, strict=True)}


__all__ = ["Dimension", "draw", "parse_space", "with_values"]
