"""How many bands (dptrain.accounting.bandmf_bands): BandMF's RMSE over DP-SGD's at equal certified epsilon, against
an independent estimate (prefix sums, T = 1000, q = 0.01, delta = 1e-5, pld: about 0.70 at epsilon 3 with b = 8, about
0.51 at epsilon 8 with b = 16 to 32), and the choice of b from public quantities."""

import math

import pytest

from dptrain.accounting import (
    bandmf_ledger,
    choose_bands,
    epsilon,
    optimal_coefficients,
    rmse_ratio,
    workload_error,
)
from dptrain.accounting.bandmf_bands import bandmf_noise_multiplier, candidate_bands
from dptrain.accounting.bandmf_strategy import PREFIX_SUMS
from dptrain.errors import AccountingError

T, Q, DELTA = 1000, 0.01, 1e-5


def test_choose_bands_matches_the_independent_estimate():
    at3 = choose_bands(T, Q, 3.0, DELTA)
    assert at3.bands == 8 and at3.rmse_ratio == pytest.approx(0.70, abs=0.01)
    assert at3.rmse_ratio == rmse_ratio(T, Q, 3.0, DELTA, 8)
    assert min(at3.candidates.values()) == at3.candidates[8] and at3.candidates[1] == 1.0
    assert at3.candidates[8] == pytest.approx(at3.rmse_ratio, rel=1e-3)  # ranked on pld's search grid
    at8 = choose_bands(T, Q, 8.0, DELTA)
    assert at8.bands in (16, 32) and at8.rmse_ratio == pytest.approx(0.51, abs=0.01)
    assert at8.candidates[16] == pytest.approx(0.51, abs=0.01) and at8.candidates[32] == pytest.approx(0.51, abs=0.01)
    assert at8.candidates[4] > 0.6 and at8.candidates[64] > at8.rmse_ratio  # a minimum inside the range
    # the sigma returned is the smallest that pld certifies for the chosen b at the budget
    assert epsilon(bandmf_ledger(at8.noise_multiplier, Q, T, at8.coefficients), DELTA, "pld").epsilon <= 8.0
    assert epsilon(bandmf_ledger(at8.noise_multiplier * (1 - 1e-4), Q, T, at8.coefficients), DELTA, "pld").epsilon > 8.0
    misses = bandmf_noise_multiplier.cache_info().misses
    assert choose_bands(T, Q, 8.0, DELTA) == at8
    assert bandmf_noise_multiplier.cache_info().misses == misses  # memoized: no calibration ran again


def test_rmse_ratio_is_sigma_ratio_times_error_ratio():
    # pld's sigmas for the equivalent DP-SGD runs at epsilon 3 (calibrate_dpsgd_noise(3, 1e-5, q, T, "pld") on
    # dpsgd_ledger, recorded), and E_b of the optimized banded C over ||A||_F^2
    sigma_1, sigma_8 = 0.8136283419111956, 1.5330566339835172
    error = workload_error(optimal_coefficients(T, 8), T) / PREFIX_SUMS.frobenius_squared(T)
    assert rmse_ratio(T, Q, 3.0, DELTA, 8) == pytest.approx(sigma_8 / sigma_1 * math.sqrt(error), rel=2e-5)
    assert rmse_ratio(T, Q, 3.0, DELTA, 1) == 1.0


def test_candidates_are_public_powers_of_two():
    assert candidate_bands(1000, 0.01) == [1, 2, 4, 8, 16, 32, 64]  # b q <= 1
    assert candidate_bands(20, 0.01) == [1, 2, 4, 8, 16]  # b <= T
    assert candidate_bands(234, 256 / 60000) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert candidate_bands(10**5, 1e-4, max_bands=256)[-1] == 256
    assert candidate_bands(10, 1.0) == [1]
    with pytest.raises(AccountingError, match=r"sampling rate must be a number in \(0, 1\]"):
        choose_bands(100, 1.5, 1.0, DELTA)
    with pytest.raises(AccountingError, match="epsilon must be a finite number > 0"):
        rmse_ratio(100, 0.01, -1.0, DELTA, 2)



def test_a_budget_only_rdp_reaches_is_ranked_by_rdp_not_refused(monkeypatch):
    """pld's discretization cannot reach some budgets below a noise multiplier of 1e4 (epsilon 1e-3 over 1000 steps at
    q = 0.01: pld > 1e4, rdp 658; epsilon 20 at delta 1e-30), where DP-SGD's calibration and a given b's fall back to
    rdp. Ranking the candidates of bands="auto" must use the same accountants (before: refused, "needs a noise
    multiplier above 1e4", where DP-SGD calibrates). Here pld is made to reach no budget at all: a candidate's sigma
    is then rdp's, the smallest that rdp certifies."""
    from dptrain.accounting.bandmf_bands import _search_noise_multiplier
    from dptrain.accounting.standard import PldAccountant
    from dptrain.errors import NoFiniteEpsilon

    def unreachable(self, ledger, delta):
        raise NoFiniteEpsilon("pld: no finite epsilon at this delta")

    monkeypatch.setattr(PldAccountant, "report", unreachable)
    sigma = _search_noise_multiplier(1.0, DELTA, 0.5, 2, 2)  # (b q = 1: one Gaussian release, rdp is quick)
    assert epsilon(bandmf_ledger(sigma, 0.5, 2, (1.0, 0.0)), DELTA, "rdp").epsilon <= 1.0
    assert epsilon(bandmf_ledger(sigma * (1 - 1e-4), 0.5, 2, (1.0, 0.0)), DELTA, "rdp").epsilon > 1.0


def test_a_b_no_calibration_reaches_is_left_out_not_a_refusal_of_the_budget(monkeypatch):
    """epsilon 4e-4 over 1000 steps at q = 0.01: DP-SGD needs sigma 1375 (rdp), b = 64 more than 1e4. bands="auto"
    refused the whole budget (the b = 64 search's refusal) where b = 1 certifies it; a candidate that cannot be
    calibrated is left out. Here b >= 2 is made unreachable: the choice is b = 1, DP-SGD, calibrated."""
    from dptrain.accounting import bandmf_bands

    search = bandmf_bands._search_noise_multiplier

    def reaches_one_band_only(epsilon, delta, q, steps, bands, guess=1.0):
        if bands > 1:
            raise AccountingError(f"epsilon={epsilon} at delta={delta} needs a noise multiplier above 1e4")
        return search(epsilon, delta, q, steps, bands, guess)

    monkeypatch.setattr(bandmf_bands, "_search_noise_multiplier", reaches_one_band_only)
    chosen = choose_bands(3, 0.01, 0.5, DELTA)  # (candidates 1 and 2)
    assert chosen.bands == 1 and chosen.candidates == {1: 1.0} and chosen.coefficients == (1.0,)
    assert chosen.noise_multiplier == bandmf_noise_multiplier(0.5, DELTA, 0.01, 3, 1)
    monkeypatch.setattr(bandmf_bands, "_search_noise_multiplier", lambda *a, **k: (_ for _ in ()).throw(
        AccountingError("epsilon=0.25 at delta=1e-05 needs a noise multiplier above 1e4")))
    with pytest.raises(AccountingError, match="above 1e4"):  # DP-SGD's own refusal: the budget is refused
        choose_bands(3, 0.01, 0.25, DELTA)
