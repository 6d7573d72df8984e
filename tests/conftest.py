"""Test-session settings. Under pytest-xdist (``make test`` runs two workers on the two cores) each worker keeps
torch to one intra-op thread, so that two workers do not oversubscribe the cores."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def run_interrupted(cfg, out, at: int, monkeypatch) -> None:
    """Run ``cfg`` into ``out`` and interrupt it like a Ctrl-C in the middle of step ``at + 1`` (after ``at``
    completed steps); the run checkpoints and re-raises, as ``dptrain train`` does."""
    import pytest

    from dptrain.engine import PrivateTrainer
    from dptrain.run import run_training

    real_step = PrivateTrainer.step

    def interrupting_step(self):
        if self.steps == at:
            raise KeyboardInterrupt
        return real_step(self)

    with monkeypatch.context() as m:
        m.setattr(PrivateTrainer, "step", interrupting_step)
        with pytest.raises(KeyboardInterrupt):
            run_training(cfg, out, progress=False)
