"""Beyond issue 30's matrix: architectures and peft adapters it did not list, tried as a Hugging Face user switching
from Opacus would (2-layer models from config objects, random weights, every trainable parameter moved off peft's
start so none has a zero gradient). Each cell is made private with ``make_private`` and its per-example gradients must
match a backward pass on each example alone, parameter by parameter, in float64, to 1e-4 of the parameter's own
gradient (test_hf_matrix.assert_exact), or be refused in one line naming the way out.

What each architecture stresses is said at hf_zoo.MORE. ResNet's BatchNorm is refused naming the converter; the
converted model on images so small that its last stage is 1 x 1 normalizes a single value per group, which torch
refuses for one example: refused naming that GroupNorm layer and fewer groups (it used to be refused for "needing the
other examples of its batch", and the way out it named was the converter that produced it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_zoo import MORE, batch, build, spec  # noqa: E402
from test_hf_matrix import assert_exact, per_example_loss, private, single_example_gradients  # noqa: E402

from dptrain.engine.api import make_private  # noqa: E402
from dptrain.errors import ModelError  # noqa: E402

LOSS_KIND = {"audio": "classify", "image": "classify", "speech2seq": "seq2seq"}

#: (model, adapter, gradient checkpointing): each architecture fully fine-tuned and with LoRA, the other adapters
#: on one decoder and one encoder, checkpointing on a few.
CELLS = (
    [(m, "full", "off") for m in MORE if m != "resnet"]
    + [(m, "lora", "off") for m in ("gpt_neox", "bloom", "phi3", "bart", "albert", "deberta_v2", "whisper", "wav2vec2")]
    + [("llama", a, "off") for a in ("adalora", "lokr", "oft", "boft", "fourierft", "ln_tuning", "p_tuning", "rslora",
                                     "lora_embedding", "lora_saved")]
    + [("bert", a, "off") for a in ("adalora", "lokr", "oft", "fourierft", "p_tuning", "lora_embedding", "lora_saved")]
    + [("gpt2", a, "off") for a in ("adalora", "lora_embedding", "lora_saved", "p_tuning")]
    + [("llama", "randlora", "off")]
    + [("wav2vec2", "lora_conv", "off"), ("vit", "lora_conv", "off")]
    + [("gpt_neox", "full", "non_reentrant"), ("bloom", "lora", "non_reentrant"), ("bart", "lora", "non_reentrant"),
       ("falcon", "full", "reentrant"), ("bart", "full", "reentrant")]
)
#: Cells over about 5 s on a shared 2-core machine (their backend runs the whole model example by example).
SLOW = {("rwkv", "full"), ("pegasus", "full"), ("beit", "full"), ("swinv2", "full"), ("deberta_v2", "full"),
        ("llama", "boft"), ("llama", "oft"), ("llama", "randlora")}
#: Cells whose per-example gradients need the whole model differentiated example by example (exact, slower, and not
#: trainable from a forward pass of your own: make_private_loop, DPTrainer): RWKV's attention reads its time-mixing
#: state across the sequence in a layout the measurement cannot split; BEiT's relative-position bias, shared by every
#: layer, is computed once for the batch (as T5's and Swin's); P-tuning's prompt encoder is computed once for the batch
#: and repeated by peft. (LoKr's layers draw torch.rand(1) in every training call, which vmap refused: now replayed,
#: dptrain.stages.dropout_replay, they record their layers.)
#: (RandLoRA's random bases, one module shared by every adapted layer, were left holding torch.func's tensors by the
#: whole-model attempt, and the model refused for writing them. Its custom autograd function, which torch.func cannot
#: transform, sent it to the loop; its layers are now differentiated example by example with autograd, alone:
#: dptrain.stages.module_func. LoHa's likewise, in test_hf_matrix.)
#: Every other cell records its layers (Falcon: its MLP output is added to in place, so the model is handed a copy;
#: BART: its decoder's learned positions [1, T, d], computed once for the batch, are expanded to it; both used to
#: need the whole model).
WHOLE_MODEL = {("rwkv", "full"), ("beit", "full"), ("llama", "p_tuning"),
               ("bert", "p_tuning"), ("gpt2", "p_tuning")}


def cells():
    return [pytest.param(*c, id="-".join(c), marks=[pytest.mark.slow] if c[:2] in SLOW else [])
            for c in CELLS]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("model_name,adapter,checkpointing", cells())
def test_more_architectures_and_adapters_are_exact_or_refused_in_one_line(model_name, adapter, checkpointing):
    model = build(model_name, adapter, checkpointing)
    kind = spec(model_name)[1]
    virtual = 2 if adapter == "p_tuning" and kind == "causal" else 0
    loss = per_example_loss(LOSS_KIND.get(kind, kind), virtual)
    x, y, one = batch(model_name)
    try:
        trainer = private(model, x, y, loss)
    except ModelError as e:
        if model_name == "rwkv":  # (it rescales its weights in forward on a switch of mode: refused, the way out named)
            assert "\n" not in str(e) and "config.rescale_every = 0" in str(e), str(e)
            model = build(model_name, adapter, checkpointing)
            model.config.rescale_every = 0  # (the way out: exact)
            trainer = private(model, x, y, loss)
        else:
            assert checkpointing == "reentrant" and "\n" not in str(e) and "use_reentrant=False" in str(e), str(e)
            return
    assert checkpointing != "reentrant", "reentrant checkpointing must be refused"
    model.train()
    grads, _ = trainer.grad_sampler(x, y)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one, params, len(y)))
    backend = trainer.grad_sampler.name
    assert backend.startswith("layerwise") == ((model_name, adapter) not in WHOLE_MODEL), backend


def _resnet(size: int, groups: int | None):
    from dptrain.models.builders import convert_batchnorm_to_groupnorm

    model = build("resnet", dtype=torch.float64)
    if groups is not None:
        convert_batchnorm_to_groupnorm(model, num_groups=groups)
    g = torch.Generator().manual_seed(1)
    x = {"pixel_values": torch.randn(4, 3, size, size, generator=g, dtype=torch.float64)}
    y = torch.randint(0, 3, (4,), generator=g)
    return model, x, y, lambda i: ({"pixel_values": x["pixel_values"][i : i + 1]}, y[i : i + 1])


def test_batchnorm_is_refused_naming_the_converter_and_a_group_of_one_value_naming_the_layer():
    model, x, y, _ = _resnet(8, None)
    with pytest.raises(ModelError, match="convert_batchnorm_to_groupnorm") as e:
        private(model, x, y, per_example_loss("classify"))
    assert "\n" not in str(e.value)
    model, x, y, _ = _resnet(8, 32)  # (16 channels in 16 groups on the last stage's 1 x 1 map)
    with pytest.raises(ModelError, match="GroupNorm") as e:
        private(model, x, y, per_example_loss("classify"))
    message = str(e.value)
    assert "\n" not in message and "encoder.stages.1" in message and "fewer groups" in message, message
    assert "other examples" not in message


def test_a_converted_resnet_normalizing_over_more_values_is_exact():
    model, x, y, one = _resnet(8, 1)  # (the way out the refusal names: GroupNorm(1, channels))
    loss = per_example_loss("classify")
    trainer = private(model, x, y, loss)
    model.train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert_exact(trainer.grad_sampler(x, y)[0].materialize(), single_example_gradients(model, loss, one, params, 4))


def test_an_adapter_on_a_module_the_forward_pass_never_calls_is_named_in_a_warning():
    """LoRA on T5's ``shared`` embedding: peft wraps ``model.shared``, but the encoder and decoder call their own
    references to the original Embedding, so the adapter is never used: its gradient is zero in every example (also
    without dptrain) and DP-SGD's noise alone moves it. The model probe says so, naming it; a used adapter is not
    named."""
    from dptrain.preflight.gradient_check import UnusedParameterWarning

    model = peft.get_peft_model(spec("t5")[0](), peft.LoraConfig(r=2, target_modules=["shared", "q"],
                                                                task_type="SEQ_2_SEQ_LM")).double()
    x, y, _ = batch("t5")
    with pytest.warns(UnusedParameterWarning, match="shared.lora_embedding_A") as record:
        private(model, x, y, per_example_loss("seq2seq"))
    assert not any("q.lora" in str(w.message) for w in record)


def test_reversible_layers_are_refused_naming_them_not_only_checkpointing():
    """Reformer's reversible layers run under torch.no_grad in the forward pass and recompute their activations in a
    backward pass of their own: no per-example gradient can be recorded. The refusal used to name only reentrant
    gradient checkpointing, which this model does not have on."""
    config = transformers.ReformerConfig(
        vocab_size=32, hidden_size=16, num_attention_heads=2, attention_head_size=8, feed_forward_size=32,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=32, local_attn_chunk_length=2,
        is_decoder=True, hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, pad_token_id=0,
        eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.ReformerModelWithLMHead(config).double().train()
    x, y, _ = batch("gpt2")
    with pytest.raises(ModelError, match="reversible layers") as e:
        private(model, x, y, per_example_loss("causal"))
    assert "\n" not in str(e.value) and "another architecture" in str(e.value)


def _recurrent_gemma():
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, lru_width=16, head_dim=8, attention_window_size=4, block_types=["recurrent", "attention"],
        pad_token_id=0)
    from hf_zoo import moved

    return moved(transformers.RecurrentGemmaForCausalLM(config)).double().train()


def test_a_model_caching_its_last_batch_in_an_attribute_trains_with_it_put_back():
    """RecurrentGemma keeps its last batch's convolution and recurrent states in module attributes (Qwen2-VL and its
    kind keep their last batch's rope_deltas so): state a training pass writes from the private batch, refused, the
    only way out named labelling the run not private. ``buffer_updates="restore"`` puts it back after every chunk's
    passes: the model trains exactly (the function the probe checked, from the same state), privately, and holds
    nothing of the batches after."""
    loss = per_example_loss("causal")
    x, y, one = batch("llama")
    model = _recurrent_gemma()
    with pytest.raises(ModelError, match='buffer_updates="restore"') as e:
        private(model, x, y, loss)
    assert "\n" not in str(e.value) and "temporal_block.conv1d_state" in str(e.value)
    model = _recurrent_gemma()
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = make_private(model, torch.optim.SGD(params, lr=0.1), (x, y), noise_multiplier=1.0, batch_size=2,
                           max_physical_batch_size=4, loss_fn=loss, buffer_updates="restore")
    model.train()
    named = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert_exact(trainer.grad_sampler(x, y)[0].materialize(), single_example_gradients(model, loss, one, named, 4))
    states = [m for m in model.modules() if hasattr(m, "recurrent_states") or hasattr(m, "conv1d_state")]
    for m in states:  # (the passes above, the test's own, wrote them)
        vars(m).update({k: None for k in ("recurrent_states", "conv1d_state") if k in vars(m)})
    before = {k: repr(v) for m in model.modules() for k, v in vars(m).items() if k.endswith("state") or k.endswith("states")}
    trainer.train(steps=2)
    after = {k: repr(v) for m in model.modules() for k, v in vars(m).items() if k.endswith("state") or k.endswith("states")}
    assert trainer.steps == 2 and trainer.ledger.private and not trainer.not_private_buffers and after == before
