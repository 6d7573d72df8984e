"""Data-parallel DP-SGD (dptrain.engine.distributed) with torchrun on the CPU (gloo): a 2-process run whose rank 1 is
killed with SIGKILL mid-run, resumed with --resume, ends with exactly the ledger, metrics and weights of the
one-process run with the same seed (chunk sums added in one order on every rank, the same noise drawn from the same
secret streams, rank 0 alone writing).

When rank 1 dies, two things race to stop rank 0: its own all-gather failing on the closed connection (it raises
RankLost and exits 2) and torchrun's agent, which polls its workers every 0.1 s and sends the survivors SIGTERM (rank 0
then checkpoints its last complete step, says "interrupted at step N" and exits 143; a SIGTERM held during a step that
then fails rolls the step back first). Both endings are correct and either can win on a loaded machine, so the test
does not leave the order to chance: it forces each one in turn, by stopping (SIGSTOP) the agent until rank 0 has
exited, or rank 0 until the agent's SIGTERM is pending at it.

The two endings run the two noise mechanisms: DP-SGD's independent noise, and banded matrix factorization's correlated
noise (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization: A unified approach to private training"), whose
secret state (the b - 1 previous noise draws and the cyclic groups) every rank must draw alike. The DP-SGD ending is
resumed on two processes and ends as the one-process run; the BandMF ending's checkpoint is compared, whole, with the
one-process run stopped (--stop-after) at the same step (one torchrun job fewer: the suite's time)."""

import os
import re
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
steps = 40
batch_size = 100
max_physical_batch_size = 16
eval_every = 5
"""
#: the mechanism each ending runs: (appended to CONFIG)
MECHANISMS = {"dpsgd": "", "bandmf": '[noise]\nmechanism = "bandmf"\nbands = 4\n'}


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


def _state(pid: int) -> str:
    """The one-letter state of process ``pid`` (R, S, T, Z, ...), "gone" once reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "gone"
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))


def _sigterm_pending(pid: int) -> bool:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    pending = int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)
    return bool(pending >> (signal.SIGTERM - 1) & 1)


def _wait(condition, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _one_process_run(cfg: Path, out: Path, *more: str) -> Path:
    """The directory of the one-process run of the config ``cfg``."""
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", *more]) == 0
    return out


def _same(a, b, where: str = "") -> None:
    """Two checkpoints hold the same state, tensor for tensor (but the wall time each process took, and a finished
    run's summary's own directory)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            if k not in ("elapsed_s", "out"):
                _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            _same(u, v, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


#: who stops rank 0 first -> (what rank 0 says, its exit status as torchrun reports it, the mechanism run)
ENDINGS = {
    "rank 0 sees the lost rank": ("another rank of this data-parallel run stopped during a step", 2, "dpsgd"),
    "torchrun's SIGTERM": ("interrupted at step", 143, "bandmf"),
}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker processes through /proc")
@pytest.mark.parametrize("first", list(ENDINGS))
def test_a_two_process_run_killed_and_resumed_equals_the_one_process_run(first, tmp_path):
    said, status, mechanism = ENDINGS[first]
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG + MECHANISMS[mechanism])
    out = tmp_path / "two"
    run = _torchrun("train", "--config", str(cfg), "--out", str(out), "--no-progress")
    stopped: list[int] = []
    try:
        metrics = out / "metrics.jsonl"
        _wait(
            lambda: run.poll() is not None or (metrics.exists() and len(metrics.read_text().splitlines()) >= 3),
            "the run has logged 3 evaluations",
        )
        rank0, rank1 = _rank_pid(0, out), _rank_pid(1, out)
        assert run.poll() is None and None not in (rank0, rank1), run.stdout.read() if run.poll() is not None else "no rank"
        if first == "rank 0 sees the lost rank":  # the agent, stopped, can neither notice nor signal anything
            stopped.append(run.pid)
            os.kill(run.pid, signal.SIGSTOP)
            os.kill(rank1, signal.SIGKILL)
            _wait(lambda: _state(rank0) in ("Z", "gone"), "rank 0 has exited by itself")
        else:  # rank 0, stopped, cannot reach its next all-gather before the agent's SIGTERM
            stopped.append(rank0)
            os.kill(rank0, signal.SIGSTOP)
            os.kill(rank1, signal.SIGKILL)
            _wait(lambda: _sigterm_pending(rank0), "torchrun has sent rank 0 SIGTERM")
        os.kill(stopped.pop(), signal.SIGCONT)
        first_log, _ = run.communicate(timeout=120)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if run.poll() is None:
            run.terminate()  # (the agent stops its workers)
            run.wait(60)

    assert run.returncode != 0  # the job stopped; rank 0 said why in one line
    assert said in first_log, first_log[-3000:]
    # (torchrun's report: rank 0 ended by itself, with its own status, not killed by a signal)
    assert re.search(rf"rank\s*: 0 \(local_rank: 0\)\s*exitcode\s*: {status} ", first_log), first_log[-3000:]
    steps_done = torch.load(out / "private" / "checkpoint.pt", weights_only=True)["steps"]
    assert 0 < steps_done < 40
    if mechanism == "bandmf":  # its secret state (the cyclic groups, the noise history) and all else, as one process
        # left it after the same steps; resuming such a checkpoint on two processes is the other ending's
        one = _one_process_run(cfg, tmp_path / "one", "--stop-after", str(steps_done))
        assert (out / "ledger.json").read_text() == (one / "ledger.json").read_text()
        # (the rows of its evaluations; --stop-after also evaluates where it stops)
        assert (one / "metrics.jsonl").read_text().startswith((out / "metrics.jsonl").read_text())
        a, b = (torch.load(d / "private" / "checkpoint.pt", weights_only=True) for d in (one, out))
        assert a["bandmf"]["noise"]["history"] and a["sampler"]["groups"] is not None
        _same(a, b)
        return
    one = _one_process_run(cfg, tmp_path / "one")
    resumed = _torchrun("train", "--resume", str(out), "--no-progress")
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log
    assert (out / "ledger.json").read_text() == (one / "ledger.json").read_text()
    assert (out / "metrics.jsonl").read_text() == (one / "metrics.jsonl").read_text()
    _same(*(torch.load(d / "private" / "checkpoint.pt", weights_only=True) for d in (one, out)))
    assert log.count("privacy ") == 1  # one report, from rank 0


#: run by torchrun on 2 ranks: (a) rank 1 launched with another clip norm; (b) make_private with secret randomness;
#: (c) a model that mixes examples on rank 1's chunks only; (d) make_private on data that differ on rank 1. Each rank
#: writes what it saw.
RANKS_SCRIPT = """
import os, sys, torch
from torch import nn
from dptrain.engine import distributed
from dptrain.engine.api import make_private
from dptrain.errors import ConfigError, DPTrainError
from dptrain.runs.run import run_training
from dptrain.config import load_config
import datetime
import torch.distributed as dist
rank, tmp = os.environ["RANK"], sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # (a rank left waiting ends, not hangs)
group = distributed.from_environment("cpu")
seen = []
try:
    run_training(load_config(f"{tmp}/c{rank}.toml"), f"{tmp}/run", progress=False)
    seen.append("a=trained")
except ConfigError as e:
    seen.append("a=refused:" + str(e).split(":")[1].split("(")[0].strip())

class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.armed = nn.Linear(4, 2), False
    def forward(self, x):
        out = self.lin(x)
        return out + out.mean(0, keepdim=True) if self.armed and rank == "1" else out

torch.manual_seed(0)
x = torch.randn(200, 4)
y = (x[:, 0] > 0).long()
def trainer_of(model):
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                        batch_size=64, max_physical_batch_size=8)

trainer = trainer_of(Mixer())
trainer.step()
hashes = distributed.gather(group, [distributed.state_hash(trainer.model.state_dict())])
seen.append(f"b={'same' if len(set(hashes)) == 1 else 'differ'}")
model = Mixer()
trainer = trainer_of(model)
model.armed = True  # (after the probe: the sentinel compares each process's first chunk with its examples alone)
try:
    trainer.step()
    seen.append("c=stepped")
except DPTrainError as e:
    seen.append(f"c={type(e).__name__}:private={trainer.private}:steps={trainer.steps}")
x[7, 1] += float(rank)  # (make_private on rank 1's own copy of the data, one value changed)
trainer = trainer_of(Mixer())
try:
    trainer.step()
    seen.append("d=stepped")
except ConfigError as e:
    seen.append("d=refused:" + str(e).split(":")[1].split("(")[0].strip() + f":steps={trainer.steps}")
open(f"{tmp}/rank{rank}.txt", "w").write(" ".join(seen))
"""


@pytest.mark.slow
def test_ranks_that_differ_are_refused_and_a_refusal_on_one_rank_stops_every_rank(tmp_path):
    """The release is the one the ledger describes on every rank, or the run stops on every rank: a rank launched with
    another config (another clip norm, no seed) is refused before anything is written; make_private's secret randomness is rank 0's on every
    rank (the same batch and noise); the sentinel's stop on rank 1's chunks stops rank 0 too, its run labelled not
    private (before: rank 0 lost its peer, its run unlabelled); make_private on data that differ by one value on rank 1
    is refused before its first step (before: it trained on both)."""
    base = CONFIG.replace("steps = 40", "steps = 2")
    (tmp_path / "c0.toml").write_text(base)  # (seeded; rank 1 not: before, the ranks waited in different collectives)
    (tmp_path / "c1.toml").write_text(
        base.replace("seed = 5\n", "").replace("noise_multiplier = 1.0", "noise_multiplier = 1.0\nmax_grad_norm = 50.0")
    )
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run([*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    seen = [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else None for r in (0, 1)]
    expected = ("a=refused:config b=same c=SentinelError:private=False:steps=0 "
                "d=refused:training examples:steps=0")
    assert seen == [expected] * 2, done.stderr[-3000:]
    assert not (tmp_path / "run" / "private" / "checkpoint.pt").exists()
