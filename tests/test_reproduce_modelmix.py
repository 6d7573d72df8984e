"""``dptrain reproduce modelmix-accounting --quick``: the report's numbers come from the data it writes."""

from __future__ import annotations

import json

import pytest

from dptrain.reproduce import run_reproduction


@pytest.mark.slow
def test_quick_accounting_reproduction_writes_fig3_and_the_review(tmp_path):
    path = run_reproduction("modelmix-accounting", tmp_path, quick=True)
    data = json.loads((tmp_path / "modelmix.json").read_text())
    assert (tmp_path / "fig3.png").stat().st_size > 1000
    cells = {(c["tau_over_lr"], c["linf_p"]): c for c in data["accounting"]["fig3"][0]["cells"]}
    # the paper's Fig. 3c under its own method, and the certificate at p = 100 near it
    assert cells[(0.3, 1)]["epsilon_paper_method"] == pytest.approx(31.7, rel=0.05)
    assert cells[(0.3, 100)]["epsilon_paper_method"] == pytest.approx(4.8, rel=0.05)
    assert cells[(0.3, 100)]["epsilon_certified"] < 6
    # without truncation the certificate (integer orders) is far above the paper's fractional-order number
    assert cells[(0.3, 1)]["epsilon_certified"] > 2 * cells[(0.3, 1)]["epsilon_paper_method"]
    text = path.read_text()
    assert f"{cells[(0.3, 100)]['epsilon_certified']:.2f}" in text
    names = {c["name"]: c["holds"] for c in data["review"]["checks"]}
    assert names["F_integer_moments_convexity"] and not names["C_one_hot_merge_convex_order"]
