"""One-run audit statistics (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run"):
Theorem 3.1 and 5.2 p-values, their inversion into an epsilon lower bound, guesses, and the audit's soundness.

The numpy seeds below draw test data (simulated secrets and scores), not privacy randomness.
"""

import math
from itertools import pairwise

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import binom, norm

from dptrain.auditing.bounds import audit, ceiling, epsilon_lower_bound, guesses, p_value
from dptrain.errors import ConfigError


def logit(p):
    return math.log(p / (1 - p))


def randomized_response(epsilon, m, rng):
    """Each score reveals S_i with probability e^eps / (1 + e^eps), else shows -S_i; plus continuous jitter."""
    included = rng.random(m) < 0.5
    secret = np.where(included, 1.0, -1.0)
    truthful = rng.random(m) < math.exp(epsilon) / (1 + math.exp(epsilon))
    return np.where(truthful, secret, -secret) + rng.uniform(-0.1, 0.1, m), included


# --- Theorem 3.1 and 5.2 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m,r,v,eps", [(1000, 100, 75, 1.0), (1000, 1000, 880, 2.0), (50, 20, 3, 0.3), (10, 10, 10, 5.0)]
)
def test_pure_dp_p_value_is_the_binomial_tail_of_theorem_3_1(m, r, v, eps):
    q = math.exp(eps) / (1 + math.exp(eps))
    assert p_value(m, r, v, eps) == pytest.approx(binom.sf(v - 1, r, q), rel=1e-9)


@pytest.mark.parametrize(
    "m,r,v,eps,delta", [(1000, 100, 75, 0.7, 1e-4), (100000, 1510, 1439, 2.6, 1e-5), (200, 50, 40, 0.0, 1e-3)]
)
def test_approximate_dp_p_value_is_theorem_5_2(m, r, v, eps, delta):
    q = math.exp(eps) / (1 + math.exp(eps))
    i = np.arange(1, m + 1)  # the theorem's max runs over every i, not just i <= v
    f_v, f_v_minus_i = binom.sf(v - 1, r, q), binom.sf(v - i - 1, r, q)  # f(u) = P[Binomial(r, q) >= u]
    spread = np.max((f_v_minus_i - f_v) / i)
    assert p_value(m, r, v, eps, delta) == pytest.approx(min(1.0, f_v + 2 * m * delta * spread), rel=1e-9)


@pytest.mark.parametrize(
    "m,r,v,delta,published",
    [
        (1000, 100, 75, 1e-4, 0.673),  # the example of the paper's Appendix D code
        (100000, 1510, 1439, 1e-5, 2.675),  # a Section 7 result (2.6758 printed truncated)
    ],
)
def test_paper_numbers_are_reproduced(m, r, v, delta, published):
    """Values the paper reports at 95% confidence (as quoted by an independent port of its Appendix D code);
    jax_privacy's auditing code gives the same to 1e-6. Dropping the delta term (0.702, 2.806) or scaling it by
    r instead of m (0.699, 2.805) misses them."""
    assert epsilon_lower_bound(m, r, v, delta, 0.95) == pytest.approx(published, abs=1e-3)


@pytest.mark.parametrize("r", [1, 20, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_all_correct_has_a_closed_form(r, confidence):
    """v = r, delta = 0: q^r <= beta exactly when eps <= logit(beta^(1/r))."""
    expected = max(0.0, logit((1 - confidence) ** (1 / r)))
    bound = epsilon_lower_bound(5000, r, r, 0.0, confidence)
    assert bound == pytest.approx(expected, abs=1e-4)
    assert bound <= expected  # conservative side


def test_the_bound_is_rejected_and_only_just():
    """The answer is itself rejected (p <= beta), and 1e-5 above it is not: the sup, from below."""
    for m, r, v, delta in [(1000, 100, 75, 1e-4), (1000, 1000, 880, 0.0), (10000, 500, 400, 1e-6)]:
        eps = epsilon_lower_bound(m, r, v, delta, 0.95)
        assert p_value(m, r, v, eps, delta) <= 0.05 < p_value(m, r, v, eps + 1e-5, delta)


def test_no_evidence_gives_zero():
    assert epsilon_lower_bound(1000, 100, 55) == 0.0  # 55/100 correct is consistent with eps = 0
    assert epsilon_lower_bound(1000, 0, 0) == 0.0  # every canary abstained


def test_monotonicity():
    by_v = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(130, 201, 10)]
    assert all(a < b for a, b in pairwise(by_v))
    by_delta = [epsilon_lower_bound(1000, 200, 180, d) for d in (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3)]
    assert all(a >= b for a, b in pairwise(by_delta)) and by_delta[0] > by_delta[-1]
    by_confidence = [epsilon_lower_bound(1000, 200, 180, 1e-6, c) for c in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
    assert all(a >= b for a, b in pairwise(by_confidence)) and by_confidence[0] > by_confidence[-1]


# --- guesses and audit -----------------------------------------------------------------------------------------


def test_guesses_take_the_extremes():
    t = guesses([0.3, -1.0, 2.0, 0.5, 0.1], k_positive=2, k_negative=1)
    assert t.tolist() == [0, -1, 1, 1, 0]


def test_guesses_break_ties_by_position():
    assert guesses([1.0] * 5, 2, 2).tolist() == [-1, -1, 0, 1, 1]
    assert guesses([0.0, 1.0, 1.0, 1.0, 2.0], 2, 2).tolist() == [-1, -1, 0, 1, 1]
    assert guesses([5.0, 5.0, 5.0], 0, 0).tolist() == [0, 0, 0]


def test_audit_reports_the_best_candidate_with_a_union_bound():
    m = 1000
    included = np.arange(m) % 2 == 0  # 500 in, 500 out, perfectly separated: every guess is correct
    scores = included + np.random.default_rng(0).uniform(0, 0.5, m)
    result = audit(scores, included)
    # 6 default candidates k in {10, 20, 50, 100, 250, 500}; the best, k = 500, guesses all 1000 right
    assert result == dict(
        epsilon_lower_bound=pytest.approx(logit((0.05 / 6) ** (1 / m)), abs=1e-4),
        confidence=0.95,
        canaries=m,
        guesses=m,
        correct=m,
        k_positive=500,
        k_negative=500,
    )
    # one candidate fixed in advance: no correction
    alone = audit(scores, included, guess_counts=[(500, 500)])
    assert alone["epsilon_lower_bound"] == pytest.approx(logit(0.05 ** (1 / m)), abs=1e-4)


def test_audit_counts_correct_guesses_on_both_sides():
    scores = np.array([3.0, 2.0, 1.0, 0.0, -1.0, -2.0])
    included = np.array([True, False, True, True, False, True])
    result = audit(scores, included, guess_counts=[(2, 2)])
    # +1 for scores 3, 2 (one included), -1 for -1, -2 (one excluded)
    assert (result["guesses"], result["correct"]) == (4, 2)


def test_audit_is_sound_and_not_vacuous_on_randomized_response():
    epsilon, rng = 2.0, np.random.default_rng(1)
    bounds = np.array(
        [audit(*randomized_response(epsilon, 1000, rng))["epsilon_lower_bound"] for _ in range(200)]
    )
    assert np.mean(bounds > epsilon) <= 0.10  # at most 5% in expectation; slack for 200 repetitions
    assert np.mean(bounds) > 0.5 * epsilon


def test_audit_stays_below_the_gaussian_mechanism_epsilon():
    """scores = S_i mu/2 + N(0, 1) is mu-GDP in each S_i, so (eps, delta)-DP for the eps of the exact tradeoff
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Dong, Roth & Su, Corollary 2.13)."""
    mu, delta = 1.0, 1e-5
    eps = brentq(
        lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 50
    )
    rng = np.random.default_rng(2)
    bounds = []
    for _ in range(100):
        included = rng.random(1000) < 0.5
        scores = np.where(included, 1.0, -1.0) * mu / 2 + rng.standard_normal(1000)
        bounds.append(audit(scores, included, delta=delta)["epsilon_lower_bound"])
    assert max(bounds) < eps
    assert np.mean(bounds) > 0.5  # the audit sees the leak (it is far from tight for Gaussian noise)


# --- the ceiling ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [20, 200, 1000])
def test_ceiling_at_delta_0_is_the_closed_form_of_all_correct_guesses(m):
    """With v = r, Theorem 3.1 gives p = q^r: the bound is the logit of (beta / K)^(1 / r), K candidates."""
    ks = sorted({min(max(1, round(f * m)), m // 2) for f in (0.01, 0.02, 0.05, 0.1, 0.25, 0.5)})
    level = 0.05 / len(ks)
    expected = max(logit(level ** (1 / (2 * k))) for k in ks)
    assert ceiling(m, 0.0, 0.95) == pytest.approx(expected, abs=1e-6)


def test_ceiling_bounds_every_audit_and_is_reached_by_perfect_guesses():
    rng = np.random.default_rng(3)
    for m, delta in ((50, 1e-5), (1000, 1e-5), (300, 0.0)):
        top = ceiling(m, delta)
        included = rng.permutation(np.arange(m) % 2 == 0)  # half included: every candidate can be all correct
        perfect = audit(np.where(included, 1.0, -1.0) + rng.uniform(-0.1, 0.1, m), included, delta)
        assert perfect["epsilon_lower_bound"] == pytest.approx(top, abs=1e-6)
        for eps in (0.5, 2.0, 6.0):
            scores, secrets = randomized_response(eps, m, rng)
            assert audit(scores, secrets, delta)["epsilon_lower_bound"] <= top + 1e-9
    assert ceiling(1000, 1e-5) < ceiling(1000, 0.0)  # delta costs power
    assert ceiling(20, 1e-5) < ceiling(200, 1e-5) < ceiling(1000, 1e-5)  # so do few canaries
    with pytest.raises(ConfigError, match="at least 2 canaries"):
        ceiling(1)


# --- refusals ----------------------------------------------------------------------------------------------------

GOOD = np.array([0.5, -0.2, 1.0, 0.0])
IN = np.array([True, False, True, False])


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: p_value(10, 11, 5, 1.0), "r"),
        (lambda: p_value(10, 5, 6, 1.0), "v"),
        (lambda: p_value(-1, 0, 0, 1.0), "m"),
        (lambda: p_value(10, 5, 2.5, 1.0), "v"),
        (lambda: p_value(10, 5, 3, -0.1), "epsilon"),
        (lambda: p_value(10, 5, 3, float("nan")), "epsilon"),
        (lambda: p_value(10, 5, 3, 1.0, delta=1.0), "delta"),
        (lambda: p_value(10, 5, 3, 1.0, delta=-1e-9), "delta"),
        (lambda: epsilon_lower_bound(10, 5, 3, confidence=1.0), "confidence"),
        (lambda: epsilon_lower_bound(10, 5, 3, confidence=0.0), "confidence"),
        (lambda: epsilon_lower_bound(10, 5, 3, delta=2.0), "delta"),
        (lambda: guesses([1.0, 2.0, 3.0], 2, 2), "k_positive"),
        (lambda: guesses([1.0, 2.0, 3.0], -1, 0), "k_positive"),
        (lambda: guesses([1.0, float("nan")], 1, 0), "scores"),
        (lambda: audit(GOOD, np.where(IN, 1, -1)), "included"),
        (lambda: audit(GOOD, IN[:3]), "included"),
        (lambda: audit(GOOD, IN, confidence=1.5), "confidence"),
        (lambda: audit(GOOD, IN, guess_counts=[(0, 0)]), "guess_counts"),
        (lambda: audit(GOOD, IN, guess_counts=[(3, 2)]), "guess_counts"),
        (lambda: audit(GOOD, IN, guess_counts=[]), "guess_counts"),
        (lambda: audit([0.5], [True]), "scores"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, name):
    with pytest.raises(ConfigError, match=rf"^{name}\b") as error:
        call()
    assert "\n" not in str(error.value)
