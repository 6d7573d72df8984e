"""The model probe's blind spots (issue 29 item 2): models that mix examples only through the example holding the
batch maximum, only in the Poisson remainder chunk, only at odd batch sizes; buffers written whatever the statistic
(torch.ao's MinMaxObserver, a running max of |x|, an outlier counter), also when the write happens only on some
batches. Each was accepted and certified before the probe compared every example with itself alone and the sentinel
watched every chunk of training."""

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.errors import ModelError
from dptrain.preflight.sentinel import SentinelError

X = torch.randn(600, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def _private(model, data=(X, Y), **options):
    options = {"noise_multiplier": 1.0, "batch_size": 64, **options}
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **options)


# --- mixing ------------------------------------------------------------------------------------------------------


class BatchMax(nn.Module):
    """Normalizes by the batch's maximum: only the example holding it moves the others."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(x / x.abs().max())


class MixesBelow(nn.Module):
    """Mixes only in batches of more than ``low`` and fewer than ``size`` examples (the remainder chunk of a Poisson
    batch cut into chunks of ``size``)."""

    def __init__(self, size: int, low: int = 1):
        super().__init__()
        self.lin, self.size, self.low = nn.Linear(6, 2), size, low

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True) if self.low < len(x) < self.size else h


class MixesAtOddSizes(nn.Module):
    def __init__(self, low: int = 0):
        super().__init__()
        self.lin, self.low = nn.Linear(6, 2), low

    def forward(self, x):
        h = self.lin(x)
        return h - 0.5 * h.mean(0, keepdim=True) if len(x) % 2 and len(x) > self.low else h


class ClampedByBatch(nn.Module):
    """x / max(1, the batch's maximum): mixes only when some example exceeds 1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(x / torch.clamp(x.abs().max(), min=1.0))


class FunctionalBatchNorm(nn.Module):
    """Batch statistics without a buffer; fails on a batch of one example."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(nn.functional.batch_norm(x, None, None, training=True))


@pytest.mark.parametrize("model", [BatchMax, lambda: MixesBelow(16), MixesAtOddSizes, ClampedByBatch,
                                   FunctionalBatchNorm], ids=["max", "remainder", "odd", "clamped", "functional-bn"])
def test_the_issues_mixing_models_are_refused_before_training(model):
    """Each example against itself alone: removing all the others sees any dependence on them (the batch maximum moves
    every example but the one holding it; a batch of one is smaller than a chunk, and odd). The issue's three, and two
    of the same kind (a clamped batch maximum was accepted too; functional batch norm was a raw ValueError)."""
    with pytest.raises(ModelError, match="independence check failed") as e:
        _private(model(), batch_size=40, max_physical_batch_size=16)
    assert "\n" not in str(e.value)


_OUTSIDE: dict = {}  # (state kept outside the model: held by this module, where no watch of the model looks)


class OutsideMax(nn.Module):
    """Normalizes by a running maximum of |x| kept outside its modules. Run alone after a chunk, each example meets
    the chunk's maximum already there: every comparison of the chunk with its examples agreed."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        _OUTSIDE.clear()

    def forward(self, x):
        _OUTSIDE["m"] = torch.maximum(_OUTSIDE.get("m", torch.tensor(1e-3)), x.detach().abs().max())
        return self.lin(x / _OUTSIDE["m"])


def test_a_model_keeping_state_outside_its_modules_is_refused_before_training():
    """An example alone must give the same output before and after the probe's passes on other examples (its
    parameters, buffers and attributes put back): state kept outside the model (a global, a closure) that examples
    write moves it. The running maximum was accepted and certified."""
    with pytest.raises(ModelError, match="outside its modules") as e:
        _private(OutsideMax(), batch_size=40, max_physical_batch_size=16, grad_sampler="layerwise")
    assert "\n" not in str(e.value)


def _loss_mixing_at_odd_sizes(out, y):
    """Each example's cross-entropy, plus half the chunk's mean in chunks of an odd size: the loss mixes, not the model."""
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    return losses + 0.5 * losses.mean() if len(y) % 2 and len(y) > 1 else losses


@pytest.mark.parametrize("mixing", ["remainder", "odd", "odd, in the loss"])
def test_a_model_mixing_only_at_some_batch_sizes_is_stopped_before_any_release_from_them(mixing):
    """Models that hide from the probe (it compares batches of 6, 16 and 1): training meets their mixing sizes at its
    first steps, and the sentinel compares every new batch size before the step's release, outputs and losses (a loss
    mixing the chunk's examples at odd sizes only, with a model that does not, trained 30 steps and was certified)."""
    model = MixesBelow(16, low=8) if mixing == "remainder" else MixesAtOddSizes(low=1)
    options = {}
    if mixing == "odd, in the loss":
        model, options = nn.Linear(6, 2), {"loss_fn": _loss_mixing_at_odd_sizes}
    trainer = _private(model, batch_size=40, max_physical_batch_size=16, **options)
    sizes = []
    original = trainer.sentinel.check

    def seen(step, index, x, y):
        sizes.append(len(y))
        return original(step, index, x, y)

    trainer.sentinel.check = seen
    with pytest.raises(SentinelError, match="the sentinel stopped the run") as e:
        for _ in range(30):
            trainer.step()
    assert "\n" not in str(e.value) and "not certified" in str(e.value)
    mixing_sizes = [s for s in sizes if (8 < s < 16 if mixing == "remainder" else s % 2 and s > 1)]
    assert mixing_sizes and sizes[-1] == mixing_sizes[0]  # stopped at the first chunk of a mixing size
    released = trainer.steps
    assert trainer.ledger.releases == released  # the stopped step released nothing
    report = trainer.epsilon()
    assert not trainer.private and not report.certified and "sentinel" in report.details["note"]
    with pytest.raises(SentinelError):  # a retry stops again at the same place (the streams were rolled back)
        trainer.step()
    assert trainer.steps == released


class _MixGradientRows(torch.autograd.Function):
    """The identity forward; backward, in batches of more than 7 rows, adds the mean of the rows' gradients to each."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True) if len(g) > 7 else g


class MixesInBackwardOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        return _MixGradientRows.apply(self.lin(x))


def test_mixing_in_the_backward_pass_only_is_stopped_at_the_first_chunk():
    """Outputs unmoved, gradients mixed, at the chunk size only: the probe compares gradients on 6 examples and
    outputs at the chunk size, so the run went on until a secret comparison met it (step 10 of one run, 9 steps
    released). The first chunk of a run is now compared backward too: stopped before anything is released."""
    trainer = _private(MixesInBackwardOnly(), batch_size=40, max_physical_batch_size=16, sampling="fixed_size")
    with pytest.raises(SentinelError, match="per-example gradient of parameter"):
        trainer.step()
    assert trainer.steps == 0 and trainer.ledger.releases == 0 and not trainer.private


def test_the_sentinel_compares_secret_chunks_forward_and_backward_and_passes_an_independent_model():
    from dptrain.preflight import sentinel

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 2))
    trainer = _private(model, batch_size=20, max_physical_batch_size=8)
    places = [trainer.sentinel.due(s, k, 8) for s in range(2000) for k in range(3)]
    secret = sum(1 for rows, new, hit in places if hit)
    assert 0.5 * sentinel.RATE < secret / len(places) < 2 * sentinel.RATE
    assert all(len(rows) <= sentinel.ROWS and all(0 <= r < 8 for r in rows) for rows, _, hit in places if hit)
    trainer.train(steps=40)  # dropout on in training, off in the comparisons: an independent model is never stopped
    assert trainer.sentinel.checked > 0 and trainer.sentinel.stopped is None and trainer.private


def test_the_sentinels_places_depend_on_the_secret_entropy_not_on_anything_shareable():
    a = _private(nn.Linear(6, 2), batch_size=20).sentinel
    b = _private(nn.Linear(6, 2), batch_size=20).sentinel
    hits = lambda s: [s.due(t, 0, 20)[2] for t in range(3000)]  # noqa: E731
    assert hits(a) != hits(b)  # two secret runs check different steps
    c = _private(nn.Linear(6, 2), batch_size=20, seed=5).sentinel
    d = _private(nn.Linear(6, 2), batch_size=20, seed=5).sentinel
    assert hits(c) == hits(d)  # a seeded run (not private) is reproducible


class Routed(nn.Module):
    """Routes each example by its value (a mixture of experts of one): example i's loss reaches expert ``a`` when
    x_i0 > 0, else ``b``. Independent per example; which parameters a checked example's loss reaches is a statistic
    of that private example."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 2), nn.Linear(6, 2)

    def forward(self, x):
        up = x[:, 0] > 0
        out = x.new_zeros(len(x), 2)
        if up.any():
            out = out.index_put((up.nonzero().squeeze(1),), self.a(x[up]))
        if (~up).any():
            out = out.index_put(((~up).nonzero().squeeze(1),), self.b(x[~up]))
        return out


def test_the_sentinels_secret_checks_print_nothing_that_depends_on_the_examples_they_drew():
    """The sentinel compares secret rows of secret chunks with each alone; it warned, from the run's first chunk on,
    that "parameter(s) 'b.bias', 'b.weight' are not used by the model's loss on the examples checked": a statistic of
    the private rows it drew (here, that x_0 > 0 for both), printed on stderr during a certified run, once for each
    set of experts those rows happened to avoid."""
    import warnings

    from dptrain.preflight.gradient_check import UnusedParameterWarning

    x = X.clone()
    x[:, 0] = x[:, 0].abs() + 0.1  # every example routes to a
    with pytest.warns(UnusedParameterWarning):  # (the probe, before training: docs/privacy.md says what it reads)
        trainer = _private(Routed(), data=(x, Y), batch_size=40)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(steps=1)  # (the run's first chunk is compared backward, on secret rows)
    assert trainer.sentinel.checked > 0 and trainer.private
    assert not [w for w in seen if issubclass(w.category, UnusedParameterWarning)]


# --- buffers ---------------------------------------------------------------------------------------------------


class Observed(nn.Module):
    """torch.ao's MinMaxObserver records the min and max of its input (the private batch's)."""

    def __init__(self):
        super().__init__()
        from torch.ao.quantization import MinMaxObserver

        self.observer, self.lin = MinMaxObserver(), nn.Linear(6, 2)

    def forward(self, x):
        return self.lin(self.observer(x))


class RunningMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("max_abs", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.max_abs = torch.maximum(self.max_abs, x.detach().abs().max())
        return self.lin(x)


class OutlierCounter(nn.Module):
    """Counts the inputs above a threshold; written through .data, which bypasses the version counter."""

    def __init__(self, threshold: float = 3.0):
        super().__init__()
        self.lin, self.threshold = nn.Linear(6, 2), threshold
        self.register_buffer("outliers", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            found = int((x.detach().abs() > self.threshold).sum())
            if found:
                self.outliers.data.add_(found)
        return self.lin(x)


@pytest.mark.parametrize("model_class,buffer", [(Observed, "observer.m.._val"), (RunningMax, "max_abs"),
                                                (OutlierCounter, "outliers")])
def test_a_buffer_statistic_is_refused_whatever_it_is(model_class, buffer):
    data = X.clone() / 10
    data[5:10] *= 100  # the extremes, among the probe's examples but not its first or last (a probe that changed
    # example 0 or dropped the last one saw the same statistic every time)
    model = model_class()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelError, match=f"model buffer '{buffer}'"):
        _private(model, data=(data, Y))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no trace of the probe


def test_a_buffer_written_only_on_some_batches_stops_the_step_before_its_release_and_is_put_back():
    data = X.clone() / 10  # no outliers among the examples the probe reads ...
    data[-40:] *= 100  # ... but the run's batches meet them
    model = OutlierCounter()
    trainer = _private(model, data=(data, Y), batch_size=100)
    with pytest.raises(ModelError, match="model buffer 'outliers' is written by a training-mode forward pass"):
        for _ in range(20):
            trainer.step()
    assert int(model.outliers) == 0 and trainer.ledger.releases == trainer.steps < 20
    # opting out trains and labels the run not private from the step the buffer was written
    model = OutlierCounter()
    trainer = _private(model, data=(data, Y), batch_size=100, buffer_updates="not_private")
    assert trainer.private or trainer.randomness.seeded
    trainer.train(steps=20)
    assert int(model.outliers) > 0 and trainer.not_private_buffers == ["outliers"]
    assert not trainer.private and trainer.ledger.private is False and not trainer.epsilon().certified


def test_your_own_loop_is_watched_by_the_same_sentinel():
    from dptrain.engine.private_loop import LoopError, make_private_loop

    model = MixesBelow(16, low=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (X, Y), noise_multiplier=1.0, batch_size=40, max_physical_batch_size=16)
    # (the loop's check of the losses against the chunk's inputs, at the sentinel's places, meets it first)
    with pytest.raises((SentinelError, LoopError), match="the sentinel stopped the run|the losses mix examples"):
        for x, y in loop.batches(steps=30):
            loop.backward(nn.functional.cross_entropy(model(x), y, reduction="none"))
            opt.step()
            opt.zero_grad()
    assert loop.ledger.releases == loop.steps < 30 and not loop.trainer.private
    loop.close()


# --- precision -----------------------------------------------------------------------------------------------------


class Float32Inside(nn.Module):
    """Casts to float32 in its forward pass: it cannot run in float64."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).float())


def test_a_model_that_cannot_run_in_float64_is_checked_in_its_own_precision_and_says_so():
    trainer = _private(Float32Inside())
    assert trainer.gradient_check.precision == "float32" and trainer.gradient_check.moved_to_func == []
    assert _private(nn.Linear(6, 2)).gradient_check.precision == "float64"
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # (cast back exactly)
