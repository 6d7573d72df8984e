"""The numerical review of the one-step analysis in Xiao, Wan & Devadas, "Differentially Private Deep Learning with
ModelMix" (dptrain.reproduce.modelmix_review): the one-coordinate law and its closed forms against direct
quadrature, the two-dimensional hockey-stick integral against the Gaussian control (where merging two coordinates
is exact), the comparison bookkeeping on known-true and known-false claims, and the quick review's output."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import integrate, stats

from dptrain.reproduce import modelmix_review as mr
from dptrain.reproduce.modelmix_review import (
    Law,
    compare,
    convexity_margins,
    hockey_1d,
    hockey_2d,
    rdp_1d,
    rdp_2d,
)

LAWS = [(0.3633, 0.0), (0.5, 1.0), (1.0, 7.5), (2.0, 30.0), (0.3633, 30.0)]


def _grid(law: Law, pad: float = 1.0) -> np.ndarray:
    return np.arange(-0.5 * law.w - 16 * law.z - pad, 0.5 * law.w + 16 * law.z + pad, law.z / 32)


@pytest.mark.parametrize("z,w", LAWS)
def test_law_integrates_to_one_and_likelihood_ratio_has_mean_one(z, w):
    law = Law(z, w)
    o = _grid(law)
    h0 = law.logpdf(o)
    assert abs(np.trapezoid(np.exp(h0), o) - 1) < 1e-12
    for v in (0.1, 1.0):
        assert abs(np.trapezoid(np.exp(h0 + law.ell(o, v)), o) - 1) < 1e-12  # E_P0[L_v] = 1
    assert abs(np.trapezoid(o * o * np.exp(h0), o) / (z * z + w * w / 12) - 1) < 1e-11


@pytest.mark.parametrize("z,w", [(0.5, 1.0), (1.0, 7.5), (2.0, 30.0)])
def test_log_density_matches_the_direct_formula(z, w):
    law = Law(z, w)
    o = np.linspace(-0.5 * w - 5 * z, 0.5 * w + 5 * z, 101)
    x = np.abs(o)  # the upper tails, where the difference does not cancel
    direct = (stats.norm.sf((x - w / 2) / z) - stats.norm.sf((x + w / 2) / z)) / w
    np.testing.assert_allclose(np.exp(law.logpdf(o)), direct, rtol=1e-12)
    h, g = law.logpdf_grad(o)
    eps = 1e-6
    np.testing.assert_allclose(g, (law.logpdf(o + eps) - law.logpdf(o - eps)) / (2 * eps), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("z,w", LAWS)
def test_survival_function_matches_quadrature(z, w):
    law = Law(z, w)
    for x in (-0.5 * w - 2 * z, 0.0, 0.3 * z, 0.5 * w + 3 * z, 0.5 * w + 12 * z):
        ref = integrate.quad(lambda t: math.exp(float(law.logpdf(t))), x, x + w + 40 * z, epsabs=0, epsrel=1e-13,
                             limit=400)[0]
        assert math.exp(float(law.logsf(x))) == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("z,w", LAWS)
def test_log_likelihood_ratio_is_monotone_and_inverted_exactly(z, w):
    law = Law(z, w)
    o = _grid(law)
    assert np.all(np.diff(law.ell(o, 1.0)) >= 0)
    assert np.all(np.diff(law.logpdf(o), 2) <= 1e-13 * (1 + np.abs(law.logpdf(o)).max()))  # log-concave
    u = np.linspace(-30, 30, 301)
    for v in (0.05, 1.0):
        assert np.max(np.abs(law.ell(law.ell_inv(u, v), v) - u)) < 1e-7


@pytest.mark.parametrize("z,w", LAWS)
def test_hockey_stick_closed_form_matches_quadrature_and_put_call_parity(z, w):
    law = Law(z, w)
    ts = np.array([0.05, 0.5, 1.0, 2.0, 20.0])
    vals, errs = hockey_1d(law, 1.0, ts)
    for t, val in zip(ts, vals, strict=True):
        f = lambda o, t=t: max(math.exp(float(law.logpdf(o - 1.0))) - t * math.exp(float(law.logpdf(o))), 0.0)  # noqa: E731
        ot = float(law.ell_inv(np.array([math.log(t)]), 1.0)[0])
        ref = integrate.quad(f, ot, ot + w + 40 * z + 10, epsabs=0, epsrel=1e-13, limit=400)[0]
        if t < 1:  # the put E(t - L)^+ = E(L - t)^+ - (1 - t)
            ref -= 1 - t
        assert val == pytest.approx(ref, rel=1e-9, abs=1e-15)
    call, _ = hockey_1d(law, 1.0, ts, form="call")
    put, _ = hockey_1d(law, 1.0, ts, form="put")
    np.testing.assert_allclose(call - put, 1 - ts, rtol=0, atol=1e-13)
    assert np.all(errs < 1e-10 * np.maximum(vals, 1e-3))


def test_total_variation_of_separated_edges_is_shift_over_width():
    """For w >> z the two edges of p_v - p_0 do not interact and E(L_v - 1)^+ = v / w exactly."""
    for z, w in ((0.3633, 30.0), (0.5, 15.0)):
        for v in (0.1, 1.0):
            val, _ = hockey_1d(Law(z, w), v, np.array([1.0]))
            assert val[0] == pytest.approx(v / w, rel=1e-12)


@pytest.mark.parametrize("z", [0.3633, 1.0, 2.0])
def test_two_coordinates_equal_one_hot_for_the_gaussian(z):
    """w = 0: L_a L_b and L_c have the same law (c^2 = a^2 + b^2); the 2-D quadrature must reproduce it."""
    law = Law(z, 0.0)
    ts = np.logspace(-3, 3, 61)
    v2, e2 = hockey_2d(law, 0.6, 0.8, ts)
    v1, _ = hockey_1d(law, 1.0, ts)
    big = v1 > 1e-9
    np.testing.assert_allclose(v2[big], v1[big], rtol=1e-10)
    assert np.all(np.abs(v2 - v1) <= 1e-12 + 1e-9 * v1)
    assert np.all(compare(v2, v1, e2) == 0) and np.all(compare(v1, v2, e2) == 0)


def test_two_coordinates_symmetric_and_put_call_parity_with_plateau():
    law = Law(0.3633, 7.5)
    ts = np.array([0.01, 0.3, 1.0, 1.7, 30.0])
    ab, err = hockey_2d(law, 0.6, 0.8, ts)
    ba, _ = hockey_2d(law, 0.8, 0.6, ts)
    np.testing.assert_allclose(ab, ba, rtol=1e-10)
    assert np.all(err < 1e-9 * ab)
    call, _ = hockey_2d(law, 0.6, 0.8, ts, form="call")
    put, _ = hockey_2d(law, 0.6, 0.8, ts, form="put")
    np.testing.assert_allclose(call - put, 1 - ts, rtol=0, atol=1e-12)


def test_known_false_claims_are_detected():
    # one-hot merging fails in convex order once the uniform's edges separate: at t = 1 (total variation) the
    # split shift leaks through two edges, sum a + b > c
    law = Law(0.5, 7.5)
    a = b = 1 / math.sqrt(2)
    ts = np.array([1.0])
    lhs, le = hockey_2d(law, a, b, ts)
    rhs, re = hockey_1d(law, 1.0, ts)
    assert lhs[0] > 1.2 * rhs[0]
    assert compare(lhs, rhs, le + re)[0] == 2
    # a deliberately wrong pair: the larger norm is not dominated by the smaller one (Gaussian and plateau)
    for w in (0.0, 7.5):
        law = Law(0.5, w)
        ts = np.logspace(-2, 2, 21)
        big, be = hockey_1d(law, 1.0, ts)
        small, se = hockey_1d(law, 0.5, ts)
        assert np.all(compare(small, big, be + se) == 0)
        assert np.any(compare(big, small, be + se) == 2)


def test_compare_and_convexity_bookkeeping():
    lhs = np.array([1.0, 1 + 5e-10, 1.1, 1 + 2e-9, 1e-13])
    rhs = np.array([1.0, 1.0, 1.0, 1.0, 0.0])
    err = np.array([0.0, 0.0, 0.0, 1e-8, 0.0])
    assert compare(lhs, rhs, err).tolist() == [0, 0, 2, 1, 0]
    x = np.linspace(0, 1, 11)
    for g, ok in ((x, True), (x * x, True), (-x * x, False)):
        _, lo, hi, e = convexity_margins(x, g, np.zeros_like(x))
        assert np.all(compare(lo, hi, e) == 0) == ok


@pytest.mark.parametrize("z", [0.5, 2.0])
def test_rdp_of_the_gaussian_control(z):
    """w = 0, q = 1: D_a = a c^2 / (2 z^2) in both directions; and two coordinates equal the merged one."""
    law = Law(z, 0.0)
    orders = (1.5, 2.0, 8.0)
    r = rdp_1d(law, 1.0, orders, (0.02, 1.0))
    exact = np.array(orders) / (2 * z * z)
    np.testing.assert_allclose(r["forward"][:, 1], exact, rtol=1e-12)
    np.testing.assert_allclose(r["reverse"][:, 1], exact, rtol=1e-12)
    assert np.all(r["forward"][:, 0] < r["forward"][:, 1])
    r2 = rdp_2d(law, 0.6, 0.8, (1.5, 2.0), (0.02, 1.0))
    r1 = rdp_1d(law, 1.0, (1.5, 2.0), (0.02, 1.0))
    np.testing.assert_allclose(r2["forward"], r1["forward"], rtol=1e-10)
    np.testing.assert_allclose(r2["reverse"], r1["reverse"], rtol=1e-10)


def test_subsampled_rdp_matches_direct_quadrature():
    law = Law(1.0, 3.75)
    r = rdp_1d(law, 1.0, (1.5, 3.0), (0.04,))
    for i, a in enumerate((1.5, 3.0)):
        for beta, key in ((a, "forward"), (1 - a, "reverse")):
            f = lambda o, beta=beta: math.exp(float(law.logpdf(o))) * (  # noqa: E731
                0.96 + 0.04 * math.exp(float(law.ell(o, 1.0)))) ** beta
            moment = integrate.quad(f, -40, 40, epsabs=0, epsrel=1e-13, limit=400)[0]
            assert r[key][i, 0] == pytest.approx(math.log(moment) / (a - 1), rel=1e-9)


@pytest.fixture(scope="module")
def quick():
    return mr.review(quick=True)


def test_quick_review_output(quick):
    json.dumps(quick)  # plain data
    names = [c["name"] for c in quick["checks"]]
    assert names == ["law", "A_direction", "B_width_convex_order", "B_width_rdp", "C_one_hot_merge_convex_order",
                     "C_one_hot_merge_rdp_pairwise", "D_norm_convex_order", "D_norm_rdp",
                     "E_p_hot_schur_convex_order", "F_integer_moments_convexity", "F_real_orders_convexity",
                     "H_power_moment_kappa"]
    for c in quick["checks"]:
        for key in ("name", "claim", "parameters", "checked", "worst_margin", "holds", "violations", "status"):
            assert key in c, (c["name"], key)
        assert c["checked"] > 0
        assert c["holds"] == (c["status"] == "holds")
    by = {c["name"]: c for c in quick["checks"]}
    assert by["law"]["holds"], by["law"]["measures"]
    for name in ("B_width_convex_order", "B_width_rdp", "D_norm_convex_order", "D_norm_rdp",
                 "F_integer_moments_convexity", "F_real_orders_convexity", "H_power_moment_kappa"):
        assert by[name]["holds"], (name, by[name]["violations"])
    # the pairwise RDP reduction holds for the forward ordering but fails for the reverse one at q = 0.3 (the split
    # shift beats the one-hot shift), never at q = 0.02 on this grid nor for the Gaussian control
    c = by["C_one_hot_merge_rdp_pairwise"]
    assert not c["holds"] and {(p["direction"], p["w"]) for p in c["failing_parameters"]} == {("reverse", 7.5)}
    assert all(v["q"] == 0.3 for v in c["violations"]) and c["worst_relative_margin"] > 0.01
    # the one-hot and p-hot reductions fail in convex order with a plateau, never for the Gaussian control
    for name in ("C_one_hot_merge_convex_order", "E_p_hot_schur_convex_order"):
        c = by[name]
        assert not c["holds"] and c["violation_count"] > 0
        assert c["worst_relative_margin"] > 0.1
        assert {p["w"] for p in c["failing_parameters"]} == {7.5}
    rows = quick["direction_table"]["rows"]
    assert len(rows) == 2 * 2 * 3 * 3  # z x w x q x orders
    for z, w, q, a, fw, rv, ef, er in rows:
        assert fw > 0 and rv > 0 and ef < 1e-6 * fw and er < 1e-6 * rv
        if q == 1.0:
            assert fw == pytest.approx(rv, rel=1e-10)
        if w == 0.0 and q == 1.0:
            assert fw == pytest.approx(a / (2 * z * z), rel=1e-12)
