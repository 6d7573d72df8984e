"""The ``modelmix`` accountant (Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix").

The reference numbers here are computed independently of ``dptrain.accounting.modelmix``: its densities, its
trapezoid rule and its binomial sum are re-derived below with ``scipy.integrate.quad`` (adaptive quadrature) and
``scipy.special.log_ndtr`` (the log normal tail, what ``scipy.stats.norm.logsf`` evaluates; called directly because
``stats.norm.logsf`` costs 150 us a scalar call inside quad). In units of the sensitivity, one coordinate's law is

    P_v = N(v, z^2) * U[-w/2, w/2],    p_v(o) = (Phi((o - v + w/2)/z) - Phi((o - v - w/2)/z)) / w.
"""

import contextlib
import io
import json
import math
import subprocess
import sys

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from scipy import integrate, special, stats

from dptrain.accounting import dpsgd_ledger, epsilon
from dptrain.accounting.modelmix import (
    Phase,
    modelmix_epsilon,
    modelmix_ledger,
    phases_from_ledger,
    reverse_rdp_bound,
    reviewed_phase,
    step_rdp,
)
from dptrain.cli import main
from dptrain.errors import AccountingError

# --- independent reference -------------------------------------------------------------------------------------


def ref_log_density(o, shift: float, z: float, w: float):
    """log p_shift(o) in closed form, evaluated on the side where neither normal tail is close to 1."""
    x = np.abs(np.asarray(o, dtype=np.float64) - shift)  # the law is symmetric about its shift
    if w == 0:
        return -0.5 * (x / z) ** 2 - math.log(z * math.sqrt(2 * math.pi))
    # Phi((x + w/2)/z) - Phi((x - w/2)/z) = Q((x - w/2)/z) - Q((x + w/2)/z), Q the upper tail, Q(t) = Phi(-t)
    log_q_near = special.log_ndtr(-(x - w / 2) / z)
    log_q_far = special.log_ndtr(-(x + w / 2) / z)
    return log_q_near + np.log(-np.expm1(log_q_far - log_q_near)) - math.log(w)


def _bregman(u, b: float):
    """(1 + u)^b - 1 - b u >= 0 (b > 1 or b < 0), without cancellation near u = 0."""
    u = np.asarray(u, dtype=np.float64)
    series, coef = np.zeros_like(u), b  # coef = b (b-1) ... (b-k+1) / k!, also at negative integers b
    for k in range(2, 7):
        coef *= (b - k + 1) / k
        series = series + coef * u**k
    with np.errstate(over="ignore", invalid="ignore"):
        direct = np.expm1(b * np.log1p(u)) - b * u
    return np.where(np.abs(u) < 1e-3, series, direct)


def _log_quad(log_f, breaks, lo: float, hi: float, small=None) -> float:
    """log of the integral over the reals of exp(log_f); the integrand must be negligible (e^-80 of its peak)
    outside [lo, hi]. Quadrature on the part of [lo, hi] where it is not negligible, split at ``breaks`` and at the
    peak. With ``small`` (the integrand of I - 1, nonnegative), log1p of its integral when I is close to 1."""
    grid = np.linspace(lo, hi, 40001)
    values = log_f(grid)
    peak = float(values.max())
    assert values[0] < peak - 80 and values[-1] < peak - 80, "reference range too short"
    kept = grid[values > peak - 80]
    h = grid[1] - grid[0]
    a, b = kept[0] - h, kept[-1] + h
    points = sorted({float(p) for p in [*breaks, grid[int(values.argmax())]] if a < p < b})
    opts = {"points": points, "limit": 200, "epsabs": 0.0, "epsrel": 1e-11}
    val, err = integrate.quad(lambda t: math.exp(float(log_f(t)) - peak), a, b, **opts)
    assert err <= 1e-9 * val
    out = peak + math.log(val)
    if small is not None and abs(out) < 1e-2:  # I - 1 directly: no loss to the 1
        val, err = integrate.quad(lambda t: float(small(t)), a, b, **opts)
        assert val >= 0 and err <= 1e-9 * val + 1e-300
        out = math.log1p(val)
    return out


def ref_step_rdp(q: float, z: float, w: float, order: float, direction: str = "forward") -> float:
    """1/(a-1) log int p_0 ((1-q) + q p_1/p_0)^b, b = a (forward) or 1 - a (reverse), by adaptive quadrature."""
    b = order if direction == "forward" else 1.0 - order

    def log_l(o):
        return ref_log_density(o, 1.0, z, w) - ref_log_density(o, 0.0, z, w)

    def log_mix(o):
        return log_l(o) if q == 1 else np.logaddexp(math.log1p(-q), math.log(q) + log_l(o))

    def log_f(o):
        return ref_log_density(o, 0.0, z, w) + b * log_mix(o)

    def small(o):  # p_0 (mix^b - 1 - b (mix - 1)): integrates to I - 1 since E_P0[mix] = 1
        return np.exp(ref_log_density(o, 0.0, z, w)) * _bregman(q * np.expm1(log_l(o)), b)

    reach = w / 2 + order + 2 + 60 * z
    breaks = [-w / 2, w / 2, 1 - w / 2, 1 + w / 2]
    return _log_quad(log_f, breaks, -reach, reach, small) / (order - 1)


def ref_log_moment(z: float, w: float, shift: float, k: int) -> float:
    """log A_k = log int p_shift^k p_0^(1-k)."""
    if k in (0, 1):
        return 0.0

    def log_l(o):
        return ref_log_density(o, shift, z, w) - ref_log_density(o, 0.0, z, w)

    def log_f(o):
        return ref_log_density(o, 0.0, z, w) + k * log_l(o)

    def small(o):
        return np.exp(ref_log_density(o, 0.0, z, w)) * _bregman(np.expm1(log_l(o)), k)

    reach = w / 2 + shift * (k + 2) + 60 * z
    breaks = [-w / 2, w / 2, shift - w / 2, shift + w / 2]
    return _log_quad(log_f, breaks, -reach, reach, small)


def ref_binomial_rdp(q: float, z: float, w: float, p: int, order: int, log_a: dict) -> float:
    """Cor. 4.1 (with the factor 1/(a-1)): 1/(a-1) log sum_k C(a,k) (1-q)^(a-k) q^k A_k^p, A_k at shift
    1/sqrt(p); written as log1p of sum_k>=2 C(a,k) (1-q)^(a-k) q^k (A_k^p - 1) (the binomial weights sum to 1)."""
    extra = sum(
        math.comb(order, k) * (1 - q) ** (order - k) * q**k * math.expm1(p * log_a[k])
        for k in range(2, order + 1)
    )
    return math.log1p(extra) / (order - 1)


def dp_accounting_rdp(q: float, z: float, orders) -> np.ndarray:
    acc = RdpAccountant(list(orders))
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)))
    return np.asarray(acc._rdp, dtype=np.float64)


def test_reference_density_is_the_convolution():
    """The reference density against scipy.stats: the closed form, and the convolution integral itself."""
    z, w = 0.7, 3.75
    for o in (-5.0, -1.875, -0.3, 0.0, 1.0, 2.5, 6.0):
        closed = (stats.norm.cdf((o + w / 2) / z) - stats.norm.cdf((o - w / 2) / z)) / w
        conv, _ = integrate.quad(
            lambda u, o=o: stats.norm.pdf(o - u, scale=z) / w, -w / 2, w / 2, epsrel=1e-12
        )
        assert math.exp(ref_log_density(o, 0.0, z, w)) == pytest.approx(closed, rel=1e-10)
        assert closed == pytest.approx(conv, rel=1e-9)
    # far tail, where the closed form in cdf differences has cancelled to 0: the log-tail form still answers
    assert ref_log_density(40.0, 0.0, z, w) == pytest.approx(
        stats.norm.logsf((40.0 - w / 2) / z) - math.log(w), rel=1e-9
    )
    total, _ = integrate.quad(
        lambda t: math.exp(ref_log_density(t, 0.3, z, w)), -30, 30, points=[-1.575, 2.175]
    )
    assert total == pytest.approx(1.0, rel=1e-10)


# --- 1. quadrature --------------------------------------------------------------------------------------------

QUAD_CASES = [  # q, z, w, a
    (0.02, 0.5, 3.75, 2.0),
    (0.02, 1.0, 15.0, 8.0),
    (0.02, 2.0, 0.5, 1.5),
    (0.02, 0.36328, 7.5, 1.57),  # the paper's Fig. 3, near its optimal order
    (0.3, 1.0, 0.5, 3.7),
    (0.3, 2.0, 15.0, 1.5),
    (0.3, 0.5, 15.0, 8.0),
    (1.0, 0.5, 0.5, 3.7),
    (1.0, 2.0, 3.75, 8.0),
    (1.0, 1.0, 15.0, 2.0),
]


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("q,z,w,a", QUAD_CASES)
def test_step_rdp_matches_adaptive_quadrature(q, z, w, a, direction):
    ours = step_rdp(q, z, w, [a], direction=direction)
    assert ours.shape == (1,)
    assert ours[0] == pytest.approx(ref_step_rdp(q, z, w, a, direction), rel=1e-6)


@pytest.mark.parametrize("q,z,w", [(0.02, 0.36328, 7.5), (0.3, 1.0, 3.75), (1.0, 2.0, 0.5)])
@pytest.mark.parametrize("p", [4, 25])
def test_linf_p_forward_matches_binomial_formula(q, z, w, p):
    orders = [2, 3, 5]
    log_a = {k: ref_log_moment(z, w, 1 / math.sqrt(p), k) for k in range(max(orders) + 1)}
    ours = step_rdp(q, z, w, orders, linf_p=p, direction="forward")
    ref = [ref_binomial_rdp(q, z, w, p, a, log_a) for a in orders]
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_linf_p_without_width_is_the_gaussian():
    """With w = 0 the p-hot shift by 1/sqrt(p) is the one-hot shift rotated: the same Gaussian divergence."""
    orders = [2, 3, 5, 8, 16]
    for q, z in [(0.02, 0.5), (0.3, 1.0)]:
        np.testing.assert_allclose(
            step_rdp(q, z, 0.0, orders, linf_p=25), dp_accounting_rdp(q, z, orders), rtol=1e-8
        )


# --- 2. tau -> 0: the sampled Gaussian -------------------------------------------------------------------------

INTEGER_ORDERS = [2, 3, 4, 5, 8, 12, 16, 32, 64, 128, 256]
GAUSSIAN_CASES = [(0.001, 1.1), (0.02, 0.5), (0.02, 1.0), (0.3, 2.0), (1.0, 1.0)]


@pytest.mark.parametrize("q,z", GAUSSIAN_CASES)
def test_zero_width_is_the_sampled_gaussian_at_integer_orders(q, z):
    np.testing.assert_allclose(
        step_rdp(q, z, 0.0, INTEGER_ORDERS, direction="forward"),
        dp_accounting_rdp(q, z, INTEGER_ORDERS),
        rtol=1e-8,
    )


@pytest.mark.parametrize("q,z", [(0.02, 0.5), (0.02, 1.0), (0.3, 2.0), (1.0, 1.0)])
def test_zero_width_at_fractional_orders(q, z):
    orders = [1.05, 1.5, 2.5, 3.7, 7.3]
    ours = step_rdp(q, z, 0.0, orders, direction="forward")
    np.testing.assert_allclose(ours, [ref_step_rdp(q, z, 0.0, a) for a in orders], rtol=1e-6)
    # dp_accounting's fractional orders are upper bounds (a series), exact only for q = 1
    assert np.all(ours <= dp_accounting_rdp(q, z, orders) * (1 + 1e-9))


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("q,z", GAUSSIAN_CASES)
def test_small_width_is_close_to_zero_width(q, z, direction):
    orders = [1.1, 1.5, 2.0, 3.0, 5.5, 8.0, 16.0, 64.0]
    np.testing.assert_allclose(
        step_rdp(q, z, 1e-3, orders, direction=direction),
        step_rdp(q, z, 0.0, orders, direction=direction),
        rtol=1e-2,
    )


# --- 3. width never hurts (post-processing) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "q,z,w", [(0.02, 0.36328, 3.75), (0.02, 1.0, 15.0), (0.3, 0.5, 0.5), (1.0, 2.0, 7.5)]
)
def test_width_never_raises_the_rdp(q, z, w):
    orders = np.round(
        np.concatenate([np.arange(1.01, 2, 0.07), np.arange(2, 12, 0.5), [16, 24, 32, 64, 128]]), 4
    )
    for direction in ("forward", "reverse"):
        with_width = step_rdp(q, z, w, orders, direction=direction)
        gaussian = step_rdp(q, z, 0.0, orders, direction=direction)
        assert np.all(np.isfinite(with_width)) and np.all(with_width >= 0)
        assert np.all(with_width <= gaussian * (1 + 1e-9)), (direction, orders[with_width > gaussian])
    integer_orders = [2, 3, 4, 6, 8, 16, 32]
    for p in (4, 25):
        p_hot = step_rdp(q, z, w, integer_orders, linf_p=p)
        assert np.all(p_hot <= step_rdp(q, z, 0.0, integer_orders) * (1 + 1e-9)), p


def test_phases_above_the_reviewed_range_are_accounted_at_a_dominating_phase():
    # The two dominations reviewed_phase relies on, checked by direct computation at the real parameters: a width
    # w is no worse than 250 (w/m with m copies of the narrower uniform, then the review's width monotonicity on
    # [250, 500)), a noise multiplier z no worse than z0 < z (added independent noise), in both orderings.
    orders = (2.0, 3.0, 8.0, 32.0)
    for direction in ("forward", "reverse"):
        wide = step_rdp(0.13653, 2.0, 409.6, orders, direction=direction)
        capped = step_rdp(0.13653, 2.0, 250.0, orders, direction=direction)
        narrow = step_rdp(0.13653, 2.0, 204.8, orders, direction=direction)
        assert np.all(wide <= capped * (1 + 1e-9)) and np.all(capped <= narrow * (1 + 1e-9))
        assert np.all(narrow > 0)
        noisy = step_rdp(0.13653, 16.0, 100.0, orders, direction=direction)
        assert np.all(noisy <= step_rdp(0.13653, 8.0, 100.0, orders, direction=direction) * (1 + 1e-9))
    ph = Phase(400, 0.13653, 16.0, 409.6)
    assert reviewed_phase(ph) == Phase(400, 0.13653, 8.0, 250.0)
    assert reviewed_phase(Phase(400, 0.13653, 16.0, 750.0)).width == 250.0  # m = 3
    inside = Phase(400, 0.13653, 2.0, 100.0)
    assert reviewed_phase(inside) is inside
    r = modelmix_epsilon([ph], 1e-5)
    assert r["in_certified_range"] and r["accounted_as"] == [{"noise_multiplier": 8.0, "width_over_sensitivity": 250.0}]
    assert r["epsilon"] == modelmix_epsilon([Phase(400, 0.13653, 8.0, 250.0)], 1e-5)["epsilon"]
    # the reported (uncertified) numbers are those of the real phase
    assert r["epsilon_paper_method"] < modelmix_epsilon([Phase(400, 0.13653, 8.0, 250.0)], 1e-5)["epsilon_paper_method"]
    # below the range nothing is proven: not certified
    assert not modelmix_epsilon([Phase(100, 0.02, 0.25, 10.0)], 1e-5)["in_certified_range"]


# --- 4. the paper's Fig. 3 ------------------------------------------------------------------------------------

FIG3 = {  # width: epsilon for p = 1, 25, 100 (q = 0.02, T = 5000, delta = 1e-5, z = 0.36328)
    3.75: (57.2, 17.9, 15.3),
    7.5: (40.4, 9.0, 7.9),
    15.0: (31.7, 5.4, 4.8),
}
FIG3_CASES = [(w, p, e) for w, eps in FIG3.items() for p, e in zip((1, 25, 100), eps, strict=True)]


@pytest.mark.parametrize("width,p,paper", FIG3_CASES)
def test_fig3_paper_method(width, p, paper):
    r = modelmix_epsilon([Phase(5000, 0.02, 0.36328, width, p)], 1e-5)
    assert r["epsilon_paper_method"] == pytest.approx(paper, rel=0.05)
    # the ledger route (width = (tau/eta) B / C with B = 1000, C = 20) certifies the larger of the two orderings
    ledger = modelmix_ledger(0.36328, 0.02, 5000, tau=width / 50, batch_size=1000, clip_norm=20, linf_p=p)
    report = epsilon(ledger, 1e-5, "modelmix")
    d = report.details
    assert report.accountant == "modelmix"
    # certified: the larger ordering, each certified on its own (integer orders forward, second-moment reverse
    # bound); both certified values bound the reported ones (fractional orders forward, exact one-hot reverse, which
    # is not itself a bound: split shifts give more)
    assert report.epsilon == pytest.approx(
        max(d["epsilon_forward_certified"], d["epsilon_reverse_certified"]), rel=1e-12
    )
    assert d["epsilon_forward_certified"] >= d["epsilon_paper_direction"] * (1 - 1e-12)
    if p == 1:  # (the one-hot shift is not admissible under an l-infinity bound: no exact reverse reported)
        assert d["epsilon_reverse_certified"] >= d["epsilon_reverse_one_hot_not_a_bound"] * (1 - 1e-12)
    else:
        assert d["epsilon_reverse_one_hot_not_a_bound"] is None
    assert "epsilon_reverse_direction" not in d  # the old name read as a bound
    assert d["epsilon_paper_direction"] == pytest.approx(r["epsilon_paper_direction"], rel=1e-9)
    plain = epsilon(ledger, 1e-5, "rdp").epsilon
    for value in (d["epsilon_paper_direction"], d["epsilon_reverse_one_hot_not_a_bound"] or 0,
                  d["epsilon_paper_method"]):
        assert value < plain
    if p > 1:  # with l-infinity truncation the certificate itself is far below plain DP-SGD's
        assert report.epsilon < plain / 10


# --- 5. the paper's transfer-learning run (Sec. 5.3) ----------------------------------------------------------


def test_transfer_learning_paper_method():
    ledger = modelmix_ledger(
        2.04, 1024 / 50000, 1500, tau=[0.0075, 0.005, 0.0025], batch_size=1024, clip_norm=0.1, linf_p=1
    )
    phases = phases_from_ledger(ledger)
    assert [ph.steps for ph in phases] == [500, 500, 500]
    np.testing.assert_allclose([ph.width for ph in phases], [76.8, 51.2, 25.6], rtol=1e-12)
    report = epsilon(ledger, 1e-5, "modelmix")
    assert report.details["epsilon_paper_method"] == pytest.approx(0.64, rel=0.05)
    assert report.epsilon < epsilon(ledger, 1e-5, "rdp").epsilon


# --- 6. ledgers -----------------------------------------------------------------------------------------------


def test_plain_dpsgd_ledger_is_refused():
    with pytest.raises(AccountingError, match="covers ModelMix"):
        epsilon(dpsgd_ledger(1.0, 0.01, 100), 1e-5, "modelmix")


def test_modelmix_ledger_under_rdp_is_the_looser_bound():
    ledger = modelmix_ledger(0.8, 0.02, 1000, tau=0.3, batch_size=1000, clip_norm=20)  # width 15
    assert phases_from_ledger(ledger)[0].width == pytest.approx(15.0)
    rdp = epsilon(ledger, 1e-5, "rdp").epsilon
    assert rdp == pytest.approx(epsilon(dpsgd_ledger(0.8, 0.02, 1000), 1e-5, "rdp").epsilon, rel=1e-12)
    assert epsilon(ledger, 1e-5, "modelmix").epsilon < rdp


# --- 7. the command line --------------------------------------------------------------------------------------

CLI = [sys.executable, "-m", "dptrain.cli"]
BASE = "account --noise-multiplier 0.36328 --sampling-rate 0.02 --steps 5000 --delta 1e-5".split()
MM = ["--batch-size", "1000", "--max-grad-norm", "20"]
CLI_ERRORS = {  # name: (extra arguments, a word the one-line message names)
    "negative_tau": (["--accountant", "modelmix", "--tau-over-lr", "-1", *MM], "tau"),
    "linf_p_0": (["--accountant", "modelmix", "--tau-over-lr", "0.3", "--linf-p", "0", *MM], "--linf-p"),
    "tau_with_rdp": (["--accountant", "rdp", "--tau-over-lr", "0.1"], "--tau-over-lr"),
    "modelmix_without_tau": (["--accountant", "modelmix", *MM], "--tau-over-lr"),
    "huge_width": (["--accountant", "modelmix", "--tau-over-lr", "1e9", *MM], "grid points"),  # (was a MemoryError)
    "modelmix_without_batch": (
        ["--accountant", "modelmix", "--tau-over-lr", "0.3", "--max-grad-norm", "20"],
        "--batch-size",
    ),
}
SUCCESS = [*BASE, "--accountant", "modelmix", "--tau-over-lr", "0.3", *MM, "--json"]
#: the refusal run in a real process (its exit status and a stderr without traceback, as a user sees them); the
#: others call the command line's main in this process (a process costs 1.5 to 2 s of CPU importing dp_accounting)
IN_A_PROCESS = "negative_tau"


def _in_this_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cli_refusals():
    """The refused commands: (exit status, stdout, stderr) by name."""
    proc = subprocess.Popen([*CLI, *BASE, *CLI_ERRORS[IN_A_PROCESS][0]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out = {name: _in_this_process([*BASE, *extra]) for name, (extra, _) in CLI_ERRORS.items() if name != IN_A_PROCESS}
    stdout, stderr = proc.communicate(timeout=120)
    out[IN_A_PROCESS] = (proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("name", list(CLI_ERRORS))
def test_cli_refusals_are_one_line(cli_refusals, name):
    code, stdout, stderr = cli_refusals[name]
    assert code == 2, (stdout, stderr)
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain: error:"), stderr
    assert CLI_ERRORS[name][1] in lines[0]


def test_cli_account_modelmix_json():
    code, stdout, stderr = _in_this_process(SUCCESS)
    assert code == 0, stderr
    out = json.loads(stdout)
    for key in ("epsilon", "epsilon_paper_direction", "epsilon_dpsgd", "optimal_order", "certified"):
        assert key in out, key
    assert out["epsilon"] < out["epsilon_dpsgd"]
    ledger = modelmix_ledger(0.36328, 0.02, 5000, tau=0.3, batch_size=1000, clip_norm=20)
    assert out["epsilon"] == pytest.approx(epsilon(ledger, 1e-5, "modelmix").epsilon, rel=1e-9)
    assert out["epsilon_dpsgd"] == pytest.approx(epsilon(ledger, 1e-5, "rdp").epsilon, rel=1e-9)


@pytest.mark.slow
def test_cli_calibrate_modelmix():
    args = (
        "calibrate --accountant modelmix --epsilon 2 --sampling-rate 0.02 --steps 1000 --delta 1e-5".split()
    )
    args += ["--tau-over-lr", "0.3", *MM, "--json"]
    code, stdout, stderr = _in_this_process(args)
    assert code == 0, stderr
    out = json.loads(stdout)
    sigma = out["noise_multiplier"]
    assert 0.3 < sigma < 2.0
    ledger = modelmix_ledger(sigma, 0.02, 1000, tau=0.3, batch_size=1000, clip_norm=20)
    spent = epsilon(ledger, 1e-5, "modelmix").epsilon
    assert spent <= 2.0 and out["epsilon"] <= 2.0
    assert spent == pytest.approx(2.0, rel=1e-3)  # a calibration, not just any sigma that fits


@pytest.mark.parametrize("q,z,w,p", [(0.02, 0.5, 3.75, 1), (0.05, 1.0, 15.0, 1), (0.02, 0.36328, 15.0, 25)])
def test_the_certified_reverse_bound_is_above_the_exact_one_hot_reverse(q, z, w, p):
    """reverse_rdp_bound holds for every admissible shift, so in particular for one coordinate shifted by 1/sqrt(p)
    (computed here by the independent quadrature: a shift s at (z, w) is a shift 1 at (z/s, w/s))."""
    orders = (1.5, 2.0, 3.0, 8.0, 20.0)
    bound = reverse_rdp_bound(q, z, w, orders, p)
    for a, b in zip(orders, bound, strict=True):
        exact = ref_step_rdp(q, z * p**0.5, w * p**0.5, a, "reverse")
        assert b >= exact * (1 - 1e-9), (a, b, exact)
