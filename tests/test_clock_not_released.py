"""A measured time is not released: how long a step takes depends on its realized (secret) batch size and on the
data, so nothing shareable may depend on the clock. Two runs identical but for the speed of the clock (a seeded run,
so that everything else is reproducible) must write the same shareable files and print the same terminal output,
progress bar included (its rate, elapsed time and the steps at which it redraws would count the batches)."""

import json
import time

import pytest
import tqdm.std

from dptrain.cli import main

CONFIG = """\
seed = 3
[data]
name = "synthetic"
options = { n = 200, dim = 4, num_classes = 2 }
test_is_public = true
[model]
name = "logistic"
[privacy]
noise_multiplier = 1.0
delta = 1e-3
[training]
epochs = 2
batch_size = 20
learning_rate = 0.5
"""


class _Clock:
    """A clock that moves by ``tick`` seconds at every reading."""

    def __init__(self, tick: float):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _run(tmp_path, name, tick, monkeypatch, capsys, args=()):
    clock = _Clock(tick)
    with monkeypatch.context() as m:
        for target in (time, tqdm.std):
            for attribute in ("time", "perf_counter", "monotonic"):
                if hasattr(target, attribute):
                    m.setattr(target, attribute, clock)
        out = tmp_path / name
        code = main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(out), *args])
    stdout, stderr = capsys.readouterr()
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.suffix != ".pt"}
    summary = json.loads(files.pop("summary.json"))
    summary.pop("out")
    return code, summary, files, stdout.replace(str(out), "OUT"), stderr.replace(str(out), "OUT")


@pytest.mark.parametrize("args", [(), ("--json",)])
def test_shareable_outputs_do_not_depend_on_the_clock(tmp_path, monkeypatch, capsys, args):
    (tmp_path / "c.toml").write_text(CONFIG)
    fast = _run(tmp_path, "fast", 1e-6, monkeypatch, capsys, args)
    slow = _run(tmp_path, "slow", 7.0, monkeypatch, capsys, args)
    assert fast[0] == slow[0] == 0
    assert fast[1] == slow[1]  # summary.json
    assert fast[2] == slow[2]  # every other shareable file, byte by byte
    assert fast[3] == slow[3]  # stdout
    assert fast[4] == slow[4] and "16/16" in fast[4]  # stderr: the progress bar is shown, the same
