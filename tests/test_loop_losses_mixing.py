"""Your own loop's losses must each come from its own example alone, by any path autograd records (a case no issue
named, tried as a reviewer would): distillation from a teacher in training mode with BatchNorm mixed every example's
target with the chunk's statistics, and the loop certified it (the losses did not depend on the student's outputs of
other examples, the check then). The chunks the sentinel compares now check the losses against the inputs handed out:
refused at the first chunk, nothing released (every other test of the loop passes the check on an independent model).
A teacher called under no_grad is beyond autograd: docs/training_loop.md says so."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.engine.private_loop import LoopError, make_private_loop

X = torch.randn(200, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def test_a_loss_mixing_the_chunk_through_a_second_model_is_refused_before_the_release():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    teacher = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).requires_grad_(False)  # (frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=32, max_physical_batch_size=64)

    def train(steps):
        for x, y in loop.batches(steps=steps):
            out = model(x)
            target = F.softmax(teacher(x), 1)  # (under no_grad or detached, it would be beyond autograd: not seen)
            kl = F.kl_div(F.log_softmax(out, 1), target, reduction="none").sum(1)
            loop.backward(F.cross_entropy(out, y, reduction="none") + kl)
            opt.step()
            opt.zero_grad()

    with pytest.raises(LoopError, match="one example's inputs move the loss of others") as e:
        train(3)
    assert "\n" not in str(e.value) and loop.steps == loop.ledger.releases == 0
    assert not loop.trainer.private  # (found at the sentinel's places: earlier chunks may have mixed unseen)
    loop.close()


@pytest.mark.parametrize("term", ["weights", "gradient penalty"])
def test_a_parameter_used_in_the_losses_outside_the_model_names_the_loops_way_out(term):
    """A term of the weights added to each loss, or a gradient penalty (double backward): no per-example gradient is
    recorded for it. The refusal named the automatic backend or torch.func as the way out, which a loop already uses
    or refuses; it names extra= now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=32, max_physical_batch_size=64)
    with pytest.raises(LoopError, match="outside the model's forward pass on the chunk") as e:
        for x, y in loop.batches(steps=1):
            out = model(x)
            losses = F.cross_entropy(out, y, reduction="none")
            if term == "weights":
                losses = losses + 0.01 * model[0].weight.norm()
            else:
                (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
                losses = losses + (g**2).sum(1)
            loop.backward(losses)
    assert "extra=fn" in str(e.value) and "grad_sampler" not in str(e.value) and loop.steps == 0
    loop.close()
