"""The model's state is written only by the optimizer's step (issue 29, items 2 and 3, the cases nobody named).

Before: the buffer watch saw registered buffers only, so a frozen Parameter holding a running mean of the batches, a
plain tensor attribute holding a running max of |x|, and a call counter were accepted and certified (the frozen
Parameter is in ``state_dict()``, hence in ``model.pt``); and your own loop certified a model a second update path had
trained without clipping or noise (``torch.autograd.grad`` of a mean loss applied by hand, a ``p.data`` write, a second
optimizer), since only ``.grad`` accumulation was watched. Now every slot of the model's state (buffers, parameters
trainable or not, the modules' own attributes) is watched across every training pass, and in a loop everywhere but the
loop's optimizer step."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.engine.api import make_private
from dptrain.engine.private_loop import LoopError, make_private_loop
from dptrain.errors import ModelError
from dptrain.preflight import buffers

X = torch.randn(400, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def _private(model, data=(X, Y), **options):
    options = {"noise_multiplier": 1.0, "batch_size": 64, **options}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return make_private(model, opt, data, **options)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)


class FrozenMean(Base):
    """A running mean of the batches in a frozen Parameter (in state_dict, so in model.pt)."""

    def __init__(self):
        super().__init__()
        self.stat = nn.Parameter(torch.zeros(6), requires_grad=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.stat.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x)


class FrozenMaxThroughData(Base):
    def __init__(self):
        super().__init__()
        self.stat = nn.Parameter(torch.zeros(6), requires_grad=False)

    def forward(self, x):
        if self.training:
            self.stat.data.copy_(x.detach().max(0).values)  # (bypasses the version counter)
        return self.lin(x)


class PlainMax(Base):
    """A running max of |x| in a plain tensor attribute (no register_buffer)."""

    def __init__(self):
        super().__init__()
        self.max_abs = torch.zeros(())

    def forward(self, x):
        if self.training:
            self.max_abs = torch.maximum(self.max_abs, x.detach().abs().max())
        return self.lin(x)


class Calls(Base):
    """Counts its calls: the number of chunks, hence the secret batch sizes."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("model_class,slot", [(FrozenMean, "parameter 'stat'"), (FrozenMaxThroughData, "parameter 'stat'"),
                                              (PlainMax, "attribute 'max_abs'"), (Calls, "attribute 'calls'")])
def test_state_a_training_pass_writes_is_refused_whatever_slot_holds_it(model_class, slot):
    model = model_class()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelError, match=f"model {slot} is written by a training-mode forward pass") as e:
        _private(model)
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no trace of the probe
    # no trace of the probe's examples (the counter holds the one call on an all-zero input, preflight.warm_up)
    assert getattr(model, "calls", 0) <= 1 and float(getattr(model, "max_abs", 0.0)) == 0.0


class SetUpOnFirstCall(Base):
    """Sets itself up on its first call, as transformers does (hooks installed and a flag that says so), and
    remembers a value of that first call's input: set up from the all-zero warm-up input, no example."""

    def __init__(self):
        super().__init__()
        self.installed, self.first_sum = False, None

    def forward(self, x):
        if not self.installed:
            self.installed, self.first_sum = True, float(x.sum())
        return self.lin(x)


def test_a_first_call_set_up_is_made_from_no_example_and_accepted():
    """A model's set-up on its first call (a flag, a lazily installed hook) was refused as state a training pass
    writes (the probe put it back, so every pass set it again: wav2vec2 in transformers 5); it is now made once on an
    all-zero input before any example is read, so what it keeps holds nothing of the data."""
    model = SetUpOnFirstCall()
    trainer = _private(model)
    trainer.step()
    assert model.installed and model.first_sum == 0.0 and trainer.private


class WritesOnOutliers(Base):
    """Writes an outlier into a frozen Parameter, or (``trainable``) nudges its own bias by it, only on batches that
    hold one; ``size`` elements (above buffers.COMPARED_BYTES: watched by checksum, not copied)."""

    def __init__(self, size: int = 6, trainable: bool = False):
        super().__init__()
        self.trainable = trainable
        self.stat = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x):
        if self.training:
            found = x.detach().abs().max()
            if found > 10:
                target = self.lin.bias if self.trainable else self.stat
                target.data[0] += found  # (through .data: no version counter)
        return self.lin(x)


@pytest.mark.parametrize("how", ["frozen", "trainable", "large"])
def test_a_state_write_on_some_batches_stops_the_step_before_its_release(how):
    data = X.clone() / 10
    data[-40:] *= 1000  # not among the examples the probe reads; the run's batches meet them
    big = buffers.COMPARED_BYTES // 4 + 1
    model = WritesOnOutliers(big if how == "large" else 6, trainable=how == "trainable")
    trainer = _private(model, data=(data, Y))
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelError, match="is written by a training-mode forward pass"):
        for _ in range(30):
            kept = {k: v.clone() for k, v in model.state_dict().items()}
            trainer.step()
    assert trainer.ledger.releases == trainer.steps < 30  # the stopped step released nothing
    if how == "large":  # detected by its checksum, but not put back: what it holds stays, and the run says so
        assert float(model.stat[0]) > 10 and not trainer.private and not trainer.epsilon().certified
    elif how == "trainable":  # (trainable parameters are watched by checksum during training, not copied)
        assert float(model.lin.bias.detach().abs().max()) > 10 and not trainer.private
    else:  # put back exactly: nothing of the batch stays in the model, the run stays private
        assert all(torch.equal(kept[k], v) for k, v in model.state_dict().items())
        assert trainer.private


# --- your own loop ------------------------------------------------------------------------------------------------


def _loop(chunk=32):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, max_physical_batch_size=chunk)
    return loop, model, opt


def _by_hand(model, x, y):
    """A second update path: the gradient of a mean loss, applied without clipping or noise."""
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.sub_(g)


WAYS = {
    "autograd.grad applied before backward": ("before", _by_hand),
    "p.data written after the step": ("after", lambda m, x, y: m[0].bias.data.add_(x.detach().mean(0)[:8].sum())),
    "a second optimizer after the step": ("after", None),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_parameter_changed_outside_the_loops_optimizer_step_is_refused_and_labels_the_run(way):
    loop, model, opt = _loop()
    when, update = WAYS[way]
    if update is None:
        second = torch.optim.SGD(model.parameters(), lr=1.0)

        def update(m, x, y):
            loss = F.cross_entropy(m(x), y)  # (after the step: a backward of one's own is not refused there)
            second.zero_grad()
            grads = torch.autograd.grad(loss, list(m.parameters()))
            for p, g in zip(m.parameters(), grads, strict=True):
                p.grad = g
            second.step()
    with pytest.raises(LoopError, match="changed outside the loop's optimizer step") as e:
        for x, y in loop.batches(steps=4):
            if when == "before":
                update(model, x, y)
            loop.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
            if when == "after":
                update(model, x, y)
    assert "\n" not in str(e.value)
    assert not loop.trainer.private and not loop.epsilon().certified
    assert "NOT private" in loop.epsilon().details["note"]
    loop.close()


def _load_edited(opt, x):
    state = opt.state_dict()
    for entry in state["state"].values():
        entry["momentum_buffer"] = entry["momentum_buffer"] + 100 * x.detach().mean()
    opt.load_state_dict(state)


OPTIMIZER_WAYS = {  # (optimizer, its state written from the chunk's examples between the release and the next step)
    "a momentum buffer written in place": (
        lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
        lambda opt, x: [s["momentum_buffer"].add_(100 * x.detach().mean()) for s in opt.state.values()],
    ),
    "Adam's first moment written through .data": (
        lambda ps: torch.optim.Adam(ps, lr=0.1),
        lambda opt, x: [s["exp_avg"].data.add_(100 * x.detach().mean()) for s in opt.state.values()],
    ),
    "another state loaded": (lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), _load_edited),
}


@pytest.mark.parametrize("way", list(OPTIMIZER_WAYS))
def test_the_optimizers_state_changed_outside_its_step_is_refused_and_labels_the_run(way):
    """The optimizer's step applies its state (momentum, Adam's moments) besides the release: written from the
    examples by hand, it moved the parameters by an unclipped, unnoised statistic of them, in a certified run."""
    make, write = OPTIMIZER_WAYS[way]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = make(model.parameters())
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=64, max_physical_batch_size=64)
    with pytest.raises(LoopError, match="optimizer's state .* changed outside the loop's optimizer step") as e:
        for x, y in loop.batches(steps=3):
            loop.backward(F.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
            if loop.steps == 1:
                write(opt, x)
                stepped = [p.detach().clone() for p in model.parameters()]
    assert "\n" not in str(e.value)
    assert all(torch.equal(a, b.detach()) for a, b in zip(stepped, model.parameters(), strict=True))  # not applied
    assert not loop.trainer.private and not loop.epsilon().certified
    loop.close()


def test_a_projection_in_the_optimizers_step_keeps_the_loop_private():
    loop, model, opt = _loop()
    opt.register_step_post_hook(lambda o, a, k: [p.data.clamp_(-0.2, 0.2) for p in model.parameters()])
    for x, y in loop.batches(steps=4):
        loop.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
        opt.zero_grad()
    loop.evaluate(X, Y)
    assert loop.steps == 4 and loop.trainer.private and loop.epsilon().certified
    assert max(float(p.detach().abs().max()) for p in model.parameters()) <= 0.2 + 1e-6
    loop.close()


class HookedNorm(Base):
    """torch's old weight_norm / spectral_norm: ``weight`` is not a Parameter but an attribute a forward pre-hook
    computes from ``weight_g``/``weight_v`` (``weight_orig``, with power-iteration buffers) on every call."""

    def __init__(self, hook):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.lin = hook(nn.Linear(6, 2))

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("hook", [nn.utils.weight_norm, nn.utils.spectral_norm])
def test_a_weight_computed_by_a_forward_hook_is_refused_in_one_line_not_a_traceback(hook):
    """Before: AttributeError ("`weight` is not an nn.Parameter", the Linear rule asked for it), then, with torch.func,
    RuntimeError (the watch read the storage of the tensor the transform left in the slot). Refused by kind, naming
    the way out (tests/test_torch_layers.py)."""
    with pytest.raises(ModelError, match="model layer 'lin' .*uses the deprecated torch.nn.utils.") as e:
        _private(HookedNorm(hook))
    assert "\n" not in str(e.value)


def test_weight_norm_as_a_parametrization_trains_with_exact_per_example_gradients():
    model = HookedNorm(nn.utils.parametrizations.weight_norm)
    trainer = _private(model)
    grads, _ = trainer.grad_sampler(X[:5], Y[:5])
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(X[i : i + 1]), Y[i : i + 1]).backward()
        row = grads.zero_examples(torch.arange(5) != i).weighted_sum(torch.ones(5))
        for name, p in model.named_parameters():
            assert torch.allclose(row[name].reshape(p.shape), p.grad, atol=1e-6), name
