"""Inverting accountants: the smallest noise multiplier for a budget, the most steps a budget allows.

Both work with any registered accountant. The noise multiplier is found with Brent's method
(scipy.optimize.brentq) on a bracket where epsilon(sigma) - target changes sign, then checked: the
returned sigma always meets the budget according to the accountant itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from scipy import optimize

from dptrain.accounting.base import (
    AUTO,
    accountant_names,
    certified_epsilon,
    check_accountant,
    check_delta,
    check_epsilon,
    epsilon,
    get_accountant,
)
from dptrain.accounting.ledger import Ledger, dpsgd_ledger
from dptrain.errors import AccountingError, NoFiniteEpsilon

#: The bracket search for sigma stays in [SIGMA_MIN, SIGMA_MAX]. sigma is whatever the ledger maps to a release: a
#: noise multiplier, or the noise std on an averaged gradient (projected noisy SGD), which can be far below 1e-2.
SIGMA_MIN, SIGMA_MAX = 1e-8, 1e4


@dataclass(frozen=True)
class Calibration:
    """The smallest noise multiplier meeting a budget, and the accountant that certifies it."""

    noise_multiplier: float
    accountant: str
    #: with ``auto``: the sigma each other certified accountant would need, and why the rest refused
    others: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def calibrate(
    target_epsilon: float,
    delta: float,
    ledger_for_sigma: Callable[[float], Ledger],
    accountant: str = AUTO,
) -> Calibration:
    """Smallest sigma with which ``accountant`` certifies ``ledger_for_sigma(sigma)`` within the budget. ``auto``:
    calibrate with every registered accountant that certifies this kind of ledger and keep the smallest sigma
    (each is a proven bound, so the smallest sigma any of them certifies is certified). ``rdp`` goes first: its
    sigma brackets the others' search."""
    check_accountant(accountant)
    if accountant != AUTO:
        return Calibration(calibrate_noise(target_epsilon, delta, ledger_for_sigma, accountant), accountant)
    names = sorted(accountant_names(), key=lambda n: n != "rdp")
    found, refused, start = {}, {}, 1.0
    for name in names:
        try:
            found[name] = calibrate_noise(target_epsilon, delta, ledger_for_sigma, name, start=start)
            if name == "rdp":
                start = found[name]
        except AccountingError as e:
            refused[name] = str(e)
    if not found:
        raise AccountingError(
            "no accountant can certify this budget: " + "; ".join(f"{k}: {v}" for k, v in refused.items())
        )
    best = min(found, key=found.get)
    return Calibration(found[best], best, {k: v for k, v in found.items() if k != best}, refused)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    ledger_for_sigma: Callable[[float], Ledger],
    accountant: str = "rdp",
    rtol: float = 1e-6,
    require_certified: bool = True,
    start: float = 1.0,
) -> float:
    """Smallest sigma (to relative tolerance ``rtol``) with epsilon(ledger_for_sigma(sigma)) <= target.
    ``require_certified=False`` also accepts accountants whose answer is not a proven bound (for exploration only:
    a budget enforced this way is not a guarantee). ``start``: where the bracket search begins (a nearby sigma,
    e.g. another accountant's, saves evaluations). ``auto``: see :func:`calibrate`."""
    if accountant == AUTO:
        return calibrate(target_epsilon, delta, ledger_for_sigma).noise_multiplier
    target_epsilon, delta = check_epsilon(target_epsilon), check_delta(delta)
    spend = certified_epsilon if require_certified else epsilon
    # An accountant may offer a faster (never tighter-by-design) variant for the search; the answer is then checked
    # and stepped up with the accountant itself below, so the sigma returned is certified by it.
    search = getattr(get_accountant(accountant), "for_search", None)
    searcher = search() if search is not None else None

    def eps(sigma: float, final: bool = False) -> float:
        try:
            ledger = ledger_for_sigma(sigma)
            if searcher is None or final:
                return spend(ledger, delta, accountant).epsilon
            report = searcher.report(ledger, delta)
            if require_certified and not report.certified:
                return spend(ledger, delta, accountant).epsilon
            return report.epsilon
        except NoFiniteEpsilon:
            return math.inf

    def eps_below(sigma: float) -> float:
        """eps on the way down from a sigma that met the budget: a noise the accountant refuses to certify (e.g.
        below the modelmix accountant's reviewed range) does not meet it either."""
        try:
            return eps(sigma)
        except AccountingError:
            return math.inf

    hi = start
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > SIGMA_MAX:
            raise AccountingError(
                f"epsilon={target_epsilon} at delta={delta} cannot be met with a noise multiplier up to {SIGMA_MAX:g}"
            )
    else:
        lo = hi
        while eps_below(lo) <= target_epsilon and lo >= SIGMA_MIN:
            hi, lo = lo, lo / 2
    if lo < SIGMA_MIN:
        sigma = hi  # any noise above SIGMA_MIN meets this (loose) budget
    else:
        cap = max(1e6, 2.0 * target_epsilon)  # (an infinite epsilon counts as over budget, whatever the budget)
        gap = lambda s: min(eps_below(s), cap) - target_epsilon  # noqa: E731
        sigma = optimize.brentq(gap, lo, hi, xtol=1e-12, rtol=rtol)
    # Brent returns a point within tolerance of the root, on either side: step up until it is within budget.
    # Below hi (which met it) a noise the accountant refuses to certify is stepped over like one over budget.
    def final(sigma: float) -> float:
        try:
            return eps(sigma, final=True)
        except AccountingError:
            if sigma >= hi:
                raise
            return math.inf

    step = max(sigma * rtol, 1e-12)
    while final(sigma) > target_epsilon:
        sigma += step
        step *= 2
    return float(sigma)


def calibrate_dpsgd_noise(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = AUTO,
    sampling: str = "poisson",
    **facts,
) -> float:
    """Smallest sigma for ``steps`` DP-SGD steps with the given sampling to meet (epsilon, delta)."""
    return calibrate_noise(
        target_epsilon, delta, lambda s: dpsgd_ledger(s, sampling_rate, steps, sampling, **facts), accountant
    )


def max_releases(
    ledger_after: Callable[[int], Ledger],
    target_epsilon: float,
    delta: float,
    accountant: str = AUTO,
    limit: int = 10**9,
    limit_first: bool = False,
) -> int:
    """Largest n <= limit such that ``ledger_after(n)`` (the ledger after n more releases) stays within the
    budget. Epsilon is non-decreasing in the number of releases, so an exponential then binary search is exact.
    ``limit_first``: try ``limit`` before searching (when it is likely to fit: one accountant call then suffices).
    """

    def fits(n: int) -> bool:
        ledger = ledger_after(n)
        if ledger.releases == 0:
            return True
        try:
            return certified_epsilon(ledger, delta, accountant).epsilon <= target_epsilon
        except NoFiniteEpsilon:
            return False

    if limit_first and fits(limit):
        return limit
    if not fits(0):
        return 0
    good, bad = 0, 1
    while bad <= limit and fits(bad):
        good, bad = bad, bad * 2
    if bad > limit:
        return limit if fits(limit) else bisect_largest(fits, good, limit)
    return bisect_largest(fits, good, bad)


def bisect_largest(fits: Callable[[int], bool], good: int, bad: int) -> int:
    """The largest integer in [good, bad) where ``fits`` holds, given fits(good), not fits(bad), and ``fits`` true
    up to a point and false beyond it."""
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


# --- the Gaussian mechanism released once -------------------------------------------------------------------


def gaussian_mechanism_delta(noise_multiplier: float, target_epsilon: float) -> float:
    """Exact delta(epsilon) of one Gaussian mechanism with std = ``noise_multiplier`` x L2 sensitivity:
    Phi(1/(2 s) - eps s) - e^eps Phi(-1/(2 s) - eps s) (Balle & Wang 2018, Theorem 8). dp_accounting's
    GaussianPrivacyLoss evaluates exactly this hockey-stick divergence (tested against the formula)."""
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise AccountingError(f"noise multiplier must be a finite number > 0, got {noise_multiplier}")
    return float(GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0).get_delta_for_epsilon(target_epsilon))


def gaussian_mechanism_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon at which one Gaussian mechanism is (epsilon, delta)-DP (exact, Balle & Wang Thm 8)."""
    delta = check_delta(delta)
    if gaussian_mechanism_delta(noise_multiplier, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while gaussian_mechanism_delta(noise_multiplier, hi) > delta:
        hi *= 2
    eps = optimize.brentq(
        lambda e: gaussian_mechanism_delta(noise_multiplier, e) - delta, 0.0, hi, xtol=1e-14
    )
    step = max(eps * 1e-12, 1e-15)
    while gaussian_mechanism_delta(noise_multiplier, eps) > delta:  # land on the certified side of the root
        eps += step
        step *= 2
    return float(eps)


def gaussian_mechanism_noise(target_epsilon: float, delta: float) -> float:
    """The analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8 and Algorithm 1): the smallest noise
    multiplier sigma (std / L2 sensitivity) with which ONE Gaussian release is (epsilon, delta)-DP.
    The classical sqrt(2 ln(1.25/delta))/epsilon is larger, and is valid only for epsilon < 1."""
    target_epsilon, delta = check_epsilon(target_epsilon), check_delta(delta)
    gap = lambda s: gaussian_mechanism_delta(s, target_epsilon) - delta  # noqa: E731  (decreasing in s)
    lo, hi = 1e-3, 1.0
    while gap(hi) > 0:
        lo, hi = hi, hi * 2
        if hi > 1e9:
            raise AccountingError(
                f"epsilon={target_epsilon} at delta={delta} needs a noise multiplier above 1e9"
            )
    sigma = optimize.brentq(gap, lo, hi, xtol=1e-14, rtol=1e-12) if gap(lo) > 0 else lo
    step = max(sigma * 1e-12, 1e-15)
    while gap(sigma) > 0:  # Brent lands within tolerance on either side: step to the certified side
        sigma += step
        step *= 2
    return float(sigma)
