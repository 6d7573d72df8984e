"""A small transformer fine-tuned with DP through LoRA adapters (dptrain.models.builders.TinyTransformer, dptrain.models.lora):
every parameter has a layerwise per-example rule (no torch.func fallback), its per-example gradients match the
single-example loop, and DP training moves the adapters and the head but not one bit of the frozen base (the
silent corruption reported against Opacus + PEFT)."""

import warnings

import torch

from dptrain.data.loaders import make_text_task
from dptrain.engine.api import make_private_with_epsilon
from dptrain.models.builders import build_model
from dptrain.models.lora import LoRALinear
from dptrain.stages.per_example import cross_entropy_per_example, make_grad_sampler

warnings.filterwarnings("ignore", message="not private")


def test_the_transformers_per_example_gradients_are_layerwise_and_match_the_loop():
    for lora in (0, 3):
        torch.manual_seed(0)
        model = build_model("tiny_transformer", (6,), 2, vocab=12, d_model=8, heads=2, layers=1, lora_rank=lora).double()
        for m in model.modules():  # non-zero adapters, so that A's gradient is not trivially zero
            if isinstance(m, LoRALinear):
                torch.nn.init.normal_(m.lora_b.weight, std=0.3)
        ids, y = torch.randint(0, 12, (5, 6)), torch.tensor([0, 1, 1, 0, 1])
        sampler = make_grad_sampler(model, cross_entropy_per_example)
        grads = sampler(ids, y)[0].materialize()
        assert sampler.name == "layerwise"
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert set(grads) == trainable
        if lora:
            assert trainable == {n for n in trainable if "lora_" in n or n.startswith("head.")}
        for i in range(5):
            model.zero_grad()
            cross_entropy_per_example(model(ids[i : i + 1]), y[i : i + 1]).sum().backward()
            for n, p in model.named_parameters():
                if p.requires_grad:
                    torch.testing.assert_close(grads[n][i], p.grad, rtol=1e-9, atol=1e-11, msg=n)


def test_dp_lora_fine_tuning_moves_the_adapters_and_never_the_frozen_base():
    data = make_text_task(n=400, n_test=10, length=8, vocab=16)
    torch.manual_seed(0)
    model = build_model("tiny_transformer", (8,), 2, vocab=16, d_model=16, heads=2, layers=1, lora_rank=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainer = make_private_with_epsilon(
        model, torch.optim.Adam(trainable, lr=0.01), data.train, target_epsilon=3.0, target_delta=1e-5, steps=8,
        batch_size=50, seed=4,
    )
    trainer.train(steps=8)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, before[n]), f"{n} did not move"
        else:
            assert torch.equal(p, before[n]), f"frozen {n} moved"
    assert trainer.epsilon().epsilon <= 3.0
