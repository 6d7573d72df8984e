"""A module without a layerwise rule is differentiated per example by torch.func on its own
(dptrain.stages.module_func), from the gradients that reach its outputs."""

import pytest
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


class Bank(nn.Module):
    """A bank of weights and a buffer, one module shared by several layers (peft's RandLoRA and VeRA bases, Lily's
    experts, a universal transformer's layer)."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("scale", torch.full((4,), 0.5))


class Layer(nn.Module):
    def __init__(self, bank):
        super().__init__()
        self.bank, self.lin = bank, nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x) + x @ self.bank.v * self.bank.scale)


class SharedBank(nn.Module):
    def __init__(self):
        super().__init__()
        bank = Bank()
        self.a, self.b, self.head = Layer(bank), Layer(bank), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


@pytest.mark.parametrize("backend", ["func", "auto"])
def test_a_module_shared_by_two_layers_keeps_its_parameter_and_buffer_and_is_exact(backend):
    """torch.func's functional_call ties weights by path: a module registered under two paths had its slots swapped
    twice and put back once, so they kept the transform's tensors: the model was refused for writing a buffer it does
    not write (RandLoRA on Llama too), and with buffer_updates="not_private" the shared parameter was replaced by a
    copy the optimizer never updated (its gradient None from then on)."""
    from dptrain.engine.api import make_private

    torch.manual_seed(0)
    model = SharedBank().double()
    slots = (model.a.bank._parameters["v"], model.a.bank._buffers["scale"])
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))

    def loss(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=2, max_physical_batch_size=3, loss_fn=loss, grad_sampler=backend)
    grads = trainer.grad_sampler(x, y)[0].materialize()
    assert model.a.bank._parameters["v"] is slots[0] and model.b.bank._buffers["scale"] is slots[1]
    for i in range(3):
        model.zero_grad()
        loss(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name][i], p.grad, rtol=1e-10, atol=1e-12), name
