"""A run or a search writes only into a directory it made, or an empty one, and alters only the files it wrote.

Before: ``dptrain train --config config.toml --out .`` in a project directory took the user's ``config.toml`` for a run
that had released nothing, deleted it and wrote the resolved config in its place (the user's comments lost); ``dptrain
tune --out DIR`` on a directory holding the user's files wrote every one of them again at its end (an executable
script lost its x bit) and gave them all the search's time."""

import json
import os
import stat

import pytest

from dptrain.cli import main

RUN = """\
[data]
name = "synthetic"
options = { n = 200, dim = 4, num_classes = 2, separation = 3.0 }
[model]
name = "logistic"
[privacy]
target_epsilon = 2.0
delta = 1e-5
[training]
epochs = 1
batch_size = 40
learning_rate = 0.5
"""
TUNE = RUN + """\
[tune]
trials_mean = 1.0
validation_fraction = 0.2
[tune.space]
"training.learning_rate" = { log_uniform = [0.1, 2.0] }
"""


def _cli(capsys, *args):
    code = main([*args, "--no-progress"])
    return code, capsys.readouterr().err


def _users_files(directory):
    directory.mkdir()
    (directory / "config.toml").write_text("# my own notes\n" + RUN)
    script = directory / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    os.utime(script, (1e9, 1e9))
    return script


@pytest.mark.parametrize("command,text", [("train", RUN), ("tune", TUNE)])
def test_a_run_or_a_search_is_refused_a_directory_holding_files_it_did_not_make(tmp_path, capsys, command, text):
    config = tmp_path / "c.toml"
    config.write_text(text)
    out = tmp_path / "mine"
    script = _users_files(out)
    code, err = _cli(capsys, command, "--config", str(config), "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds files that are not a dptrain run's (config.toml, run.sh)" in err
    assert sorted(os.listdir(out)) == ["config.toml", "run.sh"]  # nothing written, nothing removed
    assert (out / "config.toml").read_text().startswith("# my own notes")
    assert stat.S_IMODE(script.stat().st_mode) == 0o755 and script.stat().st_mtime == 1e9


def test_a_search_publishing_again_leaves_a_file_the_user_put_there_as_it_is(tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text(TUNE)
    out = tmp_path / "search"
    code, err = _cli(capsys, "tune", "--config", str(config), "--out", str(out))
    assert code == 0, err
    script = out / "notes.sh"  # the user's, put beside the search's files afterwards
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    os.utime(script, (1e9, 1e9))
    inode = script.stat().st_ino
    summary = (out / "summary.json").read_text()
    (out / "summary.json").unlink()  # (lost: the resume publishes the search's files again)
    code, err = _cli(capsys, "tune", "--resume", str(out))
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text()) == json.loads(summary)
    assert script.stat().st_ino == inode and stat.S_IMODE(script.stat().st_mode) == 0o755
    assert script.stat().st_mtime == 1e9
    times = {(out / name).stat().st_mtime_ns for name in ("config.toml", "ledger.json", "summary.json", "best", ".lock")}
    assert len(times) == 1  # the search's own files: one time
    code, err = _cli(capsys, "train", "--config", str(config), "--out", str(out / "best"))
    assert code == 2 and "already holds a run; choose another --out" in err  # (a copy without its checkpoint)


def test_a_refused_search_or_run_leaves_no_directory_behind(tmp_path, capsys):
    """Refused after it claimed its directory (here: a search scoring on a test split cut from the private examples,
    refused when the data is loaded; a run whose data file is missing), nothing is left: the directory it made is
    removed, an empty one the user gave keeps nothing but what it had (it used to keep a stray .lock, and a second try
    then met a directory dptrain had made)."""
    tune = tmp_path / "tune.toml"
    tune.write_text(TUNE.replace("validation_fraction = 0.2", "validation_is_public = true"))
    code, err = _cli(capsys, "tune", "--config", str(tune), "--out", str(tmp_path / "new"))
    assert code == 2 and "validation_is_public" in err and not (tmp_path / "new").exists()
    (tmp_path / "given").mkdir()
    assert _cli(capsys, "tune", "--config", str(tune), "--out", str(tmp_path / "given"))[0] == 2
    assert list((tmp_path / "given").iterdir()) == []
    run = tmp_path / "run.toml"
    run.write_text(RUN.replace('name = "synthetic"\noptions = { n = 200, dim = 4, num_classes = 2, separation = 3.0 }',
                               f'name = "npz"\npath = "{tmp_path / "missing.npz"}"\noptions = {{ num_classes = 2 }}'))
    code, err = _cli(capsys, "train", "--config", str(run), "--out", str(tmp_path / "run"))
    assert code == 2 and "file not found" in err
    assert not (tmp_path / "run").exists()
