"""The names of the schedule kinds, their parameters and the accountants a schedule can be calibrated under, in a
module that imports nothing heavy: the config validator and the command-line parser read them without numpy, scipy
or dp_accounting (:mod:`dptrain.schedules.kinds` builds and calibrates the schedules)."""

from __future__ import annotations

#: The shapes of "On Dynamic Noise Influence in Differential Private Learning" and the baselines.
KINDS = (
    "uniform",
    "influence",
    "gd-optimal",
    "momentum",
    "exponential",
    "time",
    "step",
    "polynomial",
)
#: Kinds that are not from Dynamic Noise Influence (Yu et al. 2019's decays, calibrated the same way).
BASELINE_KINDS = ("exponential", "time", "step", "polynomial")
ACCOUNTANTS = ("zcdp", "exact", "rdp", "pld")
MOMENTUM_FORMS = ("reindexed", "two-exponential")

#: Parameters each kind accepts (anything else is a ConfigError naming it).
KIND_PARAMS: dict[str, tuple[str, ...]] = {
    "uniform": (),
    "influence": ("influence",),
    "gd-optimal": ("gamma", "kappa", "eta"),
    "momentum": ("beta", "gamma", "kappa", "eta0", "form", "c1", "c2"),
    "exponential": ("rate",),
    "time": ("rate",),
    "step": ("factor", "period"),
    "polynomial": ("power", "final", "period"),
}
