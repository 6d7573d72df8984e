"""A run states the bound on any membership-inference attacker (summary.json, the printed report), from its own
ledger: for full-batch Gaussian steps the run is mu-GDP with mu = sqrt(T) / sigma exactly (Dong, Roth & Su, "Gaussian
Differential Privacy", Cor. 3.3), so the highest TPR at FPR a is Phi(Phi^-1(a) + mu), computed here directly."""

from __future__ import annotations

import math

import pytest
from scipy.stats import norm

from dptrain.config import load_config
from dptrain.runs.report import format_report
from dptrain.runs.run import run_training

CONFIG = """
[data]
name = "synthetic"
options = {{ n = 400, dim = 5, num_classes = 2, separation = 3.0 }}

[model]
name = "logistic"

[privacy]
noise_multiplier = {sigma}
delta = 1e-5
sampling = "{sampling}"

[training]
steps = {steps}
batch_size = 50
learning_rate = 0.5
"""


def _run(tmp_path, sigma: float, steps: int, sampling: str) -> dict:
    path = tmp_path / "c.toml"
    path.write_text(CONFIG.format(sigma=sigma, steps=steps, sampling=sampling))
    return run_training(load_config(path), tmp_path / "out", progress=False)


def test_a_full_batch_run_states_the_exact_gaussian_bound(tmp_path):
    summary = _run(tmp_path, sigma=4.0, steps=9, sampling="full")
    bound = summary["membership_inference"]
    mu = math.sqrt(9) / 4.0
    assert bound["mu_gdp"] == pytest.approx(mu, rel=1e-9)
    assert bound["tpr_at_fpr_1pct"] == pytest.approx(norm.cdf(norm.ppf(0.01) + mu), rel=1e-6)
    assert bound["tpr_at_fpr_10pct"] == pytest.approx(norm.cdf(norm.ppf(0.10) + mu), rel=1e-6)
    line = next(row for row in format_report(summary).splitlines() if row.startswith("attacker"))
    assert f"{100 * norm.cdf(norm.ppf(0.01) + mu):.3g}% at FPR 1%" in line


def test_a_poisson_run_is_bounded_by_its_profile_below_what_epsilon_alone_says(tmp_path):
    summary = _run(tmp_path, sigma=1.0, steps=20, sampling="poisson")
    bound, eps = summary["membership_inference"], summary["epsilon"]
    assert bound["mu_gdp"] is None and bound["accountant"] == "pld"
    # the profile bounds the attacker more tightly than the one (epsilon, delta) pair the run certifies
    naive = min(math.exp(eps) * 0.01 + 1e-5, 1 - math.exp(-eps) * (1 - 1e-5 - 0.01))
    assert 0.01 < bound["tpr_at_fpr_1pct"] < naive


def test_a_failure_while_the_summary_is_made_keeps_the_trained_model(tmp_path, monkeypatch):
    """The model is written before the summary: an error computing the summary's figures (here the attacker bound)
    ends the run with that error, and the trained model is on disk, not lost with it."""
    import dptrain.runs.run as run_module

    def broken(ledger, delta):
        raise RuntimeError("summary figure failed")

    monkeypatch.setattr(run_module, "attacker_bound", broken)
    with pytest.raises(RuntimeError, match="summary figure failed"):
        _run(tmp_path, sigma=4.0, steps=3, sampling="full")
    assert (tmp_path / "out" / "model.pt").is_file()
