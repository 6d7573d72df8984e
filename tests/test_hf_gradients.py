"""Per-example gradients of stock Hugging Face models, exactly as transformers builds them (random weights from config
objects: no hub here), against a loop of single-example backward passes: GPT-2 (tied embeddings, broadcast position
ids), BERT, a Llama-style decoder (tied, grouped-query attention, rotary positions), each with and without peft LoRA
adapters, each with padding. Norms and the clipped sum (a clip norm no example reaches) must agree."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dptrain.engine.api import make_private  # noqa: E402
from dptrain.models.losses import default_loss  # noqa: E402
from dptrain.stages.clipping import FlatClipping  # noqa: E402
from dptrain.stages.per_example import make_grad_sampler, trainable_parameters  # noqa: E402

VOCAB, T, B = 97, 12, 5


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                  eos_token_id=1, pad_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), ["c_attn", "c_proj"]


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg), ["query", "value"]


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=True, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg), ["q_proj", "v_proj"]


def _batch(classify: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 7:], mask[2, 4:] = 0, 0  # padded examples
    ids = ids.masked_fill(mask == 0, 0)
    labels = torch.randint(0, 3, (B,), generator=g) if classify else ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def _loop(model, x, y, loss_fn):
    params = trainable_parameters(model)
    rows = []
    for i in range(B):
        xi = {k: v[i : i + 1] for k, v in x.items()}
        rows.append(torch.autograd.grad(loss_fn(model(**xi), y[i : i + 1]).sum(), list(params.values()),
                                        allow_unused=True))
    return list(params), rows


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("build", [gpt2, bert, llama])
def test_per_example_gradients_match_the_single_example_loop(build, lora):
    torch.manual_seed(0)
    model, targets = build()
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           fan_in_fan_out=build is gpt2))
    model.eval()  # no dropout: the loop and the batch see the same function
    loss_fn = default_loss(model)
    x, y = _batch(build is bert)
    grads, _ = make_grad_sampler(model, loss_fn, "auto")(x, y)
    names, rows = _loop(model, x, y, loss_fn)
    expected = torch.stack([torch.sqrt(sum((g.double() ** 2).sum() for g in r if g is not None)) for r in rows])
    norms = torch.sqrt(sum(v.double() for v in grads.sq_norms().values()))
    torch.testing.assert_close(norms, expected, rtol=1e-4, atol=1e-7)
    summed, _ = FlatClipping(1e9).clip_and_sum(grads)  # nobody clipped: the sum of the per-example gradients
    scale = max(float(expected.max()), 1e-12)
    for j, name in enumerate(names):
        ref = sum(r[j] for r in rows if r[j] is not None)
        if torch.is_tensor(ref):
            assert float((summed[name].double() - ref.double()).norm()) <= 1e-4 * scale, name


def test_a_stock_gpt2_trains_as_transformers_builds_it_and_its_checks_are_cheap():
    torch.manual_seed(0)
    model, _ = gpt2()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (200, T), generator=g)
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), ({"input_ids": ids}, ids),
                           noise_multiplier=1.0, batch_size=16)
    check = trainer.gradient_check
    assert check.moved_to_func == [] and check.backend.startswith("layerwise")
    trainer.step()
    assert trainer.steps == 1 and trainer.ledger.releases == 1


def test_the_func_backend_on_transformers_masking_code_is_a_one_line_error_and_auto_still_trains():
    from dptrain.errors import ModelError

    model, _ = bert()
    x, y = _batch(True)
    with pytest.raises(ModelError, match="torch.func cannot differentiate this model per example") as e:
        make_grad_sampler(model, default_loss(model), "func")(x, y)
    assert "\n" not in str(e.value)
