"""An example's output in its batch differs from its output alone: the independence check refuses the model, and its
one line names the kind of dependence and its way out (dptrain.preflight.batch_dependence). Tried on stock models
built from config objects (random weights): the other examples' values reach it (CLIP's contrastive loss, a loss with
no per-example value; NLLB-MoE's experts, whose capacity the batch's tokens share), or only the batch's shape does
(Wav2Vec2's SpecAugment masks and ViTMAE's random masking: random numbers drawn for the whole batch in the forward
pass). All used to get one message, which blamed a statistic of the batch and named BatchNorm -> GroupNorm as the
way out; a model returning no logits with the default loss was a raw TypeError."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from hf_zoo import MORE, batch, moved  # noqa: E402
from test_hf_matrix import assert_exact, per_example_loss, private, single_example_gradients  # noqa: E402

from dptrain.engine.api import make_private  # noqa: E402
from dptrain.errors import ModelError  # noqa: E402


def _images(n=4, **more):
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), **more}


def _refusal(model, x, y, loss, **options) -> str:
    with pytest.raises(ModelError) as refused:
        private(moved(model).double().train(), x, y, loss, **options)
    message = str(refused.value)
    assert "\n" not in message and "independence check failed" in message, message
    return message


def _clip():
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2),
        vision_config=dict(image_size=8, patch_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2), projection_dim=8)
    torch.manual_seed(0)
    return transformers.CLIPModel._from_config(config, attn_implementation="eager")


def test_a_contrastive_loss_over_the_batch_is_refused_as_mixing_examples():
    """Image i's loss is its cross-entropy against every text of the batch: it has no value of its own."""
    x = _images(input_ids=torch.randint(3, 32, (4, 6), generator=torch.Generator().manual_seed(2)))

    def contrastive(outputs, labels):
        return F.cross_entropy(outputs.logits_per_image, torch.arange(len(labels)), reduction="none")

    message = _refusal(_clip(), x, torch.arange(4), contrastive)
    assert "depends on the other examples" in message and "contrastive loss" in message, message
    with pytest.raises(ModelError, match="without logits; pass loss_fn") as refused:  # (the default loss)
        private(_clip().double(), x, torch.arange(4), None)
    assert "\n" not in str(refused.value)


@pytest.mark.slow
def test_experts_sharing_a_capacity_across_the_batch_are_refused_as_mixing_examples():
    """NLLB-MoE routes the batch's tokens flattened together, each expert taking at most its capacity of them: which
    of an example's tokens an expert drops depends on the other examples' tokens. (Its router writes a module
    attribute in training, refused first; labelled not private here to reach the independence check.)"""
    torch.manual_seed(0)
    config = transformers.NllbMoeConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        num_experts=2, expert_capacity=2, encoder_sparse_step=1, decoder_sparse_step=1, moe_token_dropout=0.0,
        second_expert_policy="all")
    x, _, _ = batch("bart")  # (padded sentences)
    target = torch.randint(2, 32, (4, 4), generator=torch.Generator().manual_seed(1))
    x["decoder_input_ids"] = torch.cat([torch.ones(4, 1, dtype=torch.long), target[:, :-1]], 1)
    model = moved(transformers.NllbMoeForConditionalGeneration(config)).train()  # (its router runs no float64)
    with pytest.raises(ModelError) as refused:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, target), noise_multiplier=1.0,
                     batch_size=2, loss_fn=per_example_loss("seq2seq"), buffer_updates="not_private")
    assert "depends on the other examples" in str(refused.value) and "capacity" in str(refused.value)


def test_random_masks_drawn_for_the_whole_batch_are_refused_naming_how_to_turn_them_off():
    """Wav2Vec2 draws its SpecAugment time masks (NumPy) for the batch, ViTMAE its random masking (torch.rand of the
    batch's shape): example i gets row i of the batch's draw, other numbers alone. Nothing of the other examples
    reaches it; the refusal says to turn the masks off or pass them per example, and both ways out are exact."""
    config = MORE["wav2vec2"][0]().config
    config.mask_time_prob, config.mask_time_length = 0.5, 2  # (SpecAugment, as pretrained checkpoints set it)
    torch.manual_seed(0)
    wav2vec2 = transformers.Wav2Vec2ForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    x, y = {"input_values": torch.randn(4, 64, generator=g, dtype=torch.float64)}, torch.randint(0, 3, (4,), generator=g)
    message = _refusal(wav2vec2, x, y, per_example_loss("classify"))
    assert "not with the other examples' values" in message and "config.mask_time_prob = 0" in message, message
    assert "BatchNorm" not in message

    config = transformers.ViTMAEConfig(
        image_size=8, patch_size=2, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, decoder_hidden_size=16, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
        decoder_intermediate_size=32, mask_ratio=0.5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def reconstruction(outputs, labels):
        return (outputs.logits ** 2).mean((1, 2))

    torch.manual_seed(0)
    message = _refusal(transformers.ViTMAEForPreTraining(config), _images(), torch.zeros(4), reconstruction)
    assert "ViTMAE: noise=" in message and "BatchNorm" not in message, message
    noise = torch.rand(4, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = _images(noise=noise)  # (the way out: each example's masking noise as an input of its own)
    torch.manual_seed(0)
    model = moved(transformers.ViTMAEForPreTraining(config)).double().train()
    trainer = private(model, x, torch.zeros(4), reconstruction)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    one = lambda i: ({k: v[i : i + 1] for k, v in x.items()}, torch.zeros(1))  # noqa: E731
    model.train()
    assert_exact(trainer.grad_sampler(x, torch.zeros(4))[0].materialize(),
                 single_example_gradients(model, reconstruction, one, params, 4))


class PerExampleFeatures(torch.nn.Module):
    """Llava's output: the logits and, in a tuple, each example's image features [patches, d], one tensor per example
    (not a row of one tensor). With as many patches as the chunk has examples, each of those tensors has as many rows
    as the batch: read off that size, they looked like outputs of one row per example, which the chunk permuted
    reorders, and the model was refused for mixing the examples (a tiny Llava with 4 patches in chunks of 4 was)."""

    def __init__(self, patches: int):
        super().__init__()
        self.patches = patches
        self.features, self.head = torch.nn.Linear(6, 6 * patches), torch.nn.Linear(6, 2)

    def forward(self, x):
        features = self.features(x).reshape(len(x), self.patches, 6)
        return {"logits": self.head(x + features.mean(1)), "image_features": tuple(features.unbind(0))}


def test_outputs_holding_one_tensor_per_example_are_not_mistaken_for_rows_of_the_batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 2, (64,), generator=g)
    torch.manual_seed(0)
    model = PerExampleFeatures(patches=8).double()
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=16, max_physical_batch_size=8)
    loss = lambda out, labels: F.cross_entropy(out["logits"], labels, reduction="none")  # noqa: E731
    grads, _ = trainer.grad_sampler(x[:8], y[:8])
    params = dict(model.named_parameters())
    one = lambda i: ({"x": x[i : i + 1]}, y[i : i + 1])  # noqa: E731
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one, params, 8))


def test_a_model_rounding_in_float32_inside_float64_is_refused_naming_precision_not_randomness():
    """Llama4 computes its router in float32: in a float64 model an example's output moves by 1e-8 with its place in
    the batch (float32 rounding), far beyond float64's. The refusal blamed random numbers drawn for the whole batch,
    naming SpecAugment's and ViTMAE's switches, though the model draws none; two passes in a row now tell: it names
    the precision. (In float32, the precision it computes in, it is exact: docs/huggingface.md.)"""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, intermediate_size_mlp=32, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, no_rope_layers=[1], attention_chunk_size=4, max_position_embeddings=32,
        pad_token_id=0, tie_word_embeddings=False)
    x, y, _ = batch("llama")
    message = _refusal(transformers.Llama4ForCausalLM(config), x, y, per_example_loss("causal"))
    assert "draws no random number" in message and "float32" in message and "mask_time_prob" not in message, message
