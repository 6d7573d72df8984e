"""Tests for dptrain.data.loaders: small files in the real formats are written to tmp_path."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_fashion_mnist

from dptrain.data.cifar import CIFAR10_MEAN, CIFAR10_STD, load_cifar10
from dptrain.data.loaders import (
    DATASET_NAMES,
    DIGITS_MEAN,
    DIGITS_STD,
    MNIST_MEAN,
    MNIST_STD,
    ArrayDataset,
    DataSplit,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_mnist,
    load_npz,
    make_gaussian_mixture,
    read_idx,
)
from dptrain.errors import DataError

# ----------------------------------------------------------------------------------------------
# Writers for the real formats
# ----------------------------------------------------------------------------------------------

_IDX_CODES = {
    np.uint8: 0x08,
    np.int8: 0x09,
    np.int16: 0x0B,
    np.int32: 0x0C,
    np.float32: 0x0D,
    np.float64: 0x0E,
}


def idx_bytes(array: np.ndarray) -> bytes:
    code = _IDX_CODES[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool) -> Path:
    data = idx_bytes(array)
    if compress:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def tiny_mnist_arrays(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(20) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.arange(10)[::-1].astype(np.uint8),
    }


def write_tiny_mnist(directory: Path, compress_train: bool = True, compress_test: bool = False):
    directory.mkdir(parents=True, exist_ok=True)
    arrays = tiny_mnist_arrays()
    for name, array in arrays.items():
        write_idx(directory / name, array, compress_train if name.startswith("train") else compress_test)
    return arrays


def cifar_batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"training batch",
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }


def write_tiny_cifar(directory: Path) -> dict[str, dict]:
    directory.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {name: cifar_batch(3 if name != "test_batch" else 4, seed) for seed, name in enumerate(names)}
    for name, batch in batches.items():
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
    return batches


# ----------------------------------------------------------------------------------------------
# IDX
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_roundtrip(tmp_path, dtype, compress):
    array = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    path = write_idx(tmp_path / "a-idx3", array, compress)
    out = read_idx(path)
    assert out.shape == (2, 3, 4)
    assert out.dtype == np.dtype(dtype)  # native byte order
    np.testing.assert_array_equal(out, array)


def test_read_idx_gzip_detected_without_suffix(tmp_path):
    array = np.arange(6, dtype=np.uint8)
    path = tmp_path / "labels-idx1"
    path.write_bytes(gzip.compress(idx_bytes(array)))
    np.testing.assert_array_equal(read_idx(path), array)


def test_read_idx_truncated(tmp_path):
    path = tmp_path / "truncated-idx3-ubyte"
    path.write_bytes(idx_bytes(np.zeros((4, 28, 28), np.uint8))[:-10])
    with pytest.raises(DataError, match=f"{path}.*truncated"):
        read_idx(path)


def test_read_idx_truncated_header(tmp_path):
    path = tmp_path / "short-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 8, 3, 0, 0]))
    with pytest.raises(DataError, match=f"{path}.*truncated"):
        read_idx(path)


def test_read_idx_trailing_garbage(tmp_path):
    path = tmp_path / "long-idx1-ubyte"
    path.write_bytes(idx_bytes(np.zeros(5, np.uint8)) + b"junk")
    with pytest.raises(DataError, match=f"{path}.*4 unexpected trailing bytes"):
        read_idx(path)


def test_read_idx_bad_magic(tmp_path):
    path = tmp_path / "magic-idx1-ubyte"
    data = bytearray(idx_bytes(np.zeros(5, np.uint8)))
    data[0] = 0x42
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{path}.*not an IDX file"):
        read_idx(path)


def test_read_idx_unknown_dtype(tmp_path):
    path = tmp_path / "dtype-idx1-ubyte"
    data = bytearray(idx_bytes(np.zeros(5, np.uint8)))
    data[2] = 0x0A
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{path}.*0x0A"):
        read_idx(path)


def test_read_idx_corrupt_gzip(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    good = gzip.compress(idx_bytes(np.zeros((2, 28, 28), np.uint8)))
    path.write_bytes(good[:20])  # truncated stream
    with pytest.raises(DataError, match=f"{path}.*gzip"):
        read_idx(path)
    path.write_bytes(b"this is not gzip at all")
    with pytest.raises(DataError, match=f"{path}.*gzip"):
        read_idx(path)
    bad_crc = bytearray(good)
    bad_crc[-8] ^= 0xFF
    path.write_bytes(bytes(bad_crc))
    with pytest.raises(DataError, match=f"{path}.*gzip"):
        read_idx(path)


def test_read_idx_missing_file(tmp_path):
    path = tmp_path / "nothing-here"
    with pytest.raises(DataError, match=f"{path}.*not found"):
        read_idx(path)


def test_load_mnist_tiny(tmp_path):
    arrays = write_tiny_mnist(tmp_path)
    assert (tmp_path / "train-images-idx3-ubyte.gz").exists()
    assert (tmp_path / "t10k-images-idx3-ubyte").exists()
    split = load_mnist(tmp_path)
    assert isinstance(split, DataSplit)
    assert isinstance(split.train, ArrayDataset)
    assert split.train.x.shape == (20, 1, 28, 28) and split.test.x.shape == (10, 1, 28, 28)
    assert split.train.x.dtype == torch.float32 and split.train.y.dtype == torch.int64
    assert len(split.train) == 20 and len(split.test) == 10
    assert split.train.input_shape == (1, 28, 28)
    assert split.train.num_classes == split.test.num_classes == 10
    assert split.train.name == "mnist"
    assert split.test.y.tolist() == list(range(9, -1, -1))
    assert split.train.y.tolist() == [i % 10 for i in range(20)]
    pixel = int(arrays["train-images-idx3-ubyte"][3, 5, 7])
    assert split.train.x[3, 0, 5, 7].item() == pytest.approx((pixel / 255 - MNIST_MEAN) / MNIST_STD, abs=1e-6)
    test_pixel = int(arrays["t10k-images-idx3-ubyte"][9, 27, 0])
    assert split.test.x[9, 0, 27, 0].item() == pytest.approx((test_pixel / 255 - 0.1307) / 0.3081, abs=1e-6)
    assert str(tmp_path) in split.description and "20 train / 10 test" in split.description


def test_load_mnist_prefers_existing_variant_and_fashion_constants(tmp_path):
    arrays = write_tiny_mnist(tmp_path, compress_train=False, compress_test=True)
    split = load_fashion_mnist(tmp_path)
    assert split.train.name == "fashion-mnist"
    pixel = int(arrays["train-images-idx3-ubyte"][0, 0, 0])
    assert split.train.x[0, 0, 0, 0].item() == pytest.approx((pixel / 255 - 0.2860) / 0.3530, abs=1e-6)


def test_load_mnist_needs_directory():
    with pytest.raises(DataError, match="MNIST cannot be downloaded"):
        load_mnist(None)


def test_load_mnist_missing_directory(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(DataError, match=f"{missing}.*train-images-idx3-ubyte"):
        load_mnist(missing)


def test_load_mnist_missing_file(tmp_path):
    write_tiny_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=f"{tmp_path / 't10k-labels-idx1-ubyte'}.*not found"):
        load_mnist(tmp_path)


def test_load_mnist_truncated_file_named(tmp_path):
    write_tiny_mnist(tmp_path, compress_train=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match=f"{path}.*truncated"):
        load_mnist(tmp_path)


def test_load_mnist_label_count_mismatch(tmp_path):
    write_tiny_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(19, np.uint8), compress=True)
    with pytest.raises(DataError, match="19 labels for 20 images"):
        load_mnist(tmp_path)


def test_load_mnist_bad_labels_and_shape(tmp_path):
    write_tiny_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(20, 10, np.uint8), compress=True)
    with pytest.raises(DataError, match="0..9"):
        load_mnist(tmp_path)
    write_tiny_mnist(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((10, 32, 32), np.uint8), compress=False)
    with pytest.raises(DataError, match=r"\(N, 28, 28\)"):
        load_mnist(tmp_path)


# ----------------------------------------------------------------------------------------------
# CIFAR-10
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("subdir", [False, True])
def test_load_cifar10(tmp_path, subdir):
    batch_dir = tmp_path / "cifar-10-batches-py" if subdir else tmp_path
    batches = write_tiny_cifar(batch_dir)
    split = load_cifar10(tmp_path)
    assert split.train.x.shape == (15, 3, 32, 32) and split.test.x.shape == (4, 3, 32, 32)
    assert split.train.x.dtype == torch.float32 and split.train.y.dtype == torch.int64
    assert split.train.num_classes == 10 and split.train.name == "cifar10"
    expected_train_labels = sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert split.train.y.tolist() == expected_train_labels
    assert split.test.y.tolist() == batches["test_batch"][b"labels"]
    assert str(batch_dir) in split.description

    # Channel layout: the first 1024 bytes of a row are red, row-major; then green, then blue.
    row = batches["data_batch_2"][b"data"][1]  # example index 3 + 1 = 4 overall
    for channel, (r, c) in [(0, (0, 1)), (1, (5, 31)), (2, (31, 0))]:
        raw = int(row[channel * 1024 + r * 32 + c])
        expected = (raw / 255 - CIFAR10_MEAN[channel]) / CIFAR10_STD[channel]
        assert split.train.x[4, channel, r, c].item() == pytest.approx(expected, abs=1e-5)


def test_load_cifar10_known_pixel_layout(tmp_path):
    write_tiny_cifar(tmp_path)
    batch = cifar_batch(1, 0)
    data = np.zeros((1, 3072), np.uint8)
    data[0, 33] = 255  # red channel, row 1, column 1
    data[0, 1024 + 2] = 255  # green channel, row 0, column 2
    batch[b"data"] = data
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump(batch, f, protocol=2)
    x = load_cifar10(tmp_path).test.x[0]
    low = [(0 - m) / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD, strict=True)]
    bright = (x > torch.tensor(low).reshape(3, 1, 1) + 1e-4).nonzero().tolist()
    assert bright == [[0, 1, 1], [1, 0, 2]]


def test_load_cifar10_missing(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}.*data_batch_1.*test_batch"):
        load_cifar10(tmp_path)
    with pytest.raises(DataError, match="CIFAR-10 cannot be downloaded"):
        load_cifar10(None)
    write_tiny_cifar(tmp_path)
    (tmp_path / "test_batch").unlink()
    with pytest.raises(DataError, match=f"{tmp_path / 'test_batch'}.*not found"):
        load_cifar10(tmp_path)


def test_load_cifar10_truncated_pickle(tmp_path):
    write_tiny_cifar(tmp_path)
    path = tmp_path / "data_batch_3"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match=f"{path}.*not a readable CIFAR-10 pickle"):
        load_cifar10(tmp_path)


def test_load_cifar10_garbage_file(tmp_path):
    write_tiny_cifar(tmp_path)
    path = tmp_path / "test_batch"
    path.write_bytes(b"\x00\x01garbage")
    with pytest.raises(DataError, match=f"{path}"):
        load_cifar10(tmp_path)


def test_load_cifar10_wrong_content(tmp_path):
    write_tiny_cifar(tmp_path)
    path = tmp_path / "data_batch_1"
    batch = cifar_batch(3, 0)
    del batch[b"labels"]
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=f"{path}.*b'labels'"):
        load_cifar10(tmp_path)
    batch = cifar_batch(3, 0)
    batch[b"data"] = np.zeros((3, 1024), np.uint8)
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=rf"{path}.*\(N, 3072\)"):
        load_cifar10(tmp_path)
    batch = cifar_batch(3, 0)
    batch[b"labels"] = [0, 1]
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=f"{path}.*one each"):
        load_cifar10(tmp_path)


class _Evil:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _EvilEval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_load_cifar10_refuses_malicious_pickle(tmp_path):
    write_tiny_cifar(tmp_path)
    marker = tmp_path / "pwned"
    batch = cifar_batch(3, 0)
    batch[b"batch_label"] = _Evil(f"touch {marker}")
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=f"{path}.*refusing to unpickle.*system"):
        load_cifar10(tmp_path)
    assert not marker.exists()


def test_load_cifar10_refuses_builtin_eval(tmp_path):
    write_tiny_cifar(tmp_path)
    path = tmp_path / "test_batch"
    batch = cifar_batch(3, 0)
    batch[b"filenames"] = _EvilEval()
    path.write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=r"refusing to unpickle (__builtin__|builtins)\.eval"):
        load_cifar10(tmp_path)


@pytest.mark.parametrize("fix_imports", [True, False])
def test_load_cifar10_global_spellings(tmp_path, fix_imports):
    """numpy 1 files name numpy.core.multiarray; builtins appear as __builtin__ or builtins."""
    write_tiny_cifar(tmp_path)
    path = tmp_path / "test_batch"
    batch = cifar_batch(2, 0)
    batch[b"extra"] = {1, 2}  # a global reference to the builtin set type
    data = pickle.dumps(batch, protocol=2, fix_imports=fix_imports)
    builtins_module = b"__builtin__" if fix_imports else b"builtins"
    assert b"numpy._core.multiarray" in data and b"c" + builtins_module + b"\nset" in data
    path.write_bytes(data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    split = load_cifar10(tmp_path)
    assert split.test.y.tolist() == batch[b"labels"]


# ----------------------------------------------------------------------------------------------
# digits, synthetic
# ----------------------------------------------------------------------------------------------


def test_load_digits():
    split = load_digits(seed=0)
    assert split.train.x.shape[1:] == (1, 8, 8) and split.test.x.shape[1:] == (1, 8, 8)
    assert len(split.train) + len(split.test) == 1797
    assert len(split.test) == pytest.approx(0.2 * 1797, abs=60)  # (each example's own coin: sd 17)
    assert split.train.num_classes == 10 and split.train.name == "digits"
    assert set(split.train.y.tolist()) == set(range(10)) and set(split.test.y.tolist()) == set(range(10))
    assert split.train.x.dtype == torch.float32 and split.train.y.dtype == torch.int64
    # Pixels 0..16 map to (v/16 - mean)/std with the fixed constants.
    assert split.train.x.min().item() == pytest.approx((0 - DIGITS_MEAN) / DIGITS_STD, abs=1e-6)
    assert split.train.x.max().item() == pytest.approx((1 - DIGITS_MEAN) / DIGITS_STD, abs=1e-6)

    again = load_digits(seed=0)
    assert torch.equal(split.train.x, again.train.x) and torch.equal(split.test.y, again.test.y)
    other = load_digits(seed=1)
    assert not torch.equal(split.train.x, other.train.x)


def test_load_digits_bad_fraction():
    with pytest.raises(DataError, match="test_fraction"):
        load_digits(test_fraction=1.5)


def test_gaussian_mixture_deterministic_and_balanced():
    a = make_gaussian_mixture(n=1000, dim=5, num_classes=4, seed=3)
    b = make_gaussian_mixture(n=1000, dim=5, num_classes=4, seed=3)
    c = make_gaussian_mixture(n=1000, dim=5, num_classes=4, seed=4)
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.train.x, c.train.x)
    assert a.train.x.shape == (800, 5) and a.test.x.shape == (200, 5)
    assert a.train.x.dtype == torch.float32 and a.train.y.dtype == torch.int64
    assert a.train.num_classes == 4 and a.train.name == "synthetic"
    counts = torch.bincount(torch.cat([a.train.y, a.test.y]), minlength=4)
    assert counts.tolist() == [250, 250, 250, 250]
    test_counts = torch.bincount(a.test.y, minlength=4).float() / len(a.test)
    assert torch.all((test_counts - 0.25).abs() < 0.05)


def test_gaussian_mixture_separable():
    split = make_gaussian_mixture(n=2000, dim=20, num_classes=3, separation=5.0, seed=0)
    means = torch.stack([split.train.x[split.train.y == k].mean(0) for k in range(3)])
    predicted = torch.cdist(split.test.x, means).argmin(1)
    accuracy = (predicted == split.test.y).float().mean().item()
    assert accuracy > 0.9


def test_gaussian_mixture_zero_separation_not_separable():
    split = make_gaussian_mixture(n=2000, dim=20, num_classes=2, separation=0.0, seed=0)
    means = torch.stack([split.train.x[split.train.y == k].mean(0) for k in range(2)])
    accuracy = (torch.cdist(split.test.x, means).argmin(1) == split.test.y).float().mean().item()
    assert accuracy < 0.65


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n": 0}, "n must be"),
        ({"dim": 0}, "dim must be"),
        ({"num_classes": 1}, "num_classes must be"),
        ({"separation": -1.0}, "separation"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"seed": -1}, "seed"),
        ({"n": 3, "num_classes": 2}, "at least 2 \\* num_classes"),
    ],
)
def test_gaussian_mixture_bad_parameters(kwargs, match):
    with pytest.raises(DataError, match=match):
        make_gaussian_mixture(**kwargs)


# ----------------------------------------------------------------------------------------------
# npz
# ----------------------------------------------------------------------------------------------


def test_load_npz_split(tmp_path):
    path = tmp_path / "data.npz"
    x = np.arange(100 * 3, dtype=np.float64).reshape(100, 3)
    y = np.arange(100) % 3
    np.savez(path, x=x, y=y)
    split = load_npz(path, num_classes=3, test_fraction=0.2, seed=1)
    assert len(split.train) + len(split.test) == 100
    assert 8 <= len(split.test) <= 32  # (each example's own coin: sd 4)
    assert split.train.x.dtype == torch.float32 and split.train.y.dtype == torch.int64
    assert split.train.input_shape == (3,) and split.train.num_classes == 3 and split.train.name == "npz"
    # Rows stay paired with their labels.
    for ds in (split.train, split.test):
        rows = (ds.x[:, 0] / 3).long()
        assert torch.equal(rows % 3, ds.y)
    assert torch.equal(load_npz(path, num_classes=3, seed=1).test.x, split.test.x)
    assert str(path) in split.description


def test_adding_an_example_to_a_file_moves_no_other_example_between_the_parts(tmp_path):
    """The certificate is under add/remove-one adjacency on the file the user gives: the training part of the file
    with one more example must be the training part without it, plus at most that example. A seeded permutation (the
    stratified split used before) moved 26 other examples each way for 600 examples of two classes."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((600, 3)), np.arange(600) % 2
    extra_x, extra_y = rng.standard_normal((1, 3)), np.array([1])
    for i, (xs, ys) in enumerate([(x, y), (np.concatenate([x[:300], extra_x, x[300:]]),
                                          np.concatenate([y[:300], extra_y, y[300:]]))]):
        np.savez(tmp_path / f"{i}.npz", x=xs, y=ys)
    small, big = (load_npz(tmp_path / f"{i}.npz", num_classes=2, seed=3) for i in (0, 1))
    rows = [{tuple(r) for r in part.x.tolist()} for part in (small.train, big.train, small.test, big.test)]
    added = {tuple(r) for r in torch.from_numpy(extra_x).float().tolist()}
    assert rows[1] - added == rows[0] and rows[3] - added == rows[2]
    assert rows[1] | rows[3] == rows[0] | rows[2] | added
    assert 90 <= len(small.test) <= 150  # (about test_fraction = 0.2 of the 600, each example's own coin)
    # the same holds for a text file without a test file (its split is the same mechanism)
    from dptrain.data.text_files import load_text_files

    lines = [{"input_ids": [int(t) for t in rng.integers(1, 9, 4)], "label": int(k % 2)} for k in range(200)]
    for i, rows_ in enumerate([lines, lines[:100] + [{"input_ids": [9, 9, 9, 9], "label": 0}] + lines[100:]]):
        (tmp_path / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    small, big = (load_text_files(tmp_path / f"{i}.jsonl", vocab_size=10, max_length=4, seed=1) for i in (0, 1))
    ids = [{tuple(r) for r in part.x["input_ids"].tolist()} for part in (small.train, big.train)]
    assert ids[1] - {(9, 9, 9, 9)} == ids[0]


def test_a_file_of_many_duplicate_rows_is_split_at_about_test_fraction_and_stays_neighbouring(tmp_path):
    """Duplicates used to share one coin (the hash of their content): a file of a few distinct rows, each repeated
    (categorical features, repeated short texts), sent whole groups to one part, so the test part held 0, a half or
    every row and was refused as too small. Copy k of a content has its own coin (the content's hash with k): the
    parts are about test_fraction of the rows, and a file with one more copy has a training part with at most that
    copy more (copies are interchangeable: only how many of each go to each part matters)."""
    x, y = np.repeat(np.array([[0.0, 1.0], [1.0, 0.0]]), 100, axis=0), np.repeat(np.array([0, 1]), 100)
    np.savez(tmp_path / "0.npz", x=x, y=y)
    np.savez(tmp_path / "1.npz", x=np.concatenate([x[:50], x[150:151], x[50:]]), y=np.concatenate([y[:50], [1], y[50:]]))
    small, big = (load_npz(tmp_path / f"{i}.npz", num_classes=2, seed=0) for i in (0, 1))
    assert 20 <= len(small.test) <= 60 and set(small.test.y.tolist()) == {0, 1}  # (each copy's own coin: sd 6)
    counts = [[int((part.y == c).sum()) for c in (0, 1)] for part in (small.train, big.train, small.test, big.test)]
    assert counts[1][0] == counts[0][0] and counts[3][0] == counts[2][0]  # (no copy of the other row moved)
    assert (counts[1][1] - counts[0][1], counts[3][1] - counts[2][1]) in ((1, 0), (0, 1))


def test_load_npz_with_test_set(tmp_path):
    path = tmp_path / "data.npz"
    x = np.zeros((6, 2, 4, 4), np.uint8)
    np.savez_compressed(
        path, x=x, y=np.array([0, 1, 2, 0, 1, 2]), x_test=np.ones((2, 2, 4, 4)), y_test=np.array([4.0, 0.0])
    )
    split = load_npz(path, num_classes=5)
    assert split.train.x.shape == (6, 2, 4, 4) and split.test.x.shape == (2, 2, 4, 4)
    assert split.train.num_classes == split.test.num_classes == 5  # from the config, not from the labels
    assert split.test.y.tolist() == [4, 0]


def test_npz_class_count_is_public_metadata_not_read_from_labels(tmp_path):
    # The class count comes from the config: a huge private label is refused, not turned into a 10^9-class model.
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((4, 2)), y=np.array([0, 1, 10**9, 1]))
    with pytest.raises(DataError, match="num_classes"):
        load_npz(path)
    with pytest.raises(DataError, match=r"integer class labels in \[0, num_classes = 3\)") as info:
        load_npz(path, num_classes=3)
    assert "1000000000" not in str(info.value)  # (the rule, not the label)
    np.savez(path, x=np.arange(40.0).reshape(20, 2), y=np.arange(20) % 2)  # (distinct examples: both parts hold some)
    assert load_npz(path, num_classes=7, test_fraction=0.5).train.num_classes == 7


def test_load_npz_missing_key(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, features=np.zeros((4, 2)), y=np.zeros(4))
    with pytest.raises(DataError, match=f"{path}.*missing array 'x'.*found features, y"):
        load_npz(path, num_classes=2)


def test_load_npz_missing_file(tmp_path):
    path = tmp_path / "absent.npz"
    with pytest.raises(DataError, match=f"{path}.*not found"):
        load_npz(path, num_classes=2)


def test_load_npz_corrupt(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((10, 2)), y=np.arange(10) % 2)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DataError, match=f"{path}.*not a valid .npz"):
        load_npz(path, num_classes=2)
    path.write_bytes(b"plain text, not an archive")
    with pytest.raises(DataError, match=f"{path}.*not a valid .npz"):
        load_npz(path, num_classes=2)


def test_load_npz_single_npy(tmp_path):
    path = tmp_path / "data.npy"
    np.save(path, np.zeros((4, 2)))
    with pytest.raises(DataError, match=f"{path}.*single .npy"):
        load_npz(path, num_classes=2)


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"x": np.zeros((4, 2)), "y": np.zeros(3)}, "4 rows but 'y' has 3"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1.5, 0, 1])}, "integer class labels"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, -1, 0, 1])}, r"integer class labels in \[0, num_classes = 2\)"),
        ({"x": np.zeros((4, 2)), "y": np.array(["a", "b", "a", "b"])}, "integer class labels"),
        ({"x": np.zeros(4), "y": np.array([0, 1, 0, 1])}, "at least 2 dims"),
        ({"x": np.full((4, 2), np.nan), "y": np.array([0, 1, 0, 1])}, "NaN"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 1]), "x_test": np.zeros((2, 2))}, "together"),
        (
            {"x": np.zeros((4, 2)), "y": [0, 1, 0, 1], "x_test": np.zeros((2, 3)), "y_test": [0, 1]},
            "shape",
        ),
    ],
)
def test_load_npz_bad_content(tmp_path, arrays, match):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError, match=match) as info:
        load_npz(path, num_classes=2)
    assert str(path) in str(info.value)


def test_load_npz_refuses_object_arrays(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.array([[1], [2]], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DataError, match=str(path)):
        load_npz(path, num_classes=2)


# ----------------------------------------------------------------------------------------------
# load_dataset
# ----------------------------------------------------------------------------------------------


def test_load_dataset_unknown_name():
    with pytest.raises(DataError, match="unknown dataset 'imagenet'.*fashion-mnist, mnist, cifar10"):
        load_dataset("imagenet")


def test_load_dataset_unknown_option():
    with pytest.raises(DataError, match="unknown option.*batch_size.*accepted: n, dim"):
        load_dataset("synthetic", batch_size=3)
    with pytest.raises(DataError, match="unknown option.*test_fraction.*accepted: pixels"):
        load_dataset("mnist", "/tmp", test_fraction=0.1)
    with pytest.raises(DataError, match="unknown option.*test_fraction.*accepted: none"):
        load_dataset("cifar10", "/tmp", test_fraction=0.1)


def test_idx_pixels_option(tmp_path):
    """pixels = "raw" gives values in [0, 1]; the default standardizes with the public constants."""
    from dptrain.data.loaders import FASHION_MNIST_MEAN, FASHION_MNIST_STD

    write_tiny_mnist(tmp_path)
    raw = load_dataset("fashion-mnist", str(tmp_path), pixels="raw")
    std = load_dataset("fashion-mnist", str(tmp_path))
    assert 0.0 <= float(raw.train.x.min()) < 0.01 and 0.99 < float(raw.train.x.max()) <= 1.0
    assert torch.allclose(std.train.x, (raw.train.x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD)
    with pytest.raises(DataError, match="pixels must be one of standardized, raw"):
        load_dataset("fashion-mnist", str(tmp_path), pixels="centered")


def test_load_dataset_dispatch(tmp_path):
    synthetic = load_dataset("synthetic", seed=5, n=100, dim=3, num_classes=2)
    assert torch.equal(synthetic.train.x, make_gaussian_mixture(n=100, dim=3, num_classes=2, seed=5).train.x)
    digits = load_dataset("digits", seed=2, test_fraction=0.5)
    assert torch.equal(digits.test.y, load_digits(test_fraction=0.5, seed=2).test.y)
    write_tiny_mnist(tmp_path / "mnist")
    assert load_dataset("mnist", str(tmp_path / "mnist")).train.name == "mnist"
    write_tiny_cifar(tmp_path / "cifar")
    assert load_dataset("cifar10", str(tmp_path / "cifar")).train.input_shape == (3, 32, 32)
    np.savez(tmp_path / "d.npz", x=np.arange(20.0).reshape(10, 2), y=np.arange(10) % 2)  # (distinct examples)
    assert load_dataset("npz", str(tmp_path / "d.npz"), test_fraction=0.4, num_classes=2).train.num_classes == 2
    with pytest.raises(DataError, match="needs a path"):
        load_dataset("npz")
    with pytest.raises(DataError, match="takes no path"):
        load_dataset("digits", "/some/where")
    text = load_dataset("text", seed=3, n=50, n_test=20, length=6, vocab=12)
    assert text.train.x.dtype == torch.int64 and text.train.input_shape == (6,) and text.separate_test
    assert int(text.train.x.min()) >= 1 and int(text.train.x.max()) < 12
    # the label is the majority polarity: ids 1..4 positive, 5..8 negative
    x, y = text.train.x, text.train.y
    pos, neg = ((x >= 1) & (x <= 4)).sum(1), ((x >= 5) & (x <= 8)).sum(1)
    assert torch.equal(y[pos != neg], (pos > neg)[pos != neg].long())
    assert set(DATASET_NAMES) == {"fashion-mnist", "mnist", "cifar10", "digits", "synthetic", "text", "npz", "text_files"}


def test_error_messages_are_one_line(tmp_path):
    path = tmp_path / "bad.gz"
    path.write_bytes(b"\x1f\x8b\x08garbage\nwith newline")
    with pytest.raises(DataError) as info:
        read_idx(path)
    assert "\n" not in str(info.value)


@needs_fashion_mnist
def test_load_dataset_fashion_mnist_real():
    split = load_dataset("fashion-mnist")
    assert len(split.train) == 60000 and len(split.test) == 10000
    assert split.train.num_classes == 10
    assert split.train.x.shape == (60000, 1, 28, 28)
    assert set(split.test.y.unique().tolist()) == set(range(10))
    # The public constants standardize the real data to roughly zero mean and unit variance.
    assert abs(split.train.x.mean().item()) < 0.01 and abs(split.train.x.std().item() - 1) < 0.01
    assert split.description == "Fashion-MNIST from /usr/share/datasets/fashion-mnist (60000 train / 10000 test)"
