"""DPSGD-F (Sun, Suresh & Menon, "The importance of feature preprocessing for differentially private linear
optimization"): analytic Gaussian calibration, the preprocessing pipelines, their privacy composition,
the bias mapping, the private quantile and the bad inputs."""

from __future__ import annotations

import json
import math
from unittest.mock import patch

import numpy as np
import pytest
import torch
from scipy import stats

from dptrain.accounting import epsilon, gaussian_mechanism_epsilon, gaussian_mechanism_noise
from dptrain.accounting.calibration import gaussian_mechanism_delta
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.data.loaders import make_gaussian_mixture
from dptrain.dpsgd_f import (
    FeaturePreprocessing,
    exponential_quantile,
    make_private_dpsgd_f,
    normalize_features,
    pipeline_noise,
    quantile_rank_error,
)
from dptrain.errors import AccountingError, ConfigError, ModelError
from dptrain.models.builders import build_model
from dptrain.randomness.generators import TorchStream
from dptrain.runs.run import run_training

DELTA = 1e-5


# --- analytic Gaussian (Balle & Wang 2018, Thm 8) ----------------------------------------------------------


@pytest.mark.parametrize(
    "eps, expected",
    [(0.02, 131.8), (0.05, 57.77), (0.1, 30.75), (0.15, 21.22), (0.2, 16.30), (1.0, 3.731)],
)
def test_analytic_gaussian_reference_multipliers(eps, expected):
    sigma = gaussian_mechanism_noise(eps, DELTA)
    assert float(f"{sigma:.4g}") == pytest.approx(expected, rel=1e-3)  # 3 significant digits at least
    assert gaussian_mechanism_delta(sigma, eps) <= DELTA
    assert gaussian_mechanism_delta(sigma * (1 - 1e-6), eps) > DELTA  # the smallest such sigma
    assert sigma < math.sqrt(2 * math.log(1.25 / DELTA)) / eps  # tighter than the classical bound


@pytest.mark.parametrize("sigma, eps", [(0.7, 0.5), (3.0, 1.0), (30.0, 0.05), (1.5, 3.0)])
def test_gaussian_delta_is_balle_wang_formula(sigma, eps):
    formula = stats.norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * stats.norm.cdf(
        -1 / (2 * sigma) - eps * sigma
    )
    assert gaussian_mechanism_delta(sigma, eps) == pytest.approx(formula, rel=1e-6, abs=1e-15)
    e = gaussian_mechanism_epsilon(sigma, formula)
    assert e == pytest.approx(eps, rel=1e-6)


def test_cli_calibrate_gaussian(capsys):
    assert (
        main(["calibrate", "--mechanism", "gaussian", "--epsilon", "0.1", "--delta", "1e-5", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["noise_multiplier"] == pytest.approx(30.75, rel=1e-3)
    assert out["epsilon"] <= 0.1
    assert main(["calibrate", "--mechanism", "gaussian", "--epsilon", "0", "--delta", "1e-5"]) == 2
    assert (
        main(["calibrate", "--mechanism", "gaussian", "--epsilon", "1", "--delta", "1e-5", "--steps", "3"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("dptrain: error:") for line in err)


# --- pipelines on synthetic data ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    # An offset mixture: all points far from the origin, the case where centering matters.
    split = make_gaussian_mixture(n=3000, dim=20, num_classes=3, separation=2.0, seed=0)
    offset = torch.full((20,), 6.0)
    split.train.x = split.train.x + offset
    split.test.x = split.test.x + offset
    return split


def _run(data, kind, eps=1.0, accountant="rdp", **kw):
    torch.manual_seed(0)
    model = build_model("logistic", data.train.input_shape, data.train.num_classes)
    return make_private_dpsgd_f(
        model,
        torch.optim.SGD(model.parameters(), lr=2.0),
        data.train,
        target_epsilon=eps,
        target_delta=DELTA,
        feature_norm=1.0,
        kind=kind,
        epochs=5,
        batch_size=300,
        accountant=accountant,
        **kw,
    )


def test_private_mean_pipeline_composes_to_the_target(data):
    run = _run(data, "private_mean", eps_f=0.1, accountant="pld")
    t = run.trainer
    planned = t.ledger_after(t.steps_for(epochs=5))
    first = planned.entries[0]
    assert first.facts["mechanism"] == "private_mean"
    assert first.event.noise_multiplier == pytest.approx(gaussian_mechanism_noise(0.1, DELTA))
    assert t.steps == 0  # the mean is a release, not a step
    total = epsilon(planned, DELTA, "pld").epsilon
    assert 1.0 - 2e-3 <= total <= 1.0
    # composition by PLD is tighter than adding eps_F to the DP-SGD phase's own epsilon
    from dptrain.accounting import Ledger

    steps_only = Ledger(planned.entries[1:])
    assert total < 0.1 + epsilon(steps_only, DELTA, "pld").epsilon
    # the calibration without data gives the same sigma
    assert pipeline_noise(
        "private_mean", 1.0, DELTA, t.sampling_rate, planned.releases - 1, 0.1
    ) == pytest.approx(t.noise_multiplier, rel=1e-9)
    t.train(epochs=5)
    assert t.steps == t.steps_for(epochs=5)
    assert epsilon(t.ledger, DELTA, "pld").epsilon <= 1.0


def test_private_mean_bias_mapping_is_exact(data):
    run = _run(data, "private_mean", eps_f=0.1)
    run.trainer.train(epochs=1)
    x = data.test.x
    with torch.no_grad():
        trained = run.trainer.model(run.preprocessing.transform(x))
        raw = run.raw_model()(x)
    assert torch.allclose(trained, raw, atol=1e-5)
    assert run.evaluate(x, data.test.y) == pytest.approx(
        float((trained.argmax(1) == data.test.y).float().mean())
    )
    # the released mean is close to the true normalized mean (noise std sigma_F / n per coordinate)
    true = normalize_features(data.train.x, 1.0).mean(0)
    err = float((run.preprocessing.mean - true).norm())
    assert err < 5 * run.preprocessing.noise_multiplier * math.sqrt(20) / len(data.train)


def test_theory_pipeline_thirds_and_composition(data):
    run = _run(data, "dpsgd_f_theory", eps=3.0, quantile_tail=30)
    t, prep = run.trainer, run.preprocessing
    planned = t.ledger_after(t.steps_for(epochs=5))
    report = epsilon(planned, DELTA, "composition")
    phases = report.details["phases"]
    assert phases["private_mean"][0] == pytest.approx(1.0, rel=1e-9)  # exact analytic epsilon at delta/3
    assert phases["private_mean"][1] == pytest.approx(DELTA / 3)
    assert phases["private_quantile"] == (1.0, 0.0)
    assert phases["training"][1] == pytest.approx(2 * DELTA / 3)  # the rest of delta
    assert 3.0 - 2e-3 <= report.epsilon <= 3.0
    # dp_accounting's accountants cannot certify the pure-DP quantile: they refuse instead of guessing
    for name in ("rdp", "pld"):
        with pytest.raises(AccountingError):
            epsilon(planned, DELTA, name)
    # features: translated, tau appended, clipped to sqrt(2) tau; clip norm sqrt(2) G tau clips nothing
    z = prep.transform(data.train.x)
    # recomputed here: x' = (x / ||x|| C_F - mu_hat, tau) (Lemma 5), then clipped to norm sqrt(2) tau (Lemma 7)
    x = data.train.x.reshape(len(data.train.x), -1)
    appended = torch.cat([x / x.norm(dim=1, keepdim=True) - prep.mean, torch.full((len(x), 1), prep.tau)], 1)
    bound = math.sqrt(2) * prep.tau
    expected = appended * torch.clamp(bound / appended.norm(dim=1, keepdim=True), max=1.0)
    assert z.shape[1] == 21 and torch.allclose(z, expected, atol=1e-6)
    assert float(z.norm(dim=1).max()) <= bound * (1 + 1e-5)
    assert (appended.norm(dim=1) > bound).any()  # the clipping was exercised
    assert t.clipping.max_grad_norm == pytest.approx(2 * prep.tau)
    t.train(epochs=1)
    assert t.model.bias is None and t.model.in_features == 21
    with torch.no_grad():
        trained = t.model(prep.transform(data.test.x))
        raw = run.raw_model()(data.test.x)
    assert torch.equal(trained.argmax(1), raw.argmax(1))  # clipping rescales scores by a positive factor
    unclipped = (normalize_features(data.test.x, 1.0) - prep.mean).norm(
        dim=1
    ) ** 2 + prep.tau**2 <= 2 * prep.tau**2
    assert unclipped.any()
    assert torch.allclose(trained[unclipped], raw[unclipped], atol=1e-5)


def test_normalize_only_releases_nothing(data):
    run = _run(data, "none")
    assert run.trainer.ledger.releases == 0
    assert torch.allclose(run.preprocessing.transform(data.train.x).norm(dim=1), torch.ones(len(data.train)))


def test_lemma5_identity():
    """L((w, b), D) == L((w, (b + w.mu)/tau), D') with x' = (x - mu, tau) (Lemma 5), any margin loss."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 4, generator=g), torch.randint(0, 2, (50,), generator=g).float() * 2 - 1
    w, b, mu, tau = torch.randn(4, generator=g), 0.7, torch.randn(4, generator=g), 1.3
    xp = torch.cat([x - mu, torch.full((50, 1), tau)], 1)
    theta = torch.cat([w, ((b + w @ mu) / tau).reshape(1)])
    for phi in (lambda z: torch.clamp(1 - z, min=0), lambda z: torch.log1p(torch.exp(-z))):
        assert torch.allclose(phi(y * (x @ w + b)).mean(), phi(y * (xp @ theta)).mean(), atol=1e-6)


# --- the private quantile --------------------------------------------------------------------------------


def test_quantile_rank_error_statistical():
    """The exponential mechanism misses the target rank by more than 2 ln(N/zeta)/eps with probability <= zeta."""
    values = np.random.default_rng(0).uniform(0, 1, size=400)
    rng = TorchStream(0)
    eps, zeta, step = 0.5, 0.1, 1e-4
    grid_points = int(1 / step) + 1
    bound = quantile_rank_error(eps, grid_points, zeta)
    rank, trials = 300, 400
    errors = []
    for _ in range(trials):
        t = exponential_quantile(values, rank, eps, 1.0, step, rng)
        errors.append(abs(int((values <= t).sum()) - rank))
    errors = np.array(errors)
    misses = int((errors > bound).sum())
    # P[misses >= observed] under Binomial(trials, zeta) must not be tiny
    assert stats.binom.sf(misses - 1, trials, zeta) > 1e-3
    assert np.median(errors) < bound / 2  # and it concentrates well inside the bound
    # a larger epsilon is more accurate
    sharp = [
        abs(int((values <= exponential_quantile(values, rank, 20.0, 1.0, step, rng)).sum()) - rank)
        for _ in range(100)
    ]
    assert np.mean(sharp) < np.mean(errors)


def test_quantile_exact_distribution_small_case():
    """Two values on a 5-point grid: the output distribution is the exponential mechanism's."""
    values, eps, rng = np.array([0.1, 0.3]), 1.0, TorchStream(3)
    grid = np.arange(5) * 0.1  # 0, .1, .2, .3, .4
    util = -np.abs(np.array([(values <= t + 1e-12).sum() for t in grid]) - 1)
    expected = np.exp(eps * util / 2) / np.exp(eps * util / 2).sum()
    draws = np.array([exponential_quantile(values, 1, eps, 0.4, 0.1, rng) for _ in range(20000)])
    freq = np.array([np.mean(np.isclose(draws, t)) for t in grid])
    assert np.allclose(freq, expected, atol=0.015)


# --- bad input ----------------------------------------------------------------------------------------------


def test_bad_inputs_one_line_errors(data, tmp_path, capsys):
    model = build_model("cnn28", (1, 28, 28), 10)
    x = torch.rand(10, 1, 28, 28)
    with pytest.raises(ModelError, match="linear model"):
        make_private_dpsgd_f(
            model,
            torch.optim.SGD(model.parameters(), lr=1),
            (x, torch.zeros(10, dtype=torch.long)),
            target_epsilon=1.0,
            target_delta=DELTA,
            feature_norm=1.0,
            eps_f=0.1,
            epochs=1,
            batch_size=5,
        )
    with pytest.raises(ConfigError, match="eps_f"):
        _run(data, "private_mean", eps_f=1.0)
    with pytest.raises(ConfigError, match="augment views images"):  # before the private mean is computed
        with patch("dptrain.dpsgd_f.algorithm.prepare", side_effect=AssertionError("a statistic was computed")):
            _run(data, "private_mean", eps_f=0.1, augment={"multiplicity": 2})
    with pytest.raises(ConfigError, match="feature_norm"):
        make_private_dpsgd_f(
            build_model("logistic", (20,), 3),
            None,
            data.train,
            target_epsilon=1.0,
            target_delta=DELTA,
            feature_norm=0.0,
            eps_f=0.1,
            epochs=1,
            batch_size=5,
        )
    base = [
        "--set",
        'data.name="synthetic"',
        "--set",
        'model.name="logistic"',
        "--set",
        "privacy.target_epsilon=1.0",
    ]
    cases = {
        "preprocessing.eps_f": [
            "--set",
            'preprocessing.kind="private_mean"',
            "--set",
            "preprocessing.feature_norm=1.0",
            "--set",
            "preprocessing.eps_f=1.5",
            "--set",
            'privacy.accountant="pld"',
        ],
        "preprocessing.feature_norm": [
            "--set",
            'preprocessing.kind="private_mean"',
            "--set",
            "preprocessing.feature_norm=-1.0",
            "--set",
            "preprocessing.eps_f=0.1",
        ],
        "linear model": [
            "--set",
            'preprocessing.kind="private_mean"',
            "--set",
            "preprocessing.feature_norm=1.0",
            "--set",
            "preprocessing.eps_f=0.1",
            "--set",
            'model.name="mlp"',
            "--set",
            'privacy.accountant="pld"',
        ],
        "composition": [
            "--set",
            'preprocessing.kind="dpsgd_f_theory"',
            "--set",
            "preprocessing.feature_norm=1.0",
            "--set",
            'privacy.accountant="rdp"',
        ],
        "quantile_tail is for kind dpsgd_f_theory": [  # (private_mean used to ignore it)
            "--set",
            'preprocessing.kind="private_mean"',
            "--set",
            "preprocessing.feature_norm=1.0",
            "--set",
            "preprocessing.eps_f=0.1",
            "--set",
            "preprocessing.quantile_tail=5",
        ],
        "preprocessing.kind": ["--set", 'preprocessing.kind="center"'],
        "preprocessing.colour": ["--set", "preprocessing.colour=1"],
    }
    for needle, extra in cases.items():
        out = tmp_path / needle.replace(" ", "_")
        assert main(["train", *base, *extra, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists()  # refused before anything was written


# --- dptrain train with [preprocessing] ---------------------------------------------------------------------


def _cfg(*extra):
    return load_config(
        None,
        [
            'data.name="synthetic"',
            "data.options={n = 2000, dim = 10, num_classes = 3, separation = 3.0}",
            "data.test_is_public=true",  # generated data: its test split is public
            'model.name="logistic"',
            "privacy.target_epsilon=2.0",
            "training.epochs=3",
            "training.batch_size=200",
            "training.learning_rate=2.0",
            *extra,
        ],
    )


def test_train_private_mean_run_and_resume(tmp_path):
    cfg = _cfg(
        "seed=3",  # reproducible, so that the cut-and-resumed run can be compared with the whole one
        'preprocessing.kind="private_mean"',
        "preprocessing.feature_norm=1.0",
        "preprocessing.eps_f=0.1",
        'privacy.accountant="rdp"',
    )
    whole = run_training(cfg, tmp_path / "whole", progress=False)
    assert whole["epsilon"] <= 2.0 and whole["accountants"]["rdp"]["certified"]
    assert not whole["certified"] and whole["private"] is False  # seeded: not private, whatever its epsilon
    assert whole["test_accuracy_raw_model"] == pytest.approx(whole["test_accuracy"])
    assert whole["preprocessing"]["kind"] == "private_mean"
    saved = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    assert saved["state_dict"]["linear.weight"].shape == (3, 10)
    # cut and resumed: same result, the mean released once
    part = run_training(cfg, tmp_path / "cut", progress=False, stop_after=7)
    assert part["steps"] == 7
    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    assert resumed["steps"] == whole["steps"]
    assert resumed["test_accuracy"] == pytest.approx(whole["test_accuracy"])
    ledger = json.loads((tmp_path / "cut" / "ledger.json").read_text())
    means = [e for e in ledger["entries"] if e["facts"].get("mechanism") == "private_mean"]
    assert len(means) == 1 and means[0]["count"] == 1
    pre = json.loads((tmp_path / "cut" / "preprocessing.json").read_text())
    assert pre["mean"] == json.loads((tmp_path / "whole" / "preprocessing.json").read_text())["mean"]


def test_train_theory_run(tmp_path):
    cfg = _cfg(
        'preprocessing.kind="dpsgd_f_theory"',
        "preprocessing.feature_norm=1.0",
        "preprocessing.quantile_tail=20",
        'privacy.accountant="composition"',
    )
    s = run_training(cfg, tmp_path / "theory", progress=False)
    assert s["accountant"] == "composition" and 2.0 - 5e-3 <= s["epsilon"] <= 2.0
    assert s["preprocessing"]["tau"] > 0
    assert s["test_accuracy_raw_model"] == pytest.approx(s["test_accuracy"])


# --- speed path: closed-form per-example gradients ----------------------------------------------------------


def test_logistic_uses_closed_form_gradients():
    """Per-example gradients of softmax regression are the outer products (p - e_y) x^T (and p - e_y for the
    bias), computed from one batched backward pass (no vmap over autograd)."""
    from dptrain.stages.per_example import cross_entropy_per_example, make_grad_sampler

    torch.manual_seed(0)
    model = build_model("logistic", (7,), 4)
    sampler = make_grad_sampler(model, cross_entropy_per_example, "auto")
    assert sampler.name == "layerwise"
    x, y = torch.randn(16, 7), torch.randint(0, 4, (16,))
    grads, _ = sampler(x, y)
    g = grads.materialize()
    r = torch.softmax(model(x), 1) - torch.nn.functional.one_hot(y, 4).float()
    weight = next(k for k in g if k.endswith("weight"))
    bias = next(k for k in g if k.endswith("bias"))
    assert torch.allclose(g[weight], torch.einsum("nk,nd->nkd", r, x), atol=1e-6)
    assert torch.allclose(g[bias], r, atol=1e-6)
    assert FeaturePreprocessing("none", 1.0).transform(x).shape == (16, 7)


def test_quantile_tie_break_on_atoms():
    """Distances with two values only (App. A's data): without jitter no threshold has a count near the target rank
    and the output spreads over [max, upper]; with the per-example jitter it sits just above the largest value."""
    rng = TorchStream(5)
    values = np.repeat([0.5, 1.0], 500)
    rank, eps, upper, step = 1000 - 60, 1.0, 4.0, 4.0 / 1000**2
    plain = [exponential_quantile(values, rank, eps, upper, step, rng) for _ in range(50)]
    broken = [
        exponential_quantile(values, rank, eps, upper, step, rng, tie_break=upper / 1000) for _ in range(50)
    ]
    assert np.median(plain) > 2.0  # anywhere on the plateau [1, 4]
    assert max(broken) < 1.0 + upper / 1000 + 1e-9 and min(broken) >= 0.5
