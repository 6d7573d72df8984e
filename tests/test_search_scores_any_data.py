"""A search scores its trials on any data a run trains on, with the sensitivity its ledger records (each test fails
on the search before it): the held-out examples are read through the trainer's own source (a memory-mapped npz has
no ``.x``; a text data set's inputs are a dict), one example moves the held-out count by at most 1 whatever the task
(a causal language model's example has many tokens: it counts its share of correct ones), and a public score is the
trial's test accuracy as its run reports it (shifted by one token for a causal language model)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dptrain.config import load_config
from dptrain.randomness.generators import Randomness
from dptrain.runs import job as job_module
from dptrain.tuning.search import Search, Trial, run_search

ROOT = Path(__file__).resolve().parent.parent
MONTHS = ROOT / "configs" / "data"

TUNE = """\
[privacy]
target_epsilon = 4.0
delta = 1e-4
[training]
{training}
[tune]
trials_mean = 1.0
validation_fraction = 0.3
{tune}
[tune.space]
"training.learning_rate" = {{ log_uniform = [0.05, 0.5] }}
"""


def test_a_search_on_memory_mapped_npz_scores_its_trials(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=x[:100], y_test=y[:100])
    path = tmp_path / "t.toml"
    path.write_text(
        f'[data]\nname = "npz"\npath = "{tmp_path / "d.npz"}"\noptions = {{ mmap = true, num_classes = 2 }}\n'
        '[model]\nname = "logistic"\n' + TUNE.format(training="epochs = 5\nbatch_size = 100", tune="")
    )
    summary = run_search(load_config(path), tmp_path / "s", progress=False)
    assert summary["best"] is not None and summary["best_score"] > 0.7  # (600 held out, noise std 10: above chance)


def _months(tmp_path, tune: str, training: str = "steps = 1\nbatch_size = 16\nmax_physical_batch_size = 16") -> Path:
    """A search over a small causal language model on the shipped months text (separate, public test file)."""
    path = tmp_path / "lm.toml"
    path.write_text(
        f'[data]\nname = "text_files"\npath = "{MONTHS / "months_train.jsonl"}"\n'
        f'options = {{ task = "causal_lm", test_path = "{MONTHS / "months_test.jsonl"}", '
        f'tokenizer = "{MONTHS / "months_tokenizer"}", max_length = 10 }}\n'
        '[model]\nname = "hf"\noptions = { task = "causal_lm", config = { model_type = "gpt2", n_layer = 1, n_embd = 16, '
        "n_head = 2, n_positions = 16, vocab_size = 17, bos_token_id = 2, eos_token_id = 2, pad_token_id = 0 } }\n"
        + TUNE.format(training=training, tune=tune)
    )
    return path


@pytest.mark.slow
def test_a_held_out_sequence_counts_its_share_of_correct_tokens(tmp_path):
    """The score of a causal language model's trial: each held-out example adds the share of its next tokens that the
    model predicts (at most 1), computed here example by example, alone; a count of correct tokens would add up to 9
    per example, and crashed before (the inputs are a dict)."""
    pytest.importorskip("transformers")
    search = Search(load_config(_months(tmp_path, "score_noise = 1e-9")))
    torch.manual_seed(0)
    job = job_module.build_job(search.trial_config({}, 1.0), Randomness(0, warn=False), data=search.data)
    trial = Trial(0, {}, [5, 6, 7, 8])
    held = search.held_out(trial).nonzero().squeeze(1)
    score = search.score(trial, job)
    model, train = job.trainer.model.eval(), search.data.train
    shares = []
    with torch.no_grad():
        for i in held.tolist():
            ids, mask, labels = train.x["input_ids"][i : i + 1], train.x["attention_mask"][i : i + 1], train.y[i]
            predicted = model(input_ids=ids, attention_mask=mask).logits[0, :-1].argmax(-1)
            target = labels[1:]
            scored = target != -100
            shares.append(float(((predicted == target) & scored).sum()) / max(1, int(scored.sum())))
    total = score * search.tune.validation_fraction * search.n
    assert total == pytest.approx(sum(shares), abs=1e-5)
    assert 0 < total <= len(held)  # one example moves it by at most 1


@pytest.mark.slow
def test_a_public_score_is_the_trials_own_test_accuracy(tmp_path):
    """validation_is_public on a causal language model: the score the search selects on and releases is the test
    accuracy the selected trial reports (next-token, shifted by one); it was the unshifted one, another number."""
    pytest.importorskip("transformers")
    out = tmp_path / "s"
    summary = run_search(load_config(_months(tmp_path, "validation_is_public = true")), out, progress=False)
    best = json.loads((out / "best" / "summary.json").read_text())
    assert summary["score"] == "test accuracy (public)"
    assert summary["best_score"] == pytest.approx(best["test_accuracy"], abs=1e-12)
