"""A run's not-private label is a one-way fact: buffers released unnoised or a sentinel stop stay on record in the
checkpoint, so a resumed run is never certified again; and the sentinel's secret places are the run's (keyed by its
entropy), the same after a resume, so a stop at a secret place happens again."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dptrain.config import load_config
from dptrain.engine.api import make_private
from dptrain.preflight.sentinel import SentinelError
from dptrain.runs.run import RunHooks, run_training

X = torch.randn(400, 6, generator=torch.Generator().manual_seed(0)).clamp(-3, 3)
X[300, 0] = 10.0  # one outlier, beyond the examples the probe tries before training
Y = (X[:, 0] > 0).long()


class CountsOutliers(nn.Module):
    """Writes a buffer only on batches holding the outlier (a statistic of the private data)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        if self.training and bool((x.abs() > 5).any()):
            self.seen += 1
        return self.lin(x)


def _trainer(model, **options):
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), noise_multiplier=1.0,
                        batch_size=40, **options)


def test_buffers_released_unnoised_keep_a_resumed_run_not_private():
    torch.manual_seed(0)
    first = _trainer(CountsOutliers(), buffer_updates="not_private")
    assert first.private  # the probe's examples hold no outlier
    while first.private and first.steps < 200:
        first.step()
    assert not first.private and first.not_private_buffers == ["seen"]
    state = first.state_dict()
    torch.manual_seed(0)
    resumed = _trainer(CountsOutliers(), buffer_updates="not_private")
    assert resumed.private
    resumed.load_state_dict(state)
    assert not resumed.private and not resumed.ledger.private and not resumed.epsilon().certified
    assert "buffers written from private batches" in " ".join(resumed.not_private_reasons)


def test_the_sentinels_secret_places_are_the_same_after_a_resume():
    torch.manual_seed(0)
    first = _trainer(nn.Linear(6, 2))
    places = [(s, k) for s in range(2000) for k in range(2) if first.sentinel.due(s, k, 10)[2]]
    assert len(places) > 20  # about one chunk in 64
    state = first.state_dict()
    torch.manual_seed(0)
    resumed = _trainer(nn.Linear(6, 2))  # new secret entropy until the checkpoint is loaded
    before = [(s, k) for s in range(2000) for k in range(2) if resumed.sentinel.due(s, k, 10)[2]]
    resumed.load_state_dict(state)
    after = [(s, k) for s in range(2000) for k in range(2) if resumed.sentinel.due(s, k, 10)[2]]
    assert after == places and before != places


def test_a_run_the_sentinel_stops_is_written_down_not_private_and_resumes_not_private(tmp_path, capsys):
    """Through dptrain train: the stop writes the checkpoint and a summary that say not private; a resume of it
    stays not private whatever happens next."""
    path = tmp_path / "c.toml"
    path.write_text('[data]\nname = "synthetic"\noptions = { n = 400, dim = 6 }\ntest_is_public = true\n'
                    '[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 1.0\n'
                    '[training]\nsteps = 8\nbatch_size = 40\neval_every = 2\n')
    cfg = load_config(path)

    def stop_at_step_5(job):
        original = job.trainer.sentinel.check

        def check(step, index, x, y):
            if step == 4:
                job.trainer.sentinel.stopped = "the sentinel stopped the run at step 5: (a test's stop)"
                raise SentinelError(job.trainer.sentinel.stopped)
            return original(step, index, x, y)

        job.trainer.sentinel.check = check

    with pytest.raises(SentinelError):
        run_training(cfg, tmp_path / "run", progress=False, hooks=RunHooks(prepare=stop_at_step_5))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["private"] is False and summary["certified"] is False and summary["steps"] == 4
    assert any("sentinel" in r for r in summary["not_private_because"])
    resumed = run_training(None, tmp_path / "run", resume=True, progress=False)
    assert resumed["steps"] == 8 and resumed["private"] is False and resumed["certified"] is False
    assert json.loads((tmp_path / "run" / "ledger.json").read_text())["private"] is False
