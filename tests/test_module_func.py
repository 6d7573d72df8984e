"""A module without a layerwise rule is differentiated per example by torch.func on its own
(dptrain.stages.module_func), from the gradients that reach its outputs."""

import torch
from torch import nn

from dptrain.stages.per_example import LoopGradSampler, make_grad_sampler


class Router(nn.Module):
    """Like Mixtral's router: returns its logits and the weights computed from them (no layerwise rule: a bare
    parameter)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5))

    def forward(self, h):
        logits = h @ self.weight.T
        return logits, torch.softmax(logits, -1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.head = Router(), nn.Linear(4, 3)

    def forward(self, x):
        logits, weights = self.router(x)
        return self.head(weights * 2.0 + logits.tanh())  # both outputs used, the weights also computed from the logits


def test_an_output_computed_from_another_has_its_gradient_counted_once():
    """The gradient reaching the logits (all of it, through the weights too) and the gradient reaching the weights
    were both pulled back through the module: the weights' path counted twice. Each output now gets only what its
    consumers send it."""
    torch.manual_seed(0)
    model = Model().double()
    x, y = torch.randn(5, 5, dtype=torch.float64), torch.randint(0, 3, (5,))

    def loss(out, t):
        return nn.functional.cross_entropy(out, t, reduction="none")

    sampler = make_grad_sampler(model, loss, "auto")
    got = sampler(x, y)[0].materialize()
    assert sampler.name == "layerwise+func"
    expected = LoopGradSampler(model, loss)(x, y)[0].materialize()
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-12, msg=n)
