"""The Proactive DP reproduction (van Dijk, Nguyen, Nguyen, Nguyen, Nguyen, "Proactive DP: A Multiple Target
Optimization Framework for DP-SGD"): Tables 9-11 against the paper's printed values, the closed form against tight
accountants recomputed here with dp_accounting, one private and one noise-free run of section (c) checked against
an accuracy computed here, and the report's plumbing on a tiny scale."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
import torch
from conftest import needs_fashion_mnist, require_fashion_mnist

from dptrain.accounting.standard import RDP_ORDERS
from dptrain.errors import ConfigError
from dptrain.proactive.planner import plan_from_sigma
from dptrain.reproduce import proactive, proactive_logistic, run_reproduction, single_thread
from dptrain.reproduce.proactive import (
    EXPERIMENT,
    NEGATIVE_CLASS,
    POSITIVE_CLASS,
    ratio_rows,
    tables_9_11,
)


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():  # as the reproduction runs its 1570-parameter model
        yield


#: Sections (c) and (d) at a size that runs in about a second.
TINY = proactive.Scale(
    n=400, k=1, seeds=(0,), sizes=(), paper_s_max=False, clips=(0.1,), sigmas=(0.0, 20.0), draws=1
)


def test_tables_9_11():
    rows = {r["name"].split()[0]: r for r in tables_9_11()}
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


@pytest.fixture(scope="module")
def ratios():
    return ratio_rows()


def test_closed_form_is_eq6_and_never_below_the_tight_accountant(ratios):
    assert len(ratios) == 9
    for r in ratios:
        assert r["T"] == math.ceil(r["k"] * r["n"] / r["s"])
        # eq. (6) inverted at delta = 1/N: eps = 2 ln(N)/(sigma^2 - 2)
        assert r["eps_closed_form"] == pytest.approx(2 * math.log(r["n"]) / (r["sigma"] ** 2 - 2), rel=1e-9)
        assert r["eps_closed_form"] >= r["eps_pld"], r
        assert r["ratio_closed_over_pld"] == pytest.approx(r["eps_closed_form"] / r["eps_pld"])


def _event(r: dict) -> dp_accounting.DpEvent:
    """T Poisson-sampled Gaussian steps, rate s/N, noise multiplier sigma: the ledger of a ratio row."""
    step = dp_accounting.PoissonSampledDpEvent(r["s"] / r["n"], dp_accounting.GaussianDpEvent(r["sigma"]))
    return dp_accounting.SelfComposedDpEvent(step, r["T"])


def test_tight_epsilons_agree_with_dp_accounting_directly(ratios):
    for r in ratios:
        rdp = dp_accounting.rdp.RdpAccountant(RDP_ORDERS)  # dptrain's orders: dp_accounting's and a few more
        rdp.compose(_event(r))
        assert r["eps_rdp"] == pytest.approx(rdp.get_epsilon(1 / r["n"]), rel=1e-9), r["setting"]
    r = ratios[4]  # CIFAR10 at the paper's s_max (T = 863)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(_event(r))
    assert r["eps_pld"] == pytest.approx(pld.get_epsilon(1 / r["n"]), rel=2e-2)


@pytest.fixture(scope="module")
def task():
    from dptrain.data.loaders import load_dataset

    require_fashion_mnist()
    data = load_dataset("fashion-mnist")
    return proactive_logistic._binary_subset(data.train, 2000), proactive_logistic._binary_subset(data.test, None)


def test_binary_subset_is_balanced_and_labels_the_positive_class():
    class Split:
        y = torch.tensor([6, 0, 3, 6, 0, 6, 0, 6, 0, 1])
        x = torch.arange(10.0).reshape(10, 1)

    x, y = proactive_logistic._binary_subset(Split, 6)  # the first 3 of each class, in file order
    assert x.squeeze(1).tolist() == [0, 1, 3, 4, 5, 6]
    assert y.tolist() == [1, 0, 1, 0, 1, 0]
    x, y = proactive_logistic._binary_subset(Split, None)
    assert len(y) == 8 and int(y.sum()) == 4
    assert (NEGATIVE_CLASS, POSITIVE_CLASS) == (0, 6)


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def test_private_and_noise_free_runs(task):
    """One run at the certified s_max of (sigma, N, k) = (19.3, 2000, 2) and the same run without noise: the
    accuracy reported is the final model's on the test set, the run's own ledger certifies the calculator's
    epsilon, and the noise costs accuracy."""
    (train, test), n, k = task, 2000, 2
    sigma, clip = EXPERIMENT["sigma"], EXPERIMENT["clip"]
    calc = plan_from_sigma(sigma, n, k)
    s = calc["s_max"]
    steps = math.ceil(k * n / s)
    assert steps * s >= n * k
    acc, trainer = proactive_logistic._train_dpsgd(train, test, s, steps, 0, "mean", sigma, clip)
    assert acc == pytest.approx(_accuracy(trainer.model, *test), abs=1e-6)
    eps = proactive_logistic._epsilons(trainer, n)
    assert eps["proactive"] == pytest.approx(calc["epsilon"], rel=1e-3)
    assert eps["pld"] < eps["proactive"]
    clean, clean_trainer = proactive_logistic._train_dpsgd(train, test, s, steps, 0, "mean", 0.0, clip)
    assert clean == pytest.approx(_accuracy(clean_trainer.model, *test), abs=1e-6)
    assert clean > 0.7  # T-shirt/top vs Shirt, balanced test set: chance is 0.5
    assert acc < clean


@needs_fashion_mnist
def test_run_writes_report_json_and_plots(tmp_path, monkeypatch, ratios):
    monkeypatch.setattr(proactive, "QUICK", TINY)
    monkeypatch.setattr(proactive, "ratio_rows", lambda: ratios)  # computed once, by the fixture
    report = run_reproduction("proactive", tmp_path, quick=True)
    assert report == tmp_path / "proactive.md"
    text = report.read_text()
    for section in ("## (a)", "## (b)", "## (c)", "## (d)"):
        assert section in text
    assert f"dptrain reproduce proactive --out {tmp_path} --quick" in text
    for png in ("accuracy_vs_s.png", "utility_graph.png"):
        assert (tmp_path / png).stat().st_size > 1000
    data = json.loads((tmp_path / "proactive.json").read_text())
    exp = data["logistic"]
    assert (exp["n"], exp["k"], exp["seeds"]) == (400, 1, [0])
    assert exp["sizes"] == [plan_from_sigma(EXPERIMENT["sigma"], 400, 1)["s_max"]]
    assert data["utility_graph"]["sigmas"] == [0.0, 20.0]
    assert proactive.render(data).markdown() == text  # the JSON holds everything the report shows


def test_unknown_reproduction_is_refused():
    with pytest.raises(ConfigError, match="proactive"):
        run_reproduction("nope", "/tmp/unused")
