"""Every command's ``--json`` says whether what it prints is private, read from the parser (a command added with
``--json`` and no line here fails): a seeded run, an audit trained with a deliberately broken stage and a model trained
without noise say ``private: false`` and why; a command that reads no data (the accounting calculators) says
``private: true``. Before, ``dptrain audit --inject-bug noise/100 --json`` said ``private: true`` (its canaries were
scored on a model trained with a hundredth of the noise) and account, calibrate, plan and schedule had no ``private``."""

import argparse
import json

import pytest

from dptrain import cli

CONFIG = """\
seed = 1
[data]
name = "synthetic"
options = { n = 40, dim = 2, num_classes = 2, separation = 3.0 }
[model]
name = "logistic"
[privacy]
noise_multiplier = 2.0
delta = 1e-3
accountant = "rdp"
sampling = "full"
[training]
steps = 1
batch_size = 10
[tune]
trials_mean = 1.0
validation_fraction = 0.2
[tune.space]
"training.learning_rate" = { choice = [0.5] }
"""

#: One cheap invocation of each command that has --json (config: CONFIG, seeded; unseeded: CONFIG without its seed;
#: search: CONFIG with a budget, as a search needs),
#: and whether its JSON must say private (False: it must also say why).
RUNS = {
    "train": (["train", "--config", "{config}", "--out", "{tmp}/train", "--no-progress"], False),
    "tune": (["tune", "--config", "{search}", "--out", "{tmp}/tune", "--no-progress"], False),
    "audit": (["audit", "--config", "{unseeded}", "--canaries", "4", "--inject-bug", "noise/10"], False),
    "utility-graph": (["utility-graph", "--config", "{config}", "--clips", "1", "--sigmas", "1", "--draws", "1",
                       "--out", "{tmp}/graph"], False),
    "account": (["account", "--sampling", "full", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5"],
                True),
    "calibrate": (["calibrate", "--mechanism", "gaussian", "--epsilon", "1", "--delta", "1e-5"], True),
    "plan": (["plan", "--from-sigma", "2", "--dataset-size", "1000", "--epochs", "2"], True),
    "schedule": (["schedule", "--kind", "uniform", "--steps", "5", "--rho", "1"], True),
}


def commands_with_json() -> list[str]:
    names = []
    for action in cli.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, parser in action.choices.items():
                if any("--json" in a.option_strings for a in parser._actions):
                    names.append(name)
    return names


def test_every_command_with_json_is_listed_here():
    assert sorted(commands_with_json()) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_commands_json_says_whether_it_is_private(name, tmp_path, capsys):
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "u.toml").write_text(CONFIG.replace("seed = 1\n", ""))
    argv, private = RUNS[name]
    (tmp_path / "s.toml").write_text(CONFIG.replace("noise_multiplier = 2.0", "target_epsilon = 8.0"))
    files = {"config": tmp_path / "c.toml", "unseeded": tmp_path / "u.toml", "search": tmp_path / "s.toml"}
    argv = [a.format(tmp=tmp_path, **files) for a in argv] + ["--json"]
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["private"] is private
    if not private:
        assert out["not_private_because"], out


def test_only_train_runs_under_torchrun(tmp_path, capsys, monkeypatch):
    """Every command but train launched by torchrun (WORLD_SIZE > 1) is refused before it reads anything: each rank
    would draw its own secrets (a search's number of trials, an audit's canaries) and write its own outputs. Before, a
    search under torchrun ran its trials once per rank, unshared."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    names = [n for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices]
    assert sorted(names) == sorted(c.NAME for c in cli.COMMANDS)
    for command in cli.COMMANDS:
        if command.NAME == "train" or not getattr(command, "READS_DATA", True):
            cli._one_process_unless_train(command)  # (train, and the calculators, which read no data: every rank)
            assert command.NAME == "train" or RUNS[command.NAME][1] is True  # (their JSON says private: true)
            continue
        with pytest.raises(cli.ConfigError, match=f"dptrain {command.NAME} runs in one process"):
            cli._one_process_unless_train(command)
    (tmp_path / "s.toml").write_text(CONFIG.replace("noise_multiplier = 2.0", "target_epsilon = 8.0"))
    code = cli.main(["tune", "--config", str(tmp_path / "s.toml"), "--out", str(tmp_path / "tune"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "WORLD_SIZE is 2" in err
    assert not (tmp_path / "tune").exists()
    from dptrain.tuning.search import run_search  # (the Python API's search too)

    with pytest.raises(cli.ConfigError, match="a search runs in one process"):
        run_search(None, tmp_path / "api")
