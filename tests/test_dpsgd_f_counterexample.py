"""The DPSGD counter-example of Sun, Suresh & Menon, "The importance of feature preprocessing for differentially
private linear optimization" (Sec. 4, Theorem 3, Lemmas 2 and 8, App. A): the data, loss and bounds; single
training runs (fixed seeds) at the quick reproduction's n = 10,000 showing the gap ordering the paper claims, each
checked against Lemma 2 computed here; and the report's plumbing on a tiny configuration."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from dptrain.accounting import certified_epsilon
from dptrain.reproduce import dpsgd_f_counterexample as ce
from dptrain.reproduce import run_reproduction, single_thread
from dptrain.reproduce.dpsgd_f_counterexample import (
    QUICK,
    counterexample_data,
    hinge_per_example,
    lemma8_bound,
    universal_floor,
)

N = QUICK.n  # 10,000: n < mu/eps for mu = 2e4, n > mu/eps for mu <= 1e3


@functools.cache
def run(method: str, mu: float, kappa: float, seed: int = 0) -> dict:
    """One run of the quick schedule (10 epochs at expected batch n/10, clip norm 1), certified."""
    with single_thread():
        return ce.train_once(method, N, mu, kappa, "1", 10, 0.1, seed, certify=certified_epsilon)


def _check_lemma2(r: dict) -> None:
    """Lemma 2 on D' (with any bias): L(w, D') - min L >= max{1 - w(2), 0}, for the last and the average iterate."""
    for output in ("last", "avg"):
        assert r[f"gap_{output}"] >= max(1 - r[f"w2_{output}"], 0) - 1e-6, (output, r)


def test_data_loss_and_bounds():
    x, y = counterexample_data(6, 100.0)
    assert torch.equal(x[:, 0], torch.full((6,), 100.0))
    assert x[:, 1].tolist() == [1, 1, 1, -1, -1, -1] and y.tolist() == [1, 1, 1, -1, -1, -1]
    w_star = torch.tensor([[0.0, 1.0]])
    assert float(hinge_per_example(x @ w_star.T, y).max()) == 0.0  # w* = (0, 1) has zero loss
    assert float(hinge_per_example(torch.zeros(6, 1), y).mean()) == 1.0  # w = 0: gap 1
    # Phi(-1/sqrt(8 log(1/delta))) at delta = 1e-5
    assert universal_floor() == pytest.approx(0.4585, abs=5e-5)
    assert universal_floor(1 / math.e) == pytest.approx(0.362, abs=5e-4)
    # Lemma 8 with n < mu/eps never goes below the universal floor, for any C and T.
    for clip in (0.1, 1.0, 1e3, 1e7):
        for steps in (1, 100, 10_000):
            assert lemma8_bound(1e6, 1000, clip, steps) >= universal_floor()
    # ... and reaches it at T = 1 as n approaches mu/eps (C < R): the floor is the bound's infimum
    assert lemma8_bound(1000.0, 999, 1.0, 1) == pytest.approx(universal_floor(), abs=1e-3)


def test_dpsgd_trains_when_mu_is_small():
    r = run("dpsgd", 10.0, 1.0)
    assert r["gap_last"] < 0.1 and r["gap_avg"] < 0.1
    _check_lemma2(r)
    assert r["epsilon"] <= 1 + 1e-9


@pytest.mark.parametrize("kappa", [1e-4, 1e-2, 1.0])
def test_dpsgd_fails_when_n_is_below_mu_over_eps(kappa):
    """Theorem 3: with n < mu/eps no learning rate helps: the gap stays above the floor 0.4585."""
    r = run("dpsgd", 2e4, kappa)
    assert N < 2e4 / ce.EPSILON
    assert r["gap_avg"] >= universal_floor() and r["gap_last"] >= universal_floor(), r
    _check_lemma2(r)
    assert r["epsilon"] <= 1 + 1e-9


def test_centering_helps_below_the_threshold():
    """At mu = 1e3 (n > mu/eps, but mu^2 >> n eps) DPSGD already fails on this step budget while both DPSGD-F
    variants, whose centered offset is ~ sigma_F R sqrt(2)/n, reach a near-zero gap."""
    for kappa in (1e-2, 1.0):
        r = run("dpsgd", 1e3, kappa)
        assert r["gap_avg"] > 0.9, (kappa, r)
        _check_lemma2(r)
    for method in ("dpsgd_f", "dpsgd_f_theory_median"):
        r = run(method, 1e3, 1.0)
        assert r["gap_last"] < 0.1 and r["gap_avg"] < 0.1, (method, r)
        assert r["epsilon"] <= 1 + 1e-9
        assert r["mean_error"] < 1e3 / 10  # the private mean removes most of the offset mu


def test_dpsgd_f_beats_dpsgd_at_large_mu():
    """Sec. 4, last paragraph: where n < mu/eps the private centering (Algorithm 2 with a median tau) lowers the
    gap of the average iterate well below DPSGD's, whose best over the rates is >= 1."""
    dpsgd = min(run("dpsgd", 2e4, kappa)["gap_avg"] for kappa in (1e-4, 1e-2, 1.0))
    theory = [run("dpsgd_f_theory_median", 2e4, 10.0, seed) for seed in (0, 1, 2)]
    for r in theory:
        _check_lemma2(r)
    assert dpsgd - sum(r["gap_avg"] for r in theory) / 3 > 0.25


TINY = ce.Config(
    n=1000,
    mus=(1e4,),
    kappas=(1.0,),
    clips=("1",),
    schedules=((10, 0.1),),
    tune_seeds=(100,),
    eval_seeds=(0,),
)


@pytest.mark.slow
def test_run_writes_report_json_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(ce, "QUICK", TINY)
    monkeypatch.setattr(ce, "NONPRIVATE_EXTRA_KAPPAS", ())
    report = run_reproduction("dpsgd-f-counterexample", tmp_path, quick=True)
    assert report == tmp_path / "counterexample.md"
    text = report.read_text()
    assert f"dptrain reproduce dpsgd-f-counterexample --out {tmp_path} --quick" in text
    assert "0.4585" in text and "## Observations" in text
    assert (tmp_path / "counterexample.png").stat().st_size > 1000
    data = json.loads((tmp_path / "counterexample.json").read_text())
    assert data["quick"] and data["floor"] == pytest.approx(universal_floor())
    assert {c["method"] for c in data["cells"]} == set(ce.METHODS)
    assert [c["mu"] for c in data["cells"]] == [1e4] * 5
    for c in data["cells"]:  # every private run was certified within the budget
        for output in ("last", "avg"):
            assert len(c[output]["gap"]["values"]) == 1
            if c["method"] != "nonprivate":
                assert c[output]["epsilon"] <= 1.0 + 1e-9
    assert ce.render(data).markdown() == text  # the JSON holds everything the report shows
