"""``dptrain schedule``: the noise schedules of Dynamic Noise Influence ("On Dynamic Noise Influence in
Differential Private Learning", anonymous ICLR 2021 submission) and its bounds, through the command line
(in-process)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.cli import main
from dptrain.schedules.bounds import bound_summary
from dptrain.schedules.kinds import calibrate_schedule

GD = ["schedule", "--kind", "gd-optimal", "--steps", "60", "--kappa", "10"]
BUDGET = ["--epsilon", "2", "--delta", "1e-6"]


def run_cli(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def schedule_json(argv, capsys) -> dict:
    code, out, err = run_cli([*argv, "--json"], capsys)
    assert code == 0 and err == "", err
    assert len(out.strip().splitlines()) == 1
    return json.loads(out)


def test_json_is_the_schedule_calibrate_schedule_gives(capsys):
    data = schedule_json([*GD, *BUDGET], capsys)
    assert {"noise_multipliers", "epsilon", "delta", "accountant", "rho", "R", "kind"} <= data.keys()
    assert len(data["noise_multipliers"]) == 60 and data["accountant"] == "exact"  # the full-batch default
    direct = calibrate_schedule("gd-optimal", 60, epsilon=2.0, delta=1e-6, accountant="exact", kappa=10.0)
    assert data["noise_multipliers"] == direct.to_json()["noise_multipliers"]
    assert data["epsilon"] == direct.epsilon and data["rho"] == direct.rho and data["R"] == direct.R
    # Subsampled steps: rdp by default, the sampling rate passed through.
    data = schedule_json([*GD, *BUDGET, "--sampling-rate", "0.05"], capsys)
    direct = calibrate_schedule(
        "gd-optimal", 60, epsilon=2.0, delta=1e-6, accountant="rdp", sampling_rate=0.05, kappa=10.0
    )
    assert data["accountant"] == "rdp" and data["noise_multipliers"] == list(direct.sigmas)
    # A zCDP budget: zcdp by default.
    data = schedule_json([*GD, "--R", "0.4"], capsys)
    assert data["accountant"] == "zcdp" and data["rho"] == pytest.approx(0.2, rel=1e-12)


def test_zcdp_spends_exactly_R(capsys):
    data = schedule_json([*GD, *BUDGET, "--accountant", "zcdp"], capsys)
    sigmas = np.array(data["noise_multipliers"])
    assert math.fsum(sigmas**-2.0) == pytest.approx(data["R"], rel=1e-9)
    assert sigmas[0] > sigmas[-1]  # gd-optimal: the noise decreases (Thm 4.3)
    data = schedule_json([*GD, "--R", "0.4"], capsys)
    assert math.fsum(np.array(data["noise_multipliers"]) ** -2.0) == pytest.approx(0.4, rel=1e-9)


def test_exact_spends_the_budget_with_18_percent_less_noise_than_zcdp(capsys):
    exact = schedule_json([*GD, *BUDGET, "--accountant", "exact"], capsys)
    zcdp = schedule_json([*GD, *BUDGET, "--accountant", "zcdp"], capsys)
    sigmas = np.array(exact["noise_multipliers"])
    mu = math.sqrt(math.fsum(sigmas**-2.0))
    assert gdp_epsilon(mu, 1e-6) == pytest.approx(2.0, rel=1e-9) and exact["epsilon"] <= 2.0
    ratio = sigmas / np.array(zcdp["noise_multipliers"])
    assert np.allclose(ratio, ratio[0], rtol=1e-12)  # the same shape, one scale
    assert 1 - ratio[0] == pytest.approx(0.18, abs=0.005)


def test_human_output_is_one_summary_block(capsys):
    code, out, err = run_cli([*GD, *BUDGET], capsys)
    lines = out.strip().splitlines()
    assert code == 0 and err == "" and len(lines) == 5
    assert lines[0].startswith("schedule  gd-optimal (kappa=10), T = 60 steps, full batch")
    assert "epsilon = 2 at delta = 1e-06 under exact" in lines[1] and "rho = " in lines[2]
    sigmas = calibrate_schedule(
        "gd-optimal", 60, epsilon=2.0, delta=1e-6, accountant="exact", kappa=10.0
    ).sigmas
    assert f"first {sigmas[0]:.6g} (t = 1), middle {sigmas[29]:.6g} (t = 30), last {sigmas[-1]:.6g}" in out


def test_bound(capsys):
    data = schedule_json(["schedule", "--bound", "--kappa", "10", "--alpha", "1e-3"], capsys)
    expected = {**bound_summary(10.0, 1e-3), "private": True}  # (it reads no data)
    assert data == expected and list(data) == list(expected)
    assert data["T_dynamic"] == 24 and data["erub_dynamic"] == expected["erub_dynamic"]
    code, out, _ = run_cli(["schedule", "--bound", "--kappa", "10", "--alpha", "1e-3"], capsys)
    assert code == 0 and f"{expected['erub_dynamic']:.6g}" in out and " 24 " in out


def test_influence_files(tmp_path, capsys):
    q = [5.0, 4.0, 3.0, 2.0, 1.0]
    (tmp_path / "q.csv").write_text("# influence\n5, 4,3\n2 1\n")
    np.save(tmp_path / "q.npy", np.array(q))
    direct = calibrate_schedule("influence", 5, rho=1.0, influence=q).to_json()["noise_multipliers"]
    for name in ("q.csv", "q.npy"):
        argv = [
            "schedule",
            "--kind",
            "influence",
            "--steps",
            "5",
            "--rho",
            "1",
            "--influence",
            str(tmp_path / name),
        ]
        assert schedule_json(argv, capsys)["noise_multipliers"] == direct


def test_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "plots" / "sigma.png"
    code, out, err = run_cli([*GD, *BUDGET, "--plot", str(png)], capsys)
    assert code == 0 and err == "" and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    assert schedule_json([*GD, *BUDGET, "--accountant", "zcdp", "--plot", str(png)], capsys)["plot"] == str(
        png
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


UNIFORM = ["schedule", "--kind", "uniform", "--steps", "5"]
INFLUENCE = ["schedule", "--kind", "influence", "--steps", "3", "--rho", "1", "--influence"]
BAD = {
    "steps 0": (
        ["schedule", "--kind", "uniform", "--steps", "0", "--rho", "1"],
        "--steps: expected an integer >= 1",
    ),
    "gamma 1": (
        [*GD[:5], "--gamma", "1", "--rho", "1"],
        "gamma=1.0 is invalid; accepted: a number in [0, 1)",
    ),
    "gamma < 0": ([*GD[:5], "--gamma", "-0.5", "--rho", "1"], "gamma=-0.5 is invalid"),
    "influence <= 0": ([*INFLUENCE, "{tmp}/neg.txt"], "influence must hold positive finite numbers"),
    "influence length": ([*INFLUENCE, "{tmp}/two.txt"], "influence must hold T=3 positive finite numbers"),
    "influence not numbers": ([*INFLUENCE, "{tmp}/words.txt"], "line 1: 'a' is not a number"),
    "influence missing": ([*INFLUENCE, "{tmp}/none.txt"], "--influence: no such file"),
    "epsilon 0": ([*UNIFORM, "--epsilon", "0", "--delta", "1e-5"], "epsilon must be a finite number > 0"),
    "rho < 0": ([*UNIFORM, "--rho", "-1"], "rho must be a finite number > 0"),
    "no budget": (UNIFORM, "give exactly one of rho"),
    "epsilon and rho": (
        [*UNIFORM, "--epsilon", "1", "--delta", "1e-5", "--rho", "1"],
        "give exactly one of rho",
    ),
    "unknown kind": (["schedule", "--kind", "linear", "--steps", "5", "--rho", "1"], "got 'linear'"),
    "flag of another kind": (
        [*UNIFORM, "--rho", "1", "--gamma", "0.5"],
        "--gamma is not a parameter of schedule kind 'uniform'",
    ),
    "flag naming the accepted ones": (
        [*GD, "--rho", "1", "--rate", "2"],
        "its flags are --gamma, --kappa, --eta",
    ),
    "bound with schedule flags": (
        ["schedule", "--bound", "--kappa", "10", "--alpha", "1", "--steps", "5"],
        "--bound takes --kappa, --alpha and --json only, got --steps",
    ),
    "exact subsampled": (
        [*UNIFORM, *BUDGET, "--accountant", "exact", "--sampling-rate", "0.1"],
        "accountant 'exact' covers full-batch steps only",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    (tmp_path / "neg.txt").write_text("1\n-2\n3\n")
    (tmp_path / "two.txt").write_text("1,2\n")
    (tmp_path / "words.txt").write_text("a,b,c\n")
    argv, message = BAD[case]
    code, out, err = run_cli([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("dptrain: error: ") and message in err, err


def test_a_closed_pipe_stops_quietly():
    """`dptrain ... | head`: the reader closes the pipe early; no traceback, exit 141 (128 + SIGPIPE)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dptrain", "schedule", "--kind", "uniform", "--steps", "20000", "--rho", "1",
           "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"Exception ignored" not in err, err
