"""The default per-example loss of a Hugging Face classifier is the loss its own forward computes when given labels
(transformers' ForSequenceClassificationLoss), one value per example: regression for one label (GLUE's STS-B), binary
cross-entropy for multi-label problems, cross-entropy for integer labels. It used to be cross-entropy whatever the
problem: a regression head (float labels) crashed with torch's "expected target dtype to be Long", and a multi-label
head (float multi-hot labels) trained silently on a soft-label softmax cross-entropy instead of its own loss."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dptrain.errors import DataError, ModelError  # noqa: E402
from dptrain.huggingface import DPTrainer, PrivacyArguments  # noqa: E402
from dptrain.models.losses import default_loss  # noqa: E402

VOCAB, LENGTH = 30, 8


def bert(num_labels, problem_type=None):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=num_labels,
                                     problem_type=problem_type, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def batch(labels, n=6):
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


CASES = {  # name: (model, labels)
    "regression": (lambda: bert(1), torch.linspace(-1.0, 2.0, 6)),
    "regression, 2 targets": (lambda: bert(2, "regression"), torch.linspace(-1.0, 2.0, 12).reshape(6, 2)),
    "multi-label": (lambda: bert(3, "multi_label_classification"), (torch.arange(18).reshape(6, 3) % 2).float()),
    "multi-label, inferred": (lambda: bert(3), (torch.arange(18).reshape(6, 3) % 3 == 0).float()),
    "single-label": (lambda: bert(3), torch.tensor([0, 2, 1, 1, 0, 2])),
    "single-label behind LoRA": (
        lambda: peft.get_peft_model(bert(3), peft.LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS")),
        torch.tensor([0, 2, 1, 1, 0, 2]),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_per_example_losses_average_to_the_models_own_loss(case):
    make, labels = CASES[case]
    model = make().eval()
    inputs, labels = batch(labels)
    with torch.no_grad():
        own = model(**inputs, labels=labels).loss  # (transformers' loss for the batch: the mean over its examples)
        fresh = make().eval()  # (transformers writes the inferred problem_type into the config: a fresh one is read)
        losses = default_loss(fresh)(fresh(**inputs), labels)
    assert losses.shape == (6,)
    torch.testing.assert_close(losses.mean(), own, rtol=1e-5, atol=1e-6)
    # one value per example: the loss of an example does not depend on the others
    torch.testing.assert_close(losses[2:3], default_loss(fresh)(fresh(**{k: v[2:3] for k, v in inputs.items()}),
                                                                labels[2:3]), rtol=1e-5, atol=1e-6)


def test_labels_that_do_not_fit_and_unknown_problem_types_are_refused_in_one_line():
    model = bert(3, "multi_label_classification")
    inputs, labels = batch(torch.ones(6, 2))
    with pytest.raises(DataError, match="do not fit") as refused:
        default_loss(model)(model(**inputs), labels)
    assert "\n" not in str(refused.value)
    model.config.problem_type = "ranking"
    with pytest.raises(ModelError, match="problem_type 'ranking'"):
        default_loss(model)


class Scores(torch.utils.data.Dataset):
    """GLUE's STS-B as a Trainer script holds it: token ids and a real-valued similarity per pair."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "attention_mask": torch.ones(LENGTH, dtype=torch.long), "label": float(i % 5) / 4}


def test_a_regression_head_trains_in_a_trainer_script(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                                          disable_tqdm=True, per_device_train_batch_size=4, max_steps=2)
    trainer = DPTrainer(model=bert(1), args=args, train_dataset=Scores(),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, delta=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert trainer.private_loop.steps == 2 and trainer.loss_fn.problem_type(torch.zeros(1)) == "regression"
