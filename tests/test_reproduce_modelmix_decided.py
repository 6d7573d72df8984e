"""``dptrain reproduce modelmix-decided``: DP-SGD, ModelMix and the same-variance control at equal certified epsilon."""

from __future__ import annotations

import json
import math

import pytest

from dptrain.accounting import dpsgd_ledger, epsilon
from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.reproduce import REPRODUCTIONS, equal_privacy, run_reproduction
from dptrain.reproduce import modelmix_decided as decided

KEYS = {
    "dataset",
    "model",
    "target_epsilon",
    "method",
    "accuracy_median",
    "accuracies",
    "seeds",
    "certified_epsilon",
    "accountant",
    "noise_multiplier",
    "tau_over_lr",
    "linf_p",
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("decided")
    report = run_reproduction("modelmix-decided", out, quick=True)
    return (
        out,
        report,
        json.loads((out / "decided.json").read_text()),
        json.loads((out / "decided_runs.json").read_text()),
    )


@pytest.mark.slow
def test_quick_mode_writes_rows_of_the_schema_a_report_and_a_plot(quick):
    out, report, rows, data = quick
    assert "modelmix-decided" in REPRODUCTIONS and report == out / "decided.md"
    assert (out / "decided.png").stat().st_size > 0 and not (out / "decided.partial.json").exists()
    models, epsilons = decided.QUICK["models"], decided.QUICK["epsilons"]
    assert len(rows) == len(models) * (len(epsilons) * 3 + 1)
    for r in rows:
        assert set(r) == KEYS
        assert r["method"] in decided.METHODS and r["seeds"] == [0] and len(r["accuracies"]) == 1
        assert 0 <= r["accuracy_median"] <= 1 and r["accuracy_median"] == r["accuracies"][0]
        private = r["method"] != "non_private"
        assert (r["certified_epsilon"] is not None) == private and (
            r["target_epsilon"] is not None
        ) == private
        assert r["accountant"] == {"dpsgd": "pld", "modelmix": "modelmix", "same_variance": "pld"}.get(
            r["method"]
        )
        assert (r["tau_over_lr"] is not None) == (r["method"] == "modelmix")
    text = report.read_text()
    assert "Quick mode" in text and "not the result" in text and "ModelMix" in text


@pytest.mark.slow
def test_the_same_variance_noise_is_modelmix_total_variance_and_pld_certifies_it(quick):
    _, _, rows, data = quick
    (setting,) = data["settings"]
    mix = setting["modelmix"]
    z, tau = mix["noise_multiplier"], mix["tau_over_lr"]
    width = tau * setting["expected_batch_size"] / setting["max_grad_norm"]  # (tau / eta) B / C
    variance = z**2 + width**2 / 12  # Gaussian z^2 plus the uniform's w^2 / 12
    for r in rows:
        if r["method"] == "same_variance":
            assert r["noise_multiplier"] == pytest.approx(math.sqrt(variance), rel=1e-12)
            ledger = dpsgd_ledger(r["noise_multiplier"], setting["sampling_rate"], setting["steps"])
            assert r["certified_epsilon"] == pytest.approx(epsilon(ledger, 1e-5, "pld").epsilon, rel=1e-6)
            assert r["certified_epsilon"] < r["target_epsilon"]


@pytest.mark.slow
def test_modelmix_and_dpsgd_meet_their_target(quick):
    _, _, rows, data = quick
    for r in rows:
        if r["method"] in ("modelmix", "dpsgd"):
            assert r["target_epsilon"] - 1e-3 <= r["certified_epsilon"] <= r["target_epsilon"]
    (setting,) = data["settings"]
    # the certificate wins where the method runs: pld would certify more than the target for ModelMix's noise
    assert setting["modelmix"]["pld_epsilon_same_noise"] > setting["target_epsilon"]
    assert setting["modelmix"]["noise_multiplier"] < setting["dpsgd"]["noise_multiplier"]


def test_same_variance_noise_formula():
    assert decided.same_variance_noise(0.6, 30.0) == pytest.approx(math.sqrt(0.36 + 75.0))
    assert decided.same_variance_noise(1.0, 0.0) == 1.0


def test_choose_setting_meets_the_target_at_the_largest_reachable_tau():
    cfg = {**decided.QUICK, "taus": (0.5, 0.1)}
    s = decided.choose_setting(3.0, cfg, 1000)
    mix = s["modelmix"]
    assert [c["tau_over_lr"] for c in s["tau_candidates"]] == [0.5, 0.1]
    assert s["tau_candidates"][0]["epsilon_at_floor"] <= 3.0 < s["tau_candidates"][1]["epsilon_at_floor"]
    assert mix["tau_over_lr"] == 0.1 and 3.0 - 1e-3 <= mix["certified_epsilon"] <= 3.0
    assert s["dpsgd"]["certified_epsilon"] <= 3.0


def _fake(monkeypatch, calls, fail_at=None):
    """The experiment's loop with fake data, settings and training (milliseconds): records each run trained."""
    setting = {
        "expected_batch_size": 10.0,
        "max_grad_norm": 1.0,
        "linf_p": 100,
        "steps": 5,
        **{
            m: {"noise_multiplier": 1.0, "accountant": "pld", "certified_epsilon": 1.0}
            for m in decided.PRIVATE
        },
    }
    setting["modelmix"] = {**setting["modelmix"], "tau_over_lr": 0.1, "accountant": "modelmix"}
    monkeypatch.setattr(decided, "load_data", lambda cfg, quick: {m: ([0] * 10,) for m in cfg["models"]})
    monkeypatch.setattr(decided, "choose_setting", lambda target, cfg, n: setting)

    def train(*args):
        method, lr, seed = (
            (args[0], args[3], args[4]) if len(args) == 6 else ("non_private", args[1], args[2])
        )
        if fail_at is not None and len(calls) == fail_at:
            raise KeyboardInterrupt
        calls.append((method, lr, seed))
        return {
            "validation_accuracy": lr / 10,
            "test_accuracy": 0.5 + seed / 100,
            "certified_epsilon": 1.0,
            "seconds": 0.0,
        }

    monkeypatch.setattr(decided, "train_private", train)
    monkeypatch.setattr(equal_privacy, "train_non_private", train)


def test_an_interrupted_run_goes_on_where_it_stopped(tmp_path, monkeypatch):
    cfg = {**decided.QUICK, "models": ("a",)}
    partial = tmp_path / "p.json"
    first: list = []
    _fake(monkeypatch, first, fail_at=4)
    with pytest.raises(KeyboardInterrupt):
        decided.experiment(cfg, True, (3.0,), 2, partial)
    assert len(first) == 4 and partial.exists()
    second: list = []
    _fake(monkeypatch, second)
    result = decided.experiment(cfg, True, (3.0,), 2, partial)
    # per private method: 2 learning rates at seed 0, then seed 1 at the best (the larger: higher validation score)
    every = [x for m in decided.PRIVATE for x in [(m, 0.5, 0), (m, 2.0, 0), (m, 2.0, 1)]] + [
        ("non_private", 0.1, 0),
        ("non_private", 0.1, 1),
    ]
    assert first + second == every and not set(first) & set(second)
    assert [r["accuracies"] for r in result["rows"]] == [[0.5, 0.51]] * 4
    assert [c["learning_rate"] for c in result["cells"]] == [2.0, 2.0, 2.0, 0.1]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"seeds": 0}, "--seeds"),
        ({"epsilons": "1,x"}, "--epsilons"),
        ({"epsilons": "-1"}, "--epsilons"),
        ({"models": "resnet"}, "--models"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message) as e:
        run_reproduction("modelmix-decided", tmp_path, quick=True, **options)
    assert "\n" not in str(e.value)


def test_the_cli_refuses_bad_epsilons_exit_2(tmp_path, capsys):
    # (in this process: tests/test_cli.py's real-process test holds that the command's exit 2 comes without traceback)
    code = main(["reproduce", "modelmix-decided", "--quick", "--epsilons", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0 and "--epsilons" in err


@pytest.mark.parametrize(
    "peak, extend, tried, kept, at_reach",
    [
        (0.125, 3, [0.0625, 0.125, 0.25, 0.5, 1.0, 2.0], 0.125, False),  # below the grid: halved until it turns
        (0.125, 1, [0.25, 0.5, 1.0, 2.0], 0.25, True),  # the reach ends first: disclosed
        (8.0, 2, [0.5, 1.0, 2.0, 4.0, 8.0], 8.0, True),
        (1.0, 2, [0.5, 1.0, 2.0], 1.0, False),  # inside: nothing more is tried
    ],
)
def test_a_best_rate_at_the_end_of_the_grid_is_looked_beyond(tmp_path, peak, extend, tried, kept, at_reach):
    calls = []

    def train(lr, seed):
        calls.append((lr, seed))
        return {"validation_accuracy": -abs(math.log2(lr / peak)), "test_accuracy": seed / 10}

    runs = equal_privacy.Runs(tmp_path / "p.json", quick=True)
    cell = equal_privacy.lr_cell(runs, "m", 1.0, "dpsgd", 2, (0.5, 1.0, 2.0), train, extend)
    assert sorted(lr for lr, s in calls if s == 0) == tried and len(calls) == len(set(calls))
    assert cell["learning_rate"] == kept and [lr for lr, s in calls if s > 0] == [kept]
    assert cell["at_reach"] is at_reach and sorted(float(r) for r in cell["grid"]) == tried
