"""The checks compare the model as training runs it (cases no issue named, tried as a reviewer would): a model that
writes its inputs in place (centering them by the batch's mean under no_grad left the rows centered for every later
pass, so each example alone agreed with the mixed batch: accepted and certified), a model that computes otherwise in
float32 than in the float64 of the checks (it mixed the Poisson remainder chunks unseen: certified), a model that
mixes only when its inputs require grad, as your own loop hands them out (certified), a model keeping the previous
batch in a global and adding it to a new batch only, not to the same batch run again (every check ran the chunk
again: certified, every step mixed with the one before), a backward mixing the gradient rows in float32 only (the
sentinel compared gradients in float64: certified). Each is now refused before training or stopped by the sentinel
before the release of the first step that meets it."""

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.engine.private_loop import LoopError, make_private_loop
from dptrain.errors import ModelError
from dptrain.preflight.sentinel import SentinelError

X = torch.randn(400, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


class Mixes(nn.Module):
    """Mixes the examples of batches of ``low`` < size < ``high`` examples (those of a Poisson remainder chunk when
    ``low`` is above the probe's batches of 6), in the way ``how`` says."""

    def __init__(self, how: str, low: int = 1, high: int = 10**9):
        super().__init__()
        self.lin, self.how, self.low, self.high = nn.Linear(6, 2), how, low, high

    def forward(self, x):
        mixes = self.low < len(x) < self.high
        if self.how == "in place" and mixes:
            with torch.no_grad():  # (idempotent: the centered rows centered again are the same)
                x.sub_(x.mean(0, keepdim=True))
        h = self.lin(x)
        if self.how == "in float32" and mixes and x.dtype == torch.float32:
            return h - h.mean(0, keepdim=True)
        if self.how == "requiring grad" and mixes and x.requires_grad:
            return h - h.mean(0, keepdim=True)
        return h


#: State kept outside the model (a module's attributes are watched): (model id, batch size) -> its last new batch's mean
_LAST: dict[tuple[int, int], torch.Tensor] = {}


class AddsTheLastBatch(nn.Module):
    """Adds the mean of the last batch of its size it saw to a new batch's inputs (every step mixes with the one
    before), but not when the same batch comes again (a check running the chunk again sees an independent model)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        if len(x) > 1:
            key = (id(self), len(x))
            mean, last = x.detach().mean(0), _LAST.get(key)
            if last is None or not torch.allclose(last, mean.to(last.dtype), atol=1e-5):
                _LAST[key] = mean
                if last is not None:
                    x = x + last.to(x.dtype)
        return self.lin(x)


class _MixesFloat32Gradients(torch.autograd.Function):
    """The identity forward; backward adds the mean of the gradient rows to each, in float32 only."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True) if g.dtype == torch.float32 and len(g) > 1 else g


class MixesGradientsInFloat32(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return _MixesFloat32Gradients.apply(self.lin(x))


def _private(model, **options):
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), noise_multiplier=1.0,
                        batch_size=40, max_physical_batch_size=16, seed=3, **options)


def test_a_model_centering_its_inputs_in_place_is_refused_before_training():
    with pytest.raises(ModelError, match="independence check failed") as e:
        _private(Mixes("in place"))
    assert "\n" not in str(e.value)


def _stopped(run) -> None:
    # (your loop: its check of the losses against the chunk's inputs, at the sentinel's places, may meet it first)
    with pytest.raises((SentinelError, LoopError), match="the sentinel stopped the run|the losses mix examples") as e:
        run()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("how", ["in place", "in float32"])
def test_a_model_mixing_remainder_chunks_unlike_the_checks_is_stopped_by_the_sentinel(how):
    trainer = _private(Mixes(how, low=8, high=16))
    _stopped(lambda: trainer.train(steps=30))
    assert trainer.ledger.releases == trainer.steps < 30 and not trainer.epsilon().certified


@pytest.mark.parametrize("model", [AddsTheLastBatch, MixesGradientsInFloat32])
def test_the_sentinel_compares_trainings_own_pass_not_a_pass_run_again(model):
    """Its outputs and, at the secret places and the first chunk, its per-example gradients (those clipped and
    released)."""
    trainer = _private(model())
    _stopped(lambda: trainer.train(steps=30))
    assert trainer.ledger.releases == trainer.steps == 0 and not trainer.epsilon().certified


@pytest.mark.parametrize("how", ["requiring grad", "the last batch"])
def test_your_loops_chunks_are_compared_as_your_loop_body_got_them(how):
    model = AddsTheLastBatch() if how == "the last batch" else Mixes(how, high=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=40, max_physical_batch_size=16,
                             seed=3)

    def run():
        for x, y in loop.batches(steps=30):
            loop.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()

    _stopped(run)
    assert loop.ledger.releases == loop.steps < 30 and not loop.trainer.private
    loop.close()
