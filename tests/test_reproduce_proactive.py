"""The Proactive DP reproduction (seed 002) in quick mode: Tables 9-11 and the closed-form/PLD ratios."""

from __future__ import annotations

import json

import pytest

from dptrain.errors import ConfigError
from dptrain.reproduce import REPRODUCTIONS, run_reproduction
from dptrain.reproduce.proactive import run


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("proactive")
    report = run(out, quick=True)
    return out, report, json.loads((out / "proactive.json").read_text())


def test_files_exist(result):
    out, report, _ = result
    assert report == out / "proactive.md"
    text = report.read_text()
    for section in ("## (a)", "## (b)", "## (c)", "## (d)"):
        assert section in text
    assert f"dptrain reproduce proactive --out {out}" in text
    for png in ("accuracy_vs_s.png", "utility_graph.png"):
        assert (out / png).stat().st_size > 1000


def test_tables_9_11(result):
    rows = {r["name"].split()[0]: r for r in result[2]["tables_9_11"]}
    expected = {
        "LIBSVM": (26, 198, 0.0497, 0.0105),
        "MNIST": (288, 3042, 0.1521, 0.0389),
        "CIFAR10": (406, 7504, 0.5253, 0.1133),
    }
    for name, (s_max, s_asym, eps, eps_fdp) in expected.items():
        r = rows[name]
        assert r["s_max"] == s_max
        assert r["s_max_asym"] == s_asym
        assert round(r["epsilon"], 4) == eps
        assert abs(r["eps_fdp"] - eps_fdp) <= 2e-4
        # the certified default allows larger batches at the same epsilon
        assert r["s_max_fixed_point"] >= r["s_max"]
        assert r["gamma_fixed_point"] <= r["gamma_paper"]


def test_closed_form_never_below_tight_accountant(result):
    rows = result[2]["ratios"]
    assert len(rows) == 9
    for r in rows:
        assert r["ratio_closed_over_pld"] >= 1, r
        assert r["eps_closed_form"] >= r["eps_pld"]


def test_logistic_quick_run(result):
    exp = result[2]["logistic"]
    assert exp["n"] == 2000 and exp["k"] == 2 and exp["seeds"] == [0]
    assert exp["sizes"] == sorted({5, exp["calculator_fixed_point"]["s_max"]})
    for r in exp["runs"]:
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["T"] * r["s"] >= exp["n"] * exp["k"]
        # every s <= s_max shares the certified budget of the calculator
        assert r["proactive"] == pytest.approx(exp["calculator_fixed_point"]["epsilon"], rel=1e-3)
        assert r["pld"] < r["proactive"]


def test_registry():
    assert "proactive" in REPRODUCTIONS
    with pytest.raises(ConfigError, match="proactive"):
        run_reproduction("nope", "/tmp/unused")
