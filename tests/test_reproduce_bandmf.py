"""``dptrain reproduce bandmf``: DP-SGD against BandMF (auto bands) at equal certified epsilon, in quick mode: the rows'
schema, the choice of b and its certificate, the verdict computed from the rows, the estimate printed first."""

from __future__ import annotations

import copy
import json

import pytest

from dptrain.accounting import choose_bands
from dptrain.errors import ConfigError
from dptrain.reproduce import REPRODUCTIONS, run_reproduction
from dptrain.reproduce import bandmf_decided as decided
from dptrain.reproduce.bandmf_decided_text import findings, verdict
from dptrain.reproduce.equal_privacy import Runs

KEYS = {
    "model",
    "epochs",
    "target_epsilon",
    "method",
    "bands",
    "accuracy_median",
    "accuracies",
    "seeds",
    "certified_epsilon",
    "accountant",
    "noise_multiplier",
    "rmse_ratio",
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bandmf")
    report = run_reproduction("bandmf", out, quick=True)
    return out, report, json.loads((out / "decided.json").read_text()), json.loads((out / "decided_runs.json").read_text())


@pytest.mark.slow
def test_quick_mode_writes_rows_of_the_schema_a_report_and_a_plot(quick):
    out, report, rows, data = quick
    assert "bandmf" in REPRODUCTIONS and report == out / "decided.md"
    assert (out / "decided.png").stat().st_size > 0 and not (out / "decided.partial.json").exists()
    q = decided.QUICK
    assert len(rows) == len(q["models"]) * (len(q["epochs"]) * len(q["epsilons"]) * 2 + 1)
    for r in rows:
        assert set(r) == KEYS, set(r) ^ KEYS
        assert r["method"] in decided.METHODS and r["seeds"] == [0] and r["accuracies"] == [r["accuracy_median"]]
        private = r["method"] != "non_private"
        assert (r["certified_epsilon"] is not None) == private and (r["accountant"] == "pld") == private
        if r["method"] == "dpsgd":
            assert r["bands"] == 1 and r["rmse_ratio"] == 1.0
        if private:  # certified by the run's own ledger, at the target (pld's calibration: within 1e-3 below it)
            assert r["target_epsilon"] - 1e-3 < r["certified_epsilon"] <= r["target_epsilon"] + 1e-9
    assert {r["epochs"] for r in rows if r["method"] != "non_private"} == set(q["epochs"])
    text = report.read_text()
    assert "Quick mode" in text and "not the result" in text and "**Verdict**" in text


@pytest.mark.slow
def test_bandmf_rows_use_the_bands_and_noise_chosen_for_the_budget_before_training(quick):
    _, _, rows, data = quick
    q = decided.QUICK
    for r in rows:
        if r["method"] != "bandmf":
            continue
        setting = next(s for s in data["settings"] if s["epochs"] == r["epochs"] and s["target_epsilon"] == r["target_epsilon"])
        choice = choose_bands(setting["steps"], q["sampling_rate"], r["target_epsilon"], decided.DELTA)
        assert r["bands"] == choice.bands == min(choice.candidates, key=choice.candidates.get) > 1
        assert r["noise_multiplier"] == choice.noise_multiplier and r["rmse_ratio"] == choice.rmse_ratio < 1


@pytest.mark.slow
def test_the_verdict_is_computed_from_the_rows(quick):
    _, report, rows, data = quick
    assert data["verdict"] == verdict(rows)
    v = verdict(rows)
    assert v["cells"] == 4 and v["bandmf_wins"] + v["bandmf_loses"] <= 4
    flipped = copy.deepcopy(rows)
    for r in flipped:  # BandMF made better than DP-SGD in every cell: the verdict follows
        if r["method"] == "bandmf":
            r["accuracy_median"] = 1.0
            r["accuracies"] = [1.0]
    assert verdict(flipped)["bandmf_wins"] == 4
    assert "in every cell (4 of 4)" in findings({"rows": flipped})[0]
    assert f"in {v['bandmf_wins']} of 4" in report.read_text() or "any cell (0 of 4)" in report.read_text() or (
        "every cell (4 of 4)" in report.read_text()
    )


def test_the_estimate_counts_the_runs_of_the_smallest_plan_left(tmp_path):
    runs = Runs(tmp_path / "p.json", quick=False)
    cfg = decided.FULL
    seconds, count = decided.estimate_seconds(cfg, decided.EPSILONS, 3, runs)
    private = 2 * 2 * 3 * 2 * (3 + 2)  # models x epochs x targets x methods x (3 rates at seed 0 + seeds 1, 2)
    assert count == private + 2 * (3 + 2)
    steps = {10: 1000, 2: 200}
    expected = sum(
        3 * 2 * (3 + 2) * steps[e] * cfg["seconds_per_step"][m] for m in cfg["models"] for e in cfg["epochs"]
    ) + sum((3 + 2) * cfg["seconds_non_private"][m] for m in cfg["models"])
    assert seconds == pytest.approx(expected)
    runs.runs[decided.run_key("cnn28", 1.0, "bandmf@10ep", 0.5, 0)] = {}
    assert decided.estimate_seconds(cfg, decided.EPSILONS, 3, runs)[1] == count - 1


@pytest.mark.parametrize(
    "options,message",
    [
        ({"models": "resnet"}, "--models takes some of"),
        ({"epsilons": "a,b"}, "--epsilons takes"),
        ({"seeds": 0}, "--seeds takes"),
        ({"power": True}, "takes no --power"),
    ],
)
def test_bad_options_are_refused_in_one_line(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        run_reproduction("bandmf", tmp_path, quick=True, **options)


def test_the_committed_report_is_its_rows_rendered():
    """docs/reproduction/bandmf: decided.md is what the renderer makes of decided_runs.json (every number of its table,
    its verdict), decided.json holds the same rows, with the issue's keys, and the stored verdict is the rows'."""
    from pathlib import Path

    from dptrain.reproduce.bandmf_decided_text import render

    docs = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "bandmf"
    data = json.loads((docs / "decided_runs.json").read_text())
    report = render(data)
    assert report.markdown() == (docs / "decided.md").read_text()
    rows = json.loads((docs / "decided.json").read_text())
    assert report.data["decided.json"] == rows == data["rows"] and all(KEYS == set(r) for r in rows)
    assert data["verdict"] == verdict(rows) and not data["quick"]
