"""dptrain.huggingface.DPTrainer: a transformers.Trainer script made private. On a tiny GPT-2 + LoRA and a tiny BERT
classifier built from config objects (random weights, dropout off): gradient accumulation releases one logical batch
per Trainer step (equal to the same logical batch in one chunk), the optimizer and the LR scheduler step once per
logical batch, the ledger holds one release per step at the rate of the logical batch, the certificate is an
independent dptrain.accounting computation, the logs carry it and drop statistics of the private batches, and every
Trainer option it cannot make private is refused in one line."""

import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dptrain.accounting import dpsgd_ledger, epsilon  # noqa: E402
from dptrain.errors import BudgetExhausted, ConfigError, DPTrainError  # noqa: E402
from dptrain.huggingface import DPTrainer, PrivacyArguments  # noqa: E402
from dptrain.models.losses import causal_lm_per_example  # noqa: E402

VOCAB, LENGTH, N = 30, 8, 48


class Tokens(torch.utils.data.Dataset):
    """N sequences of random token ids (fixed length), labelled as transformers' datasets label them: ``labels`` (the
    ids, for a causal LM) or ``label`` (a class, for a classifier)."""

    def __init__(self, n=N, seed=1, classes=None):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.classes = classes

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        item = {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long)}
        if self.classes is None:
            item["labels"] = self.ids[i]
        else:
            item["label"] = int(self.ids[i].sum()) % self.classes
        return item


def gpt2_lora(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, lora)


def bert_classifier(seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def arguments(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, save_strategy="no",
                disable_tqdm=True, logging_steps=1, max_grad_norm=0.0)
    return transformers.TrainingArguments(**{**base, **kw})


class Released(transformers.TrainerCallback):
    """The gradient the optimizer is given at each of its steps (after the Trainer's own clipping, off here)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})


def train_gpt2(tmp_path, per_device, accumulation, steps=2, **privacy):
    released = Released()
    args = arguments(tmp_path, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                     max_steps=steps, optim="sgd", learning_rate=0.5, lr_scheduler_type="linear")
    privacy = PrivacyArguments(**{"noise_multiplier": 1.0, "accountant": "rdp", "privacy_seed": 7, **privacy})
    trainer = DPTrainer(model=gpt2_lora(), args=args, train_dataset=Tokens(), privacy_args=privacy,
                        callbacks=[released])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (transformers' and peft's deprecation notices; ours are checked below)
        output = trainer.train()
    return trainer, output, released


@pytest.mark.slow
def test_gradient_accumulation_releases_one_logical_batch_per_step(tmp_path):
    """A logical batch of 8 (expected) in chunks of 2 (4 micro-batches) equals the same logical batch in one chunk: the
    same secret batch and noise (same privacy_seed), the clipped gradients summed chunk by chunk. One release, one
    optimizer step and one scheduler step per logical batch; the ledger records them at the rate 8 / N."""
    chunked, out, released = train_gpt2(tmp_path / "a", per_device=2, accumulation=4)
    whole, _, reference = train_gpt2(tmp_path / "b", per_device=8, accumulation=1)
    assert out.global_step == 2 and len(released.grads) == len(reference.grads) == 2
    for got, want in zip(released.grads, reference.grads, strict=True):
        assert got.keys() == want.keys() and all("lora_" in n for n in got)
        for n in got:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    assert any(g.abs().max() > 0 for g in released.grads[0].values())
    for (n, p), q in zip(chunked.model.named_parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    ledger = chunked.ledger.to_dict()
    [entry] = ledger["entries"]
    assert entry["count"] == 2 and ledger["releases"] == 2
    assert entry["event"]["sampling_probability"] == pytest.approx(8 / N) and entry["facts"]["sampling"] == "poisson"
    assert chunked.lr_scheduler.last_epoch == 2  # (stepped once per logical batch, never on the micro-batches)
    rates = [row["learning_rate"] for row in chunked.state.log_history if "grad_norm" in row]
    assert rates == pytest.approx([0.5, 0.25])


def test_the_certificate_is_logged_and_matches_an_independent_computation(tmp_path):
    trainer, output, _ = train_gpt2(tmp_path, per_device=4, accumulation=2, steps=3)
    expected = epsilon(dpsgd_ledger(1.0, 8 / N, 3), 1e-5, "rdp").epsilon
    report = trainer.epsilon()
    assert report.epsilon == pytest.approx(expected, rel=1e-9) and report.accountant == "rdp"
    assert not report.certified  # (privacy_seed: reproducible, NOT private)
    with pytest.raises(DPTrainError, match="not certified"):
        float(report)
    steps = [row for row in trainer.state.log_history if "grad_norm" in row]
    assert [row["private_steps"] for row in steps] == [1, 2, 3]
    assert steps[-1]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert all(row["accountant"] == "rdp" and row["certified"] is False for row in steps)
    assert output.metrics["epsilon"] == pytest.approx(expected, rel=1e-9)
    # statistics of the private batches are not logged (the training loss, FLOPs from the batches' sizes)
    keys = {k for row in trainer.state.log_history for k in row}
    assert not keys & {"loss", "train_loss", "total_flos"} and math.isnan(output.training_loss)


def test_a_bert_classifier_calibrated_to_a_target_epsilon(tmp_path):
    """The HF conventions (a ``label`` column, the default collator, AdamW, a warmup schedule, compute_metrics on an
    eval set); a calibrated run spends its target in its planned steps, certified, and is refused a second train()."""

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    args = arguments(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=1,
                     learning_rate=1e-2, warmup_steps=2, logging_steps=2)
    privacy = PrivacyArguments(target_epsilon=4.0, delta=1e-5, accountant="rdp", log_not_private=True,
                               eval_is_public=True)
    trainer = DPTrainer(model=bert_classifier(), args=args, train_dataset=Tokens(N, classes=2),
                        eval_dataset=Tokens(16, seed=2, classes=2), compute_metrics=accuracy, privacy_args=privacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = trainer.train()
        evaluation = trainer.evaluate()
    planned = round(N / 8)  # (one epoch of logical batches of 8 expected examples out of N)
    assert output.global_step == planned == trainer.planned_steps == trainer.private_loop.steps
    report = trainer.epsilon()
    assert report.certified and float(report) == report.epsilon <= 4.0 + 1e-9 and report.epsilon > 3.9
    sigma = trainer.private_loop.trainer.noise_multiplier
    assert float(report) == pytest.approx(epsilon(dpsgd_ledger(sigma, 8 / N, planned), 1e-5, "rdp").epsilon)
    adam = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert {int(s["step"]) for s in adam.state.values()} == {planned}
    assert trainer.lr_scheduler.last_epoch == planned
    assert 0.0 <= evaluation["eval_accuracy"] <= 1.0
    last = trainer.state.log_history[-1]
    assert "eval_accuracy" in last and last["epsilon"] == report.epsilon and last["certified"] is True
    assert any("loss_not_private" in row for row in trainer.state.log_history)  # (asked for, labelled)
    assert not any("loss" in row for row in trainer.state.log_history)
    assert math.isfinite(output.training_loss)
    with pytest.raises(BudgetExhausted, match="spent its budget"):
        trainer.train()


def test_privacy_arguments_parse_beside_training_arguments(tmp_path):
    parser = transformers.HfArgumentParser((transformers.TrainingArguments, PrivacyArguments))
    args, privacy = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--max_grad_norm", "0.5", "--per_sample_max_grad_norm", "2",
         "--target_epsilon", "3", "--delta", "1e-6", "--report_to", "none"]
    )
    assert args.max_grad_norm == 0.5 and privacy.per_sample_max_grad_norm == 2.0
    assert privacy.target_epsilon == 3.0 and privacy.delta == 1e-6 and privacy.sampling == "poisson"


class OwnLoss(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class OwnSampler(DPTrainer):
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Tokens())


@pytest.mark.parametrize(
    ("arguments_", "options", "message"),
    [
        ({"fp16": True}, {}, "loss scaler"),
        ({"torch_compile": True}, {}, "torch_compile"),
        ({"auto_find_batch_size": True}, {}, "auto_find_batch_size"),
        # (the model's refusal, at train(), named model.gradient_checkpointing_enable(...), which the Trainer overrides)
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}, {},
         "TrainingArguments(gradient_checkpointing_kwargs={'use_reentrant': False})"),
        ({"train_sampling_strategy": "group_by_length"}, {}, "secret sampling"),
        ({"label_smoothing_factor": 0.1}, {"loss_fn": causal_lm_per_example}, "with loss_fn, smooth in it"),
        ({"include_num_input_tokens_seen": "all"}, {}, "not private"),
        ({"neftune_noise_alpha": 5.0}, {}, "padded length"),
        ({"use_liger_kernel": True}, {}, "Liger"),
        ({"optim": "lomo"}, {}, "inside the backward pass"),
        ({}, {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: outputs.loss},
         "one loss per example"),
        ({}, {"eval_dataset": "train"}, "evaluate on held-out data"),
        ({}, {"model_init": lambda trial=None: gpt2_lora()}, "pass model="),
        ({}, {"cls": OwnLoss}, "may not override compute_loss"),
        ({}, {"cls": OwnSampler}, "may not override _get_train_sampler"),
        ({}, {"train_dataset": Stream()}, "map-style"),
        ({}, {"privacy_args": None}, "needs privacy_args"),
        ({}, {"privacy_args": PrivacyArguments(target_epsilon=1.0, noise_multiplier=1.0)}, "exactly one"),
        ({"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}, {}, "exceeds the training set"),
        ({"label_names": []}, {}, "TrainingArguments(label_names=["),
    ],
)
def test_what_cannot_be_made_private_is_refused_in_one_line(tmp_path, arguments_, options, message):
    options = dict(options)
    cls = options.pop("cls", DPTrainer)
    train = options.pop("train_dataset", Tokens())
    if options.get("eval_dataset") == "train":
        options["eval_dataset"] = train
    options.setdefault("privacy_args", PrivacyArguments(noise_multiplier=1.0))
    model = None if "model_init" in options else gpt2_lora()
    with pytest.raises(ConfigError) as refused:
        cls(model=model, args=arguments(tmp_path, **arguments_), train_dataset=train, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_data_parallel_resuming_and_searches_are_refused(tmp_path):
    args = arguments(tmp_path)
    args._n_gpu = 2  # (what the Trainer reads on a machine with two visible GPUs: it would use DataParallel)
    with pytest.raises(ConfigError, match="DataParallel across 2 GPUs"):
        DPTrainer(model=gpt2_lora(), args=args, train_dataset=Tokens(), privacy_args=PrivacyArguments(noise_multiplier=1))
    trainer = DPTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=Tokens(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0))
    with pytest.raises(ConfigError, match="forget what it spent"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
    with pytest.raises(ConfigError, match="dptrain tune"):
        trainer.hyperparameter_search()
    with pytest.raises(ConfigError, match="has not trained"):
        trainer.epsilon()
    with pytest.raises(ConfigError, match="held-out data"):
        trainer.evaluate(trainer.train_dataset)


def test_an_empty_poisson_batch_is_released_as_noise_without_calling_the_model(tmp_path):
    """GPT-2 cannot take a batch of no example (transformers reshapes its mask with -1): an empty Poisson batch is
    released (noise alone, one ledger step) without a forward pass. With this seed, logical batches 2 and 3 of 4 are
    empty (q = 1/48)."""
    seen = []

    class Started(transformers.TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            seen.clear()  # (the model probe before training computes losses too)

    def loss_fn(outputs, labels):
        seen.append(trainer.state.global_step)
        return causal_lm_per_example(outputs, labels)

    args = arguments(tmp_path, per_device_train_batch_size=1, max_steps=4, logging_steps=10, optim="sgd")
    privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", privacy_seed=1)
    trainer = DPTrainer(model=gpt2_lora(), args=args, train_dataset=Tokens(), loss_fn=loss_fn, callbacks=[Started(),
                        released := Released()], privacy_args=privacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert sorted(set(range(4)) - set(seen)) == [1, 2] and trainer.private_loop.steps == 4
    assert len(released.grads) == 4 and all(g.abs().max() > 0 for g in released.grads[1].values())  # (the noise)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_model_whose_gradients_need_the_whole_model_is_refused_naming_what_trains_it(tmp_path):
    """T5 fully fine-tuned: its relative-position bias is computed once for the batch, so its per-example gradients
    need the whole model differentiated example by example, which a Trainer step (one forward pass) cannot give. The
    refusal used to tell a Trainer user to use "the trainer's own step instead of your own loop" (they wrote no loop);
    now it names the layer, make_private and LoRA. A translation data set holding labels only (the decoder's inputs
    derived from them, tests/test_hf_seq2seq_labels.py)."""
    from hf_zoo import build
    from test_hf_seq2seq_labels import Pairs

    trainer = DPTrainer(model=build("t5", dtype=torch.float32), args=arguments(tmp_path, max_steps=1,
                                                                               per_device_train_batch_size=2),
                        train_dataset=Pairs(), privacy_args=PrivacyArguments(noise_multiplier=1.0, delta=1e-2))
    with pytest.raises(DPTrainError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "\n" not in message and "your own loop" not in message
    assert "relative_attention_bias" in message and "dptrain.make_private" in message and "LoRA" in message


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fully_fine_tuned_bart_from_a_seq2seq_script_trains_evaluates_and_reloads(tmp_path):
    """A translation script as HF writes it: BART fully fine-tuned, `DataCollatorForSeq2Seq(tokenizer)` (labels
    only: the decoder's inputs derived from them), gradient accumulation, evaluation during training, `save_model`
    and `from_pretrained` alone. It used to be refused (BART's decoder positions, computed once for the batch, needed
    the whole model differentiated example by example, and the refusal named "your own loop"), and without decoder
    inputs BART would have read its encoder input as the decoder's."""
    from hf_zoo import MORE
    from test_hf_inputs import tokenizer
    from test_hf_seq2seq_labels import Pairs

    class Items(Pairs):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {"input_ids": item["input_ids"].tolist(), "labels": item["labels"][item["labels"] >= 0].tolist()}

    torch.manual_seed(0)
    model = MORE["bart"][0]()
    args = arguments(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                     eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3, learning_rate=1e-2)
    collator = transformers.DataCollatorForSeq2Seq(tokenizer())
    trainer = DPTrainer(model=model, args=args, train_dataset=Items(), eval_dataset=Items(), data_collator=collator,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, delta=1e-2, eval_is_public=True))
    trainer.train()
    assert trainer.private_loop.trainer.grad_sampler.name.startswith("layerwise")
    assert sum("eval_loss" in row for row in trainer.state.log_history) == 2 and trainer.private_loop.steps == 2
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "saved")).eval()
    batch = collator([Items()[i] for i in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model.eval()(**batch).logits)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_evaluation_and_prediction_on_training_examples_are_refused_through_views(tmp_path):
    """The training examples are refused for evaluation and prediction however they are reached: the train_dataset
    itself, a Subset of it, a ConcatDataset holding one, predict(), an eval_dataset set after the Trainer was made.
    The parts of one random_split share no example: training on one and evaluating on the other is held-out data.
    predict(train_dataset) and evaluate(Subset(train_dataset)) used to return the training examples' statistics."""
    full = Tokens(N + 16)
    train, held_out = torch.utils.data.random_split(full, [N, 16], generator=torch.Generator().manual_seed(0))
    some_train = torch.utils.data.Subset(train, [3, 5])
    mixed = torch.utils.data.ConcatDataset([held_out, torch.utils.data.Subset(full, [train.indices[7]])])
    with pytest.raises(ConfigError, match="holds training examples"):
        DPTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=train, eval_dataset={"a": mixed},
                  privacy_args=PrivacyArguments(noise_multiplier=1.0))
    trainer = DPTrainer(model=gpt2_lora(), args=arguments(tmp_path), train_dataset=train, eval_dataset=held_out,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, eval_is_public=True))
    assert "eval_loss" in trainer.evaluate()  # (the other part of the split: held out)
    assert trainer.predict(torch.utils.data.Subset(held_out, [0, 1])).predictions is not None
    for call in (lambda: trainer.predict(train), lambda: trainer.predict(some_train),
                 lambda: trainer.evaluate(some_train), lambda: trainer.evaluate(mixed)):
        with pytest.raises(ConfigError, match="holds training examples") as refused:
            call()
        assert "\n" not in str(refused.value)
    trainer.eval_dataset = {"test": held_out, "train": some_train}
    assert "test_loss" in trainer.evaluate("test", metric_key_prefix="test")
    with pytest.raises(ConfigError, match="holds training examples"):
        trainer.evaluate()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_metrics_of_evaluation_data_not_declared_public_are_refused_or_labelled(tmp_path):
    """The held-out part of a random_split of the user's data is as sensitive as the part trained on (the CLI writes a
    test accuracy only for a public test set). Its evaluation metrics used to be logged as they were, and a model could
    be chosen by them (load_best_model_at_end): refused unless the evaluation data are declared public, or logged and
    returned labelled _not_private with log_not_private (a choice of the model by them refused even so)."""
    train, held_out = torch.utils.data.random_split(Tokens(N + 8), [N, 8], generator=torch.Generator().manual_seed(0))
    options = dict(model=gpt2_lora(), train_dataset=train, eval_dataset=held_out)
    trainer = DPTrainer(args=arguments(tmp_path), privacy_args=PrivacyArguments(noise_multiplier=1.0), **options)
    with pytest.raises(ConfigError, match="eval_is_public=True") as refused:
        trainer.evaluate()
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="eval_strategy"):
        DPTrainer(args=arguments(tmp_path, eval_strategy="steps", eval_steps=1),
                  privacy_args=PrivacyArguments(noise_multiplier=1.0), **options)
    best = arguments(tmp_path, eval_strategy="steps", save_strategy="steps", load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="metric_for_best_model='loss'"):
        DPTrainer(args=best, privacy_args=PrivacyArguments(noise_multiplier=1.0, log_not_private=True), **options)
    labelled = DPTrainer(args=arguments(tmp_path), **options,
                         privacy_args=PrivacyArguments(noise_multiplier=1.0, log_not_private=True))
    metrics = labelled.evaluate()
    assert "eval_loss_not_private" in metrics and "eval_loss" not in metrics
    assert "eval_loss_not_private" in labelled.state.log_history[-1]
    assert not any("eval_loss" in row for row in labelled.state.log_history)
    public = DPTrainer(args=best, privacy_args=PrivacyArguments(noise_multiplier=1.0, eval_is_public=True), **options)
    assert "eval_loss" in public.evaluate() and "eval_loss" in public.state.log_history[-1]


def test_each_checkpoint_and_saved_model_carries_its_ledger_and_certificate(tmp_path):
    """Trainer checkpoints (save_strategy) and save_model() write, beside the weights, the ledger of the steps that
    produced them (the format of a dptrain train run's ledger.json) and their certificate: weights shared from a
    checkpoint say what they cost. Before, a checkpoint held weights and optimizer state but no trace of the privacy
    spent (the certificate only where a log happened to fall on the same step)."""
    from dptrain.accounting import Ledger

    args = arguments(tmp_path, per_device_train_batch_size=4, max_steps=4, save_strategy="steps", save_steps=2,
                     logging_steps=100, optim="sgd")
    trainer = DPTrainer(model=gpt2_lora(), args=args, train_dataset=Tokens(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, accountant="rdp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    for directory, steps in ((tmp_path / "out" / "checkpoint-2", 2), (tmp_path / "out" / "checkpoint-4", 4),
                             (tmp_path / "final", 4)):
        ledger = Ledger.load(directory / "ledger.json")
        assert ledger.to_dict()["releases"] == steps
        expected = epsilon(dpsgd_ledger(1.0, 4 / N, steps), 1e-5, "rdp").epsilon
        certificate = json.loads((directory / "certificate.json").read_text())
        assert certificate["epsilon"] == pytest.approx(expected, rel=1e-9) and certificate["private_steps"] == steps
        assert certificate["certified"] is True and epsilon(ledger, 1e-5, "rdp").epsilon == pytest.approx(expected)


def test_the_trainers_progress_bar_shows_steps_not_time(tmp_path, monkeypatch, capsys):
    """A step's time depends on its realized (secret) batch size: the Trainer's bar (on by default) shows no elapsed
    time or rate, and redraws at steps the clock does not choose (a slow clock changes nothing on stderr)."""
    import re
    import time

    import tqdm.std

    def run(name, tick):
        now = [0.0]

        def clock():
            now[0] += tick
            return now[0]

        with monkeypatch.context() as m:
            for target in (time, tqdm.std):
                for attribute in ("time", "perf_counter", "monotonic"):
                    if hasattr(target, attribute):
                        m.setattr(target, attribute, clock)
            args = arguments(tmp_path / name, disable_tqdm=False, per_device_train_batch_size=8, max_steps=3,
                             optim="sgd", learning_rate=0.5)
            trainer = DPTrainer(model=gpt2_lora(), args=args, train_dataset=Tokens(),
                                privacy_args=PrivacyArguments(noise_multiplier=1.0, accountant="rdp", privacy_seed=7))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
        err = capsys.readouterr().err
        return [line for line in re.split(r"[\r\n]", err) if "3/3" in line or "/3 " in line or "/3|" in line]

    fast, slow = run("fast", 1e-6), run("slow", 9.0)
    assert fast and fast == slow and not any(re.search(r"it/s|s/it|\d\d:\d\d", line) for line in fast), fast


class Spans(torch.utils.data.Dataset):
    """Question-answering examples as transformers' run_qa.py prepares them: token ids and each answer's start and
    end positions (one past the sequence: no answer in this window, ignored)."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.start = torch.randint(0, LENGTH + 1, (n,), generator=g)
        self.end = torch.clamp(self.start + torch.randint(0, 3, (n,), generator=g), max=LENGTH + 1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                "start_positions": self.start[i], "end_positions": self.end[i]}


def test_a_question_answering_head_trains_on_its_two_label_names(tmp_path):
    """transformers names a question-answering head's labels start_positions and end_positions. DPTrainer took one
    label name and refused the head, its way out (pass loss_fn) refused too. Now the two labels are stacked into one
    label per example ([start, end]) and the default per-example loss is the head's own: each example's equals the
    loss the model computes when given that example's positions alone (a position past the sequence ignored: 0)."""
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    data = Spans()
    trainer = DPTrainer(model=model, args=arguments(tmp_path, per_device_train_batch_size=4, max_steps=1),
                        train_dataset=data, privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert trainer.train().global_step == 1 and trainer.private_loop.steps == 1
    x, y = trainer.private_loop.trainer.data.batch(torch.arange(6))
    assert torch.equal(y, torch.stack([data.start[:6], data.end[:6]], 1)) and "start_positions" not in x
    model.eval()
    inside = [i for i in range(6) if data.start[i] < LENGTH and data.end[i] < LENGTH]
    assert len(inside) >= 3
    with torch.no_grad():
        losses = trainer.loss_fn(model(**x), y)
        for i in inside:  # (alone, transformers' loss of an example whose positions are both ignored is NaN; ours 0)
            own = float(model(**{k: v[None] for k, v in data[i].items()}).loss)
            assert abs(float(losses[i]) - own) <= 1e-6 * own


def test_state_a_forward_pass_caches_is_put_back_after_every_chunk_with_restore(tmp_path):
    """A model keeping its last batch in an attribute (as Qwen2-VL keeps its rope_deltas) is refused naming
    buffer_updates="restore" (tests/test_hf_architectures.py), which PrivacyArguments did not take; with it, the
    attribute is put back after every chunk, so the trained model holds nothing of the private batches and the run
    stays private."""
    model = gpt2_lora()
    trunk = model.base_model.model.transformer

    def cache(module, args, kwargs, output):  # (the batch's tokens)
        module.last_batch = kwargs.get("input_ids", args[0] if args else None).detach().clone()

    trunk.register_forward_hook(cache, with_kwargs=True)
    trainer = DPTrainer(model=model, args=arguments(tmp_path, per_device_train_batch_size=4, max_steps=1),
                        train_dataset=Tokens(), privacy_args=PrivacyArguments(noise_multiplier=1.0,
                                                                              buffer_updates="restore"))
    trainer.train()
    # (what it holds after: the model's first call's, on an all-zero input before any example: dptrain's warm-up)
    assert trainer.private_loop.steps == 1 and trainer.ledger.private and not trunk.last_batch.any()


def test_a_torch_compiled_model_trains_as_the_eager_model_it_wraps(tmp_path):
    """DPTrainer(model=torch.compile(model)): the Trainer read the wrapper's forward(*args, **kwargs), found no label
    name and it was refused for that ("set TrainingArguments(label_names=...)"); with label_names set, every column
    was dropped as unused ("the batches ... must hold tensors"). It trains the eager model it wraps, as make_private
    does (the same parameters)."""
    model = gpt2_lora()
    trainer = DPTrainer(model=torch.compile(model), args=arguments(tmp_path), train_dataset=Tokens(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0))
    assert trainer.model is model and trainer.label_names == ["labels"]
    inputs, labels = trainer._training_source().batch(torch.tensor([0, 1]))
    assert torch.equal(inputs["input_ids"], Tokens().ids[:2]) and torch.equal(labels, Tokens().ids[:2])


@pytest.mark.parametrize("classifier", [False, True])
def test_label_smoothing_is_the_trainers_smoother_of_each_example_alone(tmp_path, classifier):
    """label_smoothing_factor was refused (the Trainer's LabelSmoother averages over the batch's labelled tokens, which
    mixes examples). The default loss is now smoothed example by example: each example's loss is transformers'
    LabelSmoother on that example alone (shifted for the causal LM, as the Trainer shifts it)."""
    from transformers.trainer_pt_utils import LabelSmoother

    model = bert_classifier() if classifier else gpt2_lora()
    data = Tokens(classes=2 if classifier else None)
    trainer = DPTrainer(model=model, args=arguments(tmp_path, label_smoothing_factor=0.2), train_dataset=data,
                        privacy_args=PrivacyArguments(noise_multiplier=1.0))
    batch = [data[i] for i in range(3)]
    ids = torch.stack([b["input_ids"] for b in batch])
    labels = torch.tensor([b["label"] for b in batch]) if classifier else ids.clone()
    labels = labels if classifier else labels.masked_fill(torch.arange(LENGTH) >= LENGTH - 2, -100)
    ours = trainer.loss_fn(model(input_ids=ids), labels)
    for i in range(3):
        theirs = LabelSmoother(epsilon=0.2)({"logits": model(input_ids=ids[i : i + 1]).logits}, labels[i : i + 1],
                                            shift_labels=not classifier)
        torch.testing.assert_close(ours[i], theirs, rtol=1e-5, atol=1e-6)


class Waves(torch.utils.data.Dataset):
    """Waveforms of 64 samples, each with a class."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_values": torch.randn(64, generator=g), "labels": i % 3}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_wav2vec2_classifier_with_lora_trains(tmp_path):
    """Wav2Vec2's feature encoder sets requires_grad on a view of its input_values in training; the private loop hands
    its floating tensors out requiring grad, and torch refused ("you can only change requires_grad flags of leaf
    variables"): a raw RuntimeError for every Wav2Vec2-family model (HuBERT, WavLM, SEW, ...) whose feature encoder
    was not frozen, LoRA included. The DPTrainer calls the model on the chunk's tensors detached."""
    from hf_zoo import MORE

    torch.manual_seed(0)
    model = peft.get_peft_model(MORE["wav2vec2"][0](), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                                       modules_to_save=["classifier"]))
    args = arguments(tmp_path, per_device_train_batch_size=4, max_steps=1, optim="sgd")
    trainer = DPTrainer(model=model, args=args, train_dataset=Waves(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, delta=1e-2, sampling="full"))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.private_loop.steps == 1
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
