"""BandMF's coefficients and noise (dptrain.accounting.bandmf_strategy, bandmf_noise): the objective against dense
linear algebra, its gradient against finite differences, the optimum against DP-SGD and worse coefficients, and the
streamed noise recurrence against a dense solve."""

import numpy as np
import pytest
from scipy import linalg

from dptrain.accounting.bandmf_noise import dense_noise, noise_recurrence, strategy_matrix, streamed_noise
from dptrain.accounting.bandmf_strategy import (
    PREFIX_SUMS,
    error_and_gradient,
    inverse_column,
    momentum_workload,
    optimal_coefficients,
    square_root_coefficients,
    toeplitz_workload,
    workload_error,
)
from dptrain.errors import AccountingError

WORKLOADS = [PREFIX_SUMS, momentum_workload(0.9), toeplitz_workload([1.0, 0.5, -0.25, 0.125])]


def _dense_error(c, steps, workload):
    """sens^2 ||A C^{-1}||_F^2 with dense matrices (the definition, independent of the O(T b) code)."""
    A = linalg.toeplitz(workload.first_column(steps), np.zeros(steps))
    C = strategy_matrix(c, steps)
    return float(np.dot(c, c) * np.linalg.norm(A @ np.linalg.inv(C), "fro") ** 2)


def test_workload_columns_are_the_papers():
    # prefix sums: SGD's iterates; momentum: theta_t = theta_{t-1} - m_t, m_t = beta m_{t-1} + g_t
    assert np.array_equal(PREFIX_SUMS.first_column(4), np.ones(4))
    beta = 0.9
    g = np.eye(6)[0]
    m, theta = 0.0, []
    for t in range(6):
        m = beta * m + g[t]
        theta.append((theta[-1] if theta else 0.0) + m)
    assert momentum_workload(beta).first_column(6) == pytest.approx(theta, rel=1e-14)
    assert momentum_workload(beta).first_column(6) == pytest.approx((1 - beta ** np.arange(1, 7)) / (1 - beta))


@pytest.mark.parametrize("workload", WORKLOADS, ids=lambda w: w.kind)
def test_objective_and_gradient_against_dense_and_finite_differences(workload):
    rng = np.random.default_rng(1)
    steps, c = 40, square_root_coefficients(5, PREFIX_SUMS) + 0.05 * rng.random(5)
    value, grad = error_and_gradient(c, steps, workload)
    assert value == pytest.approx(_dense_error(c, steps, workload), rel=1e-10)
    assert workload_error(c, steps, workload) == pytest.approx(value, rel=1e-12)
    h = 1e-6
    fd = [(workload_error(c + h * e, steps, workload) - workload_error(c - h * e, steps, workload)) / (2 * h)
          for e in np.eye(5)]
    assert grad == pytest.approx(fd, rel=1e-6, abs=1e-6 * np.abs(grad).max())
    assert np.dot(grad, c) == pytest.approx(0.0, abs=1e-8 * value)  # scale invariance: E(s c) = E(c)


def test_gradient_with_a_decayed_inverse_matches_finite_differences():
    # long horizon: the optimizer's C^{-1} stops once it has decayed below 1e-18 of its peak
    steps, c = 20000, optimal_coefficients(1000, 8)
    value, grad = error_and_gradient(c, steps)
    assert value == pytest.approx(workload_error(c, steps), rel=1e-10)
    h = 1e-7
    fd = [(workload_error(c + h * e, steps) - workload_error(c - h * e, steps)) / (2 * h) for e in np.eye(8)]
    assert grad == pytest.approx(fd, rel=1e-5, abs=1e-5 * np.abs(grad).max())


@pytest.mark.parametrize("workload", WORKLOADS[:2], ids=lambda w: w.kind)
def test_optimum_beats_dpsgd_the_square_root_and_a_worse_c(workload):
    steps, bands = 1000, 8
    c = optimal_coefficients(steps, bands, workload)
    assert len(c) == bands and c[0] > 0 and np.linalg.norm(c) == pytest.approx(1.0, abs=1e-14)
    best = workload_error(c, steps, workload)
    dpsgd = workload_error(np.eye(bands)[0], steps, workload)
    assert dpsgd == pytest.approx(workload.frobenius_squared(steps), rel=1e-12)
    assert best < 0.2 * dpsgd
    assert best < workload_error(square_root_coefficients(bands, workload), steps, workload)
    flat = np.ones(bands) / np.sqrt(bands)
    assert best < workload_error(flat, steps, workload)
    # a stationary point: the gradient vanishes (relative to the objective; the momentum problem is ill-conditioned,
    # E is within 1e-12 of its minimum there) and random perturbations only increase it
    _, grad = error_and_gradient(c, steps, workload)
    assert np.abs(grad).max() < 1e-5 * best
    rng = np.random.default_rng(0)
    for _ in range(5):
        assert workload_error(c + 1e-3 * rng.standard_normal(bands), steps, workload) > best


def test_prefix_sum_optimum_reference_values():
    # total error over DP-SGD's at T = 1000 (the same optimum from four different starting points when written)
    assert workload_error(optimal_coefficients(1000, 8), 1000) / PREFIX_SUMS.frobenius_squared(1000) == pytest.approx(
        0.1393605, rel=1e-6
    )
    assert workload_error(optimal_coefficients(1000, 32), 1000) / PREFIX_SUMS.frobenius_squared(1000) == pytest.approx(
        0.0481822, rel=1e-6
    )


def test_one_band_is_dpsgd():
    assert np.array_equal(optimal_coefficients(100, 1), [1.0])
    assert workload_error([1.0], 100) == PREFIX_SUMS.frobenius_squared(100) == sum(100 - k for k in range(100))


def test_streamed_noise_equals_the_dense_solve():
    rng = np.random.default_rng(3)
    c = optimal_coefficients(64, 5)
    z = rng.standard_normal((23, 3))
    w = streamed_noise(c, z)
    assert w == pytest.approx(dense_noise(c, z), rel=1e-12, abs=1e-12)
    assert strategy_matrix(c, 23) @ w == pytest.approx(z, abs=1e-12)
    assert streamed_noise([1.0], z) == pytest.approx(z)  # DP-SGD: independent noise
    # the recurrence an engine implements: w_t = scale z_t - sum_j feedback_j w_{t-j}
    rec = noise_recurrence(c)
    assert rec.scale == pytest.approx(1 / c[0]) and rec.feedback == pytest.approx(c[1:] / c[0])
    assert inverse_column(c, 23) == pytest.approx(dense_noise(c, np.eye(23)[:, 0]), abs=1e-12)


def test_refusals_are_one_line():
    for bad, match in [
        (lambda: optimal_coefficients(10, 11), "bands must be at most the steps"),
        (lambda: optimal_coefficients(0, 1), "steps must be an integer >= 1"),
        (lambda: workload_error([0.0, 1.0], 10), "c_0 > 0"),
        (lambda: noise_recurrence([1.0, np.nan]), "finite numbers"),
        (lambda: momentum_workload(1.0), r"momentum of a workload must be a number in \[0, 1\)"),
        (lambda: optimal_coefficients(10, 2, "prefix"), "workload must be a Workload"),
    ]:
        with pytest.raises(AccountingError, match=match) as info:
            bad()
        assert "\n" not in str(info.value)


def test_the_coefficients_do_not_depend_on_the_number_of_blas_threads():
    """The coefficients are a public number of the run, in its ledger and its checkpoint: a run resumed on a machine
    with another number of cores, or under torchrun (one thread per rank), computes them again and must find the
    same bits, or its checkpoint is refused ("coefficients differ"). OpenBLAS splits a long dot product over its
    threads (T = 16384: other last bits with 1 and 2 threads, before)."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from dptrain.accounting import bandmf_strategy

    found = []
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(threads):
            bandmf_strategy._optimal.cache_clear()
            found.append(optimal_coefficients(16384, 4).tobytes())
    assert found[0] == found[1]


def test_more_steps_than_the_objective_holds_in_memory_is_a_one_line_refusal():
    """The objective holds vectors of T doubles: 10^9 steps (``dptrain account --bands 4 --steps 1000000000``, which
    DP-SGD accounts) needed ~50 GB and ended in a MemoryError or the OOM killer; 10^12 fails at once. Refused in one
    line beyond MAX_STEPS; one band (DP-SGD, c = [1]) needs no optimization at any length."""
    from dptrain.accounting import choose_bands, rmse_ratio

    for call in (lambda: optimal_coefficients(10**12, 4), lambda: workload_error([0.8, 0.6], 10**12),
                 lambda: choose_bands(10**12, 1e-6, 3.0, 1e-5), lambda: rmse_ratio(10**12, 1e-6, 3.0, 1e-5, 1)):
        with pytest.raises(AccountingError, match=r"at most 1e\+07 steps") as e:
            call()
        assert "\n" not in str(e.value)
    assert list(optimal_coefficients(10**12, 1)) == [1.0]
