"""dptrain reproduce tuning --quick: the three ways to choose hyperparameters, each with its epsilon."""

import json

import pytest

from dptrain.reproduce import run_reproduction


@pytest.mark.slow
def test_quick_reproduction_prices_every_method(tmp_path):
    path = run_reproduction("tuning", tmp_path, quick=True)
    data = json.loads((tmp_path / "tuning.json").read_text())
    rows = {r["method"]: r for r in data["summary"]}
    assert path.exists() and (tmp_path / "tuning.png").exists() and set(rows) == {"default", "tune", "common practice"}
    assert rows["default"]["epsilon_median"] <= 3.0 and rows["tune"]["epsilon_median"] <= 3.0
    assert rows["tune"]["certified"] and not rows["common practice"]["certified"]
    assert rows["common practice"]["epsilon_median"] > 3.0  # two full-budget runs, composed
    assert "NO (priced as 2 runs composed)" in path.read_text()
