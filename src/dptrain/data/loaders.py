"""Datasets for private training, read from local files only (nothing is downloaded).

Formats read:

* IDX files (the MNIST / Fashion-MNIST format), gzip-compressed (``.gz``) or plain;
* the "CIFAR-10 python version" (pickled batches ``data_batch_1..5`` and ``test_batch``),
  read with a restricted unpickler;
* scikit-learn's bundled 8x8 digits (shipped inside scikit-learn, no download);
* a synthetic Gaussian mixture generated from a seed;
* a user's ``.npz`` archive holding arrays ``x`` and ``y`` (optionally ``x_test`` and ``y_test``);
* a user's text in JSON lines or CSV files, tokenized or pre-tokenized (``text_files``: :mod:`dptrain.data.text_files`).

Images are standardized with FIXED, PUBLIC constants. Statistics are never computed from the
data: a mean or standard deviation taken over the private training set is itself a function of
every example, and releasing a model trained on it would leak information that the privacy
accounting does not cover.

Every problem caused by a user's file or parameter raises :class:`dptrain.errors.DataError`
with a one-line message naming the file and the rule it breaks, never what the data holds (a label value, the
range of the labels, the number or position of bad examples): error messages end up in logs.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.data.cifar import load_cifar10
from dptrain.data.datasets import TEN_CLASSES, ArrayDataset, DataSplit, array_dataset, labels_in_range
from dptrain.data.datasets import as_tensors as as_tensors  # (re-exported: it lived here)
from dptrain.data.memmap import load_npz_mapped
from dptrain.data.splits import array_contents, example_split
from dptrain.data.text_files import OPTIONS as TEXT_FILE_OPTIONS
from dptrain.data.text_files import TextDataset, load_text_files
from dptrain.errors import DataError, one_line

DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "digits", "synthetic", "text", "npz", "text_files")

DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

# Public normalization constants (mean, std of pixel values scaled to [0, 1]), as published
# with each dataset. Fixed in advance, never measured on the data being trained on.
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
# Digits pixels are 0..16, scaled to [0, 1] by /16. Round, data-independent constants chosen once.
DIGITS_MEAN, DIGITS_STD = 0.3, 0.4
#: Loader option ``pixels`` of the image data sets: public standardization, or values in [0, 1].
PIXEL_SCALINGS = ("standardized", "raw")

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# IDX dtype code -> big-endian numpy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def _check_fraction(test_fraction: float) -> float:
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)):
        raise DataError(f"test_fraction must be a number strictly between 0 and 1, got {test_fraction!r}")
    if not 0.0 < float(test_fraction) < 1.0:
        raise DataError(f"test_fraction must be strictly between 0 and 1, got {test_fraction!r}")
    return float(test_fraction)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _split_generated(y: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A generated data set's split: each class sends ``round(count * test_fraction)`` examples to the test set (at
    least one kept for training), chosen by the generator's own stream."""
    train_parts, test_parts = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        n_test = min(int(round(len(idx) * test_fraction)), len(idx) - 1)
        test_parts.append(idx[:n_test])
        train_parts.append(idx[n_test:])
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))


def split_examples(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, what: str):
    """Indices (train, test) of the examples, each decided by the example alone (:mod:`dptrain.data.splits`: adding
    or removing an example moves no other between the parts); both parts must hold an example."""
    train_idx, test_idx = example_split(array_contents(x, y), test_fraction, seed)
    if len(test_idx) == 0 or len(train_idx) == 0:
        raise DataError(
            f"{what}: too few examples ({len(y)}) to split off a test set of fraction {test_fraction} (split seed "
            f"{seed} sent every one to one part); give more examples, another test_fraction, or a test set"
        )
    return train_idx, test_idx


# ----------------------------------------------------------------------------------------------
# IDX (MNIST, Fashion-MNIST)
# ----------------------------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    """Whole file content, gunzipped when the name ends in .gz or the content is gzip."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz" or raw[:2] == b"\x1f\x8b":
            return gzip.decompress(raw)
        return raw
    except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as exc:
        raise DataError(f"{path}: not a readable gzip file ({one_line(exc)})") from exc


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain) into a native-endian numpy array.

    Layout: two zero bytes, a dtype code byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), a byte with the number of dimensions, one big-endian uint32 per
    dimension, then the data in big-endian row-major order.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[:2] != b"\x00\x00":
        raise DataError(f"{path}: not an IDX file (expected magic bytes 00 00 <dtype> <ndim>)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        accepted = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise DataError(f"{path}: unknown IDX dtype code 0x{code:02X} (accepted: {accepted})")
    if ndim == 0:
        raise DataError(f"{path}: IDX header declares 0 dimensions (expected at least 1)")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataError(f"{path}: truncated IDX header (expected {ndim} dimension sizes)")
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = _IDX_DTYPES[code]
    expected = math.prod(dims) * dtype.itemsize
    actual = len(data) - header_len
    if actual < expected:
        raise DataError(f"{path}: truncated IDX data: dims {dims} need {expected} bytes, found {actual}")
    if actual > expected:
        extra = actual - expected
        raise DataError(f"{path}: {extra} unexpected trailing bytes after IDX data of dims {dims}")
    array = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return array.astype(dtype.newbyteorder("="))


def _find_idx_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise DataError(f"{directory / stem}: file not found (expected {stem}.gz or {stem} in {directory})")


def _load_idx_pair(directory: Path, images_stem: str, labels_stem: str) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find_idx_file(directory, images_stem)
    labels_path = _find_idx_file(directory, labels_stem)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise DataError(f"{images_path}: expected images of shape (N, 28, 28), found {images.shape}")
    if labels.ndim != 1:
        raise DataError(f"{labels_path}: expected labels of shape (N,), found {labels.shape}")
    if len(labels) != len(images):
        raise DataError(f"{labels_path}: {len(labels)} labels for {len(images)} images in {images_path}")
    if len(labels) == 0:
        raise DataError(f"{labels_path}: no examples")
    if not labels_in_range(labels, 10):
        raise DataError(f"{labels_path}: {TEN_CLASSES}")
    return images, labels.astype(np.int64)


def _load_idx_dataset(
    directory: str | os.PathLike, name: str, title: str, mean: float, std: float, pixels: str = "standardized"
) -> DataSplit:
    directory = Path(directory)
    if not directory.is_dir():
        expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
        raise DataError(f"{directory}: directory not found (expected it to hold {expected})")
    parts = {}
    for split in ("train", "test"):
        images, labels = _load_idx_pair(directory, IDX_FILES[f"{split}_images"], IDX_FILES[f"{split}_labels"])
        # Fixed public constants: see the module docstring for why nothing is measured on the data.
        x = images.astype(np.float32) / 255.0
        if _check_pixels(pixels) == "standardized":
            x = (x - mean) / std
        parts[split] = array_dataset(x[:, None, :, :], labels, 10, name)
    description = f"{title} from {directory} ({len(parts['train'])} train / {len(parts['test'])} test)"
    return DataSplit(parts["train"], parts["test"], description)


def _check_pixels(pixels: str) -> str:
    if pixels not in PIXEL_SCALINGS:
        raise DataError(f"pixels must be one of {', '.join(PIXEL_SCALINGS)}, got {pixels!r}")
    return pixels


def load_fashion_mnist(directory: str | os.PathLike | None = None, pixels: str = "standardized") -> DataSplit:
    """Fashion-MNIST from IDX files (default directory ``/usr/share/datasets/fashion-mnist``). ``pixels``:
    "standardized" (public mean/std) or "raw" (values in [0, 1], as DPSGD-F (Sun, Suresh & Menon) feeds its linear models)."""
    if directory is None:
        directory = DEFAULT_FASHION_MNIST_DIR
    return _load_idx_dataset(
        directory, "fashion-mnist", "Fashion-MNIST", FASHION_MNIST_MEAN, FASHION_MNIST_STD, pixels
    )


def load_mnist(directory: str | os.PathLike | None, pixels: str = "standardized") -> DataSplit:
    """MNIST from IDX files in ``directory`` (required: nothing can be downloaded here)."""
    if directory is None:
        expected = ", ".join(f"{stem}[.gz]" for stem in IDX_FILES.values())
        raise DataError(f"MNIST cannot be downloaded here: pass the directory holding {expected}")
    return _load_idx_dataset(directory, "mnist", "MNIST", MNIST_MEAN, MNIST_STD, pixels)


# ----------------------------------------------------------------------------------------------
# scikit-learn digits, synthetic Gaussian mixture
# ----------------------------------------------------------------------------------------------


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> DataSplit:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), split by ``seed``."""
    from sklearn.datasets import load_digits as sklearn_digits

    test_fraction = _check_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    bunch = sklearn_digits()
    # Fixed constants (DIGITS_MEAN, DIGITS_STD): see the module docstring.
    x = ((bunch.images.astype(np.float32) / 16.0 - DIGITS_MEAN) / DIGITS_STD)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    train_idx, test_idx = split_examples(x, y, test_fraction, seed, "digits")
    train = array_dataset(x[train_idx], y[train_idx], 10, "digits")
    test = array_dataset(x[test_idx], y[test_idx], 10, "digits")
    description = f"scikit-learn digits ({len(train)} train / {len(test)} test, split seed {seed})"
    return DataSplit(train, test, description, separate_test=False)


def make_gaussian_mixture(
    n: int = 2000,
    dim: int = 20,
    num_classes: int = 2,
    separation: float = 3.0,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> DataSplit:
    """Synthetic classification: class c has mean ``separation * u_c`` (``u_c`` a random unit
    vector) and examples ``mean + N(0, I)``. Classes are balanced (sizes differ by at most one)."""
    n = _check_int("n", n, 2)
    dim = _check_int("dim", dim, 1)
    num_classes = _check_int("num_classes", num_classes, 2)
    if n < 2 * num_classes:
        raise DataError(f"n must be at least 2 * num_classes = {2 * num_classes}, got {n}")
    if isinstance(separation, bool) or not isinstance(separation, (int, float)) or not separation >= 0:
        raise DataError(f"separation must be a number >= 0, got {separation!r}")
    test_fraction = _check_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((num_classes, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    means = separation * directions
    y = rng.permutation(np.arange(n) % num_classes)
    x = means[y] + rng.standard_normal((n, dim))
    # (generated from the seed, balanced: no user's file whose neighbour could be given, so the exact split by class)
    train_idx, test_idx = _split_generated(y, test_fraction, np.random.default_rng(seed))
    train = array_dataset(x[train_idx], y[train_idx], num_classes, "synthetic")
    test = array_dataset(x[test_idx], y[test_idx], num_classes, "synthetic")
    description = (
        f"synthetic Gaussian mixture: {num_classes} classes, {dim} dims, separation {separation} "
        f"({len(train)} train / {len(test)} test, seed {seed})"
    )
    return DataSplit(train, test, description, separate_test=False)


def make_text_task(n: int = 2000, n_test: int = 500, length: int = 16, vocab: int = 32, seed: int = 0) -> DataSplit:
    """A generated text classification task (a stand-in for sentiment): sequences of ``length`` token ids in
    [1, vocab); ids 1..4 are "positive" words, 5..8 "negative" ones, the rest filler; the label is 1 when the
    sequence holds more positive than negative words (ties broken by the first polar word). Training and test
    sets are drawn separately (the test set is not split off the training examples)."""
    n, n_test = _check_int("n", n, 2), _check_int("n_test", n_test, 1)
    length, vocab = _check_int("length", length, 2), _check_int("vocab", vocab, 10)
    seed = _check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)

    def draw(count: int) -> ArrayDataset:
        ids = rng.integers(9, vocab, (count, length))
        polar = rng.random((count, length)) < 0.25  # a quarter of the words carry polarity
        ids[polar] = rng.integers(1, 9, int(polar.sum()))
        pos, neg = ((ids >= 1) & (ids <= 4)).sum(1), ((ids >= 5) & (ids <= 8)).sum(1)
        first_polar = np.where((ids >= 1) & (ids <= 8), ids, 99).min(1) <= 4
        y = np.where(pos != neg, pos > neg, first_polar).astype(np.int64)
        return ArrayDataset(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(y), 2, "text")

    train, test = draw(n), draw(n_test)
    description = f"generated text task: {length} tokens of a {vocab}-word vocabulary ({n} train / {n_test} test, seed {seed})"
    return DataSplit(train, test, description)


# ----------------------------------------------------------------------------------------------
# User .npz
# ----------------------------------------------------------------------------------------------


def _npz_labels(path: Path, key: str, y: np.ndarray, num_classes: int) -> np.ndarray:
    if y.ndim != 1:
        raise DataError(f"{path}: '{key}' must be 1-D class labels, found shape {y.shape}")
    if y.dtype.kind not in "iuf":
        raise DataError(f"{path}: '{key}' must hold integer class labels, found dtype {y.dtype.type.__name__}")
    if not labels_in_range(y, num_classes):
        raise DataError(f"{path}: '{key}' must hold integer class labels in [0, num_classes = {num_classes})")
    return y.astype(np.int64)


def _npz_features(path: Path, key: str, x: np.ndarray) -> np.ndarray:
    if x.dtype.kind not in "biuf":
        raise DataError(f"{path}: '{key}' must be a numeric array, found dtype {x.dtype.type.__name__}")
    if x.ndim < 2:
        raise DataError(f"{path}: '{key}' must have shape (N, ...) with at least 2 dims, found {x.shape}")
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise DataError(f"{path}: '{key}' must hold finite numbers (no NaN or infinity)")
    return x


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: file not found (expected an .npz archive with arrays 'x' and 'y')")
    npz_errors = (zipfile.BadZipFile, ValueError, OSError, EOFError, zlib.error)
    try:
        # allow_pickle=False: object arrays would be unpickled, which can execute code.
        archive = np.load(path, allow_pickle=False)
    except npz_errors as exc:
        raise DataError(f"{path}: not a valid .npz archive ({one_line(exc)})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: a single .npy array, expected an .npz archive with arrays 'x' and 'y'")
    try:
        with archive:
            return {key: archive[key] for key in archive.files}
    except npz_errors as exc:
        raise DataError(f"{path}: not a valid .npz archive ({one_line(exc)})") from exc


def load_npz(
    path: str | os.PathLike, num_classes: int | None = None, test_fraction: float = 0.2, seed: int = 0
) -> DataSplit:
    """A user's ``.npz`` with arrays ``x`` (N x ...) and ``y`` (N integer labels in [0, num_classes)).

    ``num_classes`` is public metadata and must be given: reading it from the labels would publish a statistic
    of the private data (the largest label) in the model's shape. With ``x_test`` and ``y_test`` also present they
    form the test set; otherwise each example goes to the test part by its own keyed hash (``seed``; about ``test_fraction`` of
    them: :mod:`dptrain.data.splits`).
    Object arrays are refused.
    """
    path = Path(path)
    if num_classes is None:
        raise DataError(
            "npz data needs data.options.num_classes (public metadata: the number of classes is not read from the "
            "private labels)"
        )
    num_classes = _check_int("num_classes", num_classes, 2)
    test_fraction = _check_fraction(test_fraction)
    seed = _check_int("seed", seed, 0)
    arrays = _read_npz(path)
    found = ", ".join(sorted(arrays)) or "none"
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(
                f"{path}: missing array '{key}' (expected x, y and optionally x_test, y_test; found {found})"
            )
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise DataError(f"{path}: 'x_test' and 'y_test' must be given together (found {found})")

    pairs = [("x", "y")] + ([("x_test", "y_test")] if "x_test" in arrays else [])
    checked = []
    for x_key, y_key in pairs:
        x = _npz_features(path, x_key, arrays[x_key])
        y = _npz_labels(path, y_key, arrays[y_key], num_classes)
        if len(x) != len(y):
            raise DataError(f"{path}: '{x_key}' has {len(x)} rows but '{y_key}' has {len(y)} labels")
        if len(x) == 0:
            raise DataError(f"{path}: '{x_key}' holds no examples")
        checked.append((x, y))
    if len(checked) == 2 and checked[0][0].shape[1:] != checked[1][0].shape[1:]:
        raise DataError(
            f"{path}: 'x_test' examples have shape {checked[1][0].shape[1:]}, "
            f"'x' examples have shape {checked[0][0].shape[1:]}"
        )

    if len(checked) == 2:
        (x_train, y_train), (x_test, y_test) = checked
        how = "given test set"
    else:
        x, y = checked[0]
        train_idx, test_idx = split_examples(x, y, test_fraction, seed, str(path))
        x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
        how = f"split seed {seed}"
    train = array_dataset(x_train, y_train, num_classes, "npz")
    test = array_dataset(x_test, y_test, num_classes, "npz")
    description = f"npz file {path} ({len(train)} train / {len(test)} test, {how})"
    return DataSplit(train, test, description, separate_test=len(checked) == 2)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def load_dataset(name: str, path: str | None = None, *, seed: int = 0, **options: Any) -> DataSplit:
    """Load dataset ``name`` (one of DATASET_NAMES) from ``path`` with loader ``options``.

    ``path`` is the directory for fashion-mnist / mnist / cifar10 and the file for npz; digits and
    synthetic take no path. ``seed`` drives the train/test split where the dataset has none.
    """
    accepted_options: dict[str, tuple[str, ...]] = {
        "fashion-mnist": ("pixels",),
        "mnist": ("pixels",),
        "cifar10": (),
        "digits": ("test_fraction",),
        "synthetic": ("n", "dim", "num_classes", "separation", "test_fraction"),
        "text": ("n", "n_test", "length", "vocab"),
        "npz": ("num_classes", "test_fraction", "mmap"),
        "text_files": TEXT_FILE_OPTIONS,
    }
    if name not in accepted_options:
        raise DataError(f"unknown dataset {name!r} (accepted: {', '.join(DATASET_NAMES)})")
    unknown = sorted(set(options) - set(accepted_options[name]))
    if unknown:
        accepted = ", ".join(accepted_options[name]) or "none"
        raise DataError(f"unknown option(s) {', '.join(unknown)} for dataset {name!r} (accepted: {accepted})")
    if name in ("digits", "synthetic", "text") and path is not None:
        raise DataError(f"dataset {name!r} takes no path, got {path!r}")

    if name == "fashion-mnist":
        return load_fashion_mnist(path, **options)
    if name == "mnist":
        return load_mnist(path, **options)
    if name == "cifar10":
        return load_cifar10(path)
    if name == "digits":
        return load_digits(seed=seed, **options)
    if name == "synthetic":
        return make_gaussian_mixture(seed=seed, **options)
    if name == "text":
        return make_text_task(seed=seed, **options)
    if name == "text_files":  # (transformers is imported only to load a tokenizer)
        return load_text_files(path, seed=seed, **options)
    if path is None:
        raise DataError("dataset 'npz' needs a path to an .npz file with arrays 'x' and 'y'")
    mmap = options.pop("mmap", False)
    if not isinstance(mmap, bool):
        raise DataError(f"data.options.mmap must be true or false, got {mmap!r}")
    if mmap:
        if options.get("num_classes") is None:
            raise DataError("npz data needs data.options.num_classes (public metadata, not read from the labels)")
        if "test_fraction" in options:
            raise DataError("data.options.test_fraction does not apply with mmap (the archive's x_test is the test set)")
        return load_npz_mapped(path, _check_int("num_classes", options["num_classes"], 2))
    return load_npz(path, seed=seed, **options)


def select_classes(split: DataSplit, classes: list[int]) -> DataSplit:
    """Keep only the examples whose label is in ``classes``, relabelled 0..k-1 in the given order (e.g. a binary
    task [2, 4] from Fashion-MNIST). A per-example filter chosen before seeing the data: no privacy cost."""
    if isinstance(split.train, TextDataset):  # (its inputs are a dict of token ids and masks)
        raise DataError("data.classes does not apply to text_files; remove it (select the rows of your files instead)")
    if not all(isinstance(getattr(ds, "x", None), torch.Tensor) and isinstance(getattr(ds, "y", None), torch.Tensor)
               for ds in (split.train, split.test)):  # (a memory-mapped set: its examples are read batch by batch)
        raise DataError("data.classes applies to data held in memory (x and y tensors), not to memory-mapped arrays; "
                        "remove it (select the rows of your arrays instead) or load them without data.options.mmap")

    def pick(ds: ArrayDataset, private: bool) -> ArrayDataset:
        keep = torch.zeros(len(ds.y), dtype=torch.bool)
        y = torch.full_like(ds.y, -1)
        for new, c in enumerate(classes):
            if not 0 <= c < ds.num_classes:
                raise DataError(
                    f"data.classes: label {c} does not exist in {ds.name} (labels 0..{ds.num_classes - 1})"
                )
            mask = ds.y == c
            if private and not mask.any():
                # (the rule, not which class or how many examples: counts of the private labels are not released)
                raise DataError(
                    "data.classes: every listed class must have examples in the training data, and a listed class has none; "
                    "list only classes the training data holds"
                )
            keep |= mask
            y[mask] = new
        if not keep.any():
            raise DataError(f"data.classes {classes} selects no example of {ds.name}")
        return ArrayDataset(ds.x[keep], y[keep], len(classes), ds.name)

    return DataSplit(
        pick(split.train, private=True),
        pick(split.test, private=False),
        f"{split.description}, classes {classes} relabelled 0..{len(classes) - 1}",
        split.separate_test,
    )
