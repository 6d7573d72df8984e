"""dptrain tune: the number of trials is secret and follows its distribution, the whole search is certified at its
budget, a failing trial is recorded with the worst score, bad input is one line, and an interrupted search resumes
as the same search."""

import json

import numpy as np
import pytest

from dptrain.accounting.tuning import TrialCount
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.engine.trainer import PrivateTrainer
from dptrain.randomness.generators import Randomness
from dptrain.tuning import search as search_module
from dptrain.tuning.search import Search, run_search, start_state

BASE = """\
[data]
name = "synthetic"
options = {{ n = 400, dim = 5, num_classes = 2, separation = 3.0 }}
[model]
name = "logistic"
[privacy]
target_epsilon = 2.0
delta = 1e-5
[training]
epochs = 1
batch_size = 40
learning_rate = 0.5
[tune]
trials_mean = {mean}
validation_fraction = 0.2
[tune.space]
{space}
"""


def _config(tmp_path, mean=2, space="{ log_uniform = [0.1, 2.0] }", seed=None, name="t.toml"):
    path = tmp_path / name
    line = "" if space is None else f'"training.learning_rate" = {space}'
    path.write_text(("" if seed is None else f"seed = {seed}\n") + BASE.format(mean=mean, space=line))
    return path


def test_the_number_of_trials_follows_its_distribution():
    rng = np.random.default_rng(0)
    for name, mean in (("geometric", 3.0), ("logarithmic", 3.0), ("poisson", 3.0)):
        k = np.array([TrialCount.named(mean, name).draw(u) for u in 1 - rng.random(5000)])
        assert abs(k.mean() - mean) < 4 * k.std() / np.sqrt(len(k)), name
    k = np.array([TrialCount.named(3.0, "geometric").draw(u) for u in 1 - rng.random(5000)])
    p1 = (k == 1).mean()  # geometric with mean 3: P[K = 1] = 1/3
    assert abs(p1 - 1 / 3) < 4 * np.sqrt(p1 * (1 - p1) / len(k))


def test_the_draws_come_from_the_secret_tuning_stream(tmp_path):
    search = Search(load_config(_config(tmp_path, mean=3)))
    a, b = start_state(search, Randomness(7, warn=False)), start_state(search, Randomness(7, warn=False))
    assert [t.values for t in a.trials] == [t.values for t in b.trials]  # seeded: reproducible (and not private)
    secret = {len(start_state(search, Randomness(warn=False)).trials) for _ in range(12)}
    assert len(secret) > 1  # unseeded: K varies from search to search


def test_a_search_is_certified_at_its_budget_and_releases_only_its_best_trial(tmp_path, capsys):
    out = tmp_path / "s"
    code = main(["tune", "--config", str(_config(tmp_path, seed=3)), "--out", str(out), "--no-progress", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["accountant"] == "rdp"
    assert 2.0 * (1 - 1e-6) <= shown["epsilon"] <= 2.0 and shown["epsilon_single_run"] < shown["epsilon"]
    assert shown["certified"] is False and shown["private"] is False  # seeded
    assert 0.1 <= shown["best"]["training.learning_rate"] <= 2.0 and shown["out"] == str(out / "best")
    written = json.loads((out / "summary.json").read_text())
    assert "not_private" not in shown and "trials_run" not in json.dumps(shown)  # K not even in the output
    assert "not_private" not in written and "trials_run" not in json.dumps(written)  # K never in a shareable file
    ledger = json.loads((out / "ledger.json").read_text())
    assert len(ledger["entries"]) == 1 and ledger["entries"][0]["event"]["type"] == "RepeatAndSelectDpEvent"
    best = json.loads((out / "best" / "summary.json").read_text())
    assert best["epsilon"] == shown["epsilon"] and (out / "best" / "model.pt").exists()
    assert not (out / "private" / "trials").exists()  # the other trials are gone


def test_a_failing_trial_is_recorded_with_the_worst_score_never_retried(tmp_path):
    cfg = load_config(_config(tmp_path, mean=1, space="{ choice = [1e39] }", seed=1))  # mean 1: exactly one trial
    summary = run_search(cfg, tmp_path / "f", progress=False, keep_trials=True)
    trials = summary["not_private"]["trials"]
    assert len(trials) == 1 and trials[0]["status"] == "failed" and summary["best"] is None


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"space": None}, "[tune.space] is empty"),
        ({"mean": 0.5}, "tune.trials_mean"),
        ({"space": "{ uniform = [-1.0, 2.0] }"}, "gives an illegal config"),
        ({"space": "{ log_uniform = [2.0, 1.0] }"}, "a < b"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, extra, words):
    code = main(["tune", "--config", str(_config(tmp_path, **extra)), "--out", str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_an_unknown_or_fixed_key_is_refused(tmp_path, capsys):
    for key, words in (("training.learnig_rate", "unknown config key"), ("privacy.delta", "cannot vary")):
        path = _config(tmp_path)
        path.write_text(path.read_text().replace('"training.learning_rate"', f'"{key}"'))
        code = main(["tune", "--config", str(path), "--out", str(tmp_path / "x"), "--no-progress"])
        assert code == 2 and words in capsys.readouterr().err


def test_an_algorithm_other_than_dpsgd_is_refused_naming_what_tune_searches(tmp_path, capsys):
    """Projected noisy SGD sets its noise by convex.noise_std; the refusal used to blame privacy.noise_multiplier,
    which the user never set (the search had set it on the trial)."""
    path = _config(tmp_path)
    path.write_text(path.read_text().replace('[training]', '[training]\nalgorithm = "projected_noisy_sgd"')
                    + '[convex]\nloss = "logistic"\nfeature_norm = 1.0\nl2 = 1e-3\ndiameter = 10.0\n')
    code = main(["tune", "--config", str(path), "--out", str(tmp_path / "x"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "tune searches DP-SGD trials" in err and len(err.strip().splitlines()) == 1


def test_an_interrupted_search_resumes_as_the_same_search(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path, mean=3, seed=11))
    whole = run_search(cfg, tmp_path / "whole", progress=False, keep_trials=True)
    trials = whole["not_private"]["trials"]
    assert len(trials) >= 2, "seed 11 draws at least two trials"
    real_step, calls = PrivateTrainer.step, {"n": 0}

    def step(self):  # Ctrl-C in the middle of the second trial's training
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return real_step(self)

    with monkeypatch.context() as m:
        m.setattr(PrivateTrainer, "step", step)
        with pytest.raises(KeyboardInterrupt):
            run_search(cfg, tmp_path / "cut", progress=False, keep_trials=True)
    from dptrain.runs.rundir import RunDirectory

    state = RunDirectory(tmp_path / "cut").load_private(search_module.STATE)
    assert [t["status"] for t in state["trials"]][:2] == ["done", "pending"]  # stopped inside the second trial
    resumed = run_search(None, tmp_path / "cut", resume=True, progress=False, keep_trials=True)
    assert resumed["not_private"]["trials"] == trials  # the same K, draws, noise and scores: nothing re-drawn
    assert resumed["best"] == whole["best"] and resumed["best_score"] == whole["best_score"]


def test_a_search_states_its_attacker_bound_and_keeps_the_selected_runs_average(tmp_path, capsys):
    """The search's summary says why no membership-inference bound applies (its certificate has no privacy profile),
    and best/summary.json keeps the weight average's entries exactly as it keeps the last iterate's (``model_ema``; they
    used to be kept by name, and an average's newer entries, ``hf_model_ema``, ``hf_adapter_ema``, dropped)."""
    path = _config(tmp_path, seed=3)
    path.write_text(path.read_text().replace("learning_rate = 0.5", "learning_rate = 0.5\nema = 0.9"))
    out = tmp_path / "s"
    assert main(["tune", "--config", str(path), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    bound = json.loads((out / "summary.json").read_text())["membership_inference"]
    assert bound["tpr_at_fpr_1pct"] is None and "hyperparameter search" in bound["no_profile"]
    assert "no bound on a membership-inference attacker" in printed
    best = json.loads((out / "best" / "summary.json").read_text())
    assert best["model_ema"]["file"] == "model_ema.pt" and (out / "best" / "model_ema.pt").is_file()
    from dptrain.tuning.release import public_key

    assert public_key("hf_model_ema") and public_key("hf_adapter_ema") and not public_key("wall_time_s_ema")
