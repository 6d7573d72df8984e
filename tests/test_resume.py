"""What a resume may change, and run directories that can always be resumed or restarted (each test fails on the
engine before it): a config edited between --stop-after and --resume used to change the certificate silently, and a
run stopped before its first checkpoint left a directory that could be neither resumed nor started again."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.cli import main
from dptrain.errors import ConfigError
from dptrain.runs.rundir import CONFIG, PREPROCESSING

TOML = """\
[data]
name = "synthetic"
options = {{ n = 600, dim = 6, num_classes = 2, separation = 3.0 }}
test_is_public = true
[model]
name = "logistic"
[privacy]
{privacy}
delta = 1e-05
[training]
epochs = 2.0
batch_size = 100
learning_rate = {lr}
"""


def _config(tmp_path, privacy="target_epsilon = 2.0", lr="1.0", name="c.toml") -> Path:
    path = tmp_path / name
    path.write_text(TOML.format(privacy=privacy, lr=lr))
    return path


def _cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _stopped(tmp_path, capsys, privacy="target_epsilon = 2.0") -> Path:
    out = tmp_path / "run"
    code, _, _ = _cli(capsys, "train", "--config", str(_config(tmp_path, privacy)), "--out", str(out), "--no-progress",
                      "--stop-after", "3")
    assert code == 0
    return out


def _edit(out: Path, old: str, new: str) -> None:
    text = (out / CONFIG).read_text()
    assert old in text, text
    (out / CONFIG).write_text(text.replace(old, new))


@pytest.mark.parametrize(
    "old,new,key",
    [
        ("delta = 1e-05", "delta = 0.001", "privacy.delta"),
        ("target_epsilon = 2.0", "target_epsilon = 20.0", "privacy.target_epsilon"),
        ("n = 600", "n = 900", "data.options.n"),
        ("batch_size = 100", "batch_size = 50", "training.batch_size"),
        ('name = "logistic"', 'name = "mlp"', "model.name"),
        ("learning_rate = 1.0", "learning_rate = 0.5", "training.learning_rate"),
    ],
)
def test_a_resume_refuses_a_changed_config_listing_the_keys(tmp_path, capsys, old, new, key):
    out = _stopped(tmp_path, capsys)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != CONFIG}
    _edit(out, old, new)
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"changed since the run started ({key})" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != CONFIG} == before


def test_a_changed_noise_multiplier_is_refused_too(tmp_path, capsys):
    out = _stopped(tmp_path, capsys, privacy="noise_multiplier = 1.0")
    _edit(out, "noise_multiplier = 1.0", "noise_multiplier = 3.0")
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and "(privacy.noise_multiplier)" in err


def test_keys_that_change_nothing_released_may_change(tmp_path, capsys):
    out = _stopped(tmp_path, capsys)
    _edit(out, "learning_rate = 1.0", "learning_rate = 1.0\neval_every = 2\nmax_physical_batch_size = 7")
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--json")
    assert code == 0, err


def test_more_epochs_stay_within_the_budget_the_run_started_with(tmp_path, capsys):
    import json

    out = _stopped(tmp_path, capsys)
    _edit(out, "epochs = 2.0", "epochs = 20.0")
    code, stdout, err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--json")
    summary = json.loads(stdout)
    assert code == 0 and summary["epsilon"] <= 2.0 and summary["steps"] < 20 * 6  # the budget stopped it


def test_more_epochs_at_a_fixed_noise_multiplier_are_refused(tmp_path, capsys):
    out = _stopped(tmp_path, capsys, privacy="noise_multiplier = 1.0")
    _edit(out, "epochs = 2.0", "epochs = 20.0")
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and "may change on resume only for a run with a privacy budget" in err


def test_a_deleted_config_is_written_back_and_a_damaged_copy_refused(tmp_path, capsys):
    out = _stopped(tmp_path, capsys)
    original = (out / CONFIG).read_text()
    (out / CONFIG).unlink()
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--stop-after", "1")
    assert code == 0 and (out / CONFIG).read_text() == original
    state = torch.load(out / "private" / "checkpoint.pt", weights_only=True)
    state["config"] = state["config"].replace("delta = 1e-05", "delta = 0.001")
    torch.save(state, out / "private" / "checkpoint.pt")
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and "does not match its hash" in err


def test_delta_of_one_over_n_or_more_is_refused_by_the_cli(tmp_path, capsys):
    config = _config(tmp_path)
    config.write_text(config.read_text().replace("delta = 1e-05", "delta = 0.5"))
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "r"), "--no-progress")
    assert code == 2 and "delta must be below 1/n" in err and not (tmp_path / "r" / "summary.json").exists()


# --- a directory with no released step is resumable and restartable --------------------------------------------


@pytest.mark.parametrize("lr", ["1e39"])
def test_a_run_that_fails_at_step_one_can_be_resumed_or_restarted(tmp_path, capsys, lr):
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "--config", str(_config(tmp_path, lr=lr)), "--out", str(out), "--no-progress")
    assert code == 2 and "diverged" in err or "not finite" in err
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")  # resumable: the same error again
    assert code == 2 and "does not exist" not in err and ("diverged" in err or "not finite" in err)
    code, _, err = _cli(capsys, "train", "--config", str(_config(tmp_path)), "--out", str(out), "--no-progress")
    assert code == 0, err  # and restartable, with the config fixed


def test_data_that_overflows_at_step_one_leaves_a_restartable_directory(tmp_path, capsys):
    import numpy as np

    x = np.full((300, 4), 1e30, dtype="float32")
    np.savez(tmp_path / "big.npz", x=x, y=np.zeros(300, dtype="int64"))
    config = tmp_path / "big.toml"
    config.write_text(
        f'[data]\nname = "npz"\npath = "{tmp_path / "big.npz"}"\noptions = {{ num_classes = 2 }}\n'
        '[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 1.0\n[training]\nsteps = 3\nbatch_size = 30\n'
    )
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(out), "--no-progress")
    assert code == 2, err
    code, _, err = _cli(capsys, "train", "--config", str(_config(tmp_path)), "--out", str(out), "--no-progress")
    assert code == 0, err


def test_a_directory_stopped_before_its_first_checkpoint_is_resumable_and_restartable(tmp_path, capsys):
    # what a run killed between writing its config and its first checkpoint left (or an older dptrain's directory)
    for mode in ("resume", "restart"):
        out = tmp_path / mode
        out.mkdir()
        (out / ".lock").touch()
        (out / CONFIG).write_text(_config(tmp_path).read_text())
        args = ["--resume", str(out)] if mode == "resume" else ["--config", str(_config(tmp_path)), "--out", str(out)]
        code, _, err = _cli(capsys, "train", *args, "--no-progress")
        assert code == 0, (mode, err)


def test_released_files_lost_before_they_were_written_come_back_from_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    config = _config(tmp_path)
    config.write_text(
        config.read_text() + '[preprocessing]\nkind = "private_mean"\nfeature_norm = 1.0\neps_f = 0.1\n'
    )
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(out), "--no-progress", "--stop-after", "1")
    assert code == 0, err
    released = (out / PREPROCESSING).read_text()
    (out / PREPROCESSING).unlink()  # a crash between the checkpoint and this file
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(out), "--no-progress")
    assert code == 2 and "already holds a run" in err  # the private mean was released: no fresh start
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 0 and (out / PREPROCESSING).read_text() == released


def _spawn(config: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}
    return subprocess.Popen(
        [sys.executable, "-m", "dptrain.cli", "train", "--config", str(config), "--out", str(out), "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True,
    )


@pytest.mark.slow
def test_kill_9_and_a_signal_in_the_first_moments_leave_a_resumable_or_restartable_directory(tmp_path, capsys):
    config = _config(tmp_path)
    config.write_text(config.read_text().replace("epochs = 2.0", "epochs = 400.0"))
    for i, (sig, when) in enumerate([(signal.SIGKILL, "lock"), (signal.SIGKILL, "checkpoint"), (signal.SIGTERM, "lock")]):
        out = tmp_path / f"run{i}"
        proc = _spawn(config, out)
        target = out / ".lock" if when == "lock" else out / "private" / "checkpoint.pt"
        deadline = time.monotonic() + 60
        while not target.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        resumed, _, resume_err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--stop-after", "1")
        restarted, _, restart_err = _cli(
            capsys, "train", "--config", str(config), "--out", str(out), "--no-progress", "--stop-after", "1"
        )
        # Either the directory held nothing (resume says so, a fresh run starts), or a run of 0 or more steps (resume
        # continues it; a fresh run is then refused only because a step was released).
        assert resumed == 0 or "holds no run to resume" in resume_err, (sig, when, resume_err)
        assert restarted == 0 or "already holds a run" in restart_err, (sig, when, restart_err)
        assert resumed == 0 or restarted == 0, (sig, when)


# --- what a resume reads again: the data, and a finished run's summary -------------------------------------------


def _npz_config(tmp_path, rows: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 4)).astype("float32")
    np.savez(tmp_path / "data.npz", x=x, y=(x[:, 0] > 0).astype("int64"))
    config = tmp_path / "npz.toml"
    config.write_text(
        f'[data]\nname = "npz"\npath = "{tmp_path / "data.npz"}"\noptions = {{ num_classes = 2 }}\n'
        '[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 1.0\ndelta = 1e-4\n'
        "[training]\nsteps = 6\nbatch_size = 30\n"
    )
    return config


def test_data_replaced_between_a_stop_and_a_resume_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    config = _npz_config(tmp_path, 1000)
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(out), "--no-progress", "--stop-after", "2")
    assert code == 0, err
    kept = (tmp_path / "data.npz").read_bytes()
    _npz_config(tmp_path, 300)  # the file swapped for another of 300 rows, the config unchanged
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "data changed since the run started" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    (tmp_path / "data.npz").write_bytes(kept)  # restored: the run goes on
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--json")
    assert code == 0, err


def test_a_finished_run_reports_from_its_checkpoint_never_from_an_edited_summary(tmp_path, capsys):
    import json

    out = tmp_path / "run"
    code, first, _ = _cli(capsys, "train", "--config", str(_config(tmp_path)), "--out", str(out), "--no-progress",
                          "--json")
    assert code == 0
    summary = json.loads(first)
    (out / "summary.json").write_text(json.dumps({**summary, "epsilon": 0.0123}))
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "summary.json does not match" in err
    (out / "summary.json").unlink()  # lost (a crash after the checkpoint): written back
    code, stdout, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 0 and "has finished" in err and f"epsilon = {summary['epsilon']:.4f}" in stdout
    assert json.loads((out / "summary.json").read_text()) == summary
    # its config.toml says what ran: an edit, even of a key an unfinished run's resume may change, is refused too
    kept = (out / CONFIG).read_text()
    for old, new in (("delta = 1e-05", "delta = 1e-09"), ("epochs = 2.0", "epochs = 4.0")):
        _edit(out, old, new)
        code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "changed since the run started" in err, err
        (out / CONFIG).write_text(kept)
    # and through the Python API: a config given with resume=True was ignored without a word
    from dptrain.config import load_config
    from dptrain.runs.run import run_training
    from dptrain.tuning.search import run_search

    with pytest.raises(ConfigError, match="takes no other"):
        run_training(load_config(_config(tmp_path, lr="3.0", name="other.toml")), out, resume=True)
    with pytest.raises(ConfigError, match="takes no other"):
        run_search(load_config(_config(tmp_path, lr="3.0", name="other.toml")), out, resume=True)


def test_a_stopped_run_is_not_finished_by_an_edited_summary(tmp_path, capsys):
    """An unfinished run's checkpoint keeps no summary: a summary.json edited to say finished (with another epsilon)
    is neither printed as the run's report nor stops the resume (it did, read as an older dptrain's checkpoint)."""
    import json

    out = _stopped(tmp_path, capsys)
    (out / "summary.json").write_text(json.dumps({"finished": True, "epsilon": 0.0123, "steps": 3}))
    code, stdout, err = _cli(capsys, "train", "--resume", str(out), "--no-progress", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["finished"] and summary["epsilon"] > 1.0 and summary["steps"] > 3


@pytest.mark.parametrize("key", ["config", "data_sha256"])
def test_a_checkpoint_that_keeps_no_record_of_its_start_is_refused(tmp_path, capsys, key):
    """Without its frozen config or its data's fingerprint a checkpoint cannot hold a resume to how the run started:
    refused in one line (both were skipped, as an older dptrain's checkpoint, so config.toml or the data could change)."""
    out = _stopped(tmp_path, capsys)
    path = out / "private" / "checkpoint.pt"
    state = torch.load(path, weights_only=False)
    del state[key]
    torch.save(state, path)
    if key == "config":
        _edit(out, "learning_rate = 1.0", "learning_rate = 3.0")
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "keeps no" in err, err


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize("option", [["--out", "elsewhere"], ["--plan", "plan.json"]])
def test_a_resume_takes_no_option_that_it_would_ignore(tmp_path, capsys, command, option):
    if command == "tune" and option[0] == "--plan":
        option = ["--trials-mean", "3"]
    code, _, err = _cli(capsys, command, "--resume", str(tmp_path / "run"), *option, "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "do not combine it" in err


def _outputs(out: Path) -> tuple:
    model = torch.load(out / "model.pt", weights_only=True)
    return (out / "ledger.json").read_text(), (out / "metrics.jsonl").read_text(), model


def _same(a: tuple, b: tuple) -> bool:
    def equal(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        return x == y

    return a[:2] == b[:2] and equal(a[2], b[2])


VALIDATION = (
    "seed = 1\n"
    + TOML.format(privacy="target_epsilon = 4.0", lr="0.5").replace("epochs = 2.0", "steps = 8\neval_every = 2")
    + '[schedule]\nkind = "validation"\noptions = { factor = 0.5, patience = 1, min_delta = 0.0, initial = 1.0 }\n'
)


@pytest.mark.parametrize("at", [1, 3])  # a signal during step 2 or 4, each evaluated (adaptive noise reads it)
def test_a_signal_during_a_step_waits_for_its_evaluation_and_checkpoint(tmp_path, capsys, monkeypatch, at):
    """Ctrl-C during a step used to stop the run after the step but before its evaluation: the checkpoint then
    held a step whose evaluation never happened, and adaptive noise resumed into another run."""
    from dptrain.engine.trainer import PrivateTrainer

    config = tmp_path / "v.toml"
    config.write_text(VALIDATION)
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "full"), "--no-progress")
    assert code == 0, err
    real = PrivateTrainer.privatize

    def privatize(self, *args, **kwargs):
        if self.steps == at:
            signal.raise_signal(signal.SIGINT)  # arrives inside the step, as a Ctrl-C would
        return real(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(PrivateTrainer, "privatize", privatize)
        code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "cut"), "--no-progress")
    assert code == 130, err
    assert torch.load(tmp_path / "cut" / "private" / "checkpoint.pt", weights_only=True)["steps"] == at + 1
    code, _, err = _cli(capsys, "train", "--resume", str(tmp_path / "cut"), "--no-progress")
    assert code == 0, err
    assert _same(_outputs(tmp_path / "full"), _outputs(tmp_path / "cut"))


@pytest.mark.parametrize("kill", ["after its final evaluation", "in the middle of a metrics row"])
def test_a_run_killed_while_writing_its_metrics_resumes_into_the_uninterrupted_one(tmp_path, capsys, monkeypatch, kill):
    """A kill after the final evaluation (before the finished checkpoint) used to write that row twice on resume; a
    kill in the middle of a row (a line without its newline) made the resume fail with a traceback."""
    import dptrain.runs.run as run

    config = _config(tmp_path, privacy="noise_multiplier = 1.0")
    config.write_text("seed = 1\n" + config.read_text().replace("epochs = 2.0", "steps = 5\nema = 0.9"))
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "full"), "--no-progress")
    assert code == 0, err

    class Killed(BaseException):
        pass

    def killed(*args, **kwargs):
        raise Killed

    cut = tmp_path / "cut"
    if kill == "after its final evaluation":
        with monkeypatch.context() as m:
            m.setattr(run, "save_averaged", killed)  # after the final row, before the model and the summary
            with pytest.raises(Killed):
                main(["train", "--config", str(config), "--out", str(cut), "--no-progress"])
    else:
        code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(cut), "--no-progress",
                            "--stop-after", "3")
        assert code == 0, err
        with open(cut / "metrics.jsonl", "a") as f:
            f.write('{"step": 4, "epoch": 1.0, "eps')  # the row a kill cut short
    code, _, err = _cli(capsys, "train", "--resume", str(cut), "--no-progress")
    assert code == 0, err
    full, resumed = _outputs(tmp_path / "full"), _outputs(cut)
    if kill != "after its final evaluation":  # (--stop-after evaluated step 3 too)
        resumed = (resumed[0], "".join(r + "\n" for r in resumed[1].splitlines() if '"step": 3,' not in r), resumed[2])
    assert _same(full, resumed)
