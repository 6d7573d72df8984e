"""Data-parallel DP-SGD (dptrain.distributed) with torchrun on the CPU (gloo): a 2-process run whose rank 1 is
killed with SIGKILL mid-run, resumed with --resume, ends with exactly the ledger, metrics and weights of the
one-process run with the same seed (chunk sums added in one order on every rank, the same noise drawn from the same
secret streams, rank 0 alone writing)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.cli import main

CONFIG = """seed = 5
[data]
name = "synthetic"
options = { n = 600, dim = 8, num_classes = 2, separation = 3.0 }
[model]
name = "mlp"
options = { hidden = [16] }
[privacy]
noise_multiplier = 1.0
accountant = "rdp"
[training]
steps = 80
batch_size = 100
max_physical_batch_size = 16
eval_every = 5
"""


def _torchrun(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dptrain"]
    return subprocess.Popen([*cmd, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rank_pid(rank: int, out: Path) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and str(out).encode() in cmdline and b"torch.distributed.run" not in cmdline:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
def test_a_two_process_run_killed_and_resumed_equals_the_one_process_run(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG)
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "two"

    run = _torchrun("train", "--config", str(cfg), "--out", str(out), "--no-progress")
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and run.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    pid = _rank_pid(1, out)
    assert run.poll() is None and pid is not None, run.stdout.read() if run.poll() is not None else "no rank 1"
    os.kill(pid, signal.SIGKILL)

    first, _ = run.communicate(timeout=120)

    assert run.returncode != 0  # the job stopped; rank 0 said why in one line
    assert "another rank of this data-parallel run stopped during a step" in first, first[-3000:]
    steps_done = torch.load(out / "private" / "checkpoint.pt", weights_only=True)["steps"]
    assert 0 < steps_done < 80
    resumed = _torchrun("train", "--resume", str(out), "--no-progress")
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log
    assert (out / "ledger.json").read_text() == (tmp_path / "one" / "ledger.json").read_text()
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "one" / "metrics.jsonl").read_text()
    a = torch.load(tmp_path / "one" / "private" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(out / "private" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert log.count("privacy ") == 1  # one report, from rank 0
