"""Which rows of a layer's tensors belong to which example is measured (two passes, B and B - 1 examples), never read
off a size (dptrain.stages.batch_layout). Each model below feeds a layer with parameters something other than [B, ...]
rows: flattened rows (OPT's feed-forward layers), a tensor computed once for the whole batch (a nanoGPT's positions
``arange(T)``, T5's relative-position buckets, a prompt repeated to the batch as peft does), the examples along the
second dimension (a sequence-first layer). Each is tested with the sequence as long as the chunk (T == B, where a size
cannot tell the dimensions apart) and not: the per-example gradients of the automatic backend (no gradient check
behind it) must equal a loop of single-example backward passes, in float64."""

import pytest
import torch
from torch import nn

from dptrain.stages.batch_layout import ROWS, SHARED, kind
from dptrain.stages.per_example import LoopGradSampler, make_grad_sampler

D, V = 6, 11


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)


class Flattened(nn.Module):
    """OPT's decoder layer: the feed-forward layers see the examples' positions flattened into rows, [B * T, d]."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2, self.head = nn.Embedding(V, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Linear(D, V)
        self.norm = nn.LayerNorm(D)

    def forward(self, ids):
        h = self.emb(ids)
        b, t, d = h.shape
        flat = self.norm(h.reshape(-1, d))
        h = h + self.fc2(torch.tanh(self.fc1(flat))).reshape(b, t, d)
        return self.head(h)


class SharedPositions(nn.Module):
    """nanoGPT: ``wpe(arange(T))`` is [T, d], computed once and broadcast against the batch."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.proj, self.head = nn.Embedding(V, D), nn.Embedding(16, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        h = self.wte(ids) + self.proj(self.wpe(positions))
        return self.head(torch.tanh(h))


class SharedBias(nn.Module):
    """T5: a bias per relative position, looked up from [T, T] buckets, permuted and added to every example's
    attention scores."""

    def __init__(self):
        super().__init__()
        self.emb, self.rel, self.head = nn.Embedding(V, D), nn.Embedding(9, 1), nn.Linear(D, V)

    def forward(self, ids):
        t = ids.shape[1]
        buckets = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(-4, 4) + 4
        bias = self.rel(buckets).permute(2, 0, 1)  # [1, T, T]
        h = self.emb(ids)
        attention = torch.softmax(h @ h.transpose(1, 2) + bias, -1)
        return self.head(attention @ h)


class SequenceFirst(nn.Module):
    """A sequence-first layer ([T, B, d]: nn.MultiheadAttention's default layout)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids).transpose(0, 1)  # [T, B, d]
        h = torch.tanh(self.mix(h)).cumsum(0)  # (along the sequence)
        return self.head(h.transpose(0, 1))


class RepeatedPrompt(nn.Module):
    """peft's prompt tuning: the prompt is embedded once ([1, n, d]) and repeated to the batch: expanding its output
    to the batch would hold B x B rows."""

    def __init__(self):
        super().__init__()
        self.emb, self.prompt, self.head = nn.Embedding(V, D), nn.Embedding(2, D), nn.Linear(D, V)

    def forward(self, ids):
        prompt = self.prompt(torch.arange(2)[None]).repeat(ids.shape[0], 1, 1)
        h = torch.cat([prompt, self.emb(ids)], 1).cumsum(1)
        return self.head(h)[:, 2:]


class Choices(nn.Module):
    """A multiple-choice head (BERT's, RoBERTa's, ...): each example's choices flattened into rows, [B * C, T], and the
    positions [1, T, d], embedded once, broadcast against those rows: expanded to one row per example, they would not
    fit; expanded to C rows per example, each example's choices get their own (they used to send the whole model to
    the loop of single-example passes, which a Trainer step cannot run)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(V, D), nn.Embedding(16, D), nn.Linear(D, V)

    def forward(self, ids):
        b, t = ids.shape
        choices = torch.stack([ids, (ids + 1) % V, (ids * 2) % V], 1).reshape(-1, t)  # [B * 3, T]
        h = torch.tanh(self.wte(choices) + self.wpe(torch.arange(t)[None]))
        return self.head(h.reshape(b, 3, t, D).cumsum(1).sum(1))


class Queries(nn.Module):
    """Perceiver's latents: a parameter expanded to the batch size it is given (an int, not a tensor of examples)."""

    def __init__(self):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(2, D))

    def forward(self, batch_size: int):
        return self.latents.expand(batch_size, -1, -1)


class ExpandedQueries(nn.Module):
    """Attention to learned queries expanded to the batch (Perceiver): the queries module's output is laid out by
    example but none of its inputs is; example by example it gives the whole batch's output, so it used to send the
    whole model to the loop of single-example passes (refused by DPTrainer and your own loop)."""

    def __init__(self):
        super().__init__()
        self.emb, self.queries, self.head = nn.Embedding(V, D), Queries(), nn.Linear(D, V)

    def forward(self, ids):
        q, h = self.queries(ids.shape[0]), self.emb(ids)
        return self.head(h + torch.softmax(h @ q.transpose(1, 2), -1) @ q)


MODELS = {"flattened": (Flattened, "layerwise"), "shared-positions": (SharedPositions, "layerwise"),
          "expanded-queries": (ExpandedQueries, "layerwise"),
          "choices": (Choices, "layerwise"),
          "shared-bias": (SharedBias, "func"), "sequence-first": (SequenceFirst, "func"),
          "repeated-prompt": (RepeatedPrompt, "func")}


@pytest.mark.parametrize("b,t", [(4, 4), (3, 5)], ids=["T==B", "T!=B"])
@pytest.mark.parametrize("name", list(MODELS))
def test_layouts_are_measured_and_gradients_exact(name, b, t):
    build, backend = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    ids = torch.randint(0, V, (b, t))
    y = torch.randint(0, V, (b, t))
    rng = torch.get_rng_state()
    sampler = make_grad_sampler(model, loss_fn, "auto")
    got = sampler(ids, y)[0].materialize()
    assert torch.equal(torch.get_rng_state(), rng) and model.training  # (the measurement leaves no trace)
    assert sampler.name.startswith(backend), sampler.name  # OPT's and nanoGPT's layers keep the fast backend
    expected = LoopGradSampler(model, loss_fn)(ids, y)[0].materialize()
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-12, msg=n)


def test_a_later_chunk_of_another_size_reuses_the_layouts_and_stays_exact():
    """Measured once (on the first chunk of >= 2 examples); later chunks of other sizes and lengths, the one with the
    sequence as long as the chunk included, are laid out by the same measurement."""
    torch.manual_seed(0)
    model = SharedPositions().double()
    sampler = make_grad_sampler(model, loss_fn, "auto")
    for b, t in [(3, 5), (5, 5), (2, 7), (1, 4)]:
        ids, y = torch.randint(0, V, (b, t)), torch.randint(0, V, (b, t))
        got = sampler(ids, y)[0].materialize()
        expected = LoopGradSampler(model, loss_fn)(ids, y)[0].materialize()
        for n, g in expected.items():
            torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-12, msg=f"{n} at B={b}, T={t}")
    assert sampler.name == "layerwise"


def test_a_tensor_is_rows_shared_or_neither_by_how_it_changes_with_the_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 2, generator=g)
    assert kind(x.reshape(12, 2), x[:3].reshape(9, 2), 4, 3) == ROWS  # three rows per example
    bias = torch.randn(4, 4, generator=g)  # [T, T] with T == B
    assert kind(bias, bias.clone(), 4, 3) == SHARED
    seq_first = torch.randn(4, 4, 2, generator=g)  # [T, B, d] with T == B
    assert kind(seq_first, seq_first[:, :3], 4, 3) is None
    assert kind(x, x[[1, 0, 2]], 4, 3) is None  # the rows of the examples moved
    assert kind(x.flip(0), x[:3].flip(0), 4, 3) is None  # the examples in another order


class TrainingOnly(Flattened):
    """A model that cannot run in evaluation mode, where the layouts are measured."""

    def forward(self, ids):
        if not self.training:
            raise RuntimeError("training only")
        return super().forward(ids)


def test_a_model_the_measurement_cannot_run_is_differentiated_whole_never_guessed():
    torch.manual_seed(0)
    model = TrainingOnly().double()
    ids, y = torch.randint(0, V, (3, 4)), torch.randint(0, V, (3, 4))
    sampler = make_grad_sampler(model, loss_fn, "auto")
    got = sampler(ids, y)[0].materialize()
    assert sampler.name == "func"
    expected = LoopGradSampler(model, loss_fn)(ids, y)[0].materialize()
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, rtol=1e-9, atol=1e-12, msg=n)
