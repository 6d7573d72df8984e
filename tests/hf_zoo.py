"""Tiny stock Hugging Face models and peft adapters for the tests: each model built from its transformers config object
(2 layers, width 16, random weights, dropout off: nothing downloaded), each adapter as peft makes it, and a padded batch
of a few examples for each kind of model."""

from __future__ import annotations

import torch
import transformers

VOCAB, LENGTH, IMAGE = 32, 6, 8
TEXT = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32)
DECODER = dict(TEXT, num_key_value_heads=1, pad_token_id=0, tie_word_embeddings=False)
ENCODER = dict(TEXT, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
VISION = dict(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0))


def opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=1,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, sliding_window=4))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER))


def mixtral():
    """A mixture of experts: a router returning its logits and the top-k weights computed from them, the experts'
    weights fused in 3-D parameters, each expert fed the rows of the tokens routed to it."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**DECODER, num_local_experts=4,
                                                                      num_experts_per_tok=2))


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(**ENCODER))


def roberta():
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**ENCODER, pad_token_id=1))


def distilbert():
    return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=32, num_labels=3,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def vit():
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def convnext():
    """Convolutions (a 2x2 patchify stem, depthwise 7x7 convolutions of groups = channels), a channels-first LayerNorm
    of its own and a layer-scale parameter per block."""
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
        drop_path_rate=0.0))


def swin():
    """Windowed attention: its layers see the examples' windows flattened into rows ([B * windows, N, C]) and add a
    learned relative-position bias indexed from a table."""
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2,
        mlp_ratio=2.0, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def _seq2seq(config_class, model_class, **kw):
    return model_class(config_class(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
        eos_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **kw))


#: Architectures beyond issue 30's matrix (tests/test_hf_architectures.py): name -> (builder, kind, the layers
#: adapters target). What each stresses: GPT-NeoX, GPT-J and CodeGen partial rotary; Falcon (ALiBi) its MLP output
#: added to in place and a Linear subclass; BLOOM and MPT ALiBi; Phi-3 fused qkv; Gemma2 its own RMSNorm and sliding
#: window; BART and Pegasus learned / sinusoidal positions computed once for the batch; ALBERT one layer shared by
#: every depth (a parameter used twice); DeBERTa-v2 relative-position embeddings read by the attention; Swin-v2 a
#: learned logit scale and a continuous position-bias MLP; Whisper and Wav2Vec2 Conv1d over time (Wav2Vec2: GroupNorm
#: over time in its feature encoder, a weight-normed positional convolution); Mamba its depthwise causal Conv1d and
#: selective scan; RWKV its time-mixing parameters read in the block's own forward; ConvNeXt-v2 global response
#: normalization (each example's channels scaled by their spatial norms over its own map); BEiT a relative-position
#: bias table shared by every layer (computed once for the batch); Data2Vec-vision a bias table in each layer and
#: layer scale; SEW a Conv1d feature encoder with GroupNorm, its sequence squeezed by a strided convolution and
#: upsampled back; StableLM partial rotary with per-head query/key LayerNorms; GPT-BigCode multi-query attention (one
#: key/value head).
MORE = {
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **TEXT, pad_token_id=0, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)),
        "causal", ["query_key_value", "dense_4h_to_h"]),
    "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, pad_token_id=0, alibi=True,
        hidden_dropout=0.0, attention_dropout=0.0)), "causal", ["query_key_value", "dense_4h_to_h"]),
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0)), "causal", ["query_key_value", "dense_4h_to_h"]),
    "mpt": (lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=32, pad_token_id=0)),
        "causal", ["Wqkv", "down_proj"]),
    "gptj": (lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)),
        "causal", ["q_proj", "v_proj", "fc_out"]),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **DECODER, bos_token_id=1, eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0,
        attention_dropout=0.0)), "causal", ["qkv_proj", "down_proj"]),
    "gemma2": (lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **DECODER, head_dim=8, sliding_window=4)), "causal", ["q_proj", "v_proj", "down_proj"]),
    "mamba": (lambda: transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2, pad_token_id=0,
        use_mambapy=True)), "causal", ["in_proj", "out_proj"]),
    "rwkv": (lambda: transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32,
        context_length=32)), "causal", ["key", "value"]),
    "bart": (lambda: _seq2seq(transformers.BartConfig, transformers.BartForConditionalGeneration, bos_token_id=1,
                              decoder_start_token_id=1), "seq2seq", ["q_proj", "v_proj", "fc2"]),
    "pegasus": (lambda: _seq2seq(transformers.PegasusConfig, transformers.PegasusForConditionalGeneration,
                                 decoder_start_token_id=0), "seq2seq", ["q_proj", "v_proj", "fc2"]),
    "albert": (lambda: transformers.AlbertForSequenceClassification(transformers.AlbertConfig(
        **ENCODER, embedding_size=8, classifier_dropout_prob=0.0, pad_token_id=0)),
        "classify", ["query", "value", "ffn_output"]),
    "deberta_v2": (lambda: transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        **ENCODER, pad_token_id=0, relative_attention=True, position_buckets=4, max_relative_positions=8,
        pos_att_type=["c2p", "p2c"], pooler_dropout=0.0)), "classify", ["query_proj", "value_proj", "output.dense"]),
    "swinv2": (lambda: transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2,
        mlp_ratio=2.0, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)),
        "image", ["query", "value", "output.dense"]),
    "whisper": (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=4, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, begin_suppress_tokens=None, suppress_tokens=None)),
        "speech2seq", ["q_proj", "v_proj", "fc2"]),
    "wav2vec2": (lambda: transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_extract_norm="group", num_labels=3, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, classifier_proj_size=8)), "audio", ["q_proj", "v_proj", "conv"]),
    "convnextv2": (lambda: transformers.ConvNextV2ForImageClassification(transformers.ConvNextV2Config(
        num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
        drop_path_rate=0.0)), "image", ["pwconv1", "pwconv2"]),
    "beit": (lambda: transformers.BeitForImageClassification(transformers.BeitConfig(
        **VISION, use_shared_relative_position_bias=True, layer_scale_init_value=0.1, drop_path_rate=0.0)),
        "image", ["query", "value", "output.dense"]),
    "data2vec_vision": (lambda: transformers.Data2VecVisionForImageClassification(transformers.Data2VecVisionConfig(
        **VISION, use_relative_position_bias=True, layer_scale_init_value=0.1, drop_path_rate=0.0)),
        "image", ["query", "value", "output.dense"]),
    "sew": (lambda: transformers.SEWForSequenceClassification(transformers.SEWConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, feat_extract_norm="group", squeeze_factor=2, num_labels=3,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=8)), "audio", ["q_proj", "v_proj", "conv"]),
    "stablelm": (lambda: transformers.StableLmForCausalLM(transformers.StableLmConfig(
        **DECODER, partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0)), "causal", ["q_proj", "v_proj", "down_proj"]),
    "gpt_bigcode": (lambda: transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, multi_query=True, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1)),
        "causal", ["c_attn", "c_proj"]),
    "resnet": (lambda: transformers.ResNetForImageClassification(transformers.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)),
        "image", ["convolution"]),
}


#: name -> (builder, kind: causal | classify | seq2seq | image, the layers adapters target, IA3's feed-forward ones)
MODELS = {
    "gpt2": (gpt2, "causal", ["c_attn", "c_fc"], ["c_fc"]),
    "opt": (opt, "causal", ["q_proj", "v_proj", "fc1"], ["fc1"]),
    "llama": (llama, "causal", ["q_proj", "v_proj", "down_proj"], ["down_proj"]),
    "mistral": (mistral, "causal", ["q_proj", "v_proj", "down_proj"], ["down_proj"]),
    "qwen2": (qwen2, "causal", ["q_proj", "v_proj", "down_proj"], ["down_proj"]),
    "mixtral": (mixtral, "causal", ["q_proj", "v_proj"], ["v_proj"]),
    "bert": (bert, "classify", ["query", "value", "output.dense"], ["output.dense"]),
    "roberta": (roberta, "classify", ["query", "value", "output.dense"], ["output.dense"]),
    "distilbert": (distilbert, "classify", ["q_lin", "v_lin", "lin2"], ["lin2"]),
    "t5": (t5, "seq2seq", ["q", "v", "wo"], ["wo"]),
    "vit": (vit, "image", ["q_proj", "v_proj", "fc2"], ["fc2"]),
    "convnext": (convnext, "image", ["pwconv1", "pwconv2"], ["pwconv2"]),
    "swin": (swin, "image", ["q_proj", "v_proj", "fc2"], ["fc2"]),
}


def spec(model: str):
    """(builder, kind, the layers adapters target, IA3's feed-forward ones) of a model of MODELS or MORE."""
    if model in MODELS:
        return MODELS[model]
    builder, kind, targets = MORE[model]
    return builder, kind, targets, targets[-1:]


TASKS = {"causal": "CAUSAL_LM", "classify": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM", "image": None, "audio": None,
         "speech2seq": None}
#: (SEQ_CLS makes peft train the head itself)
HEADS = {"classify": None, "image": ["classifier"], "audio": ["classifier"], "speech2seq": None}
#: More adapters (tests/test_hf_architectures.py), by the layers they take: a model's token embedding (LoRA on an
#: Embedding), a module trained whole beside the adapters (peft's modules_to_save), its convolutions.
EMBEDDINGS = {"gpt2": ["wte"], "llama": ["embed_tokens"], "bert": ["word_embeddings"]}
SAVED = {"gpt2": ["lm_head"], "llama": ["lm_head"], "bert": ["pooler"]}
CONVOLUTIONS = {"wav2vec2": ["conv"], "vit": ["projection"]}


def adapter(name: str, model: str):
    """The peft config of adapter ``name`` for ``model`` (None: full fine-tuning)."""
    import peft

    _, kind, targets, feedforward = spec(model)
    common = {"task_type": TASKS[kind]} if TASKS[kind] else {"modules_to_save": HEADS[kind]}
    fan = {"fan_in_fan_out": True} if model == "gpt2" else {}
    if name == "full":
        return None
    if name in ("lora", "dora"):
        return peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, use_dora=name == "dora", **fan, **common)
    if name == "ia3":
        return peft.IA3Config(target_modules=targets, feedforward_modules=feedforward, **fan, **common)
    if name == "loha":
        return peft.LoHaConfig(r=2, alpha=4, target_modules=targets, **common)
    if name == "vera":
        return peft.VeraConfig(r=2, target_modules=targets, **fan, **common)
    if name == "prefix":
        return peft.PrefixTuningConfig(num_virtual_tokens=2, **common)
    if name == "prompt":  # (DistilBERT's config names its sizes in words peft does not read)
        return peft.PromptTuningConfig(num_virtual_tokens=2, token_dim=16, num_attention_heads=2, num_layers=2,
                                       **common)
    more = {
        "adalora": lambda: peft.AdaLoraConfig(r=2, init_r=4, target_r=2, lora_alpha=4, target_modules=targets,
                                              total_step=10, **fan, **common),
        "lokr": lambda: peft.LoKrConfig(r=2, alpha=4, target_modules=targets, **common),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=targets, **common),
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=targets, **common),
        "fourierft": lambda: peft.FourierFTConfig(n_frequency=8, target_modules=targets, **fan, **common),
        "ln_tuning": lambda: peft.LNTuningConfig(**common),
        "p_tuning": lambda: peft.PromptEncoderConfig(num_virtual_tokens=2, encoder_hidden_size=8, token_dim=16,
                                                     num_attention_heads=2, num_layers=2, **common),
        "rslora": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, use_rslora=True, **fan, **common),
        "lora_embedding": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets + EMBEDDINGS[model],
                                                  **fan, **common),
        "lora_saved": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, modules_to_save=SAVED[model],
                                              **fan, **common),
        "lora_conv": lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=CONVOLUTIONS[model], **common),
        "randlora": lambda: peft.RandLoraConfig(r=2, target_modules=targets, **common),
    }
    if name in more:
        return more[name]()
    raise ValueError(name)


def build(model: str, adapter_name: str = "full", checkpointing: str = "off", dtype=torch.float64):
    """Model ``model`` with ``adapter_name`` (peft) and gradient checkpointing off, "non_reentrant" or "reentrant",
    in ``dtype``, in training mode (dropout is off in every config: training mode is deterministic)."""
    import peft

    torch.manual_seed(0)
    net = spec(model)[0]()
    if checkpointing != "off":
        net.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
    config = adapter(adapter_name, model)
    if config is not None:
        net = peft.get_peft_model(net, config)
    return moved(net).to(dtype).train()


def moved(net):
    """``net`` with every trainable parameter moved by a small random amount: adapters start where some gradients are
    exactly zero (LoRA's B = 0 zeroes A's gradient, LoKr's and IA3's starts likewise), and a rule for a parameter whose
    gradient is zero cannot be checked."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return net


def lengths(n: int) -> list[int]:
    """Each example's number of real tokens: the first full, the others padded by various amounts."""
    return [LENGTH - (i * 2) % 4 for i in range(n)]


def batch(model: str, n: int = 4, dtype=torch.float64):
    """(inputs, labels, one_example) for ``n`` examples: token ids right-padded to LENGTH with an attention mask
    (labels -100 on padding), or images; ``one_example(i)`` is example i alone, without padding, as a batch of one."""
    kind = spec(model)[1]
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        x = {"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=g, dtype=dtype)}
        y = torch.randint(0, 3, (n,), generator=g)
        return x, y, lambda i: ({"pixel_values": x["pixel_values"][i : i + 1]}, y[i : i + 1])
    if kind == "audio":  # (a waveform of 64 samples)
        x = {"input_values": torch.randn(n, 64, generator=g, dtype=dtype)}
        y = torch.randint(0, 3, (n,), generator=g)
        return x, y, lambda i: ({"input_values": x["input_values"][i : i + 1]}, y[i : i + 1])
    if kind == "speech2seq":  # (4 mel bins x 16 frames, and the decoder's shifted target)
        target = torch.randint(2, VOCAB, (n, 4), generator=g)
        x = {"input_features": torch.randn(n, 4, 16, generator=g, dtype=dtype),
             "decoder_input_ids": torch.cat([torch.ones(n, 1, dtype=torch.long), target[:, :-1]], 1)}
        return x, target, lambda i: ({k: v[i : i + 1] for k, v in x.items()}, target[i : i + 1])
    pad = 1 if model == "roberta" else 0
    ids = torch.randint(2, VOCAB, (n, LENGTH), generator=g)
    mask = torch.zeros(n, LENGTH, dtype=torch.long)
    for i, k in enumerate(lengths(n)):
        mask[i, :k] = 1
    ids = ids.masked_fill(mask == 0, pad)
    x = {"input_ids": ids, "attention_mask": mask}
    if kind == "classify":
        y = torch.randint(0, 3, (n,), generator=g)
    elif kind == "causal":
        y = ids.masked_fill(mask == 0, -100)
    else:  # seq2seq: the decoder reads the shifted target
        target = torch.randint(2, VOCAB, (n, 4), generator=g)
        x["decoder_input_ids"] = torch.cat([torch.zeros(n, 1, dtype=torch.long), target[:, :-1]], 1)
        y = target

    def one(i):
        k = lengths(n)[i]
        xi = {key: (v[i : i + 1, :k] if key != "decoder_input_ids" else v[i : i + 1]) for key, v in x.items()}
        return xi, (y[i : i + 1, :k] if kind == "causal" else y[i : i + 1])

    return x, y, one
