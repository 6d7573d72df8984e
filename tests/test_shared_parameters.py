"""Parameters used in several places (tied weights) get the sum of every use, and a layer applied to an input shared by
the whole batch (position ids of shape [1, T]) gets each example's own gradient: both against a loop of
single-example backward passes. A stock GPT-2 has both; dptrain used to drop the output layer's share of the tied
embedding (its update 80% off) and fail on the broadcast position ids."""

import pytest
import torch
from torch import nn

from dptrain.stages.gradient_factors import _EmbeddingFactors, _inner, _LinearFactors, shared
from dptrain.stages.per_example import make_grad_sampler, trainable_parameters


class TiedLM(nn.Module):
    """GPT-2's shape in miniature: token + position embeddings (positions [1, T], broadcast against the batch), a
    block, and an output layer whose weight IS the token embedding."""

    def __init__(self, vocab=23, dim=8, positions=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # [1, T]
        h = self.wte(ids) + self.wpe(positions)
        return self.head(self.block(h))


def lm_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _loop(model, x, y, loss_fn):
    params = trainable_parameters(model)
    rows = []
    for i in range(len(y)):
        grads = torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]).sum(), list(params.values()))
        rows.append(dict(zip(params, grads, strict=True)))
    return rows


@pytest.mark.parametrize("backend", ["auto", "layerwise", "func"])
def test_tied_embedding_gets_every_use_in_norm_and_sum(backend):
    torch.manual_seed(0)
    model, ids = TiedLM(), torch.randint(0, 23, (5, 10))
    assert len(trainable_parameters(model)) == 6  # the tied weight counted once
    grads, _ = make_grad_sampler(model, lm_loss, backend)(ids, ids)
    loop = _loop(model, ids, ids, lm_loss)
    norms = torch.sqrt(sum(grads.sq_norms().values()))
    expected = torch.stack([torch.sqrt(sum((g**2).sum() for g in row.values())) for row in loop])
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=1e-6)
    f = torch.randn(5)
    summed = grads.weighted_sum(f)
    for name in loop[0]:
        torch.testing.assert_close(summed[name], sum(f[i] * loop[i][name] for i in range(5)), rtol=1e-4, atol=1e-6)


def test_cross_terms_of_every_pair_of_forms_match_the_materialized_gradients():
    g = torch.Generator().manual_seed(1)
    b, t, vocab, dim = 3, 5, 7, 4
    emb = _EmbeddingFactors(torch.randint(0, vocab, (b, t), generator=g), torch.randn(b, t, dim, generator=g), vocab)
    lin_seq = _LinearFactors(torch.randn(b, t, vocab, generator=g), torch.randn(b, t, dim, generator=g))
    lin_flat = _LinearFactors(torch.randn(b, vocab, generator=g), torch.randn(b, dim, generator=g))
    dense = torch.randn(b, vocab, dim, generator=g)
    forms = [emb, lin_seq, lin_flat, dense]
    for p in forms:
        for q in forms:
            mp = p if torch.is_tensor(p) else p.materialize()
            mq = q if torch.is_tensor(q) else q.materialize()
            torch.testing.assert_close(_inner(p, q), (mp * mq).sum((1, 2)), rtol=1e-5, atol=1e-5)
    total = shared(shared(emb, lin_seq), dense)
    torch.testing.assert_close(total.sq_norms(), (total.materialize() ** 2).sum((1, 2)), rtol=1e-5, atol=1e-5)


class FunctionalReuse(nn.Module):
    """A weight used by its layer and, functionally, once more: hooks on the layer see only the first use."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)) + nn.functional.linear(x, self.lin.weight))


def _data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 6, generator=g)
    return x, (x[:, 0] > 0).long()


def test_the_gradient_check_moves_a_wrong_layer_to_torch_func_and_training_is_exact():
    from dptrain.engine.api import make_private

    torch.manual_seed(0)
    model = FunctionalReuse()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), noise_multiplier=1.0,
                           batch_size=50, seed=0)
    check = trainer.gradient_check
    assert "lin.weight" in check.moved_to_func and check.backend == "func"
    x, y = _data()
    grads, _ = trainer.grad_sampler(x[:7], y[:7])
    loop = _loop(model, x[:7], y[:7], lambda out, t: nn.functional.cross_entropy(out, t, reduction="none"))
    norms = torch.sqrt(sum(grads.sq_norms().values()))
    torch.testing.assert_close(norms, torch.stack([torch.sqrt(sum((g**2).sum() for g in r.values())) for r in loop]))


class Scale(nn.Module):
    """No rule (differentiated by torch.func on its own); calls the layer it is handed, as peft's DoRA magnitude layer
    calls the LoRA layers: a recorded call inside another."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x, layer):
        return self.s * layer(x)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale, self.head = nn.Linear(6, 4), Scale(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(x, layer=self.lin)))


def test_a_layer_called_inside_another_recorded_call_keeps_its_rule_and_is_exact():
    """Coverage holds each use against the innermost recorded call: lin's weight inside Scale's call is lin's (its rule
    records it), not a use Scale's torch.func pass misses."""
    torch.manual_seed(0)
    model = Nested()
    x, y = _data()
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")  # noqa: E731
    grads, _ = make_grad_sampler(model, loss, "auto")(x[:5], y[:5])
    mat = grads.materialize()
    for i, row in enumerate(_loop(model, x[:5], y[:5], loss)):
        for name, g in row.items():
            torch.testing.assert_close(mat[name][i], g, rtol=1e-5, atol=1e-7)
    from dptrain.engine.api import make_private

    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), noise_multiplier=1.0,
                           batch_size=50)
    assert trainer.gradient_check.moved_to_func == [] and trainer.grad_sampler.name == "layerwise+func"


def test_a_chosen_backend_that_misses_a_use_is_refused_naming_the_parameter_whatever_the_checks_asked():
    """The functional reuse of lin.weight is outside every recorded call: coverage is proven on every chunk, so it is
    refused even with the gradient check skipped (a skipped check is recorded as skipped on a covered model)."""
    from dptrain.engine.api import make_private
    from dptrain.errors import ModelError

    model = FunctionalReuse()
    for check in (True, False):
        with pytest.raises(ModelError, match="parameter 'lin.weight' is used outside every call that records") as e:
            make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), noise_multiplier=1.0,
                         batch_size=50, grad_sampler="layerwise", check_gradients=check)
        assert "grad_sampler='auto'" in str(e.value) and "\n" not in str(e.value)
    plain = nn.Sequential(nn.Linear(6, 2))
    trainer = make_private(plain, torch.optim.SGD(plain.parameters(), lr=0.1), _data(), noise_multiplier=1.0,
                           batch_size=50, grad_sampler="layerwise", check_gradients=False)
    assert trainer.gradient_check is None  # skipped on request, and recorded as skipped
