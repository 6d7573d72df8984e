"""Stock torch.nn layers and model patterns as users write them (issue 30, the plain-torch side): each exact against
single-example backward passes through make_private and make_private_loop, or refused in one line naming the layer and
the way out. docs/python_api.md lists what was tried."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from dptrain.engine.api import make_private
from dptrain.engine.private_loop import make_private_loop
from dptrain.errors import ModelError
from dptrain.stages.per_example import LayerwiseGradSampler, trainable_parameters

N, V, T = 6, 5, 6


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _alone(model, x, y) -> dict[str, torch.Tensor]:
    """name -> [N, ...]: each example's gradient from a backward pass on it alone."""
    params = trainable_parameters(model)
    rows = []
    for i in range(len(y)):
        grads = torch.autograd.grad(_loss(model(x[i : i + 1]), y[i : i + 1]).sum(), list(params.values()))
        rows.append([g.to_dense() if g.is_sparse else g for g in grads])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def _alone_inputs(model, inputs: tuple, y) -> dict[str, torch.Tensor]:
    """:func:`_alone` for a model of several positional inputs."""
    params = trainable_parameters(model)
    rows = []
    for i in range(len(y)):
        loss = _loss(model(*(t[i : i + 1] for t in inputs)), y[i : i + 1]).sum()
        rows.append(torch.autograd.grad(loss, list(params.values())))
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(params)}


def _assert_exact(got: dict, want: dict) -> None:
    for name, w in want.items():
        for i in range(len(w)):
            err = float((got[name][i].reshape(w[i].shape) - w[i]).norm())
            assert err <= 1e-4 * float(w[i].norm()) + 1e-7, (name, i, err)


def _private(model, x, y, loop=False):
    """make_private (or make_private_loop) on the whole data as one batch, no noise, no clipping to speak of."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    make = make_private_loop if loop else make_private
    return make(model, opt, (x, y), noise_multiplier=0.0, non_private=True, max_grad_norm=1e6, sampling="full",
                batch_size=len(y), loss_fn=_loss)


class OwnParameters(nn.Module):
    """Parameters of the model itself, read in its forward outside any layer: a 0-dim scale (a temperature, ReZero's
    alpha, CLIP's logit scale) and a learned token added to every position (a CLS token, a position embedding)."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.randn(4))
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(1.3))

    def forward(self, x):  # x: [B, T, 4]
        return self.lin(torch.tanh(x + self.token).mean(1)) * self.scale


def test_parameters_of_the_model_itself_are_exact_in_make_private_and_in_your_own_loop():
    """Before: the step raised IndexError (a 0-dim parameter's per-example gradients are [B]: flatten(1) of the
    squared norms), and the loop refused the model (its own hooks ran inside torch.func's pass over the model)."""
    torch.manual_seed(0)
    x, y = torch.randn(N, T, 4), torch.randint(0, 3, (N,))
    model = OwnParameters()
    want = _alone(model, x, y)
    mean = {n: g.mean(0) for n, g in want.items()}
    trainer = _private(model, x, y)
    _assert_exact(trainer.grad_sampler(x, y)[0].materialize(), want)
    before = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    trainer.step()  # (SGD, lr 1: the update is the mean gradient)
    _assert_exact({n: (before[n] - p.detach())[None] for n, p in trainable_parameters(model).items()},
                  {n: g[None] for n, g in mean.items()})
    model = OwnParameters()
    model.load_state_dict({n: b for n, b in before.items()})
    loop = _private(model, x, y, loop=True)
    for inputs, labels in loop.batches(steps=1):
        loop.backward(_loss(model(inputs), labels))
        _assert_exact({n: p.grad[None] for n, p in trainable_parameters(model).items()},
                      {n: g[None] for n, g in mean.items()})
        loop.optimizer.step()
    loop.close()


class Bag(nn.Module):
    def __init__(self, **embedding):
        super().__init__()
        self.emb = nn.Embedding(V, 4, **embedding)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("embedding", [{"scale_grad_by_freq": True}, {"sparse": True},
                                       {"scale_grad_by_freq": True, "padding_idx": 0}])
def test_embedding_rule_is_exact_with_repeated_ids_and_sparse_gradients(embedding):
    """scale_grad_by_freq divides a row's gradient by its id's count in the batch: for an example alone, in the
    example (before: the rule ignored it, 1/count off wherever an id repeats, caught only if the probe's examples
    repeated one). sparse=True only changes torch's gradient format (before: no rule, and a raw RuntimeError)."""
    torch.manual_seed(0)
    ids = torch.randint(0, V, (N, T))  # (5 ids in 6 positions: every example repeats one)
    y = torch.randint(0, 3, (N,))
    model = Bag(**embedding)
    sampler = LayerwiseGradSampler(model, _loss, fallback=False)
    _assert_exact(sampler(ids, y)[0].materialize(), _alone(model, ids, y))
    sampler.close()
    trainer = _private(model, ids, y)
    assert trainer.grad_sampler.name == "layerwise"  # (the rule, not moved to torch.func by the check)
    trainer.step()


def _hooked(hook):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.Sequential(hook(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3))


class Script(nn.Module):
    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.body = torch.jit.script(nn.Linear(4, 3))

    def forward(self, x):
        return self.body(x)


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128))

    def forward(self, x):
        return (x.to(torch.complex128) @ self.w).abs().float()


def _renormed_bag():
    """max_norm with every row already within it: the first forward writes nothing a probe can see, a later one
    (after an update) renormalizes the rows the batch looks up."""
    model = Bag(max_norm=1.0)
    with torch.no_grad():
        model.emb.weight.mul_(0.1)
    return model


REFUSED = {
    "embedding_max_norm": (_renormed_bag, r"layer .emb. \(Embedding\) has max_norm=1: .*pass max_norm=None"),
    "spectral_norm": (lambda: _hooked(parametrizations.spectral_norm),
                      r"'0.parametrizations.weight.0' \(torch.nn.utils.parametrizations.spectral_norm\) writes its "
                      "power-iteration buffers.*torch.linalg.matrix_norm"),
    "old_weight_norm": (lambda: _hooked(nn.utils.weight_norm),
                        "deprecated torch.nn.utils.weight_norm.*use torch.nn.utils.parametrizations.weight_norm"),
    "old_spectral_norm": (lambda: _hooked(nn.utils.spectral_norm),
                          "deprecated torch.nn.utils.spectral_norm.*matrix_norm"),
    "torchscript": (Script, "layer 'body' is a TorchScript module .*pass the module before scripting"),
    "complex": (Complex, r"parameter 'w' is complex .*torch.view_as_real"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_layers_that_cannot_be_private_are_refused_in_one_line_naming_the_way_out(case):
    """Before: max_norm trained until a step renormalized a row (then refused mid-run), spectral_norm and the old
    hooks were refused as an anonymous buffer or attribute write with no way out, TorchScript raised AttributeError,
    a complex128 parameter passed the checks and crashed the step (fixed, its noise would be sigma / sqrt(2) per real
    coordinate: torch's complex normal)."""
    build, message = REFUSED[case]
    torch.manual_seed(0)
    x = torch.randint(1, V, (N, T)) if case == "embedding_max_norm" else torch.randn(N, 4)
    y = torch.randint(0, 3, (N,))
    for loop in (False, True):
        with pytest.raises(ModelError, match=message) as e:
            _private(build(), x, y, loop=loop)
        assert "\n" not in str(e.value)


def test_the_stateless_spectral_norm_the_refusal_names_is_exact():
    class ExactSpectralNorm(nn.Module):
        def forward(self, w):
            return w / torch.linalg.matrix_norm(w.flatten(1), 2)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    parametrize.register_parametrization(model[0], "weight", ExactSpectralNorm())
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    trainer = _private(model, x, y)
    _assert_exact(trainer.grad_sampler(x, y)[0].materialize(), _alone(model, x, y))


class Encoder(nn.Module):
    """torch's TransformerEncoder as users build it (dropout 0.1 inside its MultiheadAttention and around it), with a
    padding mask, and an attention of one's own whose parameter has no rule (the model's), with dropout in
    scaled_dot_product_attention and F.dropout."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.qkv = nn.Parameter(0.3 * torch.randn(8, 24))
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask):
        h = self.encoder(x, src_key_padding_mask=mask)
        q, k, v = (h @ self.qkv).chunk(3, -1)
        h = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], dropout_p=0.2, is_causal=True)[:, 0]
        return self.head(F.dropout(h, 0.3, self.training).mean(1))


def test_dropout_inside_modules_without_a_rule_is_replayed_exactly_in_your_own_loop():
    """Each example's gradient, from the chunk's forward pass with dropout on, against the gradient of its own loss in
    that same forward pass (the masks the batch drew). Before: the loop refused the model at its first backward
    ("vmap: called random operation"), and make_private left the layerwise backend for torch.func on the whole model."""
    torch.manual_seed(0)
    x, y = torch.randn(N, T, 8), torch.randint(0, 3, (N,))
    mask = torch.arange(T)[None] >= torch.tensor([T - i % 3 for i in range(N)])[:, None]
    model = Encoder()
    loop = make_private_loop(model, torch.optim.SGD(model.parameters(), lr=0.1), ((x, mask), y), noise_multiplier=0.0,
                             non_private=True, max_grad_norm=1e6, sampling="full", batch_size=N, loss_fn=_loss)
    params = trainable_parameters(model)
    sampler = loop.trainer.grad_sampler
    with sampler.recording(N), torch.enable_grad():
        losses = _loss(model(x, mask), y)
    want = [torch.autograd.grad(losses[i], list(params.values()), retain_graph=True) for i in range(N)]
    _assert_exact(sampler.from_losses(losses).materialize(),
                  {n: torch.stack([w[k] for w in want]) for k, n in enumerate(params)})
    assert sampler.name == "layerwise+func"
    for inputs, labels in loop.batches(steps=1):  # (and the loop's own step)
        loop.backward(_loss(model(*inputs), labels))
        loop.optimizer.step()
    loop.close()


class NestedOutput(nn.Module):
    """A layer of one's own returning (h, (2 h, sin(x w))), as an LSTM returns (output, (h_n, c_n))."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(0.5 * torch.randn(4, 4))

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        return h, (2 * h, torch.sin(x @ self.w))


class ReadsInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.head = NestedOutput(), nn.Linear(4, 3)

    def forward(self, x):
        h, (_, s) = self.inner(x)
        return self.head(h + s)


class ReadsAnotherWeight(nn.Module):
    """A layer's weight read outside it by the model itself (``F.linear(x, self.lin.weight)``, the layer never
    called): only torch.func on the whole model covers it."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(F.linear(x, self.lin.weight)))


def test_a_module_returning_nested_tuples_is_exact_in_your_own_loop_and_a_refusal_names_the_parameter():
    """Every tensor of a module's output is recorded, nested ones too (before: only the top level's, so the inner
    tensor's use of ``w`` sent the whole model to torch.func, and your own loop was refused without a reason); a model
    your own loop cannot take is refused naming the parameter (before: no reason given)."""
    torch.manual_seed(0)
    x, y = torch.randn(N, 4), torch.randint(0, 3, (N,))
    model = ReadsInner()
    want = {n: g.mean(0) for n, g in _alone(model, x, y).items()}
    loop = _private(model, x, y, loop=True)
    assert loop.trainer.grad_sampler.name == "layerwise+func"
    for inputs, labels in loop.batches(steps=1):
        loop.backward(_loss(model(inputs), labels))
        _assert_exact({n: p.grad[None] for n, p in trainable_parameters(model).items()},
                      {n: g[None] for n, g in want.items()})
        loop.optimizer.step()
    loop.close()
    with pytest.raises(ModelError, match=r"torch.func for the whole model \(parameter 'lin.weight' is used outside"):
        _private(ReadsAnotherWeight(), x, y, loop=True)


class Recurrent(nn.Module):
    """torch's recurrent layers as users call them: an LSTM batch-first with a projection, read through h_n and c_n; a
    2-layer bidirectional GRU sequence-first; a ReLU RNN on a PackedSequence of each example's length, bidirectional."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, proj_size=2, batch_first=True)
        self.gru = nn.GRU(3, 3, num_layers=2, bidirectional=True)
        self.rnn = nn.RNN(3, 2, nonlinearity="relu", batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 + 4 + 6 + 4, 3)

    def forward(self, x, lengths):
        _, (h, c) = self.lstm(x)
        g, _ = self.gru(x.transpose(0, 1))
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, r = self.rnn(packed)
        return self.head(torch.cat([h[0], c[0], g[-1], r.transpose(0, 1).flatten(1)], 1))


def test_recurrent_layers_are_exact_layerwise_in_your_own_loop_and_make_private():
    """Before: torch.func cannot vmap their fused kernels, so every model with one was trained by a loop of
    single-example passes (about 1.8x slower than now for an LSTM(32, 64) at 64 examples), and your own loop refused it.
    (make_private's trainer is the loop's: the backend and the checks are the same.)"""
    torch.manual_seed(0)
    x, y = torch.randn(N, T, 3), torch.randint(0, 3, (N,))
    lengths = torch.tensor([T - i % 3 for i in range(N)])
    model = Recurrent()
    want = _alone_inputs(model, (x, lengths), y)
    loop = _private(model, (x, lengths), y, loop=True)
    sampler = loop.trainer.grad_sampler
    assert sampler.name == "layerwise+func"
    with sampler.recording(N), torch.enable_grad():
        losses = _loss(model(x, lengths), y)
    _assert_exact(sampler.from_losses(losses).materialize(), want)
    for inputs, labels in loop.batches(steps=1):
        loop.backward(_loss(model(*inputs), labels))
        _assert_exact({n: p.grad[None] for n, p in trainable_parameters(model).items()},
                      {n: g.mean(0)[None] for n, g in want.items()})
        loop.optimizer.step()
    loop.close()


def test_dropout_between_recurrent_layers_trains_by_single_examples_and_your_loop_is_told_the_way_out():
    torch.manual_seed(0)
    x, y = torch.randn(N, T, 3), torch.randint(0, 3, (N,))

    class Stacked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    model = Stacked()
    assert _private(model, x, y).grad_sampler.name == "loop"  # (exact: each example its own masks)
    with pytest.raises(ModelError, match="dropout between layers .*stack single-layer LSTMs with nn.Dropout"):
        _private(Stacked(), x, y, loop=True)


def test_sequence_first_attention_in_your_own_loop_is_told_batch_first():
    """nn.MultiheadAttention's default layout [T, B, E] has the examples along dimension 1: make_private takes it by
    torch.func on the whole model (exact: docs/python_api.md), and your own loop's refusal names the way out (before:
    not how to fix it)."""

    class SequenceFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = nn.MultiheadAttention(4, 2), nn.Linear(4, 3)

        def forward(self, x):
            h = x.transpose(0, 1)
            return self.head(self.attn(h, h, h)[0].mean(0))

    torch.manual_seed(0)
    x, y = torch.randn(N, T, 4), torch.randint(0, 3, (N,))
    with pytest.raises(ModelError, match="MultiheadAttention: .*build it with batch_first=True"):
        _private(SequenceFirst(), x, y, loop=True)


def test_recurrent_layers_train_under_bf16_autocast():
    """Before: make_private refused an LSTM under mixed_precision="bf16" at its first step, as a model writing its
    attribute '_flat_weight_refs' (the recurrence failed on bf16 output gradients, and torch.func's try on the whole
    model rewrote the LSTM's flat-weight bookkeeping). The recurrence is formed in float32, as a rule's gradients are."""
    torch.manual_seed(0)
    x, y = torch.randn(N, T, 3), torch.randint(0, 3, (N,))

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[1][0][0])

    model = Last()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = make_private(model, opt, (x, y), noise_multiplier=0.0, non_private=True, max_grad_norm=1e6,
                           sampling="full", batch_size=N, loss_fn=_loss, mixed_precision="bf16")
    before = {n: p.detach().clone() for n, p in trainable_parameters(model).items()}
    want = {n: g.mean(0) for n, g in _alone(model, x, y).items()}  # (float32: bf16's rounding apart)
    trainer.step()
    assert trainer.grad_sampler.name == "layerwise+func (bf16 autocast)"
    for n, p in trainable_parameters(model).items():
        assert float((before[n] - p.detach() - want[n]).norm()) <= 5e-2 * float(want[n].norm()) + 1e-4, n
