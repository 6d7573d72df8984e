"""``dptrain reproduce recipes``: the rows' schema, certified budgets, and the selection rule for the weight-averaged rows
(ranked by the averaged models' held-out accuracy, from the same runs: none trained twice)."""

from __future__ import annotations

import json

import pytest

from dptrain.reproduce import recipes

KEYS = {"model", "recipe", "target_epsilon", "accuracy_median", "accuracies", "seeds", "certified_epsilon",
        "accountant", "noise_multiplier", "epochs", "batch_size", "augment_multiplicity", "ema"}  # fmt: skip


def test_quick_mode_writes_rows_of_the_schema_certified_at_the_target(tmp_path):
    report = recipes.run(tmp_path, quick=True)
    rows = json.loads((tmp_path / "recipes.json").read_text())
    assert report.exists() and (tmp_path / "recipes.png").exists()
    assert {r["recipe"] for r in rows} == {"mlp", "mlp+ema", "mlp_augment", "mlp_augment+ema"}
    for r in rows:
        assert KEYS <= set(r)
        assert r["accountant"] == "pld" and 2.99 <= r["certified_epsilon"] <= 3.0 + 1e-6
        assert (r["ema"] in recipes.EMA_DECAYS) == r["recipe"].endswith("+ema")
    assert {r["augment_multiplicity"] for r in rows} == {1, 2}
    assert not (tmp_path / recipes.PARTIAL).exists()


def test_the_averaged_rows_are_chosen_on_the_averages_held_out_accuracy_from_the_same_runs(tmp_path, monkeypatch):
    calls = []

    def fake(recipe, data, setting, lr, seed, cfg):
        calls.append((lr, seed))
        # the last iterate is best at the smallest rate, its weight average at the largest; decay 0.99 best
        ema = {f"{d:g}": {"validation_accuracy": lr / 10 + (0.05 if d == 0.99 else 0), "test_accuracy": 0.6 + seed / 100}
               for d in recipes.EMA_DECAYS}  # fmt: skip
        return {"validation_accuracy": 1 - lr / 10, "test_accuracy": 0.5 + seed / 100, "certified_epsilon": 3.0,
                "seconds": 0.0, "ema": ema, "ema_validation_accuracy": lr / 10 + 0.05}  # fmt: skip

    monkeypatch.setattr(recipes, "train", fake)
    cfg = {**recipes.QUICK, "models": ("mlp",)}
    cfg["recipes"] = {"mlp": {**cfg["recipes"]["mlp"], "learning_rates": (0.5, 1.0, 2.0)}}
    out = recipes.experiment(cfg, True, (3.0,), 2, tmp_path / "p.json")
    plain, averaged = out["rows"]
    assert plain["learning_rate"] == 0.5 and plain["accuracies"] == [0.5, 0.51] and plain["ema"] is None
    assert averaged["learning_rate"] == 2.0 and averaged["ema"] == pytest.approx(0.99)
    assert averaged["accuracies"] == [0.6, 0.61]
    assert sorted(calls) == sorted(set(calls))  # every (rate, seed) trained once for both rows
    assert set(calls) == {(0.5, 0), (1.0, 0), (2.0, 0), (0.5, 1), (2.0, 1)}


def test_the_committed_report_is_its_rows_rendered():
    """docs/reproduction/recipes: recipes.md is what the renderer makes of recipes_runs.json (every number of its
    table and findings), and recipes.json holds the same rows, with the issue's keys."""
    from pathlib import Path

    from dptrain.reproduce.recipes_text import DATA_JSON, REPORT, RUNS_JSON, render

    docs = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "recipes"
    data = json.loads((docs / RUNS_JSON).read_text())
    report = render(data)
    assert report.markdown() == (docs / REPORT).read_text()
    rows = json.loads((docs / DATA_JSON).read_text())
    assert report.data[DATA_JSON] == rows and all(KEYS <= set(r) for r in rows) and not data["quick"]
