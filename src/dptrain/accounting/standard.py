"""RDP and PLD accountants, delegated to Google's dp_accounting (we do not re-implement them).

- ``rdp``: Renyi DP of the (sub)sampled Gaussian, Mironov 2017 / Mironov, Talwar, Zhang 2019,
  converted to (epsilon, delta) with the conversion implemented in dp_accounting's RdpAccountant; it also certifies a
  hyperparameter search (dp_accounting's RepeatAndSelectDpEvent; Papernot & Steinke 2022, Thm 2 and 6), which every
  other accountant refuses (:func:`refuse_search`).
- ``pld``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022): dp_accounting's PLDs with a
  pessimistic discretization, so the epsilon it returns is an upper bound, composed as its PLDAccountant does, on
  a grid coarse enough to fit in memory (details["discretization"]).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import pld_pmf, privacy_loss_distribution, privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import fft, stats

from dptrain.accounting.base import PrivacyReport, register_accountant
from dptrain.accounting.ledger import NEIGHBORING, Ledger
from dptrain.accounting.rdp_steps import RdpStepsAccountant
from dptrain.errors import AccountingError, NoFiniteEpsilon

#: Epsilons above this guarantee nothing (e^epsilon overflows a float from 710 on); every accountant reports them
#: as NoFiniteEpsilon, the refusal calibration treats as infinity (its search caps epsilon at the same value).
EPSILON_MAX = 1e6


def no_finite_epsilon(who: str, why: str) -> NoFiniteEpsilon:
    """The one refusal when the noise is too small for a finite epsilon (calibration reads it as infinity)."""
    return NoFiniteEpsilon(
        f"the noise is too small for a finite epsilon: {who} found no finite epsilon ({why})"
    )


def finite_epsilon(eps: float, accountant: str) -> float:
    """``eps`` as a float, or :func:`no_finite_epsilon` when it is infinite, NaN or above EPSILON_MAX."""
    if not eps <= EPSILON_MAX:
        value = f" ({eps:.3g})" if math.isfinite(eps) else ""
        raise no_finite_epsilon(f"the {accountant} accountant", f"its bound is above {EPSILON_MAX:g}{value}")
    return float(eps)


#: Below this noise multiplier one Gaussian release's privacy loss, 1/(2 sigma^2) at its mean, is above EPSILON_MAX
#: (sigma = 7.07e-4); far below it (sigma ~ 1e-150) dp_accounting's RDP overflows and returns 0.
SIGMA_FLOOR = (2 * EPSILON_MAX) ** -0.5
#: Above this, dp_accounting's RDP overflows computing sigma^2 log(1/q) (from about 1e152).
SIGMA_CEILING = 1e150


def check_noise(ledger: Ledger, accountant: str) -> None:
    """Refuse a ledger with a Gaussian release whose noise multiplier is below SIGMA_FLOOR (:func:`no_finite_epsilon`)
    or above SIGMA_CEILING, before any accountant computes with it."""
    for entry in ledger.entries:
        # every Gaussian of the release: inside a sampled release, or a search's trial (a composition of releases)
        for event in walk_events(entry.event):
            if isinstance(event, dpa.GaussianDpEvent):
                _check_sigma(event.noise_multiplier, accountant)


def _check_sigma(sigma: float, accountant: str) -> None:
    if not sigma >= SIGMA_FLOOR:
        raise no_finite_epsilon(
            f"the {accountant} accountant",
            f"noise multiplier {sigma:g} < {SIGMA_FLOOR:.3g}: one release's privacy loss 1/(2 sigma^2) is "
            f"above {EPSILON_MAX:g}",
        )
    if sigma > SIGMA_CEILING:
        raise AccountingError(
            f"the {accountant} accountant cannot compute with noise multiplier {sigma:g} (above "
            f"{SIGMA_CEILING:g}, its arithmetic overflows); any smaller sigma above 1e6 already gives epsilon ~ 0"
        )


def _compose(accountant, ledger: Ledger, name: str):
    event = ledger.dp_event()
    if not accountant.supports(event):
        raise _not_covered(ledger, name)
    accountant.compose(event)
    return accountant


#: What rdp (dp_accounting's RdpAccountant) and pld (dptrain's composition of dp_accounting's PLDs) certify.
_COVERS = {
    "rdp": "Gaussian releases, Poisson-sampled ones (add/remove adjacency) and fixed-size samples without replacement "
    "(replace-one adjacency)",
    "pld": "Gaussian releases and Poisson-sampled ones (add/remove adjacency); use rdp for fixed-size samples",
}


def _not_covered(ledger: Ledger, name: str) -> AccountingError:
    schemes = sorted({str(e.facts.get("sampling", "?")) for e in ledger.entries})
    return AccountingError(
        f"the {name} accountant cannot certify this ledger (events {type(ledger.dp_event()).__name__}, sampling "
        f"{', '.join(schemes)}, {ledger.neighboring} adjacency); it covers {_COVERS[name]}"
    )


# --- hyperparameter searches: dp_accounting's RepeatAndSelectDpEvent ----------------------------------------------
#
# A search (dptrain.accounting.tuning) releases the best of K trials, K drawn at random: one RepeatAndSelectDpEvent
# whose RDP dp_accounting's RdpAccountant computes (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential
# Privacy", ICLR 2022, Thm 2 and Thm 6). No other accountant here has a bound for it: each refuses it first thing.


def walk_events(event: dpa.DpEvent):
    """``event`` and every DpEvent inside it, depth first (the sampled release, a composition's parts, a search's
    trial)."""
    yield event
    for f in attr.fields(type(event)):
        value = getattr(event, f.name)
        for sub in value if isinstance(value, list | tuple) else (value,):
            if isinstance(sub, dpa.DpEvent):
                yield from walk_events(sub)


def searches(ledger: Ledger) -> list[dp_event.RepeatAndSelectDpEvent]:
    """The hyperparameter searches (RepeatAndSelectDpEvents) anywhere in ``ledger``."""
    return [
        e for entry in ledger.entries for e in walk_events(entry.event) if isinstance(e, dp_event.RepeatAndSelectDpEvent)
    ]


def refuse_search(ledger: Ledger, accountant: str) -> None:
    """Every accountant but rdp calls this first: a ledger holding a hyperparameter search is refused in one line,
    before it reads anything else (none of them has a bound for the best of a random number of trials)."""
    if searches(ledger):
        raise AccountingError(
            f"the {accountant} accountant cannot certify a hyperparameter search (RepeatAndSelectDpEvent: the best of a "
            "random number of trials, Papernot & Steinke 2022); the rdp accountant certifies it"
        )


def search_problem(mean: float, shape: float) -> str | None:
    """Why a search whose number of trials K has mean ``mean`` and dp_accounting's ``shape`` (inf Poisson, 1
    geometric, 0 logarithmic, else eta of the truncated negative binomial) cannot be certified, or None.

    - mean: a finite number >= 1. A truncated negative binomial K is >= 1 (Papernot & Steinke, Definition 1), so its
      mean is too; for Poisson K, Thm 6's bound eps + mu delta_hat + log(mu)/(lambda - 1) turns negative (impossible)
      as mu -> 0, and dp_accounting computes it for mu >= 1 only.
    - shape: inf, or eta >= 0. Thm 2 holds for eta in (-1, inf), but dp_accounting's RDP computes eta >= 0 only."""
    if isinstance(mean, bool) or not isinstance(mean, int | float) or not (math.isfinite(mean) and mean >= 1):
        return f"the mean number of trials must be a finite number >= 1 (Papernot & Steinke, Thm 2 and 6), got {mean!r}"
    if isinstance(shape, bool) or not isinstance(shape, int | float) or not (shape == math.inf or 0 <= shape < math.inf):
        if isinstance(shape, int | float) and -1 < shape < 0:
            return (
                f"a truncated negative binomial shape eta in (-1, 0) ({shape:g}) is in Papernot & Steinke's Thm 2, but "
                "dp_accounting's RDP accountant computes eta >= 0 only: use eta >= 0"
            )
        return (
            "the shape of the number of trials must be inf (Poisson), 1 (geometric), 0 (logarithmic) or a truncated "
            f"negative binomial eta > 0, got {shape!r}"
        )
    return None


def check_searches(ledger: Ledger, accountant: str) -> None:
    """The rdp accountant's check of every search in ``ledger`` (:func:`search_problem`; dp_accounting would raise a
    bare ValueError on a mean below 1 or a negative shape)."""
    for search in searches(ledger):
        problem = search_problem(search.mean, search.shape)
        if problem:
            raise AccountingError(f"the {accountant} accountant cannot certify this search: {problem}")


@contextlib.contextmanager
def quiet_absl():
    """dp_accounting logs a warning (through absl) each time a fractional RDP order fails to converge and
    is dropped from the minimum over orders. Dropping an order can only make epsilon larger (a valid
    bound), so the messages carry no risk; they would flood a progress bar."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


#: dp_accounting's default orders jump 64 -> 128 -> 256 -> 512 and stop there; small-epsilon, large-sigma runs
#: (the settings of van Dijk et al., "Proactive DP") have their optimum in those gaps or beyond, so we fill them.
#: Any set of orders gives a valid bound; a denser set, a tighter one.
_EXTRA_ORDERS = (
    80,
    96,
    112,
    160,
    192,
    224,
    320,
    384,
    448,
    640,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)
RDP_ORDERS = tuple(sorted(set(rdp_privacy_accountant.DEFAULT_RDP_ORDERS) | set(_EXTRA_ORDERS)))
#: dp_accounting computes an integer order alpha in O(alpha) Python steps, so the orders above 768 are 95% of the
#: cost (0.48 s against 0.09 s per report for a Poisson-sampled ledger). They are tried only when the optimum over
#: the orders up to 768 lies at 448 or above (near the top of that set), where a larger order can be better; below
#: that the RDP-to-(epsilon, delta) curve has turned up long before. Either way the answer is the minimum over a
#: set of orders: a valid bound.
_SMALL_ORDERS = tuple(a for a in RDP_ORDERS if a <= 768)
_LARGE_ORDER_TRIGGER = 448


class RdpAccountant:
    name = "rdp"
    facts_used = ()  # events and adjacency only
    covers_bandmf = True  # composes Ledger.dp_event(): a BandMF run as ceil(T/b) participations
    description = "Renyi DP of the subsampled Gaussian (dp_accounting RdpAccountant)"

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        check_searches(ledger, self.name)
        check_noise(ledger, self.name)
        for orders in (_SMALL_ORDERS, RDP_ORDERS):
            acc = RdpStepsAccountant(orders, neighboring_relation=ledger.neighboring_relation)
            with quiet_absl():
                _compose(acc, ledger, self.name)
                eps, order = acc.get_epsilon_and_optimal_order(delta)
            if order < _LARGE_ORDER_TRIGGER:
                break
        return PrivacyReport(
            finite_epsilon(eps, self.name), delta, self.name, True, {"optimal_order": float(order)}
        )


# --- the pld accountant: dp_accounting's PLDs on a grid that fits ---------------------------------------------
#
# dp_accounting composes T Poisson-sampled Gaussian steps by raising the FFT of one step's discretized PLD to the
# T-th power, on a grid as wide as its Chernoff bound on the composed losses: about 5.7e7 points per PMF for
# 10^9 steps at sigma = 1.1, q = 0.004 and the interval 1e-4 (4.5 GB peak, 107 s); it builds one step's PMF
# point by point (about 7 microseconds each). The pessimistic connect-the-dots discretization (Doroshenko, Ghazi,
# Kamath, Kumar, Manurangsi, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions",
# PETS 2022, Algorithm 1) dominates the mechanism at any interval, so epsilon stays an upper bound; a coarser
# interval is looser. So the ledger is composed here, with dp_accounting's PLDs and exactly the calls its
# PLDAccountant makes, at the interval 1e-4 (or the one given) doubled until every PMF fits the bounds below;
# each size is known before anything that large is allocated (dp_accounting's own Chernoff bound).

PLD_INTERVAL = 1e-4
#: The interval of :meth:`PldAccountant.for_search` (calibration's search; its answer is checked at PLD_INTERVAL).
PLD_SEARCH_INTERVAL = 1e-3
#: Points of a composed PMF: about 110 bytes each at the peak of a composition (both PMFs of a Poisson run, FFT
#: buffers included), so at most ~0.5 GB.
PLD_MAX_POINTS = 2**22
#: Points of one release's PMF (built point by point: ~4 s at this size). Ledgers with sigma >= 0.3 stay at 1e-4.
PLD_MAX_STEP_POINTS = 2**19
#: A coarser grid bounds nothing useful (and dp_accounting overflows computing e^interval from 710 on).
PLD_MAX_INTERVAL = 1.0
_TAIL_MASS = 1e-15  # dp_accounting's tail_mass_truncation when composing
_SHIFT = {"add_or_remove_one": 1, "replace_one": 2}  # distance between the two Gaussians' means
#: Where dp_accounting truncates a Gaussian of std 1: its tails beyond hold 0.5 e^-50 each (log_mass_truncation_bound).
_Z = float(stats.norm.isf(0.5 * math.exp(-50)))
_ADJACENCIES = {  # the PMFs dp_accounting builds for one Gaussian release under each neighbouring relation
    "add_or_remove_one": (
        privacy_loss_mechanism.AdjacencyType.REMOVE,
        privacy_loss_mechanism.AdjacencyType.ADD,
    ),
    "replace_one": (privacy_loss_mechanism.AdjacencyType.REPLACE,),
}

PLD = privacy_loss_distribution.PrivacyLossDistribution


class PldAccountant:
    name = "pld"
    facts_used = ()  # events and adjacency only
    covers_bandmf = True  # composes each entry's event entry.compositions times
    description = "privacy loss distributions, pessimistic discretization (dp_accounting PLDs)"

    def __init__(self, value_discretization_interval: float = PLD_INTERVAL):
        self.value_discretization_interval = value_discretization_interval

    def for_search(self) -> PldAccountant:
        """A faster pld for calibration searches: the interval PLD_SEARCH_INTERVAL (10x coarser, about 10x faster;
        epsilon within 2e-4 of this one's on DP-SGD ledgers of 234 to 14,062 steps). Calibration then checks its
        answer with this accountant, so what it returns is certified at the fine interval."""
        return PldAccountant(max(self.value_discretization_interval, PLD_SEARCH_INTERVAL))

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        composed, interval = self.composed(ledger)
        eps = composed.get_epsilon_for_delta(delta)
        tail = infinity_mass(composed)
        if not eps <= EPSILON_MAX and delta < tail:
            # the profile never falls below its tail at an infinite loss (what the pessimistic discretization charges
            # for the losses it truncates): a delta below that has no finite epsilon, however much noise
            raise NoFiniteEpsilon(
                f"the pld accountant certifies no delta below {tail:.3g} (the probability its pessimistic "
                f"discretization charges to an infinite loss), got delta = {delta:g}: use rdp, or a larger delta"
            )
        eps = finite_epsilon(eps, self.name)
        return PrivacyReport(eps, delta, self.name, True, {"discretization": interval})

    def composed(self, ledger: Ledger) -> tuple[PLD, float]:
        """The ledger's composed PLD (both orderings, pessimistic) and the interval it was composed at: the privacy
        profile this accountant certifies, delta(eps) = ``composed.get_delta_for_epsilon(eps)`` for every eps (what
        :mod:`dptrain.accounting.membership` reads). Refuses what :meth:`report` refuses."""
        refuse_search(ledger, self.name)  # dp_accounting's PLDs have no RepeatAndSelectDpEvent
        check_noise(ledger, self.name)
        found = _composed_at(tuple(_pld_releases(ledger)), self.value_discretization_interval, ledger.neighboring)
        if found is None:
            raise AccountingError(
                f"the pld accountant cannot compose these {ledger.releases} releases in bounded memory (even "
                f"the discretization interval {PLD_MAX_INTERVAL:g} would need more than {PLD_MAX_POINTS} "
                "points); use rdp"
            )
        return found


def infinity_mass(pld: PLD) -> float:
    """The probability a composed PLD puts on an infinite privacy loss, the larger of its two orderings: its profile
    delta(eps) is at least that at every eps."""
    pmfs = (pld._pmf_remove, pld._pmf_add)  # noqa: SLF001 (dp_accounting 0.6.0, pinned)
    return max(float(p._infinity_mass) for p in pmfs)  # noqa: SLF001


@functools.lru_cache(maxsize=1)
def _composed_at(
    releases: tuple[tuple[float, float | None, int], ...], interval: float, neighboring: str
) -> tuple[PLD, float] | None:
    """(the composed PLD, its interval): at ``interval``, or at the first interval doubled enough times that it fits
    in bounded memory; None when not even PLD_MAX_INTERVAL fits. The last one is kept (a pure function of these
    numbers; at most PLD_MAX_POINTS points per PMF): a report reads one ledger's PLD twice, for its epsilon and for
    the membership-inference profile (dptrain.accounting.membership), which composed it again (about 1 s of a
    summary at sigma = 0.01, q = 0.01, 100 steps)."""
    while True:
        composed, excess = _compose_pld(releases, interval, neighboring)
        if composed is not None:
            return composed, interval
        interval *= 2 ** math.ceil(math.log2(excess))
        if interval > PLD_MAX_INTERVAL:
            return None


def _pld_releases(ledger: Ledger) -> list[tuple[float, float | None, int]]:
    """(sigma, q, count) per entry, q = None for unsampled Gaussian releases; refuses what it does not cover
    (Poisson sampling is covered under add/remove adjacency only, as in dp_accounting's PLDAccountant)."""
    out = []
    for e in ledger.entries:
        ev = e.event
        if isinstance(ev, dpa.GaussianDpEvent):
            out.append((ev.noise_multiplier, None, e.compositions))
        elif (
            isinstance(ev, dpa.PoissonSampledDpEvent)
            and isinstance(ev.event, dpa.GaussianDpEvent)
            and ledger.neighboring == "add_or_remove_one"
        ):
            if ev.sampling_probability > 0:  # q = 0 releases nothing
                out.append((ev.event.noise_multiplier, ev.sampling_probability, e.compositions))
        else:
            raise _not_covered(ledger, "pld")
    return out


def _compose_pld(
    releases: tuple[tuple[float, float | None, int], ...], interval: float, neighboring: str
) -> tuple[PLD | None, float]:
    """(the composed PLD, 0) at ``interval``, as dp_accounting's PLDAccountant composes it: ``count`` unsampled
    Gaussian releases as one Gaussian of std sigma/sqrt(count), ``count`` Poisson-sampled ones by self-composing
    one step. Or (None, excess) as soon as a PMF would be ``excess`` (> 1) times larger than its bound: one step
    beyond PLD_MAX_STEP_POINTS (known before it is built), the composition beyond PLD_MAX_POINTS (known from
    dp_accounting's Chernoff bound before the FFT)."""
    composed = privacy_loss_distribution.identity(value_discretization_interval=interval)
    for sigma, q, count in releases:
        std, prob = (sigma / math.sqrt(count), 1.0) if q is None else (sigma, q)
        # An unsampled Gaussian release's noise multiplier is its std over its sensitivity under the ledger's own
        # adjacency (for replace-one, the projected ledgers record sigma b / (2L)): its PLD is the add/remove
        # one at that multiplier, whatever the adjacency. dp_accounting's REPLACE_ONE Gaussian PLD instead reads the
        # multiplier per element and shifts by twice it, which would charge such ledgers twice (rdp and gdp read
        # the multiplier as we record it).
        adjacency = neighboring if q is not None else "add_or_remove_one"
        relation = NEIGHBORING[adjacency]
        step_points = _step_points(std, prob, interval, adjacency)
        if step_points > PLD_MAX_STEP_POINTS:
            return None, step_points / PLD_MAX_STEP_POINTS
        step = _gaussian_step(std, prob, interval, relation)
        if q is not None:
            step = _densified(step, count)
        bounds = None if q is None else _self_convolve_plan(step, count)
        points = _points(composed) + (_points(step) if q is None else _self_composed_points(step, count, bounds))
        if points > PLD_MAX_POINTS:
            return None, points / PLD_MAX_POINTS
        composed = composed.compose(step if q is None else _self_composed(step, count, bounds))
    return composed, 0.0


def _self_convolve_plan(step: PLD, count: int) -> list[tuple[int, int] | None]:
    """For each PMF of ``step`` (remove, then add unless symmetric): the truncation bounds of its self-composition
    (:func:`_self_convolve_bounds`) if it is dense, else None. Computed once, for the size check and the composition."""
    pmfs = [step._pmf_remove] if step._symmetric else [step._pmf_remove, step._pmf_add]
    return [
        _self_convolve_bounds(pmf._probs, count) if isinstance(pmf, pld_pmf.DensePLDPmf) else None for pmf in pmfs
    ]


def _self_composed(step: PLD, count: int, plan: list[tuple[int, int] | None] | None = None) -> PLD:
    """``step.self_compose(count)`` computed as dp_accounting computes it (the same FFT, truncation and infinity
    mass), with the truncation bounds of :func:`_self_convolve_bounds` widened by one point on each side (they equal
    dp_accounting's Chernoff bounds up to the last bit of a float, so one point; its 40 scipy log-sum-exps per PMF were
    60% of a calibration): the kept losses are a superset of dp_accounting's, the truncated tail no larger, and the
    tail mass is still charged to infinity as dp_accounting does. tests/test_accounting.py checks the result against
    dp_accounting's. Sparse PMFs are composed by dp_accounting."""

    plan = _self_convolve_plan(step, count) if plan is None else plan

    def compose(pmf, bounds):
        if bounds is None:
            return pmf.self_compose(count, _TAIL_MASS)
        lower, upper = bounds
        lower, upper = max(0, lower - 1), min((len(pmf._probs) - 1) * count, upper + 1)
        size = upper - lower + 1
        fast = fft.next_fast_len(max(size, len(pmf._probs)))
        probs = np.roll(np.real(fft.ifft(fft.fft(pmf._probs, fast) ** count)), -lower)[:size]
        infinity = _TAIL_MASS - math.expm1(count * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(
            pmf._discretization, pmf._lower_loss * count + lower, np.array(probs), infinity, pmf._pessimistic_estimate
        )

    if step._symmetric:
        return PLD(compose(step._pmf_remove, plan[0]))
    return PLD(compose(step._pmf_remove, plan[0]), compose(step._pmf_add, plan[1]))


class _VectorizedGaussianLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """dp_accounting's GaussianPrivacyLoss, with ``get_delta_for_epsilon`` computing the inverse privacy losses of an
    array of epsilons at once (dp_accounting calls ``inverse_privacy_loss`` once per grid point in Python: about 8 us
    each, 0.2 s for one step's 23,000 points, most of a calibration). Same formulas, same branches, the same cdf
    calls: tests/test_accounting.py checks the PMFs against dp_accounting's own to 1e-12. Replace-one adjacency and
    scalar calls use dp_accounting's code unchanged."""

    def get_delta_for_epsilon(self, epsilon):
        add = self.adjacency_type == privacy_loss_mechanism.AdjacencyType.ADD
        remove = self.adjacency_type == privacy_loss_mechanism.AdjacencyType.REMOVE
        if isinstance(epsilon, numbers.Number) or not (add or remove):
            return super().get_delta_for_epsilon(epsilon)
        q = self.sampling_prob
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons, dtype=float)
        if q == 1.0:
            inverse = np.full_like(epsilons, True, dtype=bool)
        elif add:
            inverse = epsilons < -math.log1p(-q)
        else:
            inverse = epsilons > math.log1p(-q)
            deltas[~inverse] = -np.expm1(epsilons[~inverse])
        x = self._inverse_losses(epsilons[inverse], add)
        deltas[inverse] = self.mu_upper_cdf(x) - np.exp(epsilons[inverse] + self.mu_lower_log_cdf(x))
        return np.clip(deltas, 0, 1)

    def _inverse_losses(self, losses: np.ndarray, add: bool) -> np.ndarray:
        """``inverse_privacy_loss`` (dp_accounting's _inverse_privacy_loss_add / _remove) for an array of losses."""
        s, var, q = self.sensitivity, self._standard_deviation**2, self.sampling_prob
        if q == 1.0:
            without = losses
        else:
            sign = -1.0 if add else 1.0
            b = sign * losses
            a, c = 1 / q, 1 - 1 / q  # log(a e^b + c) as common.log_a_times_exp_b_plus_c computes it (a > 0 > c)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                d = b + np.log(a)
                logged = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(np.log(-c) - d)))
                without = sign * logged
            edge = math.log(1 - q) * (-1.0 if add else 1.0)  # where dp_accounting maps the loss to -+infinity
            close = np.isclose(losses, edge, rtol=1e-9, atol=0.0)
            without = np.where(close, math.inf if add else -math.inf, without)
        with np.errstate(invalid="ignore"):
            x = -0.5 * s - without * var / s  # _inverse_privacy_loss_without_subsampling_remove
        return s + x if add else x


def _gaussian_pld(std: float, prob: float, interval: float, relation) -> PLD:
    """What ``privacy_loss_distribution.from_gaussian_mechanism`` builds (the same calls, its defaults: sensitivity 1,
    pessimistic, connect the dots, truncation at log mass -50), with the vectorised privacy loss above."""

    def single(adjacency):
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            _VectorizedGaussianLoss(
                std,
                sensitivity=1.0,
                pessimistic_estimate=True,
                log_mass_truncation_bound=-50,
                sampling_prob=prob,
                adjacency_type=adjacency,
            ),
            pessimistic_estimate=True,
            value_discretization_interval=interval,
            use_connect_dots=True,
        )

    if relation == dpa.NeighboringRelation.REPLACE_ONE:
        return PLD(single(privacy_loss_mechanism.AdjacencyType.REPLACE))
    return privacy_loss_distribution._pld_for_subsampled_mechanism(single, prob)


@functools.lru_cache(maxsize=32)
def _gaussian_step(std: float, prob: float, interval: float, relation) -> PLD:
    """One (sub)sampled Gaussian release's PLD, memoized: building it is most of an epsilon evaluation, and a run
    asks for the epsilon of the same step after more and more steps. PLD objects are not modified by composing
    them."""
    return _gaussian_pld(std, prob, interval, relation)


def _step_points(std: float, prob: float, interval: float, neighboring: str) -> int:
    """Points (at most) of the one-release PMF dp_accounting builds: its connect-the-dots range [epsilon_lower,
    epsilon_upper] on the grid. A range passing EPSILON_MAX gives no finite epsilon: refused before it is built.

    dp_accounting truncates the noise at +-_Z std around the two means, d = 1 apart (add/remove) or 2 (replace),
    where the loss stays within +-d (2 _Z std + d)/(2 std^2) (sampling only shrinks it: checked against its exact
    range over sigma in [7e-4, 1e8], q in [1e-12, 1]); when that fits, it stands in for dp_accounting's exact
    range (about 2 ms a release, which long ledgers of distinct steps feel).
    """
    d = _SHIFT[neighboring]
    bound = 1.001 * d * (2 * _Z * std + d) / (2 * std * std)
    if bound <= EPSILON_MAX and 2 * bound / interval + 2 <= PLD_MAX_STEP_POINTS:
        return math.ceil(2 * bound / interval) + 2
    points = 0
    for adjacency in _ADJACENCIES[neighboring]:
        bounds = privacy_loss_mechanism.GaussianPrivacyLoss(
            std, sampling_prob=prob, adjacency_type=adjacency
        ).connect_dots_bounds()
        reach = max(abs(bounds.epsilon_lower), abs(bounds.epsilon_upper))
        if not reach <= EPSILON_MAX:
            raise no_finite_epsilon(
                "the pld accountant",
                f"its privacy loss distribution reaches {reach:.3g}, above {EPSILON_MAX:g}",
            )
        lower, upper = math.floor(bounds.epsilon_lower / interval), math.ceil(bounds.epsilon_upper / interval)
        points = max(points, upper - lower + 1)
    return points


# dp_accounting 0.6.0 (pinned) keeps a PLD's two PMFs in _pmf_remove / _pmf_add and a dense PMF's values in _probs.
#: dp_accounting keeps a PMF of at most this many points sparse (pld_pmf._MAX_PMF_SPARSE_SIZE).
_SPARSE_POINTS = 1000


def _pmfs(pld: PLD) -> list:
    return [pld._pmf_remove] if pld._pmf_add is pld._pmf_remove else [pld._pmf_remove, pld._pmf_add]


def _points(pld: PLD) -> int:
    return max(p.size for p in _pmfs(pld))


def _densified(step: PLD, count: int) -> PLD:
    """``step`` with each PMF that dp_accounting would self-compose densely anyway made dense first: it turns a sparse
    PMF dense when size**count > _SPARSE_POINTS, after computing size**count as a Python integer (minutes for 10^7
    steps of 72 points). Converting first gives the same PLD without that integer."""

    def dense(pmf):
        return pmf.to_dense_pmf() if count * math.log(pmf.size) > math.log(_SPARSE_POINTS) else pmf

    if step._pmf_add is step._pmf_remove:
        return PLD(dense(step._pmf_remove))
    return PLD(dense(step._pmf_remove), dense(step._pmf_add))


def _self_composed_points(step: PLD, count: int, plan: list[tuple[int, int] | None] | None = None) -> int:
    """Points of ``step`` self-composed ``count`` times: dp_accounting's Chernoff bound on the composed losses for a
    dense PMF (``plan``: :func:`_self_convolve_plan`, computed here if not given); a sparse one stays at most
    _SPARSE_POINTS (see :func:`_densified`)."""
    if count == 1:
        return _points(step)
    plan = _self_convolve_plan(step, count) if plan is None else plan
    return max(_SPARSE_POINTS if b is None else b[1] - b[0] + 1 for b in plan)


def _self_convolve_bounds(probs: np.ndarray, count: int) -> tuple[int, int]:
    """The Chernoff truncation bounds dp_accounting computes for a self-composition
    (``common.compute_self_convolve_bounds(probs, count, _TAIL_MASS)``: the same 40 orders and formula), with plain
    numpy log-sum-exps instead of 40 scipy calls (whose overhead was a third of a calibration). A size prediction
    only (the composition computes its own bounds); tests/test_accounting.py checks it against dp_accounting's."""
    n = len(probs)
    upper, lower = (n - 1) * count, 0
    with np.errstate(divide="ignore"):
        log_p = np.log(probs)
    positions = np.arange(n, dtype=float)
    for order in np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n:
        t = positions * order + log_p
        top = float(np.max(t))
        if not math.isfinite(top):
            continue
        log_mgf = top + math.log(float(np.sum(np.exp(t - top))))
        bound = (count * log_mgf + math.log(2 / _TAIL_MASS)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    return lower, upper


register_accountant(RdpAccountant())
register_accountant(PldAccountant())
