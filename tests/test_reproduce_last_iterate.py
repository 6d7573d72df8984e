"""The last-iterate reproduction (seed 003, Altschuler & Talwar) in quick mode: epsilon vs T against the
digest's reference values, and the calibrated training experiment."""

from __future__ import annotations

import json

import pytest

from dptrain.reproduce import REPRODUCTIONS
from dptrain.reproduce.last_iterate import run


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("last_iterate")
    report = run(out, quick=True)
    return out, report, json.loads((out / "last_iterate.json").read_text())


def _sig4(x: float) -> float:
    return float(f"{x:.4g}")


def test_registered():
    assert REPRODUCTIONS["last-iterate"] == "dptrain.reproduce.last_iterate"


def test_files_exist(result):
    out, report, data = result
    assert report == out / "last_iterate.md"
    text = report.read_text()
    for section in ("## (a)", "## (b)", "## (c)"):
        assert section in text
    assert f"dptrain reproduce last-iterate --out {out} --quick" in text
    assert data["command"] == f"dptrain reproduce last-iterate --out {out} --quick"
    for png in ("epsilon_vs_T.png", "training.png"):
        assert (out / png).stat().st_size > 1000


def test_reference_checks_pass(result):
    cv = result[2]["curves"]
    assert cv["checks"] and all(c["passed"] for c in cv["checks"]), cv["checks"]
    rows = {r["T"]: r for r in cv["settings"]["reference"]["rows"]}
    assert _sig4(rows[1000]["rdp"]) == _sig4(1.00103e-3)
    late = [r["rdp"] for t, r in rows.items() if t >= 20_000]
    assert late and all(_sig4(v) == _sig4(2.00205e-2) for v in late)
    assert _sig4(cv["settings"]["strongly_convex"]["plateau_rdp"]) == _sig4(6.84902e-4)


def test_bound_below_composition_and_monotone(result):
    cv = result[2]["curves"]
    for name, s in cv["settings"].items():
        rows = s["rows"]
        for r in rows:
            assert r["rdp"] <= r["rdp_composition"] * (1 + 1e-12), (name, r)
            assert r["epsilon"] <= r["epsilon_composition"] * (1 + 1e-12), (name, r)
        for a, b in zip(rows, rows[1:], strict=False):
            assert b["rdp"] >= a["rdp"] * (1 - 1e-9), (name, a, b)
            assert b["epsilon"] >= a["epsilon"] * (1 - 1e-9), (name, a, b)
        assert s["below_composition"] and s["non_decreasing"]
    convex, strong = cv["settings"]["reference"]["rows"], cv["settings"]["strongly_convex"]["rows"]
    for c, s in zip(convex, strong, strict=True):
        assert s["rdp"] <= c["rdp"] * (1 + 1e-12)
    assert cv["strongly_convex_below_convex"]
    for r in cv["rederivation"]:  # an independent evaluation of (B.2)/(B.3) agrees with rdp_bound
        assert -1e-9 <= r["rel_diff"] < 1e-3, r


def test_training_table(result):
    exp = result[2]["training"]
    assert exp["quick"] and exp["seeds"] == [0] and exp["n"] == 2000
    certs = {r["certification"] for r in exp["rows"]}
    assert {"composition", "last_iterate"} <= certs
    for r in exp["rows"]:
        certified = {"composition": "eps_composition", "last_iterate": "eps_last_iterate"}
        certified["conservative"] = "eps_conservative"
        assert r[certified[r["certification"]]] <= 1 + 1e-9, r
        assert 0 <= r["mean"] <= 1
    for cert in ("composition", "last_iterate"):
        assert len({r["epochs"] for r in exp["rows"] if r["certification"] == cert}) == 2
    assert exp["nonprivate"]
