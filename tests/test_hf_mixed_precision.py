"""bf16 autocast on a stock masked language model: BERT's masked-LM head (its decoder tied to the token embedding, a
bias of its own) has no layer rule and is differentiated by torch.func on its own, where vmap of a Linear feeding a
LayerNorm under CPU autocast fails inside torch ("expected scalar type BFloat16 but found Float"). The head then sent
the whole model to the loop of single-example passes with make_private, and a Trainer script with `bf16=True` was
refused. Now the head is differentiated in float32 from its recorded bfloat16 inputs and output gradients (as the
layer rules form theirs): the fast backend is kept and the gradients are float32's within bfloat16's rounding."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_inputs import Texts, tokenizer  # noqa: E402
from test_hf_trainer import arguments  # noqa: E402

from dptrain.huggingface import DPTrainer, PrivacyArguments  # noqa: E402
from dptrain.models.losses import default_loss  # noqa: E402
from dptrain.stages.per_example import LayerwiseGradSampler  # noqa: E402
from dptrain.stages.precision import MixedPrecision  # noqa: E402


def masked_lm():
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))


def test_a_masked_lm_head_under_bf16_autocast_has_layerwise_gradients_within_bf16_rounding():
    model = masked_lm().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 32, (6, 8), generator=g)
    labels = torch.where(torch.rand(6, 8, generator=g) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]  # (every example has a labelled token)
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    loss = default_loss(model)
    full, _ = LayerwiseGradSampler(model, loss, fallback=True)(x, labels)
    half, _ = MixedPrecision(LayerwiseGradSampler(model, loss, fallback=True), torch.bfloat16, torch.device("cpu"))(
        x, labels)  # (raised FallbackError: the automatic backend went to the loop, a Trainer step was refused)
    full, half = full.materialize(), half.materialize()
    assert "cls.predictions.bias" in half
    for name, ref in full.items():
        assert half[name].dtype == torch.float32
        assert float((half[name] - ref).norm()) <= 0.05 * float(ref.norm()) + 1e-6, name


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_masked_lm_trainer_script_with_bf16_trains(tmp_path):
    """`bf16=True`, transformers' masking collator (`DataCollatorForLanguageModeling(mlm=True)`: random masks drawn
    per example by the collator), a training set of 25 with gradient accumulation 3 and evaluation during training."""
    tok = tokenizer()
    tok.mask_token = "[UNK]"
    args = arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=2, bf16=True,
                     eval_strategy="steps", eval_steps=2)
    trainer = DPTrainer(model=masked_lm(), args=args, train_dataset=Texts(tok, n=25), eval_dataset=Texts(tok, n=6),
                        data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, delta=1e-2, eval_is_public=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.private_loop.steps == 2 and "bf16" in trainer.private_loop.trainer.grad_sampler.name
    assert trainer.private_loop.trainer.grad_sampler.name.startswith("layerwise")
    assert any("eval_loss" in row for row in trainer.state.log_history)
