"""Test-session settings. Under pytest-xdist (``make test`` runs two workers on the two cores) each worker keeps
torch to one intra-op thread, so that two workers do not oversubscribe the cores."""

import os
from pathlib import Path

import pytest
import torch

from dptrain.data.loaders import DEFAULT_FASHION_MNIST_DIR

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

#: Tests that read the real Fashion-MNIST (Debian's dataset-fashion-mnist, which `make test` installs when it can):
#: skipped, with the reason, on a machine without it.
HAS_FASHION_MNIST = (Path(DEFAULT_FASHION_MNIST_DIR) / "train-images-idx3-ubyte.gz").is_file()
NO_FASHION_MNIST = f"Fashion-MNIST not installed at {DEFAULT_FASHION_MNIST_DIR} (make data, as root)"
needs_fashion_mnist = pytest.mark.skipif(not HAS_FASHION_MNIST, reason=NO_FASHION_MNIST)


def require_fashion_mnist() -> None:
    """In a fixture (marks do not apply to fixtures): skip the tests using it on a machine without Fashion-MNIST."""
    if not HAS_FASHION_MNIST:
        pytest.skip(NO_FASHION_MNIST)


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in the test even when the suite was started with SIGINT ignored (a shell's
    background job without job control, nohup), as it does for an interactive run."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def run_interrupted(cfg, out, at: int, monkeypatch) -> None:
    """Run ``cfg`` into ``out`` and interrupt it like a Ctrl-C in the middle of step ``at + 1`` (after ``at``
    completed steps); the run checkpoints and re-raises, as ``dptrain train`` does."""
    import pytest

    from dptrain.engine.trainer import PrivateTrainer
    from dptrain.runs.run import run_training

    real_step = PrivateTrainer.step

    def interrupting_step(self):
        if self.steps == at:
            raise KeyboardInterrupt
        return real_step(self)

    with monkeypatch.context() as m:
        m.setattr(PrivateTrainer, "step", interrupting_step)
        with pytest.raises(KeyboardInterrupt):
            run_training(cfg, out, progress=False)
