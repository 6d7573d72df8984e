"""Errors about bad training data name the rule, never a statistic of the private data.

A message ends up in logs, CI output and bug reports: it must not carry a label value, the range of the labels, the
number of bad ones, the position of a bad example or its shape. Each test below breaks one rule with a distinctive
value (a label 37, five bad labels, item 13, ...) and checks that the one-line message names the rule and holds none
of it. Public facts (the file name, the number of examples, num_classes from the config) may appear; the file name
is taken out before looking for the value, since a temporary path may hold any digit.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from dptrain.data.batches import DatasetSource
from dptrain.data.loaders import load_cifar10, load_dataset, load_mnist, load_npz
from dptrain.errors import DataError


def _message(info: pytest.ExceptionInfo, *paths: Path) -> str:
    text = str(info.value)
    assert "\n" not in text, text
    for path in paths:
        text = text.replace(str(path), "<path>")
    return text


def _absent(text: str, *statistics: str) -> None:
    for statistic in statistics:
        assert statistic not in text, f"{statistic!r} leaks in: {text}"


# --- IDX (MNIST) and CIFAR-10 labels --------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def _write_mnist(directory: Path, train_labels: np.ndarray) -> None:
    n = len(train_labels)
    _write_idx(directory / "train-images-idx3-ubyte.gz", np.zeros((n, 28, 28)))
    _write_idx(directory / "train-labels-idx1-ubyte.gz", train_labels)
    _write_idx(directory / "t10k-images-idx3-ubyte.gz", np.zeros((4, 28, 28)))
    _write_idx(directory / "t10k-labels-idx1-ubyte.gz", np.arange(4))


def test_an_idx_label_out_of_range_is_refused_by_the_rule_not_the_labels_range(tmp_path):
    labels = np.array([3, 4, 5, 37, 6, 7])  # range 3..37
    _write_mnist(tmp_path, labels)
    with pytest.raises(DataError) as info:
        load_mnist(tmp_path)
    text = _message(info, tmp_path)
    _absent(text, "37", "3..")
    assert "labels must be integers in 0..9" in text


def _write_cifar(directory: Path, train_labels: list) -> None:
    def batch(labels):
        return {b"labels": labels, b"data": np.zeros((len(labels), 3072), np.uint8)}

    for i in range(1, 6):
        with open(directory / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(train_labels if i == 1 else [0, 1]), f, protocol=2)
    with open(directory / "test_batch", "wb") as f:
        pickle.dump(batch([0, 1]), f, protocol=2)


@pytest.mark.parametrize(
    "labels, statistics",
    [([1, 2, 23, 4], ["23", "1.."]), ([1, "cat-41", 3], ["cat", "41", "literal"])],
    ids=["out of range", "not an integer"],
)
def test_a_cifar_label_is_refused_by_the_rule_not_its_value(tmp_path, labels, statistics):
    _write_cifar(tmp_path, labels)
    with pytest.raises(DataError) as info:
        load_cifar10(tmp_path)
    text = _message(info, tmp_path)
    _absent(text, *statistics)
    assert "integers in 0..9" in text


# --- npz ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arrays, statistics",
    [
        ({"y": np.array([0, 1, -7, 2, 0, 1, 2, 3])}, ["-7"]),  # a negative label: was "found -7"
        ({"y": np.array([0, 11, 11, 11, 1, 11, 11, 2])}, ["11", "5", "label(s)"]),  # five labels >= 4: was "holds 5"
        ({"y": np.array([0, 1, 2, 3, 0, 1, 2, 2.5])}, ["2.5"]),  # not an integer
        (  # the test labels: the same rule
            {"y": np.array([0, 1, 2, 3, 0, 1, 2, 3]), "x_test": np.zeros((3, 2)), "y_test": np.array([0, 9, 9])},
            ["9", "2 label"],
        ),
    ],
    ids=["negative", "too large", "not an integer", "test labels"],
)
def test_npz_labels_are_refused_by_the_rule_not_their_values_or_count(tmp_path, arrays, statistics):
    path = tmp_path / "data.npz"
    np.savez(path, **{"x": np.zeros((len(arrays["y"]), 2))}, **arrays)
    with pytest.raises(DataError) as info:
        load_npz(path, num_classes=4)
    text = _message(info, path)
    _absent(text, *statistics)
    assert "must hold integer class labels in [0, num_classes = 4)" in text


def test_npz_text_labels_are_refused_without_the_length_of_the_longest(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((3, 2)), y=np.array(["a", "seventeen-letters", "b"]))  # dtype <U17
    with pytest.raises(DataError) as info:
        load_npz(path, num_classes=2)
    text = _message(info, path)
    _absent(text, "17", "<U")
    assert "must hold integer class labels" in text


def test_npz_features_that_are_not_finite_are_refused_by_the_rule(tmp_path):
    path = tmp_path / "data.npz"
    x = np.zeros((6, 2))
    x[4, 1] = np.inf
    np.savez(path, x=x, y=np.array([0, 1, 0, 1, 0, 1]))
    with pytest.raises(DataError) as info:
        load_npz(path, num_classes=2)
    text = _message(info, path)
    _absent(text, "row 4", "1 value")
    assert "'x' must hold finite numbers" in text


def test_memory_mapped_npz_labels_are_refused_by_the_rule(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.array([0, 1, 13, 2]), x_test=np.zeros((2, 2)), y_test=np.array([0, 1]))
    with pytest.raises(DataError) as info:
        load_dataset("npz", str(path), num_classes=3, mmap=True)
    text = _message(info, path)
    _absent(text, "13")
    assert "'y' must hold integer class labels in [0, num_classes = 3)" in text


# --- a user's Dataset -----------------------------------------------------------------------------------------


class Items(Dataset):
    """20 good items ({"x": 3 numbers, "labels": 0}) but item 13, which is ``odd``."""

    def __init__(self, odd):
        self.odd = odd

    def __len__(self):
        return 20

    def __getitem__(self, i):
        return self.odd if i == 13 else {"x": torch.zeros(3), "labels": torch.tensor(0)}


@pytest.mark.parametrize(
    "odd, rule, statistics",
    [
        ({"x": torch.zeros(3), "secret_field": torch.zeros(1)}, "without the label key 'labels'", ["secret_field"]),
        ({"x": torch.zeros(3), "extra": torch.zeros(1), "labels": torch.tensor(0)}, "same structure", ["extra"]),
        ("a sentence", "a Dataset item must be an (inputs..., label) tuple", ["str"]),
        ({"x": torch.zeros(7), "labels": torch.tensor(0)}, "must collate into a batch", ["[7]", "entry"]),
    ],
    ids=["no label", "another structure", "not a tuple or dict", "another shape"],
)
def test_a_bad_dataset_item_is_refused_by_the_rule_not_its_index_or_content(odd, rule, statistics):
    with pytest.raises(DataError) as info:
        DatasetSource(Items(odd)).batch(torch.tensor([2, 13, 5]))
    text = _message(info)
    _absent(text, "13", "item 1", "entry 1", *statistics)
    assert rule in text


def test_a_listed_class_without_examples_is_refused_by_the_rule_not_the_count(tmp_path, capsys):
    from dptrain.cli import main
    from dptrain.data.loaders import select_classes

    path = tmp_path / "data.npz"
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1])  # class 5 of 6 has no example
    np.savez(path, x=np.zeros((len(y), 2)), y=y, x_test=np.zeros((6, 2)), y_test=np.arange(6))
    data = load_dataset("npz", str(path), num_classes=6)
    with pytest.raises(DataError) as info:
        select_classes(data, [0, 5])
    text = _message(info, path)
    _absent(text, "5", "4 ", "11", "one class")  # not which class, nor how many examples the others have
    assert "every listed class must have examples in the training data" in text
    config = tmp_path / "c.toml"
    config.write_text(
        f'[data]\nname = "npz"\npath = "{path}"\noptions = {{ num_classes = 6 }}\nclasses = [0, 5]\n'
        '[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 1.0\ndelta = 0.01\n[training]\nsteps = 2\nbatch_size = 2\n'
    )
    code = main(["train", "--config", str(config), "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "every listed class" in err
    assert not (tmp_path / "r" / "summary.json").exists()


def test_a_loss_of_the_wrong_shape_in_training_is_refused_by_the_rule_not_the_chunks_size():
    """A loss function that misbehaves only at some batch sizes passes the checks before training and is refused at a
    secret Poisson batch's chunk: the message must not quote that chunk's size (a realized batch size)."""
    import torch
    from torch import nn

    from dptrain.engine.api import make_private
    from dptrain.errors import ModelError

    x = torch.randn(400, 5, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()

    def loss_fn(outputs, labels):
        losses = nn.functional.cross_entropy(outputs, labels, reduction="none")
        return losses[:-1] if len(labels) % 5 == 3 else losses  # (not at the checks' sizes)

    model = nn.Linear(5, 2)
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0,
                           batch_size=60, max_physical_batch_size=64, loss_fn=loss_fn)
    with pytest.raises(ModelError) as caught:
        for _ in range(200):
            trainer.step()
    message = str(caught.value)
    assert "one loss per example" in message and not any(c.isdigit() for c in message), message
