"""Per-example gradients equal a loop of single-example backward passes, for both backends."""

import pytest
import torch
from torch import nn

from dptrain.models.builders import build_model
from dptrain.stages.per_example import (
    FuncGradSampler,
    LayerwiseGradSampler,
    cross_entropy_per_example,
    layerwise_supported,
    make_grad_sampler,
)


def loop_gradients(model, x, y):
    """Reference: one ordinary backward pass per example."""
    out = {n: [] for n, p in model.named_parameters() if p.requires_grad}
    for i in range(len(x)):
        model.zero_grad()
        cross_entropy_per_example(model(x[i : i + 1]), y[i : i + 1]).sum().backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                out[n].append(p.grad.detach().clone())
    return {n: torch.stack(g) for n, g in out.items()}


class Shared(nn.Module):
    """One Linear used twice (weight sharing) plus a LayerNorm over a sequence dimension."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # x: [B, T, 6]
        h = torch.tanh(self.lin(x))
        h = self.norm(self.lin(h))
        return self.head(h.mean(1))


def _conv_zoo():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 5, 5),
    )


CASES = {
    "mlp": (lambda: build_model("mlp", (10,), 4, hidden=[8, 8]), (10,), 4),
    "conv_groupnorm_dilation_groups": (_conv_zoo, (2, 10, 10), 5),
    "cnn28": (lambda: build_model("cnn28", (1, 28, 28), 10), (1, 28, 28), 10),
    "resnet20": (lambda: build_model("resnet20", (3, 8, 8), 10, groups=4), (3, 8, 8), 10),
    "shared_weights_layernorm_sequence": (Shared, (5, 6), 3),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["func", "layerwise"])
def test_per_example_gradients_match_loop(case, backend):
    torch.manual_seed(0)
    build, shape, classes = CASES[case]
    model = build().double()
    x = torch.randn(7, *shape, dtype=torch.float64)
    y = torch.randint(0, classes, (7,))
    expected = loop_gradients(model, x, y)
    assert layerwise_supported(model)
    sampler = (FuncGradSampler if backend == "func" else LayerwiseGradSampler)(
        model, cross_entropy_per_example
    )
    per_example, losses = sampler(x, y)
    sampler.close()
    grads = per_example.materialize()
    assert set(grads) == set(expected)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-9, atol=1e-11, msg=f"{case}/{backend}/{n}")
    torch.testing.assert_close(losses, cross_entropy_per_example(model(x), y).detach())
    # Norms and weighted sums (ghost norms / book-keeping for Linear layers) agree with the tensors.
    f = torch.rand(7, dtype=torch.float64)
    sq, summed = per_example.sq_norms(), per_example.weighted_sum(f)
    for n, g in expected.items():
        torch.testing.assert_close(sq[n], g.reshape(7, -1).pow(2).sum(1), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(summed[n], torch.tensordot(f, g, dims=1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", ["conv_groupnorm_dilation_groups", "cnn28"])
def test_grouped_convolutions_split_into_calls_match_loop(case, monkeypatch):
    """Per-example conv gradients computed a few examples per grouped convolution (7 = 3 + 3 + 1) match the loop."""
    import dptrain.stages.layer_rules as rules

    monkeypatch.setattr(rules, "CONV_GROUPS_PER_CALL", 3)
    torch.manual_seed(0)
    build, shape, classes = CASES[case]
    model = build().double()
    x, y = torch.randn(7, *shape, dtype=torch.float64), torch.randint(0, classes, (7,))
    expected = loop_gradients(model, x, y)
    sampler = LayerwiseGradSampler(model, cross_entropy_per_example)
    grads = sampler(x, y)[0].materialize()
    sampler.close()
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-9, atol=1e-11, msg=f"{case}/{n}")


def test_auto_falls_back_per_module_not_for_the_whole_model():
    assert (
        make_grad_sampler(build_model("cnn28", (1, 28, 28), 10), cross_entropy_per_example).name
        == "layerwise"
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 2)).double()
    assert not layerwise_supported(model)  # PReLU has a parameter the layerwise backend has no rule for
    sampler = make_grad_sampler(model, cross_entropy_per_example)
    assert sampler.name == "layerwise+func"  # torch.func for the PReLU only
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    grads, expected = sampler(x, y)[0].materialize(), loop_gradients(model, x, y)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n])
    with pytest.raises(Exception, match="rules for Linear"):
        make_grad_sampler(model, cross_entropy_per_example, "layerwise")  # the strict backend refuses


class Gated(nn.Module):
    """A layer of its own (no rule) that draws ``torch.rand(1)`` in every training call, as peft's LoHa and LoKr layers
    do (their module dropout, here at 0)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.scale if bool(torch.rand(1) >= 0.0) else x


def test_random_draws_shared_by_the_batch_are_replayed_to_the_module_alone_not_the_whole_model():
    """vmap refuses random operations: such a layer sent the whole model to torch.func example by example (LoKr), or
    DPTrainer refused it. The batch's draws are replayed to each example's call of the layer alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Gated(), nn.Linear(4, 2)).double()
    sampler = make_grad_sampler(model, cross_entropy_per_example)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    grads = sampler(x, y)[0].materialize()
    assert sampler.name == "layerwise+func"  # (was the whole model: loop)
    for i in range(5):
        out = model(x[i : i + 1])
        ref = torch.autograd.grad(cross_entropy_per_example(out, y[i : i + 1]).sum(), list(model.parameters()))
        for (n, _), r in zip(model.named_parameters(), ref, strict=True):
            torch.testing.assert_close(grads[n][i], r, rtol=1e-9, atol=1e-12)


class Branchy(nn.Module):
    """A layer of its own whose forward branches on its input's values: vmap cannot run it (data-dependent control
    flow), as it cannot run peft's SHiRA (sparse weights) or LoHa (a custom autograd.Function)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.scale if bool(x.abs().sum() > 0) else x


def test_a_layer_vmap_cannot_run_is_differentiated_example_by_example_alone_not_the_whole_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Branchy(), nn.Linear(4, 2)).double()
    sampler = make_grad_sampler(model, cross_entropy_per_example)
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    grads, expected = sampler(x, y)[0].materialize(), loop_gradients(model, x, y)
    assert sampler.name == "layerwise+func"  # (was the whole model: loop)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-9, atol=1e-12)


class Sequence(nn.Module):
    """Token ids -> Embedding (with a padding id) -> Conv1d over time -> RMSNorm -> Linear on [B, T, d] (ghost
    norms: short sequence, wide layer) -> LayerNorm -> attention (no rule: torch.func for that module) -> head."""

    def __init__(self, vocab=50, d=12, ghost_width=40):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.conv = nn.Conv1d(d, d, 3, padding=1, groups=2)
        self.rms = nn.RMSNorm(d)
        self.wide = nn.Linear(d, ghost_width)
        self.norm = nn.LayerNorm(ghost_width)
        self.attn = nn.MultiheadAttention(ghost_width, 2, batch_first=True)
        self.head = nn.Linear(ghost_width, 3)

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        h = self.norm(torch.tanh(self.wide(self.rms(h))))
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch.func on CPU attention (the func backend)
@pytest.mark.parametrize("backend", ["auto", "func"])
def test_sequence_layers_match_the_loop(backend):
    from dptrain.stages.gradient_factors import _EmbeddingFactors, _LinearFactors
    from dptrain.stages.layer_rules import ghost_pays

    torch.manual_seed(0)
    model = Sequence().double()
    ids = torch.randint(0, 50, (6, 5))
    ids[0, 3:] = 0  # padding
    ids[1, :] = 7  # repeated ids: the embedding's Gram form must add them up
    y = torch.randint(0, 3, (6,))
    expected = loop_gradients(model, ids, y)
    sampler = make_grad_sampler(model, cross_entropy_per_example, backend)
    per_example, _ = sampler(ids, y)
    if backend == "auto":
        assert sampler.name == "layerwise+func"
        parts = per_example._parts
        assert isinstance(parts["emb.weight"], _EmbeddingFactors)  # never [B, vocab, d]
        assert ghost_pays(5, 12, 40) and isinstance(parts["wide.weight"], _LinearFactors)
    grads = per_example.materialize()
    f = torch.rand(6, dtype=torch.float64)
    sq, summed = per_example.sq_norms(), per_example.weighted_sum(f)
    for n, g in expected.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-9, atol=1e-11, msg=n)
        torch.testing.assert_close(sq[n], g.reshape(6, -1).pow(2).sum(1), rtol=1e-9, atol=1e-12, msg=n)
        torch.testing.assert_close(summed[n], torch.tensordot(f, g, dims=1), rtol=1e-9, atol=1e-12, msg=n)
    assert not grads["emb.weight"][:, 0].any()  # the padding row gets no gradient


def test_ghost_norms_are_chosen_per_layer_from_its_shapes():
    from dptrain.stages.layer_rules import ghost_pays

    assert ghost_pays(positions=16, fan_in=768, fan_out=50_000)  # a vocabulary projection on short text
    assert not ghost_pays(positions=196, fan_in=9, fan_out=16)  # cnn28's first convolution as a matmul


def test_inplace_activation_gets_a_copy_with_correct_gradients():
    # ReLU(inplace=True) overwrites the Linear's output, which the layerwise backend would misread: it sees the
    # overwrite (the output's version counter) and records again, handing the model a copy of that layer's output
    # (it used to send the whole model to torch.func).
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    sampler = make_grad_sampler(model, cross_entropy_per_example, "auto")
    assert sampler.name == "layerwise"
    grads = sampler(x, y)[0].materialize()
    assert sampler.name == "layerwise" and sampler.backend._copied == {model[0]}
    expected = loop_gradients(model, x, y)
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n])


def test_unused_parameters_get_zero_gradients():
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(3, 2), nn.Linear(3, 2)

        def forward(self, x):
            return self.used(x)

    model = Partly()
    sampler = LayerwiseGradSampler(model, cross_entropy_per_example)
    grads = sampler(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))[0].materialize()
    assert grads["unused.weight"].shape == (4, 2, 3) and not grads["unused.weight"].any()


class Encoder(nn.Module):
    """torch's own TransformerEncoderLayer (its attention takes a batched key_padding_mask keyword) and a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, ids, mask):
        return self.head(self.layer(self.emb(ids), src_key_padding_mask=mask).mean(1))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_keyword_tensors_of_a_fallback_module_are_split_by_example_and_checked():
    from dptrain.stages.module_func import FallbackError
    from dptrain.stages.module_func import per_module_gradients as _per_module

    torch.manual_seed(0)
    model = Encoder().double()
    ids = torch.randint(0, 20, (5, 6))
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[1, 4:] = True  # padding in example 1 only: sharing the mask whole would be wrong
    y = torch.tensor([0, 1, 1, 0, 1])
    sampler = make_grad_sampler(model, lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"))
    grads = sampler((ids, mask), y)[0].materialize()
    assert sampler.name == "layerwise+func"  # the encoder layer on its own; embedding and head by their rules
    for i in range(5):
        model.zero_grad()
        nn.functional.cross_entropy(model(ids[i : i + 1], mask[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[n][i], p.grad, rtol=1e-8, atol=1e-10, msg=n)
    # a module whose per-example outputs do not reproduce the batch's is refused, not differentiated wrongly
    lin = nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(FallbackError, match="does not reproduce"):
        _per_module(lin, (x,), {}, [torch.ones(4, 3, dtype=torch.float64)], [lin(x) + 1.0])


@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1),
        lambda: nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=(2, 0), dilation=(1, 2)),
        lambda: nn.Conv2d(1, 6, 5, stride=3, padding=2, dilation=2, bias=False),
        lambda: nn.Conv2d(9, 8, 3, padding=1),  # above the channel threshold: both forms asked for explicitly
        lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1, dilation=2),
    ],
)
@pytest.mark.parametrize("below", [0, 100])  # CONV_FORWARD_BELOW_CHANNELS: 0 -> grouped backward, 100 -> forward form
def test_conv_weight_gradients_by_forward_and_grouped_backward_match_loop(conv, below, monkeypatch):
    """Both ways of forming per-example conv weight gradients (one forward convolution with the output gradients as
    filters, or a grouped convolution backward) equal the loop, across strides, dilations, paddings and kernel
    shapes."""
    import dptrain.stages.layer_rules as rules

    monkeypatch.setattr(rules, "CONV_FORWARD_BELOW_CHANNELS", below)
    torch.manual_seed(0)
    layer = conv()
    spatial = (11,) if isinstance(layer, nn.Conv1d) else (11, 9)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(6, layer.in_channels, *spatial, dtype=torch.float64)
    model(x)  # materialize the lazy head
    y = torch.randint(0, 3, (6,))
    expected = loop_gradients(model, x, y)
    sampler = LayerwiseGradSampler(model, cross_entropy_per_example)
    grads = sampler(x, y)[0].materialize()
    sampler.close()
    for n in expected:
        torch.testing.assert_close(grads[n], expected[n], rtol=1e-9, atol=1e-11, msg=n)


@pytest.mark.parametrize("mean", [0.0, 100.0])
def test_group_norm_gradients_in_float32_are_as_exact_as_torchs_own(mean):
    """The GroupNorm rule runs torch's fused kernels on the batch seen as one example of B x C channels (the same
    rstd (sum go x - mean sum go) torch forms its batch gradient with). In float32 its per-example gradients stay
    within 1e-5 (relative) of float64's for centred inputs and, for inputs whose mean is 100x their spread, within
    what torch's own batch gradient errs by (both round the same sums)."""
    torch.manual_seed(0)
    norm = nn.GroupNorm(4, 16)
    x = torch.randn(32, 16, 8, 8) + mean
    go = torch.randn(32, 16, 8, 8)
    sampler = LayerwiseGradSampler(nn.Sequential(norm), lambda out, y: (out * go).flatten(1).sum(1))
    got = sampler(x, torch.zeros(32))[0].materialize()
    sampler.close()
    xhat = torch.nn.functional.group_norm(x.double(), 4, None, None, norm.eps)
    exact = {"0.weight": (go.double() * xhat).sum((2, 3)), "0.bias": go.double().sum((2, 3))}
    torch_batch = torch.autograd.grad(torch.nn.functional.group_norm(x, 4, norm.weight, norm.bias, norm.eps), norm.weight, go)[0]
    torch_error = float((torch_batch.double() - exact["0.weight"].sum(0)).norm() / exact["0.weight"].sum(0).norm())
    for name, value in exact.items():
        error = float((got[name].double() - value).norm() / value.norm())
        assert error < max(1e-5, 3 * torch_error), (name, error, torch_error)
