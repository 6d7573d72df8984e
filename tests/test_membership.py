"""The membership-inference bound (dptrain.accounting.membership) against direct computations of the best attack.

- A Gaussian release without subsampling (and a composition of them): the exact trade-off curve is
  G_mu(a) = Phi(Phi^-1(1 - a) - mu), mu = sqrt(sum count_i / sigma_i^2) (Dong, Roth & Su, "Gaussian Differential
  Privacy", Sec. 2.3 and Cor. 3.3), so the best attacker's TPR at FPR a is 1 - G_mu(a).
- A Poisson-subsampled Gaussian, one or two steps: the most powerful test between P = N(0, s^2)^T (the example left
  out) and Q = ((1 - q) N(0, s^2) + q N(1, s^2))^T (the example in) thresholds the likelihood ratio (Neyman-Pearson),
  whose power is computed here by numerical integration, for both orderings (member as the alternative, or as the
  null). The two orderings give different TPRs: a bound from one of them alone is below the other's attack.
"""

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
from scipy import optimize, stats

from dptrain.accounting import Ledger, dpsgd_ledger, epsilon, get_accountant, search_ledger
from dptrain.accounting.ledger import LedgerEntry
from dptrain.accounting.membership import (
    FPRS,
    compact,
    gdp_tpr,
    membership_inference,
    no_profile,
    profile_deltas,
    profile_tpr,
    summary_line,
    tpr_bound,
)
from dptrain.accounting.tuning import TrialCount
from dptrain.cli import main
from dptrain.errors import NoFiniteEpsilon
from dptrain.runs.report import attacker_text
from dptrain.runs.run import attacker_bound

FPR_GRID = np.array([0.001, 0.01, 0.05, 0.1, 0.3, 0.6])
DEFAULT_RUN = (0.5869, 256 / 60000, 234)  # the default job: z, q, steps (delta 1e-5)


def pld_tpr(ledger, fpr):
    composed, interval = get_accountant("pld").composed(ledger)
    return profile_tpr(composed, interval, fpr)[0]


def gaussian_tpr(fpr, mu):
    """1 - G_mu(fpr), written as the trade-off curve itself."""
    return 1 - stats.norm.cdf(stats.norm.ppf(1 - np.asarray(fpr)) - mu)


# --- the profile: dp_accounting's numbers ---------------------------------------------------------------------------


def test_profile_deltas_are_dp_accountings_vectorized_hockey_stick():
    # the default run (dense, asymmetric PMFs) and one Gaussian release (symmetric); a grid across every loss
    for ledger in (dpsgd_ledger(*DEFAULT_RUN), dpsgd_ledger(2.0, 1.0, 1, sampling="full")):
        composed, _ = get_accountant("pld").composed(ledger)
        eps = np.linspace(0, 12, 3001)
        ours, theirs = profile_deltas(composed, eps), composed.get_delta_for_epsilon(eps)
        assert np.max(np.abs(ours - theirs)) <= 1e-15 and np.max(theirs) > 0.05


def test_tpr_bound_of_one_pair_is_the_epsilon_delta_region():
    # (eps, delta) = (1, 0.01): TPR <= min(e FPR + 0.01, 1 - (1 - 0.01 - FPR)/e), written out at three FPRs
    for a, want in ((0.01, math.e * 0.01 + 0.01), (0.3, 1 - (0.69) / math.e), (0.0, 0.01)):
        assert tpr_bound([a], [1.0], [0.01])[0] == pytest.approx(want, rel=1e-12)


# --- Gaussian without subsampling: exact -------------------------------------------------------------------------


def test_one_gaussian_release_matches_the_exact_tradeoff_curve_from_above():
    sigma = 1.5
    ledger = dpsgd_ledger(sigma, 1.0, 1, sampling="full")
    exact = gaussian_tpr(FPR_GRID, 1 / sigma)
    bound = pld_tpr(ledger, FPR_GRID)
    assert np.all(bound >= exact - 1e-12) and np.max(bound - exact) < 2e-6
    result = membership_inference(ledger, 1e-5)
    assert result["accountant"] == "gdp" and result["mu_gdp"] == pytest.approx(1 / sigma, rel=1e-12)
    for key, a in FPRS.items():
        assert result[key] == pytest.approx(gaussian_tpr(a, 1 / sigma), rel=1e-9)
        assert result[key] <= result["pld"][key] <= result[key] + 2e-6


def test_composed_full_batch_gaussians_are_mu_gdp():
    ledger = Ledger()
    for sigma, count in ((2.0, 3), (3.0, 2), (1.2, 1)):
        ledger.record(dpa.GaussianDpEvent(sigma), {"mechanism": "dpsgd", "sampling": "full"}, count)
    mu = math.sqrt(3 / 4 + 2 / 9 + 1 / 1.44)
    result = membership_inference(ledger, 1e-5, curve=True)
    assert result["mu_gdp"] == pytest.approx(mu, rel=1e-12) and result["accountant"] == "gdp"
    fpr = np.array(result["curve"]["fpr"])
    assert np.allclose(result["curve"]["tpr"], gaussian_tpr(fpr, mu), atol=1e-12)
    bound, exact = pld_tpr(ledger, FPR_GRID), gaussian_tpr(FPR_GRID, mu)
    assert np.all(bound >= exact - 1e-12) and np.max(bound - exact) < 2e-6
    # the one (epsilon, delta) pair alone is a looser bound, never a tighter one
    assert np.all(np.array(result["curve"]["tpr_epsilon_delta"]) >= np.array(result["curve"]["tpr"]) - 1e-12)


# --- Poisson-subsampled Gaussian: the Neyman-Pearson test, both orderings -----------------------------------------


class NeymanPearson:
    """The most powerful tests between P = N(0, s^2)^T (example out) and Q = ((1 - q) N(0, s^2) + q N(1, s^2))^T
    (example in), T = ``steps`` in {1, 2}: each thresholds the privacy loss log dQ/dP (Neyman-Pearson). Two steps by
    numerical integration over the first step's output."""

    def __init__(self, sigma, q, steps):
        self.sigma, self.q, self.steps = sigma, q, steps
        self.x = np.linspace(-14 * sigma, 14 * sigma + 1, 20001)
        self.p = stats.norm.pdf(self.x, scale=sigma)
        self.mix = (1 - q) * self.p + q * stats.norm.pdf(self.x, loc=1, scale=sigma)
        self.loss = self._loss(self.x)
        self.low = steps * math.log1p(-q) + 1e-12  # every loss is above steps * log(1 - q)

    def _loss(self, x):  # one step's log dQ/dP, increasing in x
        return np.log1p(-self.q + self.q * np.exp((2 * x - 1) / (2 * self.sigma**2)))

    def _threshold(self, s):  # the x at which one step's loss is s (-inf where every x is above)
        v = np.expm1(s) + self.q
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(v > 0, self.sigma**2 * np.log(np.maximum(v, 1e-300) / self.q) + 0.5, -np.inf)

    def above(self, c):
        """(P, Q) probability that the total loss exceeds c: (FPR, TPR) of the test rejecting above c."""
        t = self._threshold(np.asarray(c - (self.loss if self.steps == 2 else 0.0), dtype=float))
        sf = stats.norm.sf
        p_tail, q_tail = sf(t / self.sigma), (1 - self.q) * sf(t / self.sigma) + self.q * sf((t - 1) / self.sigma)
        if self.steps == 1:
            return float(p_tail), float(q_tail)
        return float(np.trapezoid(self.p * p_tail, self.x)), float(np.trapezoid(self.mix * q_tail, self.x))

    def tprs(self, fpr):
        """The best TPRs at ``fpr``: the member as the alternative, the member as the null."""
        alt = optimize.brentq(lambda c: self.above(c)[0] - fpr, self.low, 60, xtol=1e-14)
        null = optimize.brentq(lambda c: 1 - self.above(c)[1] - fpr, self.low, 60, xtol=1e-14)
        return self.above(alt)[1], 1 - self.above(null)[0]

    def symmetrized(self, fpr):
        """1 - the lower convex envelope of min(f, f^-1) at ``fpr`` (f through 400 thresholds, so a little below
        the exact one): the trade-off that holds for both orderings at once, which a profile of both orderings
        (delta(eps) = the larger of the two, eps >= 0) determines (Dong, Roth & Su, Prop. 2.12; their C_p(f) =
        min(f_p, f_p^-1)** of Sec. 4 is this envelope for subsampling). f^-1 is f mirrored across the diagonal."""
        top = optimize.brentq(lambda c: self.above(c)[0] - 1e-5, self.low, 60)
        f = np.array([self.above(c) for c in np.linspace(self.low, top, 400)])
        f[:, 1] = 1 - f[:, 1]
        pts = np.vstack([f, f[:, ::-1], [[0.0, 1.0], [1.0, 0.0]]])
        pts = pts[np.lexsort((pts[:, 1], pts[:, 0]))]
        hull = []
        for pt in pts:  # Andrew's monotone chain: the lower hull
            while len(hull) >= 2:
                (ax, ay), (bx, by) = hull[-2], hull[-1]
                if (bx - ax) * (pt[1] - ay) - (by - ay) * (pt[0] - ax) > 0:
                    break
                hull.pop()
            hull.append(pt)
        hull = np.array(hull)
        return 1 - np.interp(fpr, hull[:, 0], hull[:, 1])


@pytest.mark.parametrize("sigma, q, steps", [(1.0, 0.5, 1), (0.5, 0.2, 1), (1.0, 0.5, 2), (0.8, 0.3, 2)])
def test_poisson_subsampled_gaussian_bound_is_the_best_attack_in_either_direction(sigma, q, steps):
    ledger = dpsgd_ledger(sigma, q, steps)
    result = membership_inference(ledger, 1e-5)
    assert result["accountant"] == "pld" and result["mu_gdp"] is None and "mu-GDP" in result["mu_gdp_reason"]
    bound, best = pld_tpr(ledger, FPR_GRID), NeymanPearson(sigma, q, steps)
    symmetrized = best.symmetrized(FPR_GRID)
    for fpr, tpr, sym in zip(FPR_GRID, bound, symmetrized, strict=True):
        alternative, null = best.tprs(fpr)
        assert abs(alternative - null) > 0.005  # the orderings differ: one of them alone need not bound the other
        # never below the best attack in either direction, and no higher than the exact trade-off of both orderings
        # (the best attack itself except where the envelope bridges f and f^-1, which it does not at 1% and 10%)
        assert tpr >= max(alternative, null) - 1e-9, (fpr, tpr, alternative, null)
        assert tpr <= max(alternative, null, sym) + 5e-5, (fpr, tpr, alternative, null, sym)
        if fpr in FPRS.values():
            assert tpr <= max(alternative, null) + 1e-6
    for key, fpr in FPRS.items():
        assert result[key] == bound[list(FPR_GRID).index(fpr)]
        assert result["epsilon_delta_reading"][key] >= result[key]


def best_attacks_by_convolution(sigma, q, steps, fprs, h=2e-4, top=8.0, points=100_001):
    """The most powerful tests of both orderings after ``steps`` Poisson-subsampled Gaussian steps, from the
    distribution of the total privacy loss L = sum_t log dQ/dP(x_t) (P = N(0, s^2) out, Q = (1 - q) N(0, s^2) +
    q N(1, s^2) in), under P and under Q, each the ``steps``-fold convolution of one step's, computed by FFT on a grid
    of step ``h`` (rounded to the nearest point; losses above ``top`` kept as mass at +inf): member as the alternative
    rejects "out" where L is large, member as the null rejects "in" where L is small (Neyman-Pearson)."""
    x = np.linspace(-12 * sigma, 12 * sigma + 1, points)
    out_pdf = stats.norm.pdf(x, scale=sigma)
    in_pdf = (1 - q) * out_pdf + q * stats.norm.pdf(x, loc=1, scale=sigma)
    loss = np.log1p(-q + q * np.exp((2 * x - 1) / (2 * sigma**2)))
    low = math.log1p(-q)  # every step's loss is above it
    size = int((top - steps * low) / h) + 1
    idx = np.round((loss - low) / h).astype(np.int64)
    n = 1 << (2 * size - 1).bit_length()
    dists = []
    for pdf in (out_pdf, in_pdf):
        w, keep = pdf / pdf.sum(), idx < size
        one = np.fft.rfft(np.bincount(idx[keep], weights=w[keep], minlength=size)[:size], n)
        acc, t = None, steps
        while t:  # repeated squaring, cut to the losses below top after each product
            if t & 1:
                acc = one if acc is None else np.fft.rfft(np.fft.irfft(acc * one, n)[:size], n)
            t >>= 1
            if t:
                one = np.fft.rfft(np.fft.irfft(one * one, n)[:size], n)
        dists.append(np.maximum(np.fft.irfft(acc, n)[:size], 0))
    p_out, p_in = dists
    above_out = (1 - p_out.sum()) + np.cumsum(p_out[::-1])  # P(L > c) from the top, with the mass at +inf
    above_in = (1 - p_in.sum()) + np.cumsum(p_in[::-1])
    alternative = np.interp(fprs, above_out, above_in)
    null = np.interp(fprs, np.cumsum(p_in), np.cumsum(p_out))
    return alternative, null


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_tiny_noise_is_a_bound_without_overflow():
    """sigma = 0.01: a participating example is all but certain to be seen, so the best attack's TPR at FPR a is the
    chance p = 1 - (1 - q)^T that it took part, plus (1 - p) a; the bound lies between that and p + a, and nothing
    overflows (e^-loss of the profile's very negative losses, e^eps of epsilon alone's reading at FPR 0)."""
    q, steps = 0.01, 100
    result = membership_inference(dpsgd_ledger(0.01, q, steps), 1e-5)
    p = 1 - (1 - q) ** steps
    for fpr, key in ((0.01, "tpr_at_fpr_1pct"), (0.1, "tpr_at_fpr_10pct")):
        assert p + (1 - p) * fpr - 1e-9 <= result[key] <= p + fpr + 1e-3
    assert tpr_bound([0.0, 0.5], [1e4], [0.3]).tolist() == [0.3, 1.0]


# --- the default run, and no profile -----------------------------------------------------------------------------


def test_default_run():
    """configs/cnn28_quick.toml (234 steps, far beyond the two integrated above): at FPR 1% and 10% the bound is the
    better of the two orderings' best attacks, computed independently of dp_accounting by convolution (never below
    it; above by less than 1e-5, the grids' error); and its numbers, quoted in docs/privacy.md."""
    result = membership_inference(dpsgd_ledger(*DEFAULT_RUN), 1e-5)
    alternative, null = best_attacks_by_convolution(*DEFAULT_RUN, np.array(list(FPRS.values())))
    for i, key in enumerate(FPRS):
        assert alternative[i] - null[i] > 0.005  # the orderings differ: one of them alone is not the bound
        assert alternative[i] - 1e-6 <= result[key] <= alternative[i] + 1e-5, (key, result[key], alternative[i])
    assert result["tpr_at_fpr_1pct"] == pytest.approx(0.02530, abs=5e-5)
    assert result["tpr_at_fpr_10pct"] == pytest.approx(0.15798, abs=5e-5)
    assert result["epsilon"] == pytest.approx(3.0, abs=1e-3)
    # epsilon alone: e^3 1% + delta and 1 - e^-3 (1 - delta - 10%)
    assert result["epsilon_delta_reading"]["tpr_at_fpr_1pct"] == pytest.approx(0.2008, abs=2e-4)
    assert result["epsilon_delta_reading"]["tpr_at_fpr_10pct"] == pytest.approx(0.9552, abs=2e-4)
    assert result["certified"] and json.loads(json.dumps(result)) == result


def test_no_profile_is_no_number():
    step = dpsgd_ledger(1.0, 0.01, 10)
    quantile = step.extended(dpa.UnsupportedDpEvent(), {"mechanism": "private_quantile", "epsilon": 0.1})
    search = search_ledger(step, TrialCount.named(10, "geometric"))
    for ledger, why in ((quantile, "pld"), (search, "hyperparameter search")):
        result = membership_inference(ledger, 1e-5)
        assert result["tpr_at_fpr_1pct"] is None and result["tpr_at_fpr_10pct"] is None
        assert result["accountant"] is None and why in result["no_profile"] and result["mu_gdp"] is None
        assert "no bound" in summary_line(result)
        # the same keys as a bound's, and as every other answer without one (account's last_iterate, a run's refusal)
        assert set(compact(result)) == {*FPRS, "accountant", "mu_gdp", "no_profile"} == set(compact(no_profile("x")))
        ledger.private = False  # (a seeded run without a profile: no number to label)
        assert set(compact(membership_inference(ledger, 1e-5))) == set(compact(result))
    assert set(attacker_bound(step, 2.0)) == set(compact(result))  # (a refusal of the bound itself: delta 2)


def test_a_seeded_run_is_not_certified():
    ledger = dpsgd_ledger(1.0, 1.0, 1, sampling="full")
    ledger.private = False
    result = membership_inference(ledger, 1e-5)
    assert result["certified"] is False and "not private" in result["note"]
    # the short form a summary.json and account --json print says so too, and so do the lines (before: bare rates)
    short = compact(result)
    assert short["certified"] is False and short["note"] == result["note"]
    assert "NOT private" in summary_line(result) and "NOT private" in attacker_text(short)
    secret = compact(membership_inference(dpsgd_ledger(1.0, 1.0, 1, sampling="full"), 1e-5))
    assert "certified" not in secret and "NOT private" not in attacker_text(secret)


# --- the command line ----------------------------------------------------------------------------------------------

ACCOUNT = ["account", "--noise-multiplier", "0.5869", "--sampling-rate", str(256 / 60000), "--steps", "234"]


def test_account_prints_the_attackers_bound(capsys, tmp_path):
    assert main([*ACCOUNT, "--delta", "1e-5", "--json"]) == 0
    mi = json.loads(capsys.readouterr().out)["membership_inference"]
    assert mi["tpr_at_fpr_1pct"] == pytest.approx(0.0253, abs=1e-4) and mi["mu_gdp"] is None
    assert mi["tpr_at_fpr_10pct"] == pytest.approx(0.158, abs=1e-4) and mi["accountant"] == "pld"
    assert main([*ACCOUNT, "--delta", "1e-5", "--accountant", "all", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["membership_inference"] == mi
    png = tmp_path / "attacker.png"
    assert main([*ACCOUNT, "--delta", "1e-5", "--attacker-plot", str(png)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "membership-inference" in line]
    assert len(lines) == 1 and "TPR <= 2.53% at FPR 1%, <= 15.8% at FPR 10%" in lines[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*ACCOUNT, "--delta", "1e-5", "--attacker-plot", str(tmp_path / "no" / "a.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dptrain: error: --attacker-plot: cannot write")


def test_account_gives_mu_for_full_batches_and_no_number_for_a_search(capsys):
    full = ["account", "--noise-multiplier", "2", "--sampling-rate", "1", "--sampling", "full", "--steps", "4"]
    assert main([*full, "--delta", "1e-5", "--json"]) == 0
    mi = json.loads(capsys.readouterr().out)["membership_inference"]
    assert mi["mu_gdp"] == pytest.approx(1.0) and mi["accountant"] == "gdp"
    assert mi["tpr_at_fpr_1pct"] == pytest.approx(gaussian_tpr(0.01, 1.0), rel=1e-9)
    assert main([*ACCOUNT, "--delta", "1e-5", "--tuning-mean", "10", "--json"]) == 0
    mi = json.loads(capsys.readouterr().out)["membership_inference"]
    assert mi["tpr_at_fpr_1pct"] is None and "hyperparameter search" in mi["no_profile"]


def test_never_above_what_a_smaller_certified_epsilon_says():
    """A last-iterate run (full batches, 10^6 steps of projected noisy SGD): the pld/gdp profile is that of releasing
    every iterate (mu = 2), the last_iterate accountant certifies epsilon 0.63 for the last one. Both bound the
    attacker, so the bound is the lower of the two at each FPR, and never above the certified epsilon's own reading
    (before: 37% at FPR 1% beside a certificate of epsilon 0.63, which alone says 1.9%)."""
    from dptrain.accounting.last_iterate import neighboring_for, step_event, step_facts

    n, steps, std = 1000, 10**6, 1.0
    facts = step_facts(batching="full", n=n, b=n, noise_std=std, lipschitz=1.0, adjacency="replace", diameter=1.0,
                       smoothness=1.0, learning_rate=0.5)
    event = step_event("full", n, n, std, facts["sensitivity"])
    ledger = Ledger([LedgerEntry(event, steps, facts)], neighboring_for("replace"))
    last = epsilon(ledger, 1e-5, "last_iterate")
    assert last.certified and last.epsilon < epsilon(ledger, 1e-5, "gdp").epsilon
    result = membership_inference(ledger, 1e-5)
    pair = tpr_bound([0.01, 0.1], [last.epsilon], [1e-5])
    profile = gdp_tpr([0.01, 0.1], 2.0)
    assert result["tpr_at_fpr_1pct"] == pytest.approx(min(pair[0], profile[0]), rel=1e-12)
    assert result["tpr_at_fpr_10pct"] == pytest.approx(min(pair[1], profile[1]), rel=1e-12)
    assert result["tpr_at_fpr_1pct"] <= pair[0] and result["tightened_by"]["accountant"] == "last_iterate"
    assert result["epsilon"] == last.epsilon and compact(result)["tightened_by"] == result["tightened_by"]
    assert "last_iterate's epsilon" in summary_line(result)
    # a ledger whose profile is the tightest (DP-SGD) is not touched
    plain = membership_inference(dpsgd_ledger(1.0, 0.01, 100), 1e-5)
    assert "tightened_by" not in plain and plain["accountant"] == "pld"


def test_a_delta_below_the_profiles_tail_still_bounds_the_attacker():
    """The bound reads the whole profile, not delta: at delta = 1e-15 pld finds no finite epsilon (its pessimistic
    tail mass), but its profile is the same and bounds the attacker exactly as at 1e-5; the one-pair reading is the
    tightest certificate's (rdp). Before: no number, and the reason given was "the noise is too small"."""
    ledger = dpsgd_ledger(1.0, 0.01, 100)
    at_usual = membership_inference(ledger, 1e-5)
    tiny = membership_inference(ledger, 1e-15)
    for key in FPRS:
        assert tiny[key] == at_usual[key] is not None
    assert tiny["accountant"] == "pld" and tiny["epsilon"] == epsilon(ledger, 1e-15).epsilon
    assert tiny["epsilon_delta_reading"]["tpr_at_fpr_1pct"] == pytest.approx(math.exp(tiny["epsilon"]) * 0.01 + 1e-15)
    assert "TPR <=" in summary_line(tiny) and json.loads(json.dumps(tiny)) == tiny
    assert "no accountant certifies a finite epsilon at delta 1e-15" in summary_line({**tiny, "epsilon": None})
    # and pld's own refusal there names delta and its tail, not the noise
    with pytest.raises(NoFiniteEpsilon, match=r"certifies no delta below [\d.e-]+ .*got delta = 1e-15: use rdp"):
        epsilon(ledger, 1e-15, "pld")
