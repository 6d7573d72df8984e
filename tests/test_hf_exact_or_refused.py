"""Every trainable parameter's per-example gradient exact or the model refused, never zero (issue 30 item 1), on stock
Hugging Face models built from config objects (2 layers, random weights): peft IA3, LoHa and VeRA adapters (kept in a
ParameterDict that is never called) on BERT and DistilBERT classifiers, gradient checkpointing with and without
use_reentrant on GPT-2 + LoRA, torch.compile inside your own loop, and the check's precision (float32 rounding of a
tiny gradient passes, a rule 1e-3 off fails)."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dptrain.engine.api import make_private  # noqa: E402
from dptrain.errors import ModelError  # noqa: E402
from dptrain.models.losses import default_loss  # noqa: E402
from dptrain.stages import layer_rules, per_example  # noqa: E402
from dptrain.stages.per_example import trainable_parameters  # noqa: E402

VOCAB, T, N = 97, 10, 40


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg), ["query", "value", "output.dense"], ["output.dense"]


def distilbert():
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                        max_position_embeddings=32, num_labels=3, dropout=0.0, attention_dropout=0.0,
                                        seq_classif_dropout=0.0)
    return transformers.DistilBertForSequenceClassification(cfg), ["q_lin", "v_lin", "out_lin"], ["out_lin"]


def gpt2(checkpointing=None, lora=True):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                                  eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                           fan_in_fan_out=True, lora_dropout=0.0))
    return model


def _data(classify: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (N, T), generator=g)
    return {"input_ids": ids}, (torch.randint(0, 3, (N,), generator=g) if classify else ids)


def _private(model, data, **options):
    params = [p for p in model.parameters() if p.requires_grad]
    return make_private(model, torch.optim.SGD(params, lr=0.1), data, noise_multiplier=1.0, batch_size=10, **options)


def assert_exact_per_parameter(trainer, x, y, rows=6) -> set[str]:
    """The trainer's per-example gradients, in training mode and float64 (no rounding to hide behind), against a
    backward pass on each example alone: every parameter within 1e-6 of its own gradient's norm. Returns the
    parameters whose gradient is not zero."""
    model, loss_fn = trainer.model, trainer.loss_fn
    model.double().train()
    try:
        x = {k: v[:rows] for k, v in x.items()}
        grads, _ = trainer.grad_sampler(x, y[:rows])
        mat = grads.materialize()
        params = trainable_parameters(model)
        nonzero = set()
        for i in range(rows):
            loss = loss_fn(model(**{k: v[i : i + 1] for k, v in x.items()}), y[i : i + 1]).sum()
            alone = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (name, p), g in zip(params.items(), alone, strict=True):
                g = torch.zeros_like(p) if g is None else g
                err = float((mat[name][i] - g).norm())
                assert err <= 1e-6 * float(g.norm()) + 1e-12, (name, err, float(g.norm()))
                if float(g.norm()) > 0:
                    nonzero.add(name)
        return nonzero
    finally:
        model.float()


@pytest.mark.parametrize(("build", "adapter"), [(b, a) for b in (bert, distilbert) for a in ("ia3", "loha", "vera")]
                         + [(bert, a) for a in ("adalora", "boft", "hra")])
def test_adapters_kept_in_a_container_never_called_are_exact_not_zero(build, adapter):
    """IA3, LoHa, VeRA (the issue's), AdaLoRA's lora_E, BOFT's boft_R, HRA's hra_u (the same kind): all were 0."""
    torch.manual_seed(0)
    model, targets, feedforward = build()
    config = {
        "ia3": lambda: peft.IA3Config(target_modules=targets, feedforward_modules=feedforward, task_type="SEQ_CLS"),
        "loha": lambda: peft.LoHaConfig(r=2, target_modules=targets, task_type="SEQ_CLS"),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=targets[:2], task_type="SEQ_CLS"),
        "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=targets[:2], task_type="SEQ_CLS", total_step=10),
        "boft": lambda: peft.BOFTConfig(boft_block_size=8, target_modules=targets[:2], task_type="SEQ_CLS"),
        "hra": lambda: peft.HRAConfig(r=4, target_modules=targets[:2], task_type="SEQ_CLS"),
    }[adapter]()
    model = peft.get_peft_model(model, config)  # (at the adapters' initial values, as a user starts)
    x, y = _data(True)
    trainer = _private(model, (x, y))
    assert trainer.gradient_check.precision == "float64"
    nonzero = assert_exact_per_parameter(trainer, x, y)
    layers = {n.split(".layer.")[1].split(".")[0] for n in nonzero if ".layer." in n}
    assert layers == {"0", "1"}  # adapters of both layers learn (their gradients were exactly 0)
    trainer.step()


def test_gradient_checkpointing_is_exact_without_reentrant_and_refused_with_it():
    torch.manual_seed(0)
    x, y = _data(False)
    model = gpt2(checkpointing=False)
    with torch.no_grad():  # (LoRA's B starts at 0, where A's gradient is exactly zero)
        for p in trainable_parameters(model).values():
            p.add_(0.3 * torch.randn_like(p))
    trainer = _private(model, (x, y))
    assert trainer.grad_sampler.name == "layerwise"
    nonzero = assert_exact_per_parameter(trainer, x, y)  # (in training mode: where transformers checkpoints)
    assert nonzero == set(trainable_parameters(model))
    for lora in (True, False):  # every LoRA gradient was 0; full fine-tuning crashed in torch
        with pytest.raises(ModelError, match="use_reentrant=False") as e:
            _private(gpt2(checkpointing=True, lora=lora), (x, y))
        assert "\n" not in str(e.value) and "without autograd" in str(e.value)
    with pytest.raises(ModelError, match="use_reentrant=False"):
        _private(gpt2(checkpointing=True), (x, y), grad_sampler="loop")


@pytest.mark.slow
def test_torch_compile_inside_your_own_loop_is_refused_before_anything_is_released():
    from dptrain.engine.private_loop import make_private_loop

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(200, 8, generator=g), torch.randint(0, 2, (200,), generator=g)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_private_loop(model, opt, (xs, ys), noise_multiplier=1.0, batch_size=20)
    with pytest.raises(ModelError, match="torch.compile") as e:
        for inputs, labels in loop.batches(steps=2):
            # (aot_eager: the graph dynamo and AOTAutograd make of it, its CompiledFunction node, as inductor's,
            # without inductor's code generation, ~2.5 s: the refusal reads the graph, never the generated code)
            compiled = torch.compile(model, backend="aot_eager")
            loop.backward(nn.functional.cross_entropy(compiled(inputs), labels, reduction="none"))
            opt.step()
    assert "\n" not in str(e.value) and "call the model itself" in str(e.value)
    assert loop.steps == 0 and loop.ledger.releases == 0 and all(p.grad is None for p in model.parameters())
    loop.close()


def test_float32_rounding_of_a_tiny_gradient_passes_and_a_rule_one_in_a_thousand_off_fails(monkeypatch):
    """BERT's attention key bias has a gradient of exactly 0 (softmax ignores a shift): float32 gives it ~1e-13, more
    than 100% off between a batch and a single example. The check passes it (float64, each parameter on its own
    scale); a Linear bias rule 1e-3 off (about 1e-6 of the whole gradient, under the old check's tolerance) fails."""
    torch.manual_seed(0)
    model, _, _ = bert()
    x, y = _data(True)
    model.eval()
    grads, _ = per_example.make_grad_sampler(model, default_loss(model), "auto")({"input_ids": x["input_ids"][:4]},
                                                                                   y[:4])
    name = "bert.encoder.layer.1.attention.self.key.bias"
    alone = torch.autograd.grad(default_loss(model)(model(input_ids=x["input_ids"][:1]), y[:1]).sum(),
                                trainable_parameters(model)[name])[0]
    assert float((grads.materialize()[name][0] - alone).norm()) > 1e-3 * float(alone.norm())  # rounding, in float32
    trainer = _private(model, (x, y))
    assert trainer.gradient_check.moved_to_func == [] and trainer.grad_sampler.name == "layerwise"

    right = per_example._layerwise_rule

    def one_in_a_thousand_off(m):
        rule = right(m)
        if rule is not layer_rules._linear:
            return rule

        def wrong(m, a, go):
            out = layer_rules._linear(m, a, go)
            return {**out, "bias": out["bias"] * (1 + 1e-3)} if "bias" in out else out

        return wrong

    monkeypatch.setattr(per_example, "_layerwise_rule", one_in_a_thousand_off)
    with pytest.raises(ModelError, match=r"per-example gradient of parameter '.*bias' from the layerwise backend"):
        _private(model, (x, y), grad_sampler="layerwise")
    trainer = _private(model, (x, y))  # the automatic backend moves the wrong layers to torch.func, and is exact
    assert trainer.gradient_check.moved_to_func and all(n.endswith("bias") or n.endswith("weight")
                                                        for n in trainer.gradient_check.moved_to_func)
    assert_exact_per_parameter(trainer, x, y, rows=3)
