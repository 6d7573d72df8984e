"""The DPSGD-F reproduction (Sun, Suresh & Menon, "The importance of feature preprocessing for differentially private
linear optimization", Tables 1 and 2): the concentration measures against a brute force, Table 2 on the quick
subset of Fashion-MNIST, one private run per method against its budget and against each other, the aggregation of
re-runs into Table 1 rows, and the report's plumbing on a one-cell grid."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import require_fashion_mnist

from dptrain.reproduce import dpsgd_f as dpf
from dptrain.reproduce import run_reproduction
from dptrain.reproduce.dpsgd_f import PAPER, PAPER_TABLE2, concentration


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
def quick_data():
    require_fashion_mnist()
    return dpf._data("fashion-mnist", True)


def test_table2_fashion_mnist_matches_paper(quick_data):
    """Table 2 (unit-normalized pixels): diam 1.41 (pixels are non-negative, so <= sqrt 2), mean distance to the
    mean 0.62. The quick subset has 6,000 training images, so its maximum is only a lower bound of the full one."""
    assert len(quick_data.train) == dpf.QUICK_TRAIN and len(quick_data.test) == dpf.QUICK_TEST
    m = concentration(quick_data.train.x)
    diam, mx, mean = PAPER_TABLE2["fashion-mnist"]
    assert m["diam"] <= 2**0.5 + 1e-6
    assert m["diam"] == pytest.approx(diam, abs=0.01)
    assert m["mean_dist_to_mean"] == pytest.approx(mean, abs=0.02)
    assert mx - 0.1 < m["max_dist_to_mean"] <= mx + 0.01


def _quick_task(method: str, n: int) -> dict:
    """The quick grid's task at eps = 1, learning rate 4 for ``method``, with its calibrated noise."""
    (task,) = [
        t
        for t in dpf._tasks("fashion-mnist", n, True)
        if t["method"] == method and t["epsilon"] == 1.0 and t["learning_rate"] == 4.0
    ]
    task["noise_multiplier"] = dpf._noise(dpf._key(task))[1]
    return task


@pytest.fixture(scope="module")
def private_runs(quick_data):
    return {m: dpf._train(_quick_task(m, len(quick_data.train))) for m in ("dpsgd", "dpsgd_f")}


def test_each_run_spends_its_budget(private_runs):
    """The noise is calibrated (PLD, private mean included) before training; the trainer's own ledger, accounted
    afterwards, spends the budget: not more, and not much less."""
    for method, r in private_runs.items():
        assert r["epsilon"] - 0.01 < r["epsilon_spent"] <= r["epsilon"] + 1e-9, method


def test_feature_centering_helps(private_runs):
    """Table 1's claim, at the quick grid's scale (2 epochs on 6,000 images): at the same budget and
    hyper-parameters, DPSGD-F's private centering beats DPSGD, and both beat chance on 10 classes."""
    dpsgd, dpsgd_f = private_runs["dpsgd"]["accuracy"], private_runs["dpsgd_f"]["accuracy"]
    assert 0.2 < dpsgd < dpsgd_f


def test_table1_row_aggregates_the_reruns():
    """Mean and sample std (ddof 1) over the fresh seeds, the largest epsilon their ledgers certify, the paper's
    value beside it; the selection run itself is only reported as such."""
    best = {"accuracy": 0.9, "feature_norm": 1.0, "batch_size": 8, "learning_rate": 2.0, "epochs": 3}
    best |= {"eps_f": 0.05, "noise_multiplier": 1.5}
    key = ("fashion-mnist", 1.0, "dpsgd_f")
    reruns = [
        {"dataset": key[0], "epsilon": 1.0, "method": "dpsgd_f", "seed": s, "accuracy": a, "epsilon_spent": e}
        for s, a, e in ((3, 0.5, 0.99), (1, 0.7, 0.995), (2, 0.6, 0.98))
    ]
    reruns.append({**reruns[0], "method": "dpsgd", "accuracy": 0.1, "epsilon_spent": 5.0})  # another cell
    row = dpf._row(key, best, reruns, "cmd")
    assert row["accuracy_mean"] == pytest.approx(0.6)
    assert row["accuracy_std"] == pytest.approx(0.1)  # ddof = 1
    assert row["seeds"] == [1, 2, 3] and row["epsilon_certified_pld_max"] == 0.995
    assert row["selection_accuracy_seed0"] == 0.9 and row["eps_f"] == 0.05 and row["noise_multiplier"] == 1.5
    assert (row["paper_accuracy"], row["paper_std"]) == pytest.approx((0.84, 0.001))
    assert row["delta"] == dpf.DELTA
    plain = {
        **reruns[0],
        "epsilon": None,
        "method": "non_private",
        "accuracy": 0.8,
        "epsilon_spent": float("inf"),
    }
    non_private = dpf._row(("fashion-mnist", None, "non_private"), best, [plain], "cmd")
    assert non_private["accuracy_mean"] == 0.8 and non_private["accuracy_std"] == 0.0
    assert non_private["delta"] is None and non_private["epsilon_certified_pld_max"] is None
    assert non_private["paper_accuracy"] == PAPER["fashion-mnist"]["non_private"][0] / 100


def test_run_writes_report_json_and_plot(tmp_path, monkeypatch, quick_data, private_runs):
    load = dpf._load
    monkeypatch.setattr(
        dpf, "_load", lambda name, quick: (quick_data, "") if name == "fashion-mnist" else load(name, quick)
    )
    monkeypatch.setattr(dpf, "EPSILONS", (1.0,))
    monkeypatch.setattr(dpf, "QUICK_GRID", {**dpf.QUICK_GRID, "learning_rate": (4.0,)})
    report = run_reproduction("dpsgd-f", tmp_path, quick=True)
    assert report == tmp_path / "dpsgd_f.md" and (tmp_path / "dpsgd_f.png").stat().st_size > 1000
    text = report.read_text()
    assert f"dptrain reproduce dpsgd-f --out {tmp_path} --quick" in text
    rows = json.loads((tmp_path / "dpsgd_f.json").read_text())
    details = json.loads((tmp_path / "dpsgd_f_grid.json").read_text())
    fm = {(r["epsilon"], r["method"]): r for r in rows if r["dataset"] == "fashion-mnist"}
    assert set(fm) == {(1.0, "dpsgd"), (1.0, "dpsgd_f"), (None, "non_private")}
    for (_, method), r in fm.items():  # one grid point per cell: the re-run (seed 1) of the runs above
        assert r["learning_rate"] == (4.0 if method != "non_private" else 1.0) and r["seeds"] == [1]
        if method != "non_private":
            assert r["selection_accuracy_seed0"] == private_runs[method]["accuracy"]
            assert r["epsilon_certified_pld_max"] <= 1.0 + 1e-9
    # data sets that are not on this machine are reported as skipped, not silently dropped
    assert {r["dataset"] for r in rows} | set(details["skipped"]) == {
        "mnist",
        "fashion-mnist",
        "cifar100-features",
    }
    assert dpf.render(rows, details).markdown() == text  # the JSON holds everything the report shows
