"""Epsilon lower bounds from the guesses of a one-run privacy audit. Imports numpy and scipy, never torch.

Paper: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023, arXiv 2305.08846).
Setting: m canaries, each included in the training set independently with probability 1/2 (secret S_i = +1 if
included, -1 if not). After one training run the auditor guesses T_i in {-1, 0, +1} for every canary (0 abstains);
r guesses are made (||T||_1 <= r) and W of them are correct (T_i = S_i). With f(v) = P[Binomial(r, q) >= v],
q = e^eps / (1 + e^eps):

- Theorem 3.1 (eps-DP):        P[W >= v] <= f(v).
- Theorem 5.2 ((eps, delta)-DP): P[W >= v] <= f(v) + 2 m delta max_{i >= 1} (f(v - i) - f(v)) / i.

An observation (m, r, v) with that bound <= beta rejects "the training run is (eps, delta)-DP" at level beta;
the largest epsilon so rejected is a lower bound on the run's epsilon with confidence 1 - beta.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
from scipy.optimize import brentq
from scipy.special import bdtrc, expit

from dptrain.errors import ConfigError

# Fractions of m tried as k = k_positive = k_negative when audit() is given no guess counts.
DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5)

# brentq's tolerance on epsilon; its answer is then stepped 2 * _XTOL down onto the rejected side.
_XTOL = 1e-7


def _count(name: str, value) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}") from None
    if count < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {count}")
    return count


def _counts(m, r, v) -> tuple[int, int, int]:
    m, r, v = _count("m", m), _count("r", r), _count("v", v)
    if r > m:
        raise ConfigError(f"r (guesses) must be at most m (canaries) = {m}, got {r}")
    if v > r:
        raise ConfigError(f"v (correct guesses) must be at most r (guesses) = {r}, got {v}")
    return m, r, v


def _number(name: str, value, accepted: str, ok) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be {accepted}, got {value!r}") from None
    if not ok(number):  # NaN fails every comparison in ok
        raise ConfigError(f"{name} must be {accepted}, got {value!r}")
    return number


def _delta(delta) -> float:
    return _number("delta", delta, "a number in [0, 1)", lambda d: 0 <= d < 1)


def _confidence(confidence) -> float:
    return _number("confidence", confidence, "a number in (0, 1)", lambda c: 0 < c < 1)


def _binomial_tail(r: int, q: float, v):
    """f(v) = P[Binomial(r, q) >= v] of Theorems 3.1 and 5.2 (1 for v <= 0); vectorized over integer v."""
    return bdtrc(np.asarray(v) - 1, r, q)


def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Upper bound on P[W >= v], W the number of correct guesses, when training is (epsilon, delta)-DP.

    Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run": m canaries, r guesses, v correct,
    q = e^eps / (1 + e^eps) and f(v) = P[Binomial(r, q) >= v].

    - delta = 0, Theorem 3.1: P[W >= v] <= f(v).
    - delta > 0, Theorem 5.2: P[W >= v] <= f(v) + 2 m delta max_{i >= 1} (f(v - i) - f(v)) / i.
      Since f(v - i) = 1 for i >= v, the terms past i = v are (1 - f(v)) / i, below the i = v term, so the max
      runs over i = 1..v. The bound is clipped to 1, as in the paper's code (its Appendix D).

    Note the delta term scales with m, all canaries, not with the r guesses.
    """
    m, r, v = _counts(m, r, v)
    epsilon = _number("epsilon", epsilon, "a finite number >= 0", lambda e: 0 <= e < np.inf)
    delta = _delta(delta)
    q = float(expit(epsilon))
    tail = float(_binomial_tail(r, q, v))
    if delta == 0 or v == 0:
        return tail
    i = np.arange(1, v + 1)
    spread = float(np.max((_binomial_tail(r, q, v - i) - tail) / i))
    return min(1.0, tail + 2 * m * delta * spread)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95) -> float:
    """The largest epsilon that v correct guesses out of r (m canaries) reject at level beta = 1 - confidence.

    Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", Theorems 3.1 (delta = 0) and 5.2,
    inverted as in the paper's Appendix D: sup{eps >= 0 : p_value(m, r, v, eps, delta) <= beta}. p_value grows
    with eps (q = e^eps / (1 + e^eps) grows), so the rejected epsilons form an interval [0, sup]. Found by
    doubling an upper bracket from 1 and Brent's method to 1e-7, then stepped 2e-7 down so that the answer
    itself satisfies p_value <= beta: it is never above the true sup. 0.0 when even eps = 0 is not rejected.
    """
    m, r, v = _counts(m, r, v)
    delta = _delta(delta)
    beta = 1.0 - _confidence(confidence)

    def excess(eps: float) -> float:
        return p_value(m, r, v, eps, delta) - beta

    if excess(0.0) > 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) <= 0:  # terminates: p_value -> 1 as eps grows (q reaches 1.0 in floating point)
        low, high = high, 2 * high
    below = max(low, brentq(excess, low, high, xtol=_XTOL) - 2 * _XTOL)
    return below if excess(below) <= 0 else low


def _scores(scores) -> np.ndarray:
    try:
        values = np.asarray(scores, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError("scores must be a 1-D array of finite numbers, got non-numbers") from None
    if values.ndim != 1:
        raise ConfigError(f"scores must be a 1-D array of finite numbers, got shape {values.shape}")
    if not np.all(np.isfinite(values)):
        raise ConfigError("scores must be a 1-D array of finite numbers, got NaN or inf")
    return values


def guesses(scores, k_positive: int, k_negative: int) -> np.ndarray:
    """The auditor's guesses T in {-1, 0, +1}^m: +1 (included) for the k_positive highest scores, -1 (excluded)
    for the k_negative lowest, 0 (abstain) for the rest (Steinke, Nasr & Jagielski, "Privacy Auditing with One
    (1) Training Run", Algorithm 1's guessing step).

    Ties are broken by position, never by the data: canaries are ranked by a stable sort of the scores, so among
    equal scores a canary with a larger index ranks higher (it is the first to get +1 and the last to get -1).
    This is independent of the secrets only if canaries are indexed independently of their inclusion (e.g. in
    the order they were drawn, before the coins were flipped).
    """
    values = _scores(scores)
    k_positive, k_negative = _count("k_positive", k_positive), _count("k_negative", k_negative)
    if k_positive + k_negative > values.size:
        raise ConfigError(
            f"k_positive + k_negative must be at most the number of scores ({values.size}), "
            f"got {k_positive} + {k_negative}"
        )
    order = np.argsort(values, kind="stable")  # ascending score, equal scores in index order
    t = np.zeros(values.size, dtype=np.int8)
    t[order[values.size - k_positive :]] = 1
    t[order[:k_negative]] = -1
    return t


def _default_guess_counts(m: int) -> list[tuple[int, int]]:
    ks = dict.fromkeys(min(max(1, round(f * m)), m // 2) for f in DEFAULT_GUESS_FRACTIONS)
    return [(k, k) for k in ks if k >= 1]


def _guess_counts(guess_counts, m: int) -> list[tuple[int, int]]:
    accepted = f"a non-empty list of (k_positive, k_negative) pairs with 1 <= k_positive + k_negative <= {m}"
    try:
        pairs = [(_count("k_positive", kp), _count("k_negative", kn)) for kp, kn in guess_counts]
    except (TypeError, ValueError):
        raise ConfigError(f"guess_counts must be {accepted}, got {guess_counts!r}") from None
    if not pairs or not all(1 <= kp + kn <= m for kp, kn in pairs):
        raise ConfigError(f"guess_counts must be {accepted}, got {guess_counts!r}")
    return pairs


def _candidates(guess_counts, m: int) -> list[tuple[int, int]]:
    candidates = _default_guess_counts(m) if guess_counts is None else _guess_counts(guess_counts, m)
    if not candidates:
        raise ConfigError(f"scores must hold at least 2 canaries for the default guess counts, got {m}")
    return candidates


def ceiling(
    m: int, delta: float = 0.0, confidence: float = 0.95, guess_counts: Sequence[tuple[int, int]] | None = None
) -> float:
    """The largest lower bound :func:`audit` can report with m canaries: every guess correct (v = r) for each
    candidate guess count, at the same Bonferroni-corrected level (Steinke, Nasr & Jagielski, "Privacy Auditing
    with One (1) Training Run", Theorems 3.1 and 5.2 at v = r). It measures the audit's power, not the run: a
    certificate at or above it cannot be refuted by this audit whatever the engine does."""
    m = _count("m", m)
    delta, confidence = _delta(delta), _confidence(confidence)
    candidates = _candidates(guess_counts, m)
    level = 1.0 - (1.0 - confidence) / len(candidates)
    return max(epsilon_lower_bound(m, kp + kn, kp + kn, delta, level) for kp, kn in candidates)


def audit(
    scores,
    included,
    delta: float = 0.0,
    confidence: float = 0.95,
    guess_counts: Sequence[tuple[int, int]] | None = None,
) -> dict:
    """Epsilon lower bound, valid with probability >= confidence, from canary scores (higher = more likely
    included) and the secret inclusion vector (True where S_i = +1).

    Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run": each candidate (k_positive,
    k_negative) makes the :func:`guesses` of r = k_positive + k_negative canaries, counts the v correct ones and
    inverts Theorem 3.1 (delta = 0) or 5.2 with :func:`epsilon_lower_bound`. The candidates are fixed before the
    scores are seen: ``guess_counts``, or by default k = k_positive = k_negative = round(f * m), capped at m // 2,
    for f in DEFAULT_GUESS_FRACTIONS = (1/100, 1/50, 1/20, 1/10, 1/4, 1/2), duplicates removed. Reporting the best
    of K candidates is a union bound (Bonferroni): each one is tested at level beta / K, beta = 1 - confidence, so
    the probability that any of them overstates epsilon is at most beta.

    Returns a dict: epsilon_lower_bound, confidence (the overall one, as given), canaries (m), guesses (r),
    correct (v), k_positive, k_negative, the last five for the best candidate (the first one on ties).
    """
    values = _scores(scores)
    secrets = np.asarray(included)
    if secrets.dtype != bool or secrets.shape != values.shape:
        raise ConfigError(
            f"included must be a boolean array shaped like scores {values.shape}, "
            f"got dtype {secrets.dtype} and shape {secrets.shape}"
        )
    m = values.size
    delta, confidence = _delta(delta), _confidence(confidence)
    candidates = _candidates(guess_counts, m)
    per_candidate_confidence = 1.0 - (1.0 - confidence) / len(candidates)
    best: dict | None = None
    for k_positive, k_negative in candidates:
        t = guesses(values, k_positive, k_negative)
        r = k_positive + k_negative
        v = int(np.sum((t == 1) & secrets) + np.sum((t == -1) & ~secrets))
        eps = epsilon_lower_bound(m, r, v, delta, per_candidate_confidence)
        if best is None or eps > best["epsilon_lower_bound"]:
            best = dict(
                epsilon_lower_bound=eps,
                confidence=confidence,
                canaries=m,
                guesses=r,
                correct=v,
                k_positive=k_positive,
                k_negative=k_negative,
            )
    return best
