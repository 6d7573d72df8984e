"""A torch.compile'd model keeps the fast backend: its per-example passes run the eager modules it wraps (the same
parameters). A compiled model used to go silently to torch.func (an MLP: slower) or fail (a transformers model)."""

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private


@pytest.mark.slow
def test_a_compiled_model_trains_on_the_layerwise_backend_with_the_same_steps():
    x = torch.randn(300, 20, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 2))
        wrapped = torch.compile(model) if compiled else model
        trainer = make_private(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.5), (x, y), noise_multiplier=1.0,
                               batch_size=50, seed=3)
        assert trainer.grad_sampler.name == "layerwise" and trainer.compiled is compiled
        assert list(trainer.params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
        trainer.train(steps=3)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
