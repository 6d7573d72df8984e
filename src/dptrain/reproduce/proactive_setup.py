"""The fixed setup of the reproduction of "Proactive DP: A Multiple Target Optimization Framework for DP-SGD"
(van Dijk, Nguyen, Nguyen, Nguyen, Nguyen; docs/proactive.md): the paper's Tables 9-11 (inputs and printed outputs),
our own settings, the binary Fashion-MNIST task and Table 3's parameters of the experiment, and how much of sections
(c) and (d) a full or quick run does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPORT, DATA_JSON = "proactive.md", "proactive.json"

#: Tables 9-11 of the paper (Sec. 4.4; theta = 1, delta = 1/N): inputs and the printed outputs.
PAPER_TABLES: list[dict[str, Any]] = [
    {
        "name": "LIBSVM (Table 9)",
        "sigma": 19.29962,
        "n": 10_000,
        "k": 5,
        "s_max": 26,
        "s_max_asym": 198,
        "epsilon": 0.0497,
        "eps_fdp": 0.0105,
        "eps_fdp_asym": 0.0533,
        "ratio": 4.7234,
        "ratio_asym": 0.9328,
    },
    {
        "name": "MNIST (Table 10)",
        "sigma": 12.10881,
        "n": 60_000,
        "k": 6,
        "s_max": 288,
        "s_max_asym": 3042,
        "epsilon": 0.1521,
        "eps_fdp": 0.0389,
        "eps_fdp_asym": 0.2097,
        "ratio": 3.9147,
        "ratio_asym": 0.7257,
    },
    {
        "name": "CIFAR10 (Table 11)",
        "sigma": 6.572,
        "n": 50_000,
        "k": 7,
        "s_max": 406,
        "s_max_asym": 7504,
        "epsilon": 0.5253,
        "eps_fdp": 0.1133,
        "eps_fdp_asym": 0.8239,
        "ratio": 4.6372,
        "ratio_asym": 0.6376,
    },
]

#: Our own (N, k, eps) settings for section (b): delta = 1/N, sigma from eq. (6), plan by Sec. 3.2.
OWN_SETTINGS: list[tuple[int, float, float]] = [(10_000, 50, 0.1), (60_000, 20, 0.3), (100_000, 100, 0.4)]

#: Fashion-MNIST classes of the binary task of section (c).
CLASS_NAMES = {0: "T-shirt/top", 6: "Shirt"}
NEGATIVE_CLASS, POSITIVE_CLASS = 0, 6

#: Table 3 (Sec. 4.2) parameters of the LIBSVM experiment and Tables 1-2's plain-convex schedule.
EXPERIMENT = {"sigma": 19.29962, "clip": 0.1, "eta0": 0.1, "beta": 0.01}


@dataclass(frozen=True)
class Scale:
    """How much of sections (c) and (d) runs: N training examples, k epochs, the seeds, the batch sizes s besides
    the certified s_max (and the paper-iteration s_max when ``paper_s_max``); (d)'s clip norms, noise multipliers
    and noise draws per cell."""

    n: int
    k: int
    seeds: tuple[int, ...]
    sizes: tuple[int, ...]
    paper_s_max: bool
    clips: tuple[float, ...]
    sigmas: tuple[float, ...]
    draws: int


FULL = Scale(
    n=10_000,
    k=5,
    seeds=(0, 1, 2, 3, 4),
    sizes=(1, 5, 10, 15, 20),
    paper_s_max=True,
    clips=(0.075, 0.1),
    sigmas=(0.0, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0),
    draws=5,
)
#: quick: N = 2000, k = 2, one seed, s in {5, s_max}; (d) with one C, three sigmas and two draws.
QUICK = Scale(
    n=2000, k=2, seeds=(0,), sizes=(5,), paper_s_max=False, clips=(0.1,), sigmas=(0.0, 1.0, 20.0), draws=2
)
