"""Your own loop's optimizer step applies the released gradient, or that gradient clipped in place (a case no issue
named, tried as a reviewer would): the gradient of a mean loss on the chunk from torch.autograd.grad (which
accumulates nothing into .grad) added in place to p.grad after the release was applied unclipped and unnoised in a
certified run. Now refused with nothing applied; clip_grad_value_ and clip_grad_norm_ stay post-processing."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.engine.private_loop import LoopError, make_private_loop

X = torch.randn(200, 5, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def _loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=32, max_physical_batch_size=32)
    return loop, model, opt


def _run(after_release, steps=2):
    loop, model, opt = _loop()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        for x, y in loop.batches(steps=steps):
            loop.backward(F.cross_entropy(model(x), y, reduction="none"))
            if loop.is_last_chunk:  # (the release: p.grad holds the private gradient)
                after_release(model, x, y)
            opt.step()
            opt.zero_grad()
    finally:
        loop.close()
    return loop, model, before


def test_a_gradient_of_the_examples_written_into_the_released_one_is_refused_with_nothing_applied():
    def add_data_gradient(model, x, y):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad.add_(g)

    with pytest.raises(LoopError, match="not the one loop.backward released") as e:
        _run(add_data_gradient)
    assert "\n" not in str(e.value)


def test_the_released_gradient_clipped_in_place_is_post_processing():
    def post_process(model, x, y):
        torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        model[0].weight.grad.zero_()

    loop, model, before = _run(post_process)
    assert loop.steps == 2 and loop.trainer.private
    moved = [float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before, strict=True)]
    assert moved[0] == 0 and 0 < max(moved[1:]) <= 2 * 0.5 * 1e-3 + 1e-7  # (lr 0.5, 2 steps of norm <= 1e-3)
