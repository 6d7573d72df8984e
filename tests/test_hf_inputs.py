"""What Hugging Face users feed dptrain: a DataLoader whose collator pads each batch to its own longest sequence
(transformers' DataCollatorWithPadding, DataCollatorForLanguageModeling: the default), a causal LM behind peft's
prompt tuning (its logits start with the virtual tokens), a model cast to bfloat16 weights."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_zoo import build  # noqa: E402

import dptrain  # noqa: E402
from dptrain.models.losses import default_loss  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[EOS]"] + [f"w{i}" for i in range(29)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]")


class Texts(torch.utils.data.Dataset):
    """Sentences of 2 to 9 words, tokenized one by one (no padding): a collator pads each batch."""

    def __init__(self, tok, n: int = 24, classes: int = 0):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for i in range(n):
            words = torch.randint(0, 29, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
            item = dict(tok(" ".join(f"w{int(w)}" for w in words)))
            if classes:
                item["labels"] = i % classes
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def setups():
    tok = tokenizer()
    return {
        "gpt2-language-modeling": (lambda: build("gpt2"), Texts(tok),
                                   transformers.DataCollatorForLanguageModeling(tok, mlm=False)),
        "bert-with-padding": (lambda: build("bert"), Texts(tok, classes=3), transformers.DataCollatorWithPadding(tok)),
        "llama-lora-with-padding": (lambda: build("llama", "lora"), Texts(tok),
                                    transformers.DataCollatorForLanguageModeling(tok, mlm=False)),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["gpt2-language-modeling", "bert-with-padding", "llama-lora-with-padding"])
def test_a_collator_padding_each_batch_trains_with_exact_per_example_gradients(name):
    """The model probe used to collate its examples and the one replacing example 0 apart (lengths 9 and 8: a raw
    RuntimeError for every model). Now it trains, and each example's gradient in a padded chunk equals its gradient
    alone, unpadded (the attention mask hides the padding): chunks of one logical batch have different lengths."""
    make, data, collate = setups()[name]
    model = make()
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=collate)
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = dptrain.make_private(model, torch.optim.SGD(params, lr=0.1), loader, noise_multiplier=1.0,
                                   max_physical_batch_size=3)
    trainer.train(steps=2)
    assert trainer.steps == 2
    idx = torch.tensor([0, 3, 5, 6])
    x, y = trainer.data.batch(idx)
    assert (x["attention_mask"] == 0).any()  # padded
    model.train()
    got = trainer.grad_sampler(x, y)[0].materialize()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for row, i in enumerate(idx.tolist()):
        xi, yi = trainer.data.batch(torch.tensor([i]))  # alone: no padding
        assert xi["attention_mask"].all()
        ref = torch.autograd.grad(trainer.loss_fn(model(**xi), yi).sum(), list(named.values()), allow_unused=True)
        whole = float(torch.sqrt(sum((r ** 2).sum() for r in ref if r is not None)))
        for (n, p), r in zip(named.items(), ref, strict=True):
            r = torch.zeros_like(p) if r is None else r
            assert float((got[n][row] - r).norm()) <= 1e-4 * float(r.norm()) + 1e-9 * whole, n


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_your_own_loop_takes_dynamically_padded_chunks():
    tok = tokenizer()
    model = build("gpt2")
    loader = torch.utils.data.DataLoader(Texts(tok), batch_size=8,
                                         collate_fn=transformers.DataCollatorForLanguageModeling(tok, mlm=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = dptrain.make_private_loop(model, optimizer, loader, noise_multiplier=1.0, max_physical_batch_size=3,
                                     seed=0)
    lengths = set()
    for inputs, labels in loop.batches(steps=3):
        lengths.add(inputs["input_ids"].shape[1])
        loop.backward(loop.trainer.loss_fn(model(**inputs), labels))
        optimizer.step()
        optimizer.zero_grad()
    assert loop.steps == 3 and len(lengths) > 1  # chunks of several lengths


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
def test_a_prompt_tuned_causal_lm_gets_the_loss_of_its_real_tokens(model_name):
    """peft prepends the prompt's virtual tokens to the logits: the default loss reads the real tokens' (it raised
    "Expected target size [2, 8], got [2, 5]"), and equals peft's own loss given the labels."""
    model = build(model_name, "prompt")
    ids = torch.randint(2, 32, (1, 6))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ours = default_loss(model)(model(input_ids=ids, attention_mask=mask), labels)
    theirs = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours.double(), theirs.reshape(1).double(), rtol=1e-6, atol=1e-7)  # (both in float32)


def test_a_model_cast_to_bfloat16_trains_with_float32_gradients_sums_and_noise():
    """``model.to(torch.bfloat16)`` used to stop at "both inputs should have same dtype". Per-example gradients are
    formed in float32 (within bfloat16's rounding of single-example passes), clipped, summed and noised in float32 (a
    sum rounded to 8 bits of mantissa before the noise would move by more than one example's clipped gradient), and
    the noisy gradient is cast to the weights' dtype."""
    from dptrain.stages.clipping import FlatClipping, clipped_sum

    model = build("gpt2", dtype=torch.bfloat16)
    ids = torch.randint(2, 32, (12, 6))
    trainer = dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), ({"input_ids": ids}, ids),
                                   noise_multiplier=1.0, batch_size=4, max_physical_batch_size=4, seed=0)
    x, y = {"input_ids": ids[:3]}, ids[:3]
    grads = trainer.grad_sampler(x, y)[0]
    got = grads.materialize()
    assert all(g.dtype == torch.float32 for g in got.values())
    for i in range(3):
        ref = torch.autograd.grad(trainer.loss_fn(model(input_ids=ids[i : i + 1]), ids[i : i + 1]).sum(),
                                  list(trainer.params.values()))
        whole = float(torch.sqrt(sum((r.float() ** 2).sum() for r in ref)))
        err = float(torch.sqrt(sum(((got[n][i] - r.float()) ** 2).sum() for n, r in zip(trainer.params, ref, strict=True))))
        assert err <= 5e-2 * whole  # bfloat16 keeps 8 bits of mantissa
    summed, _, _ = clipped_sum([(grads, torch.zeros(3))], FlatClipping(1.0), trainer.params)
    assert all(s.dtype == torch.float32 for s in summed.values())
    trainer.step()
    assert trainer.steps == 1 and all(p.dtype == torch.bfloat16 for p in model.parameters())


def _convbert():
    """ConvBERT: its span-based dynamic convolution reads the padding tokens (its attention mask does not reach it)."""
    from hf_zoo import moved

    torch.manual_seed(0)
    return moved(transformers.ConvBertForSequenceClassification(transformers.ConvBertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        embedding_size=16, head_ratio=2, conv_kernel_size=3, num_groups=2)))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_model_reading_its_padding_is_refused_with_a_collator_padding_each_batch():
    """With a collator padding each batch to its own longest sequence, an example is padded to the longest of its
    chunk; ConvBERT's loss for it then depends on the other examples' lengths (0.96066 alone, 0.96072 padded), which
    per-example clipping does not bound, and the gradient check compared the example with itself at the padded
    length: it trained. Refused in one line naming fixed-length padding; with it, the per-example gradients equal the
    example's alone."""
    tok = tokenizer()
    data = Texts(tok, classes=3)
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=transformers.DataCollatorWithPadding(tok))
    model = _convbert()
    with pytest.raises(dptrain.errors.ModelError, match="pads it") as e:
        dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                             max_physical_batch_size=3)
    assert "\n" not in str(e.value) and 'padding="max_length"' in str(e.value)
    fixed = transformers.DataCollatorWithPadding(tok, padding="max_length", max_length=10)
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=fixed)
    trainer = dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0,
                                   max_physical_batch_size=3)
    x, y = trainer.data.batch(torch.tensor([0, 3, 5]))
    got = trainer.grad_sampler(x, y)[0].materialize()
    for row, i in enumerate([0, 3, 5]):
        xi, yi = trainer.data.batch(torch.tensor([i]))
        ref = torch.autograd.grad(trainer.loss_fn(model(**xi), yi).sum(), list(trainer.params.values()))
        for (n, _), r in zip(trainer.params.items(), ref, strict=True):
            assert float((got[n][row] - r).norm()) <= 1e-3 * float(r.norm()) + 1e-6, n


def test_a_padding_free_collator_packing_examples_into_one_row_is_refused_naming_padding():
    """transformers' DataCollatorWithFlattening packs a batch's examples into one row ([1, sum of lengths], positions
    restarting at each): no rule can tell the examples' gradients apart. Refused in one line naming it and padding
    (the refusal used to name only the rule, not the collator that broke it, nor the way out)."""
    tok = tokenizer()
    loader = torch.utils.data.DataLoader(Texts(tok, n=8), batch_size=4,
                                         collate_fn=transformers.DataCollatorWithFlattening())
    model = build("gpt2", dtype=torch.float32)
    with pytest.raises(dptrain.errors.DataError) as e:
        dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, noise_multiplier=1.0)
    message = str(e.value)
    assert "\n" not in message and "DataCollatorWithFlattening" in message and "DataCollatorWithPadding" in message


def test_an_input_packing_every_examples_rows_into_one_is_refused_naming_the_way_out():
    """Qwen2-VL's processor packs every image's patches of a batch into one tensor ([sum of patches, d], with
    image_grid_thw saying how many each image has): no row of it is one example's. Refused in one line, which used to
    give the sizes only; it now names the way out (each example's rows in a dimension of their own, flattened in a
    wrapper's forward)."""
    x = {"input_ids": torch.randint(2, 32, (4, 6)), "pixel_values": torch.randn(16, 24),
         "image_grid_thw": torch.tensor([[1, 2, 2]] * 4)}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(dptrain.errors.DataError) as e:
        dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, torch.zeros(4, dtype=torch.long)),
                             noise_multiplier=1.0, batch_size=2)
    message = str(e.value)
    assert "\n" not in message and "[4, 16]" in message and "wrapper" in message and "[examples, rows" in message


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_masking_collator_on_short_sentences_is_not_refused_for_reading_its_padding():
    """transformers' masking collator (DataCollatorForLanguageModeling(mlm=True), rate 0.15) on sentences of 2 to 9
    words: the padding check compared an example's loss alone and in the padded probe batch unless two collations of
    it alone differed; a sentence of 2 words drew no mask in both often enough (probe seeds 1, 3 and 5 of 0 to 5) that
    BERT, which masks its padding, was refused for "reading the padding" (its loss alone 0). Now the probe's examples
    collated together many times over tell a random collator (every copy of an example the same row otherwise): a
    padding collator is still checked, a masking one is not compared."""
    from dptrain.data.batches import DatasetSource
    from dptrain.preflight.padding import check_padding, collates_randomly

    tok = tokenizer()
    tok.mask_token = "[UNK]"
    masking = DatasetSource(Texts(tok, n=8), "labels", collate_items=transformers.DataCollatorForLanguageModeling(
        tok, mlm=True, mlm_probability=0.15))
    padding = DatasetSource(Texts(tok, n=8, classes=2), "labels",
                            collate_items=transformers.DataCollatorWithPadding(tok))
    idx = [0, 1, 2, 3]
    assert collates_randomly(masking, idx) and not collates_randomly(padding, idx)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).double()
    for seed in range(6):
        torch.manual_seed(seed)
        x, y = masking.batch(torch.tensor(idx))
        check_padding(model, default_loss(model), masking, x, y, idx, 1e-6)  # (raised ModelError "pads it")
