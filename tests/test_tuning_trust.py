"""A search's certificate, third round (each test fails on the search before it): its config frozen like a run's (a
resume refuses any change, the seed included), nothing shareable that depends on the number of trials or the best
trial's index (paths, counts on stderr, file times, wall times), public validation only on a public test set, a trial
labelled not private labels the search, the search's certificate first in best/, the secure streams for every
draw of a search, and a finished search's report from its state, never from an edited file."""

import inspect
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.engine.trainer import PrivateTrainer
from dptrain.runs.rundir import RunDirectory
from dptrain.tuning import release as release_module
from dptrain.tuning import search as search_module
from dptrain.tuning.search import run_search

BASE = """\
{seed}[data]
name = "synthetic"
options = {{ n = 400, dim = 5, num_classes = 2, separation = 3.0 }}
{data}
[model]
name = "logistic"
[privacy]
target_epsilon = 2.0
delta = 1e-5
{privacy}
[training]
epochs = 1
batch_size = 40
learning_rate = 0.5
{training}
[tune]
trials_mean = 2.0
validation_fraction = 0.2
score_noise = 10.0
{tune}
[tune.space]
"training.learning_rate" = {{ log_uniform = [0.1, 2.0] }}
"""


def _config(tmp_path, seed=1, data="", privacy="", training="", tune="", name="t.toml"):
    path = tmp_path / name
    path.write_text(BASE.format(seed="" if seed is None else f"seed = {seed}\n", data=data, privacy=privacy,
                                training=training, tune=tune))
    return path


def _interrupted(tmp_path, monkeypatch, config, at=3):
    """A search stopped by Ctrl-C at its ``at``-th training step (inside its first trial)."""
    real_step, calls = PrivateTrainer.step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt
        return real_step(self)

    out = tmp_path / "cut"
    with monkeypatch.context() as m:
        m.setattr(PrivateTrainer, "step", step)
        with pytest.raises(KeyboardInterrupt):
            run_search(load_config(config), out, progress=False)
    return out


def _cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# --- 1. the config of a search is frozen, like a run's --------------------------------------------------------


@pytest.mark.parametrize(
    "old,new,key",
    [
        ("trials_mean = 2.0", "trials_mean = 1.0", "tune.trials_mean"),
        ("score_noise = 10.0", "score_noise = 1000.0", "tune.score_noise"),
        ("seed = 1\n", "", "seed"),
        ("epochs = 1.0", "epochs = 2.0", "training.epochs"),
    ],
)
def test_a_resumed_search_refuses_any_change_of_its_config(tmp_path, monkeypatch, capsys, old, new, key):
    out = _interrupted(tmp_path, monkeypatch, _config(tmp_path))
    capsys.readouterr()
    text = (out / "config.toml").read_text()
    assert old in text
    (out / "config.toml").write_text(text.replace(old, new, 1))
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert key in err and "changed since the run started" in err
    assert not (out / "summary.json").exists()  # nothing released
    if key == "seed":  # restored: the same search goes on
        (out / "config.toml").write_text(text)
        code, _, _ = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
        assert code == 0 and json.loads((out / "summary.json").read_text())["private"] is False


def test_a_deleted_search_config_is_written_back_and_the_search_goes_on(tmp_path, monkeypatch, capsys):
    out = _interrupted(tmp_path, monkeypatch, _config(tmp_path))
    text = (out / "config.toml").read_text()
    (out / "config.toml").unlink()
    # and entries the search writes or removes made links (its trials moved elsewhere, best/ pointing at a directory
    # of the user's): removed as links, never followed (the end was a raw OSError, and the search could not finish)
    shutil.move(out / "private" / "trials", tmp_path / "moved")
    (out / "private" / "trials").symlink_to(tmp_path / "moved")
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "kept.txt").write_text("mine")
    (out / "best").symlink_to(tmp_path / "users")
    assert run_search(None, out, resume=True, progress=False)["private"] is False  # seeded: never private
    assert (out / "config.toml").read_text() == text
    assert (out / "best").is_dir() and not (out / "best").is_symlink() and (out / "best" / "summary.json").exists()
    assert (tmp_path / "users" / "kept.txt").read_text() == "mine" and len(list((tmp_path / "users").iterdir())) == 1
    assert not (out / "private" / "trials").exists() and not list((tmp_path / "moved").iterdir())  # trials deleted


# --- 2. K and the best trial's index leave no trace in what is shared -----------------------------------------


def _shareable(out):
    """Every file and directory of a search directory but its secret private/ and best/private/."""
    found = []
    for root, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if d != "private"]
        found += [os.path.join(root, d) for d in dirs] + [os.path.join(root, f) for f in files]
    return found


def _search(tmp_path, capsys, seed, name):
    out = tmp_path / name
    code, stdout, err = _cli(capsys, "tune", "--config", str(_config(tmp_path, seed=seed, name=f"{name}.toml")),
                             "--out", str(out), "--json")
    assert code == 0
    return out, json.loads(stdout), err


def test_nothing_shareable_depends_on_the_number_of_trials_or_the_best_index(tmp_path, capsys):
    errs: dict[int, str] = {}  # K -> stderr (the searches' own number of trials, read from their secret state)
    for seed in range(12):
        out, shown, err = _search(tmp_path, capsys, seed, f"s{seed}")
        assert "not_private" not in shown and "trials_run" not in json.dumps(shown)  # K not in the output
        clock = re.sub(r"\r[^\r\n]*", "", err)  # (the clock's ticks: time, not trials)
        assert "trial" not in clock.replace("the number of trials is secret", "")
        paths = _shareable(out)
        assert paths
        for path in paths:
            if os.path.isfile(path) and not path.endswith((".pt", ".lock")):
                text = open(path).read()
                assert "private/trials" not in text and "trials_run" not in text, path
        assert len({os.stat(p).st_mtime_ns for p in [*paths, str(out)]}) == 1  # one time: no file dates a trial
        best = json.loads((out / "best" / "summary.json").read_text())
        assert "wall_time_s" not in json.dumps(best) and best["out"] == str(out / "best")
        k = len(RunDirectory(out).load_private(search_module.STATE)["trials"])
        errs[k] = re.sub(r"seed = \d+", "seed = N", clock.replace(str(out), "DIR"))
        if len(errs) == 2:
            break
    assert len(errs) == 2, "two of the seeds draw different numbers of trials"
    first, second = errs.values()
    assert first == second  # stderr reads the same whatever K is


def test_an_interrupted_search_says_how_to_resume_the_search_not_its_trial(tmp_path, monkeypatch, capsys):
    out = _interrupted(tmp_path, monkeypatch, _config(tmp_path))
    err = capsys.readouterr().err
    assert f"dptrain tune --resume {out}" in err
    assert "train --resume" not in err and "trials" not in err.replace("number of trials", "")


# --- 3. public validation only on a public test set -----------------------------------------------------------


def test_public_validation_on_a_split_of_the_private_data_is_refused(tmp_path, capsys):
    path = _config(tmp_path, tune="validation_is_public = true")
    code, _, err = _cli(capsys, "tune", "--config", str(path), "--out", str(tmp_path / "x"), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "validation_is_public" in err
    assert not (tmp_path / "x" / "summary.json").exists()
    declared = load_config(_config(tmp_path, data="test_is_public = true", tune="validation_is_public = true"))
    summary = run_search(declared, tmp_path / "declared", progress=False)
    assert summary["score"] == "test accuracy (public)"


# --- 4. a trial labelled not private labels the search ---------------------------------------------------------


class _RunningMean(nn.Module):
    """A logistic model that keeps a running mean of its inputs in a buffer (released unnoised, labelled)."""

    def __init__(self, dim, classes):
        super().__init__()
        self.lin = nn.Linear(dim, classes)
        self.register_buffer("running_mean", torch.zeros(dim))

    def forward(self, x):
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


def test_a_trial_labelled_not_private_makes_the_search_not_private(tmp_path, monkeypatch):
    monkeypatch.setattr("dptrain.runs.job.build_model", lambda name, shape, classes, **o: _RunningMean(shape[0], classes))
    cfg = load_config(_config(tmp_path, seed=None, training='buffer_updates = "not_private"'))
    summary = run_search(cfg, tmp_path / "s", progress=False)
    assert summary["private"] is False and summary["certified"] is False
    assert "running_mean" in " ".join(summary["not_private_because"])
    for path in ("summary.json", "best/summary.json"):
        written = json.loads((tmp_path / "s" / path).read_text())
        assert written["private"] is False and written["certified"] is False
    assert json.loads((tmp_path / "s" / "ledger.json").read_text())["private"] is False


# --- 5. best/ shows the search's certificate first, and the search's settings -----------------------------------


def test_best_shows_the_searchs_certificate_first_and_its_settings(tmp_path, capsys):
    out = tmp_path / "s"
    summary = run_search(load_config(_config(tmp_path, seed=None)), out, progress=False)
    best = json.loads((out / "best" / "summary.json").read_text())
    assert list(best)[:5] == ["epsilon", "delta", "accountant", "certified", "private"]
    assert best["epsilon"] == summary["epsilon"] and best["certified"] is True and best["accountant"] == "rdp"
    assert best["trial_alone"]["epsilon"] < best["epsilon"] and "NOT" in best["trial_alone"]["note"]
    assert "trials_mean = 2.0" in (out / "best" / "config.toml").read_text()  # the search's, not the default 10
    # every privacy number in best/ is the search's: its ledger, its attacker bound (rdp's search: no pld profile)
    assert json.loads((out / "best" / "ledger.json").read_text()) == json.loads((out / "ledger.json").read_text())
    assert best["membership_inference"]["tpr_at_fpr_1pct"] is None and "no_profile" in best["membership_inference"]
    assert all("epsilon" not in json.loads(row) for row in (out / "best" / "metrics.jsonl").read_text().splitlines())
    assert not (out / "best" / "private").exists()  # the trial's secret state is not in what is shared
    assert "wall_time_s" not in best and "seconds" not in best.get("gradient_check", {})
    code, stdout, _ = _cli(capsys, "tune", "--resume", str(out))  # the search's report
    assert code == 0 and f"{summary['epsilon']:.4g}" in stdout


# --- 6. every draw of a search from its secret streams ------------------------------------------------------------


def test_with_secure_noise_every_draw_of_a_search_comes_from_the_secure_stream(tmp_path, monkeypatch):
    numpy_rng = np.random.default_rng

    def no_numpy(*args, **kwargs):  # (the synthetic data's public generator may; the search may not)
        caller = inspect.stack()[1].filename
        assert "tuning" not in caller, f"{caller} drew from numpy's generator"
        return numpy_rng(*args, **kwargs)

    monkeypatch.setattr(np.random, "default_rng", no_numpy)
    out = tmp_path / "s"
    run_search(load_config(_config(tmp_path, seed=None, privacy="secure_noise = true")), out, progress=False)
    state = RunDirectory(out).load_private(search_module.STATE)
    assert state["origin"]["kind"] == "secure" and state["done"]
    # the held-out split of each trial: a stream of its own, AES-256-CTR keyed by four secret words
    trial = search_module.Trial(**state["trials"][0])
    split = search_module.Search(load_config(out / "config.toml")).held_out(trial)
    assert 0 < int(split.sum()) < len(split)


# --- 7. a finished search prints what it released, never an edited file ---------------------------------------


def test_a_finished_search_reports_from_its_state_and_refuses_an_edited_summary(tmp_path, capsys):
    out = tmp_path / "s"
    summary = run_search(load_config(_config(tmp_path, seed=None)), out, progress=False)
    again = run_search(None, out, resume=True, progress=False)
    public = lambda s: {k: v for k, v in s.items() if k != "not_private"}  # noqa: E731
    assert public(again) == public(summary)
    written = json.loads((out / "summary.json").read_text())
    shutil.copy(out / "summary.json", tmp_path / "kept.json")
    (out / "summary.json").write_text(json.dumps({**written, "epsilon": 0.0123}))
    capsys.readouterr()
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and "does not match" in err and len(err.strip().splitlines()) == 1
    (out / "summary.json").unlink()  # lost in a crash: published again from the state
    code, stdout, _ = _cli(capsys, "tune", "--resume", str(out), "--no-progress", "--json")
    assert code == 0 and json.loads(stdout)["epsilon"] == summary["epsilon"]
    assert (out / "summary.json").read_text() == (tmp_path / "kept.json").read_text()


def _birth_ns(path) -> int:
    """A file's birth time (statx, through GNU stat), in nanoseconds."""
    seconds, _, fraction = subprocess.run(["stat", "-c", "%w", str(path)], capture_output=True, text=True,
                                          check=True).stdout.split()[1].partition(".")
    h, m, s = seconds.split(":")
    return ((int(h) * 60 + int(m)) * 60 + int(s)) * 10**9 + int(fraction[:9].ljust(9, "0"))


def test_no_shareable_file_is_born_when_the_search_started(tmp_path):
    """Mtimes are set, but a file system also records when each file was born: the search's config.toml is written
    again when the search finishes, so no shareable file dates its start (the length of the search tracks K)."""
    if subprocess.run(["stat", "-c", "%w", str(tmp_path)], capture_output=True, text=True).stdout.strip() == "-":
        pytest.skip("this file system records no birth times")
    out = tmp_path / "s"
    run_search(load_config(_config(tmp_path, seed=None)), out, progress=False)
    first_trial_done = _birth_ns(out / "best" / "model.pt")  # (copied when the search finished)
    for name in ("config.toml", "ledger.json", "summary.json"):
        assert _birth_ns(out / name) >= first_trial_done, name


def test_a_search_interrupted_while_it_publishes_publishes_everything_again(tmp_path, monkeypatch):
    """Stopped after its files were written but before they were given one time, a search resumed as finished and
    left them so: its .lock dated the search's start, the others its end (its length tracks K)."""
    real, calls = release_module.same_times, {"n": 0}

    def interrupted_once(rd, when=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        real(rd, when)

    monkeypatch.setattr(release_module, "same_times", interrupted_once)
    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        run_search(load_config(_config(tmp_path, seed=None)), out, progress=False)
    os.utime(out / ".lock", (1e9, 1e9))  # (made when the search started)
    run_search(None, out, resume=True, progress=False)
    assert calls["n"] == 2
    assert len({os.stat(p).st_mtime_ns for p in [*_shareable(out), str(out)]}) == 1
    run_search(None, out, resume=True, progress=False)  # published: a resume publishes nothing again
    assert calls["n"] == 2
