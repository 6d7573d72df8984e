"""The sensitivity of banded matrix factorization under participations at least b steps apart, and the refusal of
every participation pattern where that argument does not hold. numpy only.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023), Theorem 4 (amplification of b-banded matrices under the cyclic Poisson
sampling of their Algorithm 2). The run releases y = C x + z. One example that takes part in steps t_1 < t_2 < ...
adds g_i (||g_i|| <= clip) to x at each t_i, so its contribution to C x is sum_i C[:, t_i] g_i, and column t of a
b-banded lower-triangular C is non-zero only in rows t..t+b-1. When every two participations are at least b steps
apart, these row blocks are disjoint: each participation is a Gaussian mechanism on its own rows (its own noise),
with L2 sensitivity ||C[:, t_i]|| clip, and the run is an (adaptive) composition of one sampled Gaussian per
participation. The per-participation sensitivity is the largest participating column norm:

    sens = max_i ||C[:, t_i]||_2 = ||c_0..c_{min(b, T - t_i) - 1}||_2 <= ||c||_2,

the columns of the last b - 1 steps being truncated by the end of the run. When two participations are closer than
b steps, their columns share rows: the privacy loss is not a composition of per-participation losses (it is larger
for positively correlated columns; tests/test_bandmf_review.py shows it numerically), so nothing here certifies it.
"""

from __future__ import annotations

import numpy as np

from dptrain.accounting.bandmf_strategy import check_coefficients, check_steps
from dptrain.errors import AccountingError


def column_norms(coefficients, steps: int) -> np.ndarray:
    """||C[:, t]||_2 for t = 0..T-1: the norm of c truncated to the T - t rows that column t has."""
    c, steps = check_coefficients(coefficients), check_steps(steps)
    prefix = np.sqrt(np.cumsum(c * c))  # ||c_0..c_k||
    rows = np.minimum(len(c), steps - np.arange(steps))
    return prefix[rows - 1]


def participation_sensitivity(coefficients, steps: int, participations) -> float:
    """The per-participation sensitivity max_i ||C[:, t_i]|| of one example taking part in steps ``participations``
    (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", the disjoint-block argument behind Theorem 4).
    Refuses, in one line, a pattern with two participations fewer than b = len(coefficients) steps apart: their
    columns overlap and the equivalence with DP-SGD does not hold."""
    c, steps = check_coefficients(coefficients), check_steps(steps)
    t = np.asarray(participations)
    if t.ndim != 1 or t.size == 0 or not np.issubdtype(t.dtype, np.integer) or t.min() < 0 or t.max() >= steps:
        raise AccountingError(f"participations must be a non-empty list of steps in [0, {steps}), got {participations!r}")
    t = np.sort(t)
    gaps = np.diff(t)
    if gaps.size and gaps.min() < len(c):
        i = int(np.argmin(gaps))
        raise AccountingError(
            f"participations at steps {t[i]} and {t[i + 1]} are {gaps[i]} apart but C has {len(c)} bands: their "
            f"columns overlap, so BandMF is not DP-SGD of one release per participation; accepted: participations at "
            f"least {len(c)} steps apart"
        )
    return float(column_norms(c, steps)[t].max())


def bandmf_sensitivity(steps: int, groups: int, coefficients) -> float:
    """The per-participation sensitivity of BandMF with cyclic participation: the data split into ``groups`` groups,
    step t drawing only from group t mod groups, so an example's participations are ``groups`` steps apart
    (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", Theorem 4 with their Algorithm 2). The max
    over every group's columns, i.e. ||c_0..c_{min(b, T) - 1}||: ||c|| once T >= b.

    Refuses, in one line, a C with more bands than groups (b > groups: consecutive participations of a group would
    share rows of C). Fewer bands than groups is accepted (the blocks are then shorter than the gaps)."""
    c, steps = check_coefficients(coefficients), check_steps(steps)
    groups = check_steps(groups, "groups")
    if len(c) > groups:
        raise AccountingError(
            f"C has {len(c)} bands but cyclic participation every {groups} steps: an example's consecutive "
            f"participations would share rows of C x; accepted: bands <= groups"
        )
    return float(column_norms(c, steps)[: min(groups, steps)].max())


def worst_group_participations(steps: int, groups: int) -> int:
    """ceil(T / groups): the participations of group 0, the most frequent group (groups 0..(T mod groups) - 1 take part
    ceil(T / groups) times, the others floor(T / groups) times)."""
    steps, groups = check_steps(steps), check_steps(groups, "groups")
    return -(-steps // groups)
