"""The DPSGD counter-example of seed 004 (Sec. 4 / App. A) in quick mode: the gap ordering the paper claims and
the report files. The numbers come from training runs (fixed seeds), not from constants."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dptrain.reproduce import REPRODUCTIONS
from dptrain.reproduce.dpsgd_f_counterexample import (
    QUICK,
    counterexample_data,
    hinge_per_example,
    lemma8_bound,
    run,
    universal_floor,
)

PREPROCESSED = ("dpsgd_f", "dpsgd_f_theory_median")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("counterexample")
    report = run(out, quick=True)
    return out, report, json.loads((out / "counterexample.json").read_text())


def _gap(data: dict, mu: float, method: str, output: str) -> float:
    cell = next(c for c in data["cells"] if c["mu"] == mu and c["method"] == method)
    return cell[output]["gap"]["mean"]


def test_registered():
    assert REPRODUCTIONS["dpsgd-f-counterexample"] == "dptrain.reproduce.dpsgd_f_counterexample"


def test_data_loss_and_bounds():
    x, y = counterexample_data(6, 100.0)
    assert torch.equal(x[:, 0], torch.full((6,), 100.0))
    assert x[:, 1].tolist() == [1, 1, 1, -1, -1, -1] and y.tolist() == [1, 1, 1, -1, -1, -1]
    w_star = torch.tensor([[0.0, 1.0]])
    assert float(hinge_per_example(x @ w_star.T, y).max()) == 0.0  # w* = (0, 1) has zero loss
    assert float(hinge_per_example(torch.zeros(6, 1), y).mean()) == 1.0  # w = 0: gap 1
    assert universal_floor() == pytest.approx(0.4585, abs=5e-5)
    # Lemma 8 with n < mu/eps never goes below the universal floor, for any C and T.
    for clip in (0.1, 1.0, 1e3, 1e7):
        for steps in (1, 100, 10_000):
            assert lemma8_bound(1e6, 1000, clip, steps) >= universal_floor()


def test_files_written(result):
    out, report, data = result
    assert report == out / "counterexample.md"
    text = report.read_text()
    assert f"dptrain reproduce dpsgd-f-counterexample --out {out} --quick" in text
    assert "0.4585" in text and "## Observations" in text
    assert (out / "counterexample.png").stat().st_size > 1000
    assert data["quick"] and data["floor"] == pytest.approx(universal_floor())
    assert {c["method"] for c in data["cells"]} >= {"dpsgd", *PREPROCESSED}
    for c in data["cells"]:  # every private run was certified within the budget
        for output in ("last", "avg"):
            e = c[output]
            assert len(e["gap"]["values"]) == len(QUICK.eval_seeds)
            if c["method"] != "nonprivate":
                assert e["epsilon"] <= 1.0 + 1e-9


def test_dpsgd_fails_at_large_mu(result):
    """Theorem 3: once n < mu/eps DPSGD's gap is Omega(1) (it trains fine at small mu)."""
    data = result[2]
    n, small, large = QUICK.n, min(QUICK.mus), max(QUICK.mus)
    assert n < large / 1.0 and n > small / 1.0
    for output in ("last", "avg"):
        assert _gap(data, small, "dpsgd", output) < 0.1
        assert _gap(data, large, "dpsgd", output) >= universal_floor()
        assert _gap(data, large, "dpsgd", output) - _gap(data, small, "dpsgd", output) > 0.5


def test_dpsgd_f_beats_dpsgd_at_large_mu(result):
    """Sec. 4, last paragraph: with private centering the large-mu gap drops well below DPSGD's, clearly for the
    average iterate (Algorithm 1's output). The last iterate varies much more from seed to seed at this mu (the full
    run's 5 seeds at mu = 3e4 give Alg. 2 gaps from 0 to 1.8): with 3 seeds only its direction is checked."""
    data = result[2]
    large = max(QUICK.mus)
    for output, margin in (("avg", 0.25), ("last", 0.0)):
        dpsgd = _gap(data, large, "dpsgd", output)
        best_f = min(_gap(data, large, m, output) for m in PREPROCESSED)
        assert dpsgd - best_f > margin, (output, dpsgd, best_f)


def test_dpsgd_f_centering_helps_below_the_threshold(result):
    """At mu = 1e3 (n > mu/eps, but mu^2 >> n eps) DPSGD already fails on this step budget while both DPSGD-F
    variants, whose centered offset is ~ sigma_F R sqrt(2)/n, reach a near-zero gap."""
    data = result[2]
    mid = sorted(QUICK.mus)[1]
    assert math.isclose(mid, 1e3)
    for output in ("last", "avg"):
        assert _gap(data, mid, "dpsgd", output) > 0.9
        for m in PREPROCESSED:
            assert _gap(data, mid, m, output) < 0.1, (m, output)
