"""A numerical review of BandMF's privacy argument (docs/accounting.md, "Banded matrix factorization"), as one would
check a paper's proof on small cases.

For one example, the run releases y = C x + z with z ~ N(0, sigma^2 I), x_t = B_t at the example's participations t
(B_t ~ Bernoulli(p) independently: Poisson sampling within its group; clip 1, a scalar gradient) and 0 elsewhere; the
other examples' contributions are the same in both neighbouring datasets and shift nothing. So the two outputs are

    P = sum_B p^|B| (1 - p)^(k - |B|) N(C[:, parts] B, sigma^2 I)   (the dataset with the example),
    Q = N(0, sigma^2 I)                                              (the dataset without it),

and the mechanism is (eps, delta)-DP for add and remove adjacency iff both hockey-stick divergences H_eps(P || Q)
(dp_accounting's REMOVE) and H_eps(Q || P) (its ADD) are <= delta. Both are computed here directly, by quadrature
over the span of the participating columns (P and Q agree on its orthogonal complement), with no assumption on the
columns, and compared with the equivalent DP-SGD event's PLD as dp_accounting computes it: equal when the
participations are >= b apart (disjoint row blocks), larger when they are not, which is why those schedules are
refused.
"""

import functools
import itertools
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

from dptrain.accounting import bandmf_ledger, bandmf_sensitivity, participation_sensitivity
from dptrain.accounting.bandmf_noise import strategy_matrix
from dptrain.errors import AccountingError

SIGMA, P, EPS = 1.0, 0.5, 1.0
C2 = np.array([0.8, 0.6])  # unit norm, columns overlap by c_0 c_1 = 0.48 when participations are 1 apart
C3 = np.array([0.7, 0.5, 0.5]) / np.linalg.norm([0.7, 0.5, 0.5])


def direct_deltas(coefficients, steps, parts, p=P, sigma=SIGMA, eps=EPS, n=600, reach=9.0):
    """(H_eps(P || Q), H_eps(Q || P)) of the mechanism above, by the midpoint rule on an n^k grid over the span of the
    k participating columns (orthonormal coordinates from a QR factorization; reach: standard deviations kept)."""
    R = np.linalg.qr(strategy_matrix(coefficients, steps)[:, parts])[1]
    k = len(parts)
    subsets = [np.array(s) for s in itertools.product((0, 1), repeat=k)]
    means = np.array([R @ s for s in subsets])
    weights = [p ** s.sum() * (1 - p) ** (k - s.sum()) for s in subsets]
    lo, hi = means.min(0) - reach * sigma, means.max(0) + reach * sigma
    edges = [np.linspace(a, b, n + 1) for a, b in zip(lo, hi, strict=True)]
    cell = math.prod(e[1] - e[0] for e in edges)
    grid = np.stack(np.meshgrid(*[(e[1:] + e[:-1]) / 2 for e in edges], indexing="ij"), -1).reshape(-1, k)
    norm = (2 * math.pi * sigma**2) ** (k / 2)
    q = np.exp(-0.5 * np.sum(grid**2, 1) / sigma**2) / norm
    mix = sum(w * np.exp(-0.5 * np.sum((grid - m) ** 2, 1) / sigma**2) for w, m in zip(weights, means, strict=True))
    mix = mix / norm
    assert cell * mix.sum() == pytest.approx(1.0, abs=1e-9) and cell * q.sum() == pytest.approx(1.0, abs=1e-9)
    e = math.exp(eps)
    return cell * np.maximum(mix - e * q, 0).sum(), cell * np.maximum(q - e * mix, 0).sum()


@functools.cache
def _sampled_gaussian(sensitivity: float, p: float = P, sigma: float = SIGMA):
    """dp_accounting's PLD of one Poisson-sampled Gaussian (pessimistic, interval 1e-4; both adjacencies)."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sensitivity=sensitivity, sampling_prob=p, value_discretization_interval=1e-4
    )


def equivalent_deltas(compositions, eps=EPS, sensitivities=None):
    """(REMOVE, ADD) deltas of the composition of Poisson-sampled Gaussians as dp_accounting computes them:
    ``compositions`` of them at sensitivity 1, or one per entry of ``sensitivities``."""
    pmfs = [_sampled_gaussian(float(s)) for s in (sensitivities or [1.0] * compositions)]
    pld = functools.reduce(lambda a, b: a.compose(b), pmfs)
    return pld._pmf_remove.get_delta_for_epsilon(eps), pld._pmf_add.get_delta_for_epsilon(eps)


def test_the_quadrature_is_exact_on_one_sampled_gaussian():
    remove, add = direct_deltas(C2, 4, [0], n=20000)
    exact = privacy_loss_mechanism.GaussianPrivacyLoss(
        SIGMA, sampling_prob=P, adjacency_type=privacy_loss_mechanism.AdjacencyType.REMOVE
    ).get_delta_for_epsilon(EPS)
    assert remove == pytest.approx(exact, rel=1e-6) and add == 0.0  # H(Q||P) = 0 for one release at eps = 1 > log 2


@pytest.mark.parametrize("parts", [[0, 2], [1, 3]], ids=["group 0", "group 1 (last column truncated)"])
def test_participations_b_apart_are_the_equivalent_dpsgd_event(parts):
    # T = 4, b = 2 bands, 2 groups: group 0 takes part at steps 0 and 2, group 1 at 1 and 3 (column 3 is (c_0))
    remove, add = direct_deltas(C2, 4, parts)
    eq_remove, eq_add = equivalent_deltas(2)
    assert remove <= eq_remove * (1 + 1e-5) and add <= eq_add * (1 + 1e-5)  # never above the certificate
    if parts == [1, 3]:  # a truncated column is a smaller sensitivity: strictly more private
        assert remove < 0.95 * eq_remove
        assert (remove, add) == pytest.approx(equivalent_deltas(2, sensitivities=[1.0, C2[0]]), rel=1e-4)
        return
    # full columns: the mechanism IS the equivalent event, in both orderings
    assert remove == pytest.approx(eq_remove, rel=1e-4) and add == pytest.approx(eq_add, rel=1e-4)
    # and the ledger certifies exactly that event: its DpEvent, composed by dp_accounting, gives the same delta
    acc = PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(bandmf_ledger(SIGMA, P / 2, 4, C2).dp_event())
    assert acc.get_delta(EPS) == pytest.approx(max(eq_remove, eq_add), rel=1e-6)


def test_b_not_dividing_t_counts_the_worst_group():
    # T = 3, b = 2: group 0 takes part at 0 and 2 (2 = ceil(3/2) times; column 2 truncated to c_0), group 1 once
    ledger = bandmf_ledger(SIGMA, P / 2, 3, C2)
    assert ledger.entries[0].compositions == 2
    eq = equivalent_deltas(2)
    group0, group1 = direct_deltas(C2, 3, [0, 2]), direct_deltas(C2, 3, [1])
    assert group0 == pytest.approx(equivalent_deltas(2, sensitivities=[1.0, C2[0]]), rel=1e-4)
    assert group0[0] <= eq[0] and group0[1] <= eq[1] and group1[0] < group0[0]
    assert bandmf_sensitivity(3, 2, C2) == pytest.approx(1.0)


def test_wrong_schedules_break_the_equivalence_and_are_refused():
    eq_remove, eq_add = equivalent_deltas(2)
    # (a) participations 1 step apart under a 2-banded C (cyclic groups of 1: every step): overlapping columns
    remove, add = direct_deltas(C2, 3, [0, 1])
    assert remove > 1.3 * eq_remove and add > 1.3 * eq_add  # the "equivalent" event would under-state the loss
    with pytest.raises(AccountingError, match="are 1 apart but C has 2 bands"):
        participation_sensitivity(C2, 3, [0, 1])
    # (b) a 3-banded C with 2 groups: participations 2 apart share a row
    remove, add = direct_deltas(C3, 5, [0, 2])
    assert remove > 1.2 * eq_remove and add > 1.2 * eq_add
    with pytest.raises(AccountingError, match="C has 3 bands but cyclic participation every 2 steps"):
        bandmf_sensitivity(5, 2, C3)
    # without sampling the overlap is a plain Gaussian of sensitivity ||col_0 + col_1|| = sqrt(2 + 2 c_0 c_1) > sqrt 2
    remove, _ = direct_deltas(C2, 3, [0, 1], p=1.0)
    exact = privacy_loss_mechanism.GaussianPrivacyLoss(SIGMA / math.sqrt(2 + 2 * C2[0] * C2[1])).get_delta_for_epsilon(EPS)
    claimed = privacy_loss_mechanism.GaussianPrivacyLoss(SIGMA / math.sqrt(2)).get_delta_for_epsilon(EPS)
    assert remove == pytest.approx(exact, rel=1e-4) and remove > 1.3 * claimed
