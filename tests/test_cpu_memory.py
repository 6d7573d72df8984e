"""dptrain.runs.cpu_memory: keeping freed memory removes the page faults a DP step on the CPU otherwise pays for."""

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, resource, warnings
import torch
from dptrain.runs.cpu_memory import keep_freed_memory
from dptrain.engine.api import make_private
from dptrain.models.builders import build_model

warnings.simplefilter("ignore")
torch.manual_seed(0)
torch.set_num_threads(2)
x, y = torch.randn(512, 1, 28, 28), torch.randint(0, 10, (512,))
model = build_model("cnn28", (1, 28, 28), 10)
trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                       batch_size=64, seed=0, sampling="fixed_size")


def faults_per_step():
    trainer.train(steps=1)  # settle
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.train(steps=1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


# malloc at glibc's static defaults (128 KiB thresholds, which also stops glibc's dynamic threshold: the model probe
# before training frees large blocks, which would already have raised it), then the same process with freed memory kept
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallopt(-3, 128 * 1024), libc.mallopt(-1, 128 * 1024)
system = faults_per_step()
applied = keep_freed_memory()
print(json.dumps({"system": system, "applied": applied, "tuned": faults_per_step()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keeping_freed_memory_removes_the_page_faults_of_a_step():
    env = {k: v for k, v in os.environ.items() if k != "DPTRAIN_SYSTEM_MALLOC"}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, env=env)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["applied"] is True, r
    # measured: about 7,200 faults per cnn28 step of 256 (fixed size) with malloc's defaults, about 3,000 per step of 64
    # (the size here: its activations, 6.4 MB a layer, are still far above malloc's 128 KiB), about 1 kept
    assert r["system"] > 1000 and r["tuned"] < r["system"] / 10, r


def test_the_opt_out_leaves_malloc_alone(monkeypatch):
    from dptrain.runs.cpu_memory import OPT_OUT, keep_freed_memory

    monkeypatch.setenv(OPT_OUT, "1")
    assert keep_freed_memory() is False
