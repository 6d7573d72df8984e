"""On a GPU: stock Hugging Face models whose layers see the examples' rows flattened (OPT), a tensor shared by the
batch (GPT-2's positions, T5's bias) or their windows (Swin) have exact per-example gradients on the device (the layout
measurement runs on the device); a model cast to bfloat16 trains with float32 gradients; a dynamically
padded DataLoader trains. Skipped where torch sees no GPU (this project's CI machine has none)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_zoo import MODELS, batch, build  # noqa: E402
from test_hf_matrix import assert_exact, per_example_loss, single_example_gradients  # noqa: E402

import dptrain  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def _to(tree, device):
    return {k: v.to(device) for k, v in tree.items()}


@pytest.mark.parametrize("model_name,adapter", [("opt", "full"), ("gpt2", "full"), ("t5", "full"), ("swin", "full"),
                                                ("llama", "lora"), ("bert", "dora"), ("gpt2", "prompt")])
def test_per_example_gradients_on_the_gpu_are_exact(model_name, adapter):
    model = build(model_name, adapter).cuda()
    kind = MODELS[model_name][1]
    loss = per_example_loss(kind, 2 if adapter == "prompt" and kind == "causal" else 0)
    x, y, one = batch(model_name)
    x, y = _to(x, "cuda"), y.cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = dptrain.make_private(model, torch.optim.SGD(params, lr=0.1), (x, y), noise_multiplier=1.0,
                                   batch_size=2, max_physical_batch_size=4, loss_fn=loss, device="cuda")
    model.train()
    grads, _ = trainer.grad_sampler(x, y)

    def one_on_gpu(i):
        xi, yi = one(i)
        return _to(xi, "cuda"), yi.cuda()

    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one_on_gpu, named, len(y)))


def test_a_bfloat16_model_trains_on_the_gpu_with_float32_gradients():
    model = build("gpt2", dtype=torch.bfloat16).cuda()
    ids = torch.randint(2, 32, (12, 6), device="cuda")
    trainer = dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), ({"input_ids": ids}, ids),
                                   noise_multiplier=1.0, batch_size=4, device="cuda", seed=0)
    grads = trainer.grad_sampler({"input_ids": ids[:3]}, ids[:3])[0].materialize()
    assert all(g.dtype == torch.float32 and g.is_cuda for g in grads.values())
    trainer.step()
    assert trainer.steps == 1 and all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_dynamically_padded_loader_trains_on_the_gpu():
    from test_hf_inputs import Texts, tokenizer

    tok = tokenizer()
    model = build("gpt2").cuda()
    loader = torch.utils.data.DataLoader(Texts(tok), batch_size=8,
                                         collate_fn=transformers.DataCollatorForLanguageModeling(tok, mlm=False))
    trainer = dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                                   max_physical_batch_size=3, device="cuda")
    trainer.train(steps=2)
    assert trainer.steps == 2
