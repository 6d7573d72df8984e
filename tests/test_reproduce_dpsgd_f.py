"""The DPSGD-F reproduction (seed 004 Tables 1 and 2) in quick mode, and its concentration measures."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from dptrain.reproduce import REPRODUCTIONS
from dptrain.reproduce.dpsgd_f import PAPER_TABLE2, concentration, run


def test_registered():
    assert REPRODUCTIONS["dpsgd-f"] == "dptrain.reproduce.dpsgd_f"


def test_concentration_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(60, 5, generator=g) - 0.3
    z = x / x.norm(dim=1, keepdim=True)
    diam = max(float((a - b).norm()) for a, b in itertools.combinations(z, 2))
    mu = z.mean(0)
    m = concentration(x, block=7)  # blocks that do not divide n
    assert m["diam"] == pytest.approx(diam, rel=1e-5)
    assert m["max_dist_to_mean"] == pytest.approx(float((z - mu).norm(dim=1).max()), rel=1e-6)
    assert m["mean_dist_to_mean"] == pytest.approx(float((z - mu).norm(dim=1).mean()), rel=1e-6)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpsgd_f")
    report = run(out, quick=True)
    return out, report, json.loads((out / "dpsgd_f.json").read_text())


def test_files_and_rows(result):
    out, report, rows = result
    assert report == out / "dpsgd_f.md" and (out / "dpsgd_f.png").stat().st_size > 1000
    details = json.loads((out / "dpsgd_f_grid.json").read_text())
    text = report.read_text()
    assert f"dptrain reproduce dpsgd-f --out {out} --quick" in text
    fm = [r for r in rows if r["dataset"] == "fashion-mnist"]
    assert {(r["epsilon"], r["method"]) for r in fm} == {
        (1.0, "dpsgd"),
        (1.0, "dpsgd_f"),
        (2.0, "dpsgd"),
        (2.0, "dpsgd_f"),
        (None, "non_private"),
    }
    for r in rows:
        for key in (
            "dataset",
            "epsilon",
            "method",
            "accuracy_mean",
            "accuracy_std",
            "seeds",
            "feature_norm",
            "batch_size",
            "learning_rate",
            "epochs",
            "command",
        ):
            assert key in r
        assert 0.1 < r["accuracy_mean"] <= 1.0  # better than chance on 10 classes
        if r["epsilon"] is not None:  # every private run's own ledger certifies its budget
            assert r["epsilon_certified_pld_max"] <= r["epsilon"] + 1e-9
            assert r["epsilon_certified_pld_max"] > r["epsilon"] - 0.01  # and the calibration used it
    # data sets that are not on this machine are reported as skipped, not silently dropped
    present = {r["dataset"] for r in rows}
    assert present | set(details["skipped"]) == {"mnist", "fashion-mnist", "cifar100-features"}


def test_table2_fashion_mnist_matches_paper(result):
    """Table 2 (unit-normalized pixels): diam 1.41 (pixels are non-negative, so <= sqrt 2), mean distance to the
    mean 0.62. The quick run uses 6,000 training images, so the maximum is only a lower bound of the full one."""
    _, _, _ = result
    details = json.loads((result[0] / "dpsgd_f_grid.json").read_text())
    m = details["table2"]["fashion-mnist"]
    diam, mx, mean = PAPER_TABLE2["fashion-mnist"]
    assert m["diam"] <= 2**0.5 + 1e-6
    assert m["diam"] == pytest.approx(diam, abs=0.01)
    assert m["mean_dist_to_mean"] == pytest.approx(mean, abs=0.02)
    assert mx - 0.1 < m["max_dist_to_mean"] <= mx + 0.01
