"""peft's LoRA on a mixture of experts' weights (``target_parameters``: the adapter is a torch parametrization that
peft registers and removes on every call). Two classes of failure it showed, each made impossible for any model:

- torch.func refuses, inside its transforms, an in-place write to a captured tensor (the parametrization re-sets the
  frozen expert weight); its error names neither vmap nor functorch, and came out as torch's raw RuntimeError. Any
  error torch.func raises now moves the automatic backend on to autograd example by example for that module alone
  (exact; it was the loop of single examples for the whole model), and is refused in one line with grad_sampler='func';
- the re-registration bumps the frozen weight's version counter and storage without changing its value: refused as a
  parameter "written by a training-mode forward pass", with a way out (not_private) that was the wrong advice. A
  watched tensor whose value is kept is compared by its value: a write that puts back what was there releases nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_matrix import per_example_loss, single_example_gradients  # noqa: E402

import dptrain  # noqa: E402
from dptrain.errors import ModelError  # noqa: E402


def _model():
    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    )
    with torch.no_grad():  # (off peft's start, where lora_B = 0 gives lora_A no gradient)
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lora_on_expert_weights_is_exact_in_make_private_and_your_loop():
    model = _model()
    ids = torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(1))
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    loss = per_example_loss("causal")
    trainer = dptrain.make_private(
        model,
        optimizer,
        ({"input_ids": ids}, ids),
        noise_multiplier=1.0,
        batch_size=4,
        max_physical_batch_size=4,
        loss_fn=loss,
    )
    assert trainer.grad_sampler.name == "layerwise+func"
    model.train()
    got, _ = trainer.grad_sampler({"input_ids": ids[:4]}, ids[:4])
    got = got.materialize()
    expected = single_example_gradients(
        model, loss, lambda i: ({"input_ids": ids[i : i + 1]}, ids[i : i + 1]), params, 4
    )
    for i, ref in enumerate(expected):  # (float32: the grouped expert product has no float64 kernel)
        for name, r in ref.items():
            assert float(r.norm()) > 0, name
            assert float((got[name][i] - r).norm()) <= 1e-4 * float(r.norm()), (name, i)
    model = _model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ModelError) as e:
        dptrain.make_private(
            model,
            optimizer,
            ({"input_ids": ids}, ids),
            noise_multiplier=1.0,
            batch_size=4,
            loss_fn=loss,
            grad_sampler="func",
        )
    assert "\n" not in str(e.value) and "grad_sampler='auto' or 'loop'" in str(e.value)
    model = _model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=4)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    # (it was refused, naming make_private: the parametrized experts needed the whole model; they are now
    # differentiated example by example on their own, so your own loop's forward pass gives them)
    loop = dptrain.make_private_loop(model, optimizer, loader, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0)
    assert loop.trainer.grad_sampler.name == "layerwise+func"
    loop.close()


class _Rewrites(torch.nn.Module):
    """Its forward pass puts its frozen scale back in place (new storage, same value), as a parametrization does."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.scale = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.scale.set_(self.scale.detach().clone())
        return self.lin(x * self.scale)


def test_a_write_that_puts_back_the_same_value_is_no_release_and_a_func_refusal_moves_on():
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 2, (12,), generator=torch.Generator().manual_seed(1))
    model = _Rewrites()
    trainer = dptrain.make_private(
        model,
        torch.optim.SGD(model.lin.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        batch_size=4,
        loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="none"),
    )
    assert trainer.private and trainer.not_private_buffers == []
    assert trainer.grad_sampler.name != "func"  # (torch.func refuses the in-place set_ on a captured tensor)
