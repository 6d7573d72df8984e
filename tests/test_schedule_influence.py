"""Noise influence (dptrain.schedules.influence): the analytic influence of a quadratic loss against simulated noisy
gradient descent, and the retraining estimator of App. D ("On Dynamic Noise Influence in Differential Private
Learning") against the analytic value, in parallel processes and from its cache."""

import numpy as np
import pytest

from dptrain.errors import ConfigError
from dptrain.schedules.influence import estimate_influence, quadratic_influence

LAM = np.array([0.2, 0.5, 1.0, 1.5])
ETA, G, N, T = 0.5, 1.0, 10, 8


def _gd(sigmas, noise, start=1.0):
    """Noisy GD on f = 1/2 theta^T diag(LAM) theta from theta = ``start``, noise G sigma_t nu_t / N: final losses, one
    per row of ``noise`` (runs x T x d)."""
    theta = np.full((noise.shape[0], LAM.size), start)
    for t, s in enumerate(sigmas):
        theta = theta - ETA * (LAM * theta + G * s * noise[:, t] / N)
    return 0.5 * np.sum(LAM * theta**2, axis=1)


def final_loss(sigmas, seed):
    """One training run from the optimum (a top-level function: worker processes run it)."""
    return float(_gd(sigmas, np.random.default_rng(seed).standard_normal((1, T, LAM.size)), start=0.0)[0])


def test_the_analytic_influence_is_the_growth_of_the_expected_final_loss():
    q = quadratic_influence(LAM, T, ETA, G, N)
    assert np.all(np.diff(q) > 0)  # late noise matters more (|1 - eta lambda| < 1 here)
    rng = np.random.default_rng(0)
    sigmas = rng.uniform(1, 5, T)
    noise = rng.standard_normal((400_000, T, LAM.size))
    excess = _gd(sigmas, noise).mean() - _gd(sigmas, np.zeros((1, T, LAM.size)))[0]
    assert excess == pytest.approx(float(np.sum(q * sigmas**2)), rel=0.01)
    # one step's noise alone, from the optimum (no cross term with the noise-free path): E loss = q_t sigma^2
    for t in (0, T - 1):
        one = np.zeros(T)
        one[t] = 3.0
        assert _gd(one, noise[:100_000], start=0.0).mean() == pytest.approx(9.0 * q[t], rel=0.02)


def test_retraining_recovers_the_influence_in_parallel_and_from_its_cache(tmp_path):
    q = quadratic_influence(LAM, T, ETA, G, N)
    base = np.full(T, 1.0)
    kwargs = dict(steps=[1, 5, 8], grid=[2.0, 4.0, 6.0, 8.0], repeats=1000, cache=tmp_path, setting="quadratic-test")
    est = estimate_influence(final_loss, base, workers=2, **kwargs)
    for t in (1, 5, 8):
        assert est.q[t - 1] == pytest.approx(q[t - 1], rel=0.1)
        fit = est.fits[t]
        assert len(fit.c2_per_repeat) == 1000 and np.mean(fit.c2_per_repeat) == pytest.approx(fit.c2)
    assert np.isnan(est.q[1])  # not estimated
    # the cache answers without running anything (this final_loss would fail)
    again = estimate_influence(lambda s, seed: 1 / 0, base, workers=1, **kwargs)
    assert np.array_equal(again.q[[0, 4, 7]], est.q[[0, 4, 7]])
    # another setting is another cache entry
    with pytest.raises(ZeroDivisionError):
        estimate_influence(lambda s, seed: 1 / 0, base, workers=1, **{**kwargs, "setting": "other"})


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(base_sigmas=[1.0, -1.0]), "base_sigmas"),
        (dict(base_sigmas=[1.0, 1.0], grid=[3.0]), "grid"),
        (dict(base_sigmas=[1.0, 1.0], steps=[3]), "steps must be in 1..2"),
        (dict(base_sigmas=[1.0, 1.0], repeats=0), "repeats"),
    ],
)
def test_bad_influence_requests_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        estimate_influence(final_loss, **args)
    with pytest.raises(ConfigError, match="eigenvalues"):
        quadratic_influence([-1.0], 3, 0.1, 1.0, 10)
