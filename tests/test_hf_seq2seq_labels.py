"""An encoder-decoder model trained from batches that hold its ``labels`` but no ``decoder_input_ids`` (a Trainer
script's ``DataCollatorForSeq2Seq(tokenizer)`` without ``model=``, or a Dataset of input/label pairs): transformers
derives the decoder's inputs from the labels inside ``forward``. dptrain splits the labels off the model's inputs, so
the model used to be called without them: T5 raised its own ValueError, and BART (mBART, Pegasus, Marian) silently
read its *encoder* input shifted as the decoder input, training a denoising objective against the labels (exact
per-example gradients of the wrong function). Now the decoder inputs are derived from the labels as transformers
derives them, so each example's gradient is that of the model called with its labels; a model that derives them in
its own way is refused in one line naming ``decoder_input_ids``; one without transformers' method (Whisper) gets the
labels shifted as its forward shifts them, verified first."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_zoo import MORE, build  # noqa: E402

import dptrain  # noqa: E402
from dptrain.errors import DataError  # noqa: E402
from dptrain.models.losses import cross_entropy_per_example  # noqa: E402

N, SOURCE, TARGET = 6, 5, 5  # (target as long as the source: BART's wrong decoder input then fits the labels)


class Pairs(torch.utils.data.Dataset):
    """Input/label pairs as a tokenized translation data set holds them, labels -100 after each target's end."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(2, 32, (N, SOURCE), generator=g)
        self.labels = torch.randint(2, 32, (N, TARGET), generator=g)
        for i in range(N):
            self.labels[i, TARGET - i % 3 :] = -100

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SOURCE, dtype=torch.long),
                "labels": self.labels[i]}


def bart_lora():
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_2_SEQ_LM")
    return peft.get_peft_model(MORE["bart"][0](), lora).double().train()


@pytest.mark.parametrize("name", ["t5-lora", "bart-lora"])
def test_decoder_inputs_are_derived_from_the_labels_as_the_model_would(name):
    model = bart_lora() if name == "bart-lora" else build("t5", "lora")
    data = Pairs()
    params = [p for p in model.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = dptrain.make_private(model, torch.optim.SGD(params, lr=0.1), loader, noise_multiplier=1.0,
                                   max_physical_batch_size=4)
    x, y = trainer.data.batch(torch.arange(N))
    model.train()
    got = trainer.grad_sampler(x, y)[0].materialize()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for i in range(N):
        item = data[i]
        out = model(input_ids=item["input_ids"][None], attention_mask=item["attention_mask"][None],
                    labels=item["labels"][None])  # (as transformers' Trainer calls it)
        loss = cross_entropy_per_example(out.logits, item["labels"][None]).sum()
        ref = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
        for (n, p), r in zip(named.items(), ref, strict=True):
            r = torch.zeros_like(p) if r is None else r
            assert float((got[n][i] - r).norm()) <= 1e-6 * float(r.norm()) + 1e-12, (n, i)


def test_whisper_shifting_its_labels_inside_forward_gets_them_shifted_and_verified():
    """Whisper (as M2M100) has no prepare_decoder_input_ids_from_labels: it shifts the labels inside forward. The
    labels shifted right behind its config's decoder_start_token_id are verified on one example to give its own
    outputs, then used (it used to be refused); a model whose forward derives them another way is refused in one
    line naming decoder_input_ids."""
    torch.manual_seed(0)
    model = MORE["whisper"][0]().double().train()
    g = torch.Generator().manual_seed(0)
    features = torch.randn(N, 4, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(2, 32, (N, 3), generator=g)
    labels[0, 2:] = -100
    trainer = dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   ({"input_features": features}, labels), noise_multiplier=1.0, batch_size=2)
    x, y = trainer.data.batch(torch.arange(N))
    model.train()
    got = trainer.grad_sampler(x, y)[0].materialize()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for i in range(N):
        out = model(input_features=features[i : i + 1], labels=labels[i : i + 1])
        ref = torch.autograd.grad(cross_entropy_per_example(out.logits, labels[i : i + 1]).sum(), list(named.values()),
                                  allow_unused=True)
        for (n, p), r in zip(named.items(), ref, strict=True):
            r = torch.zeros_like(p) if r is None else r
            assert float((got[n][i] - r).norm()) <= 1e-6 * float(r.norm()) + 1e-12, (n, i)

    class Unshifted(torch.nn.Module):  # (its decoder reads the labels themselves, not shifted)
        def __init__(self):
            super().__init__()
            self.inner, self.config = MORE["whisper"][0](), MORE["whisper"][0]().config

        def forward(self, input_features, decoder_input_ids=None, labels=None):
            if decoder_input_ids is None:
                decoder_input_ids = labels.clamp_min(0)
            return self.inner(input_features=input_features, decoder_input_ids=decoder_input_ids)

    model = Unshifted()
    with pytest.raises(DataError, match="decoder_input_ids") as e:
        dptrain.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ({"input_features": features.float()}, labels), noise_multiplier=1.0, batch_size=2)
    assert "\n" not in str(e.value)


def _classifier(name: str):
    """BART's and T5's sequence classifiers: their labels are class indices, and their forward derives the decoder's
    inputs from ``input_ids`` (shifted right), whether or not it is given labels."""
    torch.manual_seed(0)
    common = dict(vocab_size=32, pad_token_id=0, eos_token_id=1, num_labels=3, decoder_start_token_id=0, dropout=0.0)
    if name == "bart":
        return transformers.BartForSequenceClassification(transformers.BartConfig(
            **common, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0)).double().train()
    model = transformers.T5ForSequenceClassification(transformers.T5Config(
        **{**common, "dropout_rate": 0.0}, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, classifier_dropout=0.0))
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v"], task_type="SEQ_CLS")
    return peft.get_peft_model(model, lora).double().train()


def test_t5s_classifier_behind_peft_is_called_as_it_is():
    """T5's sequence classifier behind peft (the same measurement, on a peft wrapper): its source is left as it is, no
    decoder inputs made from class labels (it used to be refused)."""
    from dptrain.data.batches import as_source
    from dptrain.models.decoder_inputs import with_decoder_inputs

    ids = torch.randint(2, 32, (N, SOURCE), generator=torch.Generator().manual_seed(0))
    ids[:, -1] = 1
    source = as_source(({"input_ids": ids, "attention_mask": torch.ones(N, SOURCE, dtype=torch.long)},
                        torch.randint(0, 3, (N,))))
    assert with_decoder_inputs(source, _classifier("t5")) is source


@pytest.mark.parametrize("name", ["bart"])
def test_an_encoder_decoder_classifier_whose_labels_are_classes_trains_as_the_trainer_calls_it(name):
    """An encoder-decoder's sequence classifier takes ``labels`` and ``decoder_input_ids`` too, but its labels are
    class indices that never reach the decoder (it shifts ``input_ids``). It used to be refused for "deriving its
    decoder's inputs from its labels", the way out named putting the labels shifted right in ``decoder_input_ids``:
    a class index as the decoder's input, another function. Whether the labels reach the outputs is now measured (the
    outputs with and without them): they do not, so the model is called as it is, and each example's gradient is that
    of the model called with its labels, as transformers' Trainer calls it."""
    model = _classifier(name.split("-")[0])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 32, (N, SOURCE), generator=g)
    ids[:, -1] = 1  # (each example ends with its end-of-sequence token, which the classifier pools)
    mask, labels = torch.ones(N, SOURCE, dtype=torch.long), torch.randint(0, 3, (N,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = dptrain.make_private(model, torch.optim.SGD(params, lr=0.1),
                                   ({"input_ids": ids, "attention_mask": mask}, labels), noise_multiplier=1.0,
                                   batch_size=2, max_physical_batch_size=N)
    x, y = trainer.data.batch(torch.arange(N))
    assert "decoder_input_ids" not in x
    model.train()
    got = trainer.grad_sampler(x, y)[0].materialize()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for i in range(N):
        out = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1], labels=labels[i : i + 1])
        ref = torch.autograd.grad(cross_entropy_per_example(out.logits, labels[i : i + 1]).sum(),
                                  list(named.values()), allow_unused=True)
        for (n, p), r in zip(named.items(), ref, strict=True):
            r = torch.zeros_like(p) if r is None else r
            assert float((got[n][i] - r).norm()) <= 1e-6 * float(r.norm()) + 1e-12, (n, i)


def test_a_classifier_that_cannot_run_on_its_examples_is_not_blamed_on_its_labels():
    """BART's classifier on examples without an end-of-sequence token raises its own error, with or without labels;
    that failure read as "the model needs its labels", and it was refused for deriving its decoder's inputs from them,
    the way out named putting the labels shifted right in ``decoder_input_ids`` (class indices as the decoder's
    input). Its source is now left as it is: the model's own error is what the user sees."""
    from dptrain.data.batches import as_source
    from dptrain.models.decoder_inputs import with_decoder_inputs

    ids = torch.randint(2, 32, (N, SOURCE), generator=torch.Generator().manual_seed(0))  # (no token 1: no eos)
    source = as_source(({"input_ids": ids, "attention_mask": torch.ones(N, SOURCE, dtype=torch.long)},
                        torch.randint(0, 3, (N,))))
    model = _classifier("bart")
    assert with_decoder_inputs(source, model) is source
    with pytest.raises(ValueError, match="eos"):
        model(**source.batch(torch.arange(2))[0])


def test_a_copy_tasks_labels_equal_to_their_inputs_still_reach_the_decoder():
    """Whether the labels reach the model's outputs is measured on the first examples; where those examples' labels
    equal their inputs (a copy task, or a denoising set's clean examples), BART's decoder reads the same shifted
    tokens with or without them, and the model looked like a classifier: every later example would have fed the
    decoder its input. The first examples' labels given to one another (rolled) still move the outputs."""
    data = Pairs()
    data.labels[:4] = data.ids[:4]
    from dptrain.data.batches import as_source
    from dptrain.models.decoder_inputs import with_decoder_inputs

    model = bart_lora()
    source = with_decoder_inputs(as_source(torch.utils.data.DataLoader(data, batch_size=4)), model)  # (make_private's)
    x, y = source.batch(torch.arange(N))
    assert torch.equal(x["decoder_input_ids"], model.prepare_decoder_input_ids_from_labels(labels=y))
