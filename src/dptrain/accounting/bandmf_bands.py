"""How many bands: the error of BandMF relative to DP-SGD at the same certified epsilon, and the choice of b from
public quantities only. numpy/scipy/dp_accounting.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023). More bands correlate the noise over more steps (less error at unit
noise, E_b decreasing in b) but split the data into more groups: each group takes part ceil(T/b) times at rate b q,
so the noise multiplier sigma_b that a budget allows grows with b (Theorem 4's equivalent DP-SGD event). The
trade-off, the paper's choice of b, is

    rmse_ratio(b) = sigma_b sqrt(E_b) / (sigma_1 sqrt(E_1)),

the RMSE of the workload (prefix sums: SGD's iterates) under BandMF over DP-SGD's at equal epsilon (b = 1 is DP-SGD:
c = [1], E_1 = ||A||_F^2). Each sigma is the smaller of pld's and rdp's calibrations: pld is the tighter at usual
budgets, rdp where epsilon is far below pld's discretization (epsilon 0.01, T = 1000, q = 0.01, b = 8: pld 476,
rdp 249).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from scipy import optimize

from dptrain.accounting.bandmf_ledger import bandmf_ledger, group_sampling_rate
from dptrain.accounting.bandmf_strategy import (
    PREFIX_SUMS,
    Workload,
    check_horizon,
    check_steps,
    optimal_coefficients,
    workload_error,
)
from dptrain.accounting.base import get_accountant
from dptrain.accounting.calibration import calibrate_noise
from dptrain.accounting.checks import check_delta, check_epsilon
from dptrain.errors import AccountingError, NoFiniteEpsilon

#: The accountant that ranks the candidates of :func:`choose_bands` (its search grid): the tightest at usual budgets.
ACCOUNTANT = "pld"
#: The largest b :func:`choose_bands` tries by default (the engine keeps b - 1 noise vectors of the model's size).
DEFAULT_MAX_BANDS = 256


def _first_band(bands: int) -> tuple[float, ...]:
    """c = e_0 of length b: unit norm, so its ledger has the same events as any optimized c of b bands (sigma does
    not depend on c)."""
    return (1.0,) + (0.0,) * (bands - 1)


@functools.lru_cache(maxsize=1024)
def bandmf_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int, bands: int) -> float:
    """The smallest sigma with which pld or rdp certifies ``steps`` steps of BandMF with ``bands`` bands at overall
    rate q within (epsilon, delta) (:func:`dptrain.accounting.calibration.calibrate_noise` on :func:`bandmf_ledger`,
    i.e. ceil(T/b) DP-SGD steps at rate min(1, b q)): pld's, or rdp's where rdp is the tighter (far below pld's
    discretization; one rdp evaluation at pld's sigma tells); refused only where neither reaches the budget.
    Memoized."""
    c = _first_band(check_steps(bands, "bands"))
    start = _SEARCHED.get((epsilon, delta, sampling_rate, steps, bands), 1.0)  # a nearby sigma saves evaluations
    ledger = functools.partial(bandmf_ledger, sampling_rate=sampling_rate, steps=steps, coefficients=c)
    try:
        sigma = calibrate_noise(epsilon, delta, ledger, ACCOUNTANT, start=start)
    except AccountingError as e:
        try:
            return calibrate_noise(epsilon, delta, ledger, "rdp", start=start)
        except AccountingError as by_rdp:
            raise AccountingError(f"{ACCOUNTANT}: {e}; rdp: {by_rdp}") from None
    return _rdp_if_tighter(sigma, epsilon, delta, ledger)


def _rdp_if_tighter(sigma: float, epsilon: float, delta: float, ledger, rtol: float = 1e-6) -> float:
    """``sigma`` (pld's), or rdp's calibration where rdp certifies (epsilon, delta) with less noise: far below pld's
    discretization (tiny epsilon). One rdp evaluation at ``sigma`` tells: its epsilon there below the target."""
    if get_accountant("rdp").report(ledger(sigma), delta).epsilon >= epsilon:
        return sigma
    return min(sigma, calibrate_noise(epsilon, delta, ledger, "rdp", rtol, start=sigma))


#: sigma by (epsilon, delta, q, T, b) from pld's search grid: :func:`_search_noise_multiplier`'s memo.
_SEARCHED: dict[tuple, float] = {}


def _search_noise_multiplier(
    epsilon: float, delta: float, sampling_rate: float, steps: int, bands: int, guess: float = 1.0
) -> float:
    """sigma from pld's search variant (its coarser grid, epsilon within 2e-4 of pld's on DP-SGD ledgers) or rdp's,
    the smaller (rdp's alone where pld reaches the budget with no sigma up to 1e4, as in
    :func:`bandmf_noise_multiplier`): what :func:`choose_bands` ranks the candidates with; the chosen b is then
    calibrated by :func:`bandmf_noise_multiplier`. ``guess``: where the bracket starts (the previous candidate's sigma).
    Memoized."""
    key = (epsilon, delta, sampling_rate, steps, bands)
    if key in _SEARCHED:
        return _SEARCHED[key]
    ledger = functools.partial(bandmf_ledger, sampling_rate=sampling_rate, steps=steps, coefficients=_first_band(bands))
    try:  # pld's search grid, then rdp where it is the tighter (one rdp evaluation)
        sigma = _rdp_if_tighter(_pld_search_root(epsilon, delta, ledger, guess), epsilon, delta, ledger, 1e-5)
    except AccountingError as by_pld:  # a budget pld does not reach below 1e4 (far below its discretization): rdp's
        try:
            sigma = calibrate_noise(epsilon, delta, ledger, "rdp", 1e-5, start=guess)
        except AccountingError as by_rdp:
            raise AccountingError(f"{ACCOUNTANT}: {by_pld}; rdp: {by_rdp}") from None
    if len(_SEARCHED) > 4096:
        _SEARCHED.clear()
    _SEARCHED[key] = sigma
    return sigma


def _pld_search_root(epsilon: float, delta: float, ledger, guess: float) -> float:
    """The sigma at which pld's search variant spends ``epsilon`` on ``ledger(sigma)``; refused above 1e4."""
    search = get_accountant(ACCOUNTANT).for_search()

    @functools.cache
    def gap(sigma: float) -> float:  # cached: brentq re-evaluates its bracket's ends
        try:
            return min(search.report(ledger(sigma), delta).epsilon, 1e6) - epsilon
        except NoFiniteEpsilon:  # (any other refusal ends pld's search: rdp's calibration is then the answer)
            return 1e6

    # bracket from the guess and a secant-like second point (epsilon falls roughly like 1/sigma), then widen
    g = gap(guess)
    other = guess * min(2.0, max(0.5, (g + epsilon) / epsilon)) * (1.02 if g > 0 else 0.98)
    lo, hi = sorted((guess, other))
    while gap(hi) > 0:
        lo, hi = hi, hi * 1.5
        if hi > 1e4:
            raise AccountingError(f"epsilon={epsilon} at delta={delta} needs a noise multiplier above 1e4")
    while gap(lo) <= 0:
        hi, lo = lo, lo / 1.5
    return float(optimize.brentq(gap, lo, hi, rtol=1e-5))


def _check(steps, sampling_rate, epsilon, delta) -> tuple[int, float, float, float]:
    steps = check_horizon(steps)
    group_sampling_rate(sampling_rate, 1)  # a number in (0, 1]
    return steps, float(sampling_rate), check_epsilon(epsilon), check_delta(delta)


def rmse_ratio(
    steps: int,
    sampling_rate: float,
    epsilon: float,
    delta: float,
    bands: int,
    workload: Workload = PREFIX_SUMS,
) -> float:
    """sigma_b sqrt(E_b) / (sigma_1 sqrt(E_1)) (module docstring): below 1 when BandMF with ``bands`` optimized bands
    (:func:`dptrain.accounting.bandmf_strategy.optimal_coefficients`) estimates the workload with less error than
    DP-SGD at the same certified (epsilon, delta), both sigmas by :func:`bandmf_noise_multiplier` (Choquette-Choo et
    al., "(Amplified) Banded Matrix Factorization": the comparison of amplified BandMF with DP-SGD that sets their
    b)."""
    steps, q, epsilon, delta = _check(steps, sampling_rate, epsilon, delta)
    c = optimal_coefficients(steps, check_steps(bands, "bands"), workload)
    error = workload_error(c, steps, workload) / workload.frobenius_squared(steps)
    sigma_b = bandmf_noise_multiplier(epsilon, delta, q, steps, bands)
    sigma_1 = bandmf_noise_multiplier(epsilon, delta, q, steps, 1)
    return sigma_b / sigma_1 * math.sqrt(error)


def reported_rmse_ratio(
    steps: int,
    sampling_rate: float,
    epsilon: float,
    delta: float,
    bands: int,
    workload: Workload = PREFIX_SUMS,
) -> tuple[float | None, str | None]:
    """(:func:`rmse_ratio`, None) for a report beside a certificate (a run's summary, ``account``/``calibrate
    --bands``), or (None, why) where it cannot be computed: an infinite epsilon, or one that no calibration of BandMF
    or of DP-SGD reaches (beyond a noise multiplier of 1e4).
    The ratio is a prediction beside the certificate: its absence never takes the certificate with it."""
    if not math.isfinite(epsilon):
        return None, "no RMSE ratio at an infinite epsilon"
    try:
        return rmse_ratio(steps, sampling_rate, epsilon, delta, bands, workload), None
    except AccountingError as e:
        return None, f"no RMSE ratio at epsilon {epsilon:.4g}: {e}"


@dataclass(frozen=True)
class BandsChoice:
    """What :func:`choose_bands` found: b, its coefficients, the sigma certified for the budget, the RMSE ratio
    against DP-SGD (both sigmas by :func:`bandmf_noise_multiplier`), and every candidate's ratio as ranked (pld's
    search grid)."""

    bands: int
    coefficients: tuple[float, ...]
    noise_multiplier: float
    rmse_ratio: float
    candidates: dict[int, float] = field(default_factory=dict)


def candidate_bands(steps: int, sampling_rate: float, max_bands: int = DEFAULT_MAX_BANDS) -> list[int]:
    """1, 2, 4, ... up to min(T, 1/q, max_bands). Why these: b q <= 1 keeps the batch at q n examples on average
    (beyond, a group is smaller than a batch: the rate is capped at 1 and the run trains on smaller batches than
    asked, with no amplification left); b <= T, else some groups never take part; powers of two span the range in
    log2 T candidates (the ratio varies slowly with b near its minimum: a few percent between b and 2b), each
    costing one optimization of c and one calibration. ``max_bands`` bounds the engine's noise state."""
    steps = check_steps(steps)
    q = group_sampling_rate(sampling_rate, 1)
    max_bands = check_steps(max_bands, "max_bands")
    top = min(steps, max_bands, math.floor(1.0 / q + 1e-9))
    out, b = [], 1
    while b <= top:
        out.append(b)
        b *= 2
    return out


def choose_bands(
    steps: int,
    sampling_rate: float,
    epsilon: float,
    delta: float,
    workload: Workload = PREFIX_SUMS,
    max_bands: int = DEFAULT_MAX_BANDS,
) -> BandsChoice:
    """The number of bands minimizing :func:`rmse_ratio` among :func:`candidate_bands`, from public quantities only
    (T, q, epsilon, delta, the workload): the choice reveals nothing about the data. Candidates are ranked with pld's
    search grid; the chosen b's sigma and ratio are then calibrated by :func:`bandmf_noise_multiplier`. A b that no
    calibration reaches (the budget needs a noise multiplier above 1e4 with b bands) is left out of ``candidates``;
    the budget is refused only where DP-SGD's (b = 1) is. Calibrations and coefficients are memoized, so a second
    call (a CLI command, a test) is immediate."""
    steps, q, epsilon, delta = _check(steps, sampling_rate, epsilon, delta)
    dpsgd = workload.frobenius_squared(steps)
    ratios, sigmas = {}, {}
    for b in candidate_bands(steps, q, max_bands):
        try:
            sigmas[b] = _search_noise_multiplier(epsilon, delta, q, steps, b, 1.2 * sigmas.get(b // 2, 0.83))
        except AccountingError:
            if b == 1:  # DP-SGD itself cannot meet the budget: refused, as its calibration is
                raise
            # no calibration reaches the budget with b bands: a candidate the run could not take, not a refusal of
            # the budget (epsilon 4e-4 over 1000 steps at q = 0.01: b = 1 at sigma 1375, b = 64 beyond 1e4); larger
            # b need more noise still (ceil(T/b) participations at the less amplified rate b q)
            break
        error = workload_error(optimal_coefficients(steps, b, workload), steps, workload) / dpsgd
        ratios[b] = sigmas[b] / sigmas[1] * math.sqrt(error)
    best = min(ratios, key=ratios.get)
    return BandsChoice(
        best,
        tuple(float(x) for x in optimal_coefficients(steps, best, workload)),
        bandmf_noise_multiplier(epsilon, delta, q, steps, best),
        rmse_ratio(steps, q, epsilon, delta, best, workload),
        ratios,
    )
