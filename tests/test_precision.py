"""Mixed precision (bf16 autocast on the CPU): the per-example passes in bfloat16 once raised "both inputs should have
same dtype"; now the gradients are formed, clipped, summed and noised in float32 and stay within bfloat16's rounding
of the float32 run."""

import pytest
import torch
from torch import nn

from dptrain.engine.api import make_private
from dptrain.errors import ConfigError
from dptrain.stages.per_example import make_grad_sampler
from dptrain.stages.precision import MixedPrecision


class Tagger(nn.Module):
    """Embedding, LayerNorm, Linear on sequences and a tied output layer: the layerwise rules under autocast."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm, self.mix = nn.LayerNorm(16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.norm(self.emb(ids)))).mean(1))


def _data(n=120):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (n, 10), generator=g)
    return ids, (ids[:, 0] % 3)


def _loss(out, y):
    return nn.functional.cross_entropy(out.float(), y, reduction="none")


@pytest.mark.parametrize("backend", ["auto", "func", "loop"])
def test_bf16_per_example_gradients_are_float32_within_bf16_rounding(backend):
    torch.manual_seed(0)
    model, (ids, y) = Tagger(), _data(8)
    full, _ = make_grad_sampler(model, _loss, backend)(ids, y)
    half, _ = MixedPrecision(make_grad_sampler(model, _loss, backend), torch.bfloat16, torch.device("cpu"))(ids, y)
    for name, g in half.materialize().items():
        assert g.dtype == torch.float32, name
        ref = full.materialize()[name]
        assert float((g - ref).norm()) <= 0.05 * float(ref.norm()) + 1e-6, name  # bf16 keeps 8 bits of mantissa
    norms_full = torch.sqrt(sum(full.sq_norms().values()))
    norms_half = torch.sqrt(sum(half.sq_norms().values()))
    torch.testing.assert_close(norms_half, norms_full, rtol=0.05, atol=1e-5)


def test_a_bf16_run_trains_with_float32_gradients_and_checks():
    torch.manual_seed(0)
    model = Tagger()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.5), _data(), noise_multiplier=1.0,
                           batch_size=30, loss_fn=_loss, mixed_precision="bf16", seed=0)
    assert "bf16" in trainer.grad_sampler.name and trainer.gradient_check.backend.startswith("layerwise")
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda opt, a, k: seen.extend(p.grad.dtype for p in model.parameters()))
    trainer.train(steps=3)
    assert trainer.steps == 3 and set(seen) == {torch.float32}
    with pytest.raises(ConfigError, match="mixed_precision must be one of bf16, fp16"):
        make_private(Tagger(), torch.optim.SGD(Tagger().parameters(), lr=0.5), _data(), noise_multiplier=1.0,
                     batch_size=30, mixed_precision="int8")
