"""What a run releases, second round (each test fails on the engine before it): buffers written from private batches,
models that mix examples only in large batches or only on real-looking inputs, test metrics from a split of the
private data, seeded runs marked not private everywhere, and one-line errors for bad API input."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.config import load_config
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import AccountingError, ConfigError, DataError, ModelError
from dptrain.runs.run import run_training

X = torch.randn(600, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def _private(model, data=(X, Y), **options):
    options = {"noise_multiplier": 1.0, "batch_size": 64, **options}
    return make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data, **options)


# --- buffers written from the batch ----------------------------------------------------------------------------


class RunningMean(nn.Module):
    """A user's layer that keeps a running mean of its inputs, as BatchNorm's running statistics do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("running_mean", torch.zeros(6))

    def forward(self, x):
        if self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


class Counter(nn.Module):
    """A buffer written the same way whatever the batch (a step counter): no private data in it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.lin(x)


class ExampleCount(nn.Module):
    """A buffer that counts the examples it saw: the (private) batch sizes, though not their values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.seen += len(x)
        return self.lin(x)


@pytest.mark.parametrize("model_class,buffer", [(RunningMean, "running_mean"), (ExampleCount, "seen"),
                                                (Counter, "calls")])
def test_a_buffer_written_by_a_training_forward_is_refused_naming_it_and_the_probe_leaves_no_trace(model_class, buffer):
    """Any write is a release: a count of calls counts the chunks, hence the secret batch sizes (it was allowed)."""
    model = model_class()
    before = model.state_dict()
    with pytest.raises(ModelError, match=f"model buffer '{buffer}' is written by a training-mode forward pass"):
        _private(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the probe's forwards were undone


def test_opting_out_trains_and_labels_the_run_not_private(tmp_path):
    model = RunningMean()
    trainer = _private(model, buffer_updates="not_private", seed=None)
    assert torch.equal(model.running_mean, torch.zeros(6))  # the probe wrote nothing into the released model
    trainer.step()
    assert not torch.equal(model.running_mean, torch.zeros(6))
    report = trainer.epsilon()
    assert not trainer.private and not report.certified and "running_mean" in report.details["note"]
    assert trainer.ledger.to_dict()["private"] is False
    with pytest.raises(ConfigError, match="buffer_updates must be one of refuse, restore, not_private"):
        _private(RunningMean(), buffer_updates="allow")


# --- the independence probe: real examples at the run's chunk size ---------------------------------------------


class MixesInLargeBatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True) if len(x) > 32 else h


class MixesOnRealLookingInputs(nn.Module):
    """Mixes only on inputs whose features are all in [0, 1] (images, say): a standard-normal probe never is."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, x):
        h = self.lin(x)
        return h - 0.5 * h.mean(0, keepdim=True) if bool((x >= 0).all() and (x <= 1).all()) else h


@pytest.mark.parametrize("grad_sampler", ["layerwise", "func"])
def test_a_model_that_mixes_only_in_large_batches_is_refused(grad_sampler):
    with pytest.raises(ModelError, match="independence check failed"):
        _private(MixesInLargeBatches(), grad_sampler=grad_sampler)
    # below the mixing size the model is independent, and the probe (one chunk of the run) says so
    _private(MixesInLargeBatches(), grad_sampler=grad_sampler, max_physical_batch_size=16)


def test_a_model_that_mixes_only_on_real_looking_inputs_is_refused():
    images = torch.rand(600, 6, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ModelError, match="independence check failed"):
        _private(MixesOnRealLookingInputs(), data=(images, Y))


# --- test metrics from a split of the private data ------------------------------------------------------------


SYNTHETIC = [
    'data.name="synthetic"',
    "data.options={n = 600, dim = 6, num_classes = 2, separation = 3.0}",
    'model.name="logistic"',
    "privacy.noise_multiplier=1.0",
    "training.epochs=2",
    "training.batch_size=100",
    "training.learning_rate=1.0",
]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_test_split_of_the_private_data_is_not_written_unless_declared_public_or_labelled(tmp_path):
    summary = run_training(load_config(None, SYNTHETIC), tmp_path / "split", progress=False)
    assert summary["test_accuracy"] is None and summary["test_is_public"] is False and "not_private" not in summary
    assert all("test_accuracy" not in r and "not_private" not in r for r in _rows(tmp_path / "split"))
    declared = run_training(load_config(None, [*SYNTHETIC, "data.test_is_public=true"]), tmp_path / "pub", progress=False)
    assert 0.5 < declared["test_accuracy"] <= 1 and all("test_accuracy" in r for r in _rows(tmp_path / "pub"))
    labelled = run_training(
        load_config(None, [*SYNTHETIC, "training.log_not_private=true"]), tmp_path / "lab", progress=False
    )
    assert labelled["test_accuracy"] is None and 0.5 < labelled["not_private"]["test_accuracy"] <= 1
    assert all("test_accuracy" in r["not_private"] for r in _rows(tmp_path / "lab"))


def test_a_separate_test_file_is_public_by_default(tmp_path):
    g = np.random.default_rng(0)
    x, x_test = g.normal(size=(400, 6)).astype("float32"), g.normal(size=(100, 6)).astype("float32")
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] > 0).astype("int64"), x_test=x_test, y_test=(x_test[:, 0] > 0).astype("int64"))
    base = ['data.name="npz"', f'data.path="{tmp_path / "d.npz"}"', "data.options={num_classes = 2}", *SYNTHETIC[2:]]
    summary = run_training(load_config(None, base), tmp_path / "npz", progress=False)
    assert summary["test_is_public"] and summary["test_accuracy"] is not None
    private = run_training(load_config(None, [*base, "data.test_is_public=false"]), tmp_path / "no", progress=False)
    assert private["test_accuracy"] is None


# --- seeded runs say so everywhere --------------------------------------------------------------------------


def test_a_seeded_run_is_marked_not_private_in_every_output_and_an_unseeded_one_private(tmp_path):
    seeded = run_training(load_config(None, [*SYNTHETIC, "seed=5"]), tmp_path / "seeded", progress=False)
    assert seeded["private"] is False and seeded["certified"] is False and seeded["accountants"]["pld"]["certified"]
    assert "seed" in " ".join(seeded["not_private_because"])
    assert json.loads((tmp_path / "seeded" / "ledger.json").read_text())["private"] is False
    assert all(r["private"] is False for r in _rows(tmp_path / "seeded"))
    secret = run_training(load_config(None, SYNTHETIC), tmp_path / "secret", progress=False)
    assert secret["private"] is True and secret["certified"] is True and "not_private_because" not in secret
    assert json.loads((tmp_path / "secret" / "ledger.json").read_text())["private"] is True
    trainer = _private(nn.Linear(6, 2), seed=3)
    trainer.step()
    assert not trainer.epsilon().certified and trainer.epsilon().details["private"] is False


def test_an_edited_private_flag_makes_the_ledger_copy_disagree(tmp_path):
    out = tmp_path / "r"
    run_training(load_config(None, [*SYNTHETIC, "seed=5"]), out, progress=False, stop_after=2)
    ledger = json.loads((out / "ledger.json").read_text())
    ledger["private"] = True
    (out / "ledger.json").write_text(json.dumps(ledger))
    with pytest.raises(DataError, match="does not match the run's checkpoint"):
        run_training(None, out, resume=True, progress=False)


# --- one-line errors for bad API input ----------------------------------------------------------------------


def test_bad_api_input_is_a_one_line_dptrain_error():
    frozen = nn.Linear(6, 2).requires_grad_(False)
    with pytest.raises(ModelError, match="no trainable parameters"):
        make_private(frozen, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), (X, Y), noise_multiplier=1.0,
                     batch_size=64)
    with pytest.raises(DataError, match="labels must be integer class indices"):
        _private(nn.Linear(6, 2), data=(X, Y.float()))
    with pytest.raises(ConfigError, match="make_private\\(\\) takes no option 'noise_multipler'"):
        _private(nn.Linear(6, 2), noise_multipler=1.0)
    model = nn.Linear(6, 2)
    with pytest.raises(ConfigError, match="make_private_with_epsilon\\(\\) takes no option 'noise_multiplier'"):
        make_private_with_epsilon(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), target_epsilon=1.0,
                                  target_delta=1e-5, epochs=1, batch_size=64, noise_multiplier=1.0)


def test_a_label_error_names_the_rule_not_the_labels():
    with pytest.raises(DataError) as e:
        _private(nn.Linear(6, 2), data=(X, Y * 7))
    assert str(e.value) == "labels must be class indices in [0, 2) for a model with 2 outputs"


def test_delta_of_one_over_n_or_more_is_refused():
    with pytest.raises(AccountingError, match=r"delta must be below 1/n = 0.00167 for a data set of n = 600"):
        _private(nn.Linear(6, 2), delta=1 / 600)
    trainer = _private(nn.Linear(6, 2), delta=1e-4)
    with pytest.raises(AccountingError, match="delta must be below 1/n"):
        trainer.epsilon(delta=0.5)
    model = nn.Linear(6, 2)
    with pytest.raises(AccountingError, match="delta must be below 1/n"):
        make_private_with_epsilon(model, torch.optim.SGD(model.parameters(), lr=0.1), (X, Y), target_epsilon=1.0,
                                  target_delta=0.5, epochs=1, batch_size=64)


def test_last_iterate_label_errors_name_the_rule_not_the_labels():
    from dptrain.last_iterate import ConvexGLM

    with pytest.raises(ConfigError) as e:
        ConvexGLM("logistic", 1.0).prepare_labels(torch.tensor([0, 1, 7, 1]))
    assert str(e.value) == "labels must be 0 or 1 for loss 'logistic'"
