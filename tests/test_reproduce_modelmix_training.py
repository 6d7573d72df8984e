"""The ModelMix training experiments (Xiao, Wan & Devadas, "Differentially Private Deep Learning with ModelMix") in
quick mode: Table I's rows and Fig. 2's same-noise runs on Fashion-MNIST ScatterNet features, checked for their
keys, their privacy (every private row within its target, the DP-SGD noise recomputed here with dp_accounting's PLD
accountant) and for training that learns."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import dp_accounting
import pytest
import torch

from dptrain.data import DEFAULT_FASHION_MNIST_DIR
from dptrain.errors import ConfigError
from dptrain.reproduce import json_default
from dptrain.reproduce import modelmix_training as mt

pytestmark = pytest.mark.slow
needs_fmnist = pytest.mark.skipif(
    not Path(DEFAULT_FASHION_MNIST_DIR).is_dir(),
    reason=f"Fashion-MNIST not installed at {DEFAULT_FASHION_MNIST_DIR}",
)

MODELMIX = importlib.util.find_spec("dptrain.modelmix") is not None
ROW_KEYS = {
    "dataset",
    "epsilon",
    "method",
    "accuracy_median",
    "accuracies",
    "seeds",
    "certified_epsilon",
    "accountant",
    "noise_multiplier",
    "steps",
    "seconds",
}
CHANCE = 0.1


def _pld_epsilon(q: float, sigma: float, steps: int) -> float:
    """Epsilon at delta = 1e-5 of ``steps`` Poisson-subsampled Gaussian steps, by dp_accounting's PLD accountant at
    its default discretization (independent of dptrain's accountants)."""
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(mt.DELTA)


def _check_rows(table):
    json.dumps(table, default=json_default, allow_nan=False)  # JSON-able, no NaN or infinity
    assert table["quick"] and table["n_train"] == mt.QUICK["n_train"] and table["steps"] == mt.QUICK["steps"]
    assert table["features"]["shape"] == [81, 7, 7]
    assert "NotPrivateWarning" in table["note"]
    methods = [r["method"] for r in table["rows"]]
    assert methods == (["dpsgd", "modelmix", "non_private"] if MODELMIX else ["dpsgd", "non_private"])
    for r in table["rows"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["dataset"] == "fashion_mnist" and r["seeds"] == [0] and len(r["accuracies"]) == 1
        assert r["accuracy_median"] == r["accuracies"][0]
        assert r["steps"] == mt.QUICK["steps"]
        if r["method"] == "non_private":
            assert r["epsilon"] is None and r["certified_epsilon"] is None and r["noise_multiplier"] == 0
            continue
        assert r["epsilon"] == 1.0 and r["noise_multiplier"] > 0
        assert math.isfinite(r["certified_epsilon"])
        # The default fallback keeps every private row certified within its target.
        assert r["certified"] and r["certified_by"] == r["accountant"]
        assert r["certified_epsilon"] == r["calibration_epsilon"] <= r["epsilon"] * 1.0001


def _check_dpsgd_noise(table):
    r = next(r for r in table["rows"] if r["method"] == "dpsgd")
    assert r["certified"] and r["accountant"] != "modelmix"
    # The tightest accountant's sigma meets the target and no smaller sigma would: dp_accounting's PLD at the
    # calibrated sigma is at the target, at 2% less noise above it.
    eps = _pld_epsilon(table["sampling_rate"], r["noise_multiplier"], r["steps"])
    assert eps == pytest.approx(r["epsilon"], rel=0.02)
    assert _pld_epsilon(table["sampling_rate"], 0.98 * r["noise_multiplier"], r["steps"]) > r["epsilon"]


def _check_learning(table):
    for r in table["rows"]:
        assert r["accuracy_median"] > 3 * CHANCE, r  # 20 steps on 2000 examples: about 0.5 measured


def _check_modelmix_row(table):
    r = next(r for r in table["rows"] if r["method"] == "modelmix")
    assert r["tau"] == [[0.05, 0.5], [0.025, 0.5]] and r["max_grad_norm"] == 1.0 and r["learning_rate"] == 0.4
    assert r["modelmix_epsilon"] is not None
    if r["modelmix_refused"] is None:  # the modelmix accountant certified the target itself
        assert r["accountant"] == "modelmix" and r["modelmix_epsilon"]["certified"]
    else:  # outside its reviewed range: the tightest certifying accountant calibrated the run
        assert r["accountant"] not in ("modelmix", None) and r["modelmix_fallback"] == "auto"
        assert not r["modelmix_epsilon"]["certified"]


@needs_fmnist
def test_table1_quick():
    """One test per experiment (pytest-xdist would run a module fixture once per worker)."""
    methods = mt.METHODS if MODELMIX else tuple(m for m in mt.METHODS if m != "modelmix")
    table = mt.table1(quick=True, progress=False, methods=methods)
    _check_rows(table)
    _check_dpsgd_noise(table)
    _check_learning(table)
    if MODELMIX:
        _check_modelmix_row(table)


@needs_fmnist
def test_fig2_same_noise():
    if not MODELMIX:
        pytest.skip("dptrain.modelmix is not importable")
    fig = mt.fig2(quick=True, progress=False)
    json.dumps(fig, default=json_default, allow_nan=False)
    runs = {r["name"]: r for r in fig["runs"]}
    assert list(runs) == ["dpsgd_eta", "dpsgd_2eta", "modelmix_2eta"]
    assert {r["noise_multiplier"] for r in fig["runs"]} == {fig["noise_multiplier"]}
    assert [r["learning_rate"] for r in fig["runs"]] == [fig["eta"], 2 * fig["eta"], 2 * fig["eta"]]
    steps = list(range(0, mt.QUICK["steps"] + 1, mt.QUICK["eval_every"]))
    for r in fig["runs"]:
        assert r["curve"]["steps"] == steps and r["steps"] == mt.QUICK["steps"]
        assert len(r["curve"]["accuracy"]) == len(r["curve"]["loss"]) == len(steps)
        assert r["final_accuracy"] > 3 * CHANCE
        assert r["curve"]["loss"][-1] < r["curve"]["loss"][0]  # test loss falls
    # One seed: the same initial model for all three runs.
    assert len({r["curve"]["loss"][0] for r in fig["runs"]}) == 1
    # Plain DP-SGD is calibrated to epsilon 8 by the tightest accountant; rdp and pld see the same DP-SGD events in
    # all three ledgers (ModelMix's release is the noisy gradient's post-processing plus secret mixing).
    calibrated = runs["dpsgd_eta"]["epsilon"][fig["calibrated_by"]]
    assert calibrated["certified"] and calibrated["epsilon"] <= fig["target_epsilon"] * 1.0001
    for name in ("rdp", "pld"):
        values = {r["epsilon"][name]["epsilon"] for r in fig["runs"]}
        assert len(values) == 1, (name, values)
    mm = runs["modelmix_2eta"]["epsilon"]["modelmix"]
    assert "modelmix" not in runs["dpsgd_eta"]["epsilon"]
    # The mixing noise can only help: ModelMix's RDP bound is below the plain sampled Gaussian's.
    assert mm["epsilon"] < runs["modelmix_2eta"]["epsilon"]["rdp"]["epsilon"]


@pytest.mark.skipif(not MODELMIX, reason="dptrain.modelmix is not importable")
@pytest.mark.parametrize("fallback", mt.MODELMIX_FALLBACKS)
def test_modelmix_fallbacks(fallback):
    """A ModelMix run outside the modelmix accountant's reviewed range (a mixing width (tau/lr) B/C twice the
    largest it covers): "auto" calibrates on a certifying accountant and enforces the budget, "uncertified" on the
    modelmix accountant's own answer, and says so."""
    from dptrain.accounting.modelmix import CERTIFIED_RANGE

    batch_size, clip = 64.0, 1.0
    tau_over_lr = 2 * CERTIFIED_RANGE["width"][1] * clip / batch_size
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(400, 81, 7, 7, generator=g), torch.randint(0, 10, (400,), generator=g))
    model, trainer, refused = mt._trainer(
        "modelmix",
        data,
        seed=0,
        steps=4,
        batch_size=batch_size,
        max_grad_norm=clip,
        learning_rate=0.4,
        tau=tau_over_lr,
        epsilon=2.0,
        modelmix_fallback=fallback,
    )
    assert refused is not None and "approximation" in refused
    trainer.train(steps=4)
    privacy = mt._privacy(trainer)
    assert privacy["certified_by"] != "modelmix"
    if fallback == "auto":
        assert trainer.accountant != "modelmix" and trainer.budget is not None
        assert privacy["certified"] and privacy["certified_epsilon"] <= 2.0 * 1.0001
    else:
        assert trainer.accountant == "modelmix" and trainer.budget is None
        assert not privacy["certified"] and privacy["calibration_epsilon"] == pytest.approx(2.0, rel=1e-3)
        assert privacy["not_certified_because"]
    trainer.close()


def test_unknown_fallback_is_a_config_error():
    with pytest.raises(ConfigError, match="modelmix_fallback"):
        mt.table1(quick=True, progress=False, modelmix_fallback="paper")
