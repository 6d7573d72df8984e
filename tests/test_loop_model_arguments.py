"""Your own loop: the model sees each example and nothing else computed from the chunk (issue 29 item 3, fifth round).

Before: a tensor passed to the model beside the chunk was refused only when its first dimension was the chunk's size,
so ``model(x, ctx=x.mean(0, keepdim=True))`` (a statistic of the batch, of shape (1, d)) or the batch's maximum (a
0-dim tensor) trained and was certified, though every example's gradient moved with the others. The probe and the
sentinel run the model on the chunk alone, so they never saw it. Now any tensor argument computed from the chunk's
examples through autograd (the loop hands them out as leaves that require grad) is refused, whatever its shape."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.engine.private_loop import LoopError, make_private_loop

X = torch.randn(256, 5, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class WithContext(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 2)

    def forward(self, x, ctx=None, positions=None):
        h = self.lin(x if ctx is None else x - ctx)
        return h if positions is None else h + 0 * positions.sum()


def _run(call, steps=2):
    torch.manual_seed(0)
    model = WithContext()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, max_physical_batch_size=16)
    for x, y in loop.batches(steps=steps):
        loop.backward(F.cross_entropy(call(model, x), y, reduction="none"))
        opt.step()
        opt.zero_grad()
    return loop


@pytest.mark.parametrize("call", [
    lambda m, x: m(x, ctx=x.mean(0, keepdim=True)),
    lambda m, x: m(x, ctx=x.abs().max()),
    lambda m, x: m(x, {"scale": x.std(0)}.get("scale")),
], ids=["batch-mean", "batch-max", "batch-std"])
def test_a_statistic_of_the_chunk_passed_beside_it_is_refused_with_nothing_released(call):
    torch.manual_seed(0)
    model = WithContext()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, max_physical_batch_size=16)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(LoopError, match="computed from the chunk's examples") as e:
        for x, y in loop.batches(steps=2):
            loop.backward(F.cross_entropy(call(model, x), y, reduction="none"))
            opt.step()
    assert "\n" not in str(e.value) and loop.steps == 0 and loop.ledger.releases == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_chunks_own_tensors_and_public_tensors_beside_them_are_accepted():
    """A cast or view of the chunk is the chunk; a public tensor (positions) computed from nothing of it is allowed."""
    loop = _run(lambda m, x: m(x.double().float(), positions=torch.arange(5.0).reshape(1, 5)))
    assert loop.steps == 2 and loop.trainer.private
