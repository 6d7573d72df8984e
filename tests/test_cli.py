"""The command line: reference numbers, error handling, an end-to-end run, and resume."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_interrupted

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.runs.run import run_training

ACCOUNT = [
    "account",
    "--noise-multiplier",
    "1.1",
    "--sampling-rate",
    str(256 / 60000),
    "--steps",
    "14062",
    "--delta",
    "1e-5",
]

TINY = """
seed = 1
[data]
name = "synthetic"
options = { n = 300, dim = 8, num_classes = 2, separation = 3.0 }
test_is_public = true  # generated data: its test split is public
[model]
name = "logistic"
[privacy]
{privacy}
delta = 1e-5
max_grad_norm = 1.0
[training]
steps = 9
batch_size = 30
learning_rate = 0.5
eval_every = 3
"""


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_account_json_matches_dp_accounting(capsys):
    code, out, _ = run_cli(ACCOUNT + ["--accountant", "rdp", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["accountant"] == "rdp" and data["delta"] == 1e-5
    assert data["epsilon"] == pytest.approx(2.5966, abs=5e-4)
    # ... and exactly what dp_accounting itself says for the same event.
    import dp_accounting as dpa
    from dp_accounting.rdp import rdp_privacy_accountant

    direct = rdp_privacy_accountant.RdpAccountant()
    direct.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(256 / 60000, dpa.GaussianDpEvent(1.1)), 14062)
    )
    assert data["epsilon"] == direct.get_epsilon(1e-5)
    code, out, _ = run_cli(ACCOUNT + ["--accountant", "pld", "--json"], capsys)
    assert json.loads(out)["epsilon"] == pytest.approx(2.38, abs=0.01)
    # The default is the tightest certified accountant: pld here (rdp says 2.60 for the same ledger).
    code, out, _ = run_cli(ACCOUNT + ["--json"], capsys)
    assert json.loads(out)["accountant"] == "pld" and json.loads(out)["epsilon"] == pytest.approx(2.38, abs=0.01)


def test_account_all_marks_the_tightest_certified(capsys):
    code, out, _ = run_cli(ACCOUNT + ["--accountant", "all"], capsys)
    lines = {line.split(":")[0].strip(): line for line in out.strip().splitlines()}
    assert "tightest certified" in lines["pld"] and "approximation" in lines["gdp"]


def test_calibrate_round_trips_through_account(capsys):
    code, out, _ = run_cli(
        [
            "calibrate",
            "--epsilon",
            "2.0",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.01",
            "--epochs",
            "5",
            "--json",
        ],
        capsys,
    )
    cal = json.loads(out)
    assert code == 0 and cal["steps"] == 500
    code, out, _ = run_cli(
        [
            "account",
            "--noise-multiplier",
            repr(cal["noise_multiplier"]),
            "--sampling-rate",
            "0.01",
            "--steps",
            "500",
            "--delta",
            "1e-5",
            "--json",
        ],
        capsys,
    )
    # Calibration searches on pld's 10x coarser grid and certifies at the fine one: within 5e-4 of the target.
    assert json.loads(out)["epsilon"] == pytest.approx(2.0, rel=5e-4)
    assert json.loads(out)["epsilon"] <= 2.0


def test_full_batch_sampling_needs_no_rate_and_refuses_another(capsys):
    """--sampling full is rate 1: without --sampling-rate it accounts as with rate 1 (the rate used to be required),
    and a rate below 1 given with it is refused (it used to be silently ignored)."""
    base = ["account", "--sampling", "full", "--noise-multiplier", "1", "--steps", "10", "--delta", "1e-5", "--json"]
    code, out, _ = run_cli(base, capsys)
    code_1, out_1, _ = run_cli(base + ["--sampling-rate", "1"], capsys)
    assert code == code_1 == 0 and json.loads(out)["epsilon"] == json.loads(out_1)["epsilon"]
    code, out, err = run_cli(base + ["--sampling-rate", "0.5"], capsys)
    assert code == 2 and out == "" and "--sampling-rate must be 1 or left out with --sampling full" in err


@pytest.mark.parametrize("flag", ["--lipschitz 3", "--rdp-order 0.5", "--noise-std 1", "--batch-size 10",
                                  "--batching cyclic", "--strong-convexity 1"])
def test_a_last_iterate_flag_on_dp_sgds_path_is_refused_not_ignored(flag, capsys):
    """account's last_iterate flags used to be ignored by the DP-SGD accountants (the epsilon printed was that of the
    run without them, and --rdp-order <= 1 passed unchecked)."""
    base = ["account", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps", "100", "--delta", "1e-5"]
    code, out, err = run_cli(base + flag.split(), capsys)
    assert code == 2 and out == "" and f"{flag.split()[0]} goes with --accountant last_iterate" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (
            [
                "account",
                "--noise-multiplier",
                "-1",
                "--sampling-rate",
                "0.1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "--noise-multiplier must be a finite number > 0",
        ),
        (
            [
                "account",
                "--noise-multiplier",
                "1",
                "--sampling-rate",
                "1.5",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "--sampling-rate must be in (0, 1]",
        ),
        (
            ["account", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--steps", "10", "--delta", "1"],
            "--delta must be in (0, 1)",
        ),
        (
            ["calibrate", "--epsilon", "0", "--delta", "1e-5", "--sampling-rate", "0.1", "--steps", "10"],
            "--epsilon must be a number > 0",
        ),
        (
            ["calibrate", "--epsilon", "1", "--delta", "1e-5", "--sampling-rate", "0.1"],
            "needs --sampling-rate and one of --steps / --epochs",
        ),
        (
            [
                "account",
                "--noise-multiplier",
                "x",
                "--sampling-rate",
                "0.1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "expected a number",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def _config(tmp_path, privacy="noise_multiplier = 1.0", extra=""):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.replace("{privacy}", privacy) + extra)
    return path


@pytest.mark.parametrize(
    "privacy,extra,message",
    [
        ("noise_multiplier = 1.0\nnoise_multiplyer = 2", "", "unknown key 'privacy.noise_multiplyer'"),
        ("noise_multiplier = -0.5", "", "privacy.noise_multiplier must be a finite number > 0"),
        ("noise_multiplier = 0.0", "", "privacy.noise_multiplier must be a finite number > 0"),
        ("noise_multiplier = 1.0\nsecure_noise = 1", "", "privacy.secure_noise must be true/false"),
        ("noise_multiplier = 'lots'", "", "privacy.noise_multiplier must be a number"),
        ("target_epsilon = 0.0", "", "privacy.target_epsilon must be a finite number > 0"),
        ("noise_multiplier = 1.0", "[extra]\nx = 1\n", "unknown key 'extra'"),
        ("noise_multiplier = 1.0\ntarget_epsilon = 1.0", "", "set exactly one of"),
    ],
)
def test_bad_configs_exit_2_naming_the_key(tmp_path, privacy, extra, message, capsys):
    code, out, err = run_cli(
        [
            "train",
            "--config",
            str(_config(tmp_path, privacy, extra)),
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        capsys,
    )
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,message",
    [
        ("privacy.delta=1.0", "privacy.delta must be in (0, 1)"),
        ("privacy.delta=1e-5", None),  # sanity: a valid override is accepted
        ("data.path=/nonexistent/dir", "dataset 'synthetic' takes no path"),
        ('data.name="mnist"', "unknown option(s) dim, n, num_classes, separation for dataset 'mnist'"),
    ],
)
def test_set_overrides_are_validated(tmp_path, override, message, capsys):
    code, _, err = run_cli(
        [
            "train",
            "--config",
            str(_config(tmp_path)),
            "--set",
            override,
            "--out",
            str(tmp_path / "run"),
            "--no-progress",
            "--set",
            "training.steps=1",
        ],
        capsys,
    )
    if message is None:
        assert code == 0
    else:
        assert code == 2 and message in err


def test_missing_data_file_is_a_one_line_error(tmp_path, capsys):
    cfg = _config(tmp_path, extra="")
    text = cfg.read_text().replace(
        'name = "synthetic"\noptions = { n = 300, dim = 8, num_classes = 2, separation = 3.0 }',
        f'name = "npz"\npath = "{tmp_path}/missing.npz"\noptions = {{ num_classes = 2 }}',
    )
    cfg.write_text(text)
    code, _, err = run_cli(
        ["train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"], capsys
    )
    assert code == 2 and "missing.npz" in err and len(err.strip().splitlines()) == 1


def test_errors_have_no_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptrain.cli",
            "train",
            "--config",
            str(_config(tmp_path, "noise_multiplier = 1.0\nbogus = 1")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        "dptrain: error: unknown key 'privacy.bogus'; accepted keys in [privacy]: "
        "noise_multiplier, target_epsilon, delta, max_grad_norm, accountant, "
        "sampling, clipping, linf_p, secure_noise"
    )


def test_end_to_end_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = run_cli(
        ["train", "--config", str(_config(tmp_path)), "--out", str(out), "--no-progress", "--json"], capsys
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(stdout) == summary
    for key in (
        "epsilon",
        "delta",
        "accountant",
        "test_accuracy",
        "steps",
        "noise_multiplier",
        "sampling_rate",
    ):
        assert key in summary
    assert "wall_time_s" not in summary  # a time depends on the secret batch sizes (tests/test_clock_not_released.py)
    assert summary["steps"] == 9 and summary["finished"]
    # auto: the tightest certified accountant, the others beside it
    certified = {k: v["epsilon"] for k, v in summary["accountants"].items() if v.get("certified")}
    assert summary["accountant"] == min(certified, key=certified.get) and set(certified) >= {"rdp", "pld"}
    assert summary["sampling_rate"] == pytest.approx(30 / 240)
    assert summary["test_accuracy"] > 0.7  # separable synthetic data
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [3, 6, 9]
    assert metrics[-1]["epsilon"] == summary["epsilon"]
    assert [m["epsilon"] for m in metrics] == sorted(m["epsilon"] for m in metrics)
    assert json.loads((out / "ledger.json").read_text())["releases"] == 9
    assert load_config(out / "config.toml") == load_config(_config(tmp_path))
    assert (out / "private" / "checkpoint.pt").exists() and (out / "model.pt").exists()
    assert oct((out / "private").stat().st_mode & 0o777) == "0o700"
    # A second run into the same directory is refused and leaves the first run intact.
    before = (out / "ledger.json").read_text()
    code, _, err = run_cli(
        ["train", "--config", str(_config(tmp_path)), "--out", str(out), "--no-progress"], capsys
    )
    assert code == 2 and "already holds a run" in err and (out / "ledger.json").read_text() == before


def _final_state(out: Path) -> dict:
    return torch.load(out / "private" / "checkpoint.pt", weights_only=True)


@pytest.mark.parametrize("privacy", ["noise_multiplier = 1.0", "target_epsilon = 2.0"])
def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, privacy, monkeypatch):
    cfg = load_config(_config(tmp_path, privacy))
    full = run_training(cfg, tmp_path / "full", progress=False)

    # Interrupt in the middle of step 5 (after 4 completed steps), like a Ctrl-C.
    run_interrupted(cfg, tmp_path / "cut", 4, monkeypatch)
    assert json.loads((tmp_path / "cut" / "ledger.json").read_text())["releases"] == 4

    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    assert resumed["steps"] == full["steps"] == 9
    assert resumed["epsilon"] == full["epsilon"]
    assert resumed["noise_multiplier"] == full["noise_multiplier"]
    assert (tmp_path / "cut" / "ledger.json").read_text() == (tmp_path / "full" / "ledger.json").read_text()
    a, b = _final_state(tmp_path / "full"), _final_state(tmp_path / "cut")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


def test_stop_after_and_resume_from_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, _ = run_cli(
        [
            "train",
            "--config",
            str(_config(tmp_path)),
            "--out",
            str(out),
            "--no-progress",
            "--stop-after",
            "5",
        ],
        capsys,
    )
    assert code == 0 and json.loads((out / "summary.json").read_text())["finished"] is False
    code, _, _ = run_cli(["train", "--resume", str(out), "--no-progress"], capsys)
    summary = json.loads((out / "summary.json").read_text())
    assert code == 0 and summary["steps"] == 9 and summary["finished"]


def test_corrupt_checkpoint_is_refused_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    run_cli(
        [
            "train",
            "--config",
            str(_config(tmp_path)),
            "--out",
            str(out),
            "--no-progress",
            "--stop-after",
            "2",
        ],
        capsys,
    )
    data = (out / "private" / "checkpoint.pt").read_bytes()
    (out / "private" / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(["train", "--resume", str(out), "--no-progress"], capsys)
    assert code == 2 and "checkpoint.pt is corrupt" in err and len(err.strip().splitlines()) == 1


# --- the package: one module per command, shared flags defined once, a light parser ------------------------------


def test_every_command_is_one_module_with_the_same_interface():
    import dptrain.cli as cli

    names = [c.NAME for c in cli.COMMANDS]
    assert names == [
        "train",
        "tune",
        "account",
        "calibrate",
        "schedule",
        "plan",
        "audit",
        "reproduce",
        "utility-graph",
    ]
    for command in cli.COMMANDS:
        assert command.__name__ == "dptrain.cli." + command.NAME.replace("-", "_")
        assert isinstance(command.HELP, str) and callable(command.add_arguments) and callable(command.run)
    subparsers = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert list(subparsers.choices) == names


def test_shared_flags_are_the_same_flag_everywhere():
    from dptrain.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices

    def flag(command, name):
        return next(a for a in commands[command]._actions if name in a.option_strings)

    def same(a, b):  # one definition: the same type, default, choices, help and metavar
        keys = ("type", "default", "choices", "help", "metavar")
        return all(getattr(a, k) == getattr(b, k) for k in keys) and type(a) is type(b)

    for name in ("--config", "--set"):
        assert same(flag("train", name), flag("audit", name))
    assert flag("utility-graph", "--config").required and not flag("train", "--config").required
    for name in ("--sampling-rate", "--sampling", "--delta", "--steps"):
        assert same(flag("account", name), flag("calibrate", name))
    assert flag("account", "--steps").required and not flag("calibrate", "--steps").required
    assert flag("account", "--accountant").choices == [*flag("calibrate", "--accountant").choices, "all"]
    assert flag("account", "--accountant").default == flag("calibrate", "--accountant").default == "auto"
    assert flag("plan", "--delta").type is flag("account", "--delta").type
    for command in set(commands) - {"reproduce"}:
        assert type(flag(command, "--json")).__name__ == "_StoreTrueAction"


def test_the_parsers_names_are_the_registries():
    """The names the parser offers without importing the accountants are theirs."""
    from dptrain.accounting import AUTO, accountant_names
    from dptrain.cli import common, plan
    from dptrain.proactive.planner import PLAN_ACCOUNTANTS

    assert common.AUTO == AUTO and common.ACCOUNTANTS == accountant_names()
    assert plan.PLAN_ACCOUNTANTS == PLAN_ACCOUNTANTS


def test_account_and_calibrate_reason_about_the_run_numbers(capsys):
    """The ledger of `account` is the planned ledger of RunNumbers (the one dpsgd_ledger gives for Poisson steps),
    and `calibrate --epochs` certifies the steps RunNumbers plans for those epochs, as `dptrain train` trains them."""
    import argparse

    from dptrain.accounting import RunNumbers, dpsgd_ledger
    from dptrain.cli.common import run_numbers

    args = argparse.Namespace(sampling="poisson", sampling_rate=256 / 60000, steps=14062)
    assert run_numbers(args).ledger(1.1) == dpsgd_ledger(1.1, 256 / 60000, 14062, "poisson")
    args = argparse.Namespace(sampling="full", sampling_rate=1.0, steps=7, epochs=None)
    assert run_numbers(args).ledger(3.0) == dpsgd_ledger(3.0, 1.0, 7, "full")
    for sampling, rate, epochs in [("poisson", "0.0042666666666666667", "1"), ("full", "1", "3")]:
        code, out, _ = run_cli(
            ["calibrate", "--epsilon", "3", "--delta", "1e-5", "--sampling-rate", rate, "--epochs", epochs]
            + ["--sampling", sampling, "--accountant", "rdp", "--json"],
            capsys,
        )
        planned = RunNumbers.planned(sampling, sampling_rate=float(rate), epochs=float(epochs))
        assert code == 0 and json.loads(out)["steps"] == planned.steps == (234 if sampling == "poisson" else 3)
        assert json.loads(out)["sampling_rate"] == planned.sampling_rate


def test_main_exit_codes(monkeypatch, capsys):
    import dptrain.auditing.runner
    import dptrain.config
    from dptrain.cli import reproduce
    from dptrain.engine.interrupts import Terminated

    def raising(exc):
        def run(args):
            raise exc

        return run

    monkeypatch.setattr(reproduce, "run", raising(KeyboardInterrupt))
    assert main(["reproduce", "audit"]) == 130
    monkeypatch.setattr(reproduce, "run", raising(Terminated))
    assert main(["reproduce", "audit"]) == Terminated.exit_code == 143
    # an audit whose lower bound exceeds the certificate: exit code 1 and a FAILED verdict
    result = {
        "epsilon_lower_bound": 2.0,
        "epsilon_certified": 1.0,
        "confidence": 0.95,
        "canaries": 10,
        "guesses": 4,
        "correct": 4,
        "kind": "input",
        "accountant": "pld",
        "delta": 1e-5,
        "setting": "dpsgd",
        "ceiling": 5.0,
        "verdict": "violation",
        "score": "loss",
        "injected_bug": None,
    }
    monkeypatch.setattr(dptrain.config, "load_config", lambda path, overrides: None)
    monkeypatch.setattr(dptrain.auditing.runner, "audit_run", lambda cfg, **kw: result)
    assert main(["audit", "--config", "any.toml"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAILED: the lower bound 2.0000 exceeds")


def test_the_progress_bar_ends_on_the_runs_epsilon(tmp_path, monkeypatch, capsys):
    """The bar shows the epsilon of the last evaluation (never refreshed on a timer: the clock would choose the steps).
    Its last value must still be the epsilon of the whole run (the summary's), not the last evaluation's (which is
    smaller: without the final refresh the bar closes on it)."""
    summary = run_training(load_config(_config(tmp_path)), tmp_path / "out", progress=True)
    shown = re.findall(r"eps=([0-9.]+)", capsys.readouterr().err)
    assert shown and shown[-1] == f"{summary['epsilon']:.3f}", shown
