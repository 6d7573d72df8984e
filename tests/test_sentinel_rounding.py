"""The sentinel during training tells rounding from mixing: a well-fit model's losses and gradients are cancellations
(1 - p), whose float32 rounding is large beside them; comparing in float64, and mixing by the outputs beside their own
norm, never stops a model that computes each example alone (a long run was stopped at its step 792 before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.preflight.sentinel import SentinelError

X = torch.randn(400, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class BatchMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(x / x.abs().max())


def _every_chunk_checked(trainer):
    """Every example of every chunk compared, forward and backward (the sentinel's secret places, everywhere)."""
    trainer.sentinel.due = lambda step, index, size, first=False: (list(range(size)), True, True)


class RoundsLikeBatchedKernels(nn.Module):
    """In float32 its batched pass rounds differently from a pass on one example (as convolution and matrix kernels
    chosen by batch size do): outputs off by 3e-5 relative, an example's own computation all the same."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        out = self.lin(x)
        if out.dtype == torch.float32 and len(x) > 1:
            out = out * (1 + 3e-5)  # (a rounding, not another example's influence)
        return out


def test_a_well_fit_model_is_not_stopped_for_rounding():
    model = RoundsLikeBatchedKernels()
    with torch.no_grad():  # well fit: losses around 1e-3, a difference of logits near 3.5 (one float32 ulp is 2e-7)
        model.lin.weight.copy_(torch.tensor([[-3.5, 0, 0, 0, 0, 0], [3.5, 0, 0, 0, 0, 0]]))
        model.lin.bias.zero_()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=1e-6), (X, Y), noise_multiplier=1.0,
                           batch_size=40, max_physical_batch_size=16)
    _every_chunk_checked(trainer)
    for _ in range(10):
        trainer.step()
    assert trainer.private and trainer.sentinel.checked >= 20


def test_mixing_is_still_caught_at_a_secret_place():
    torch.manual_seed(0)
    model = BatchMax()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), noise_multiplier=1.0,
                           batch_size=40, check_independence=False)
    trainer.sentinel.mixing = True  # (the probe skipped: the sentinel alone sees it, at its first secret place)
    _every_chunk_checked(trainer)
    with pytest.raises(SentinelError, match="mixes examples"):
        trainer.step()
