"""CIFAR-10, "python version" (pickled batches ``data_batch_1..5`` and ``test_batch``), read with a restricted
unpickler: a pickle can run code, so only numpy arrays, numpy dtypes and builtin types are resolved."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.data.datasets import TEN_CLASSES, DataSplit, array_dataset, labels_in_range
from dptrain.errors import DataError, one_line

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_SUBDIR = "cifar-10-batches-py"



def _numpy_reconstruct() -> Callable[..., Any]:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


# Harmless builtin types a pickle may name. Functions such as eval, exec, getattr or
# __import__ are deliberately absent: naming them is how a malicious pickle runs code.
_SAFE_BUILTINS = {
    "dict": dict,
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "bytes": bytes,
    "bytearray": bytearray,
    "str": str,
    "int": int,
    "float": float,
    "complex": complex,
    "bool": bool,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only what the CIFAR-10 batches need.

    Allowed: numpy's array reconstructor, ``numpy.ndarray``, ``numpy.dtype``, the builtin types in
    ``_SAFE_BUILTINS`` and ``_codecs.encode`` (how Python 3 writes bytes at pickle protocol 2).
    Any other global is refused with a DataError before it is imported.
    """

    def __init__(self, file: Any, path: Path):
        super().__init__(file, encoding="bytes")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _numpy_reconstruct()
        if module == "numpy" and name == "ndarray":
            return np.ndarray
        if module == "numpy" and name == "dtype":
            return np.dtype
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:
            return _SAFE_BUILTINS[name]
        if module == "_codecs" and name == "encode":
            import _codecs

            return _codecs.encode
        raise DataError(
            f"{self._path}: refusing to unpickle {module}.{name} (a CIFAR-10 batch only needs numpy arrays, "
            "numpy dtypes and builtin types)"
        )


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with open(path, "rb") as f:
            batch = _RestrictedUnpickler(f, path).load()
    except DataError:
        raise
    except Exception as exc:  # any failure while decoding an untrusted file means it is corrupt
        raise DataError(f"{path}: not a readable CIFAR-10 pickle ({one_line(exc)})") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        found = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataError(f"{path}: expected a dict with keys b'data' and b'labels', found {found}")
    data, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", type(data).__name__)
        raise DataError(f"{path}: b'data' must be a uint8 array of shape (N, 3072), found {shape}")
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):  # (its message would quote the offending label)
        raise DataError(f"{path}: b'labels' must be a list of integers in 0..9 (the 10 classes)") from None
    if labels.shape != (len(data),):
        raise DataError(f"{path}: labels of shape {labels.shape} for {len(data)} images (expected one each)")
    if not labels_in_range(labels, 10):
        raise DataError(f"{path}: {TEN_CLASSES}")
    return data, labels


def _cifar_directory(directory: Path) -> Path:
    for candidate in (directory / CIFAR10_SUBDIR, directory):
        if (candidate / CIFAR10_TRAIN_FILES[0]).is_file():
            return candidate
    expected = ", ".join((*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE))
    raise DataError(
        f"{directory}: CIFAR-10 python batches not found (expected {expected} in {directory} "
        f"or in {directory / CIFAR10_SUBDIR})"
    )


def _cifar_images(data: np.ndarray) -> np.ndarray:
    # Each row is 1024 red, then 1024 green, then 1024 blue bytes, each channel row-major 32x32.
    x = data.reshape(-1, 3, 32, 32).astype(np.float32) / 255.0
    # Fixed public constants: see the module docstring for why nothing is measured on the data.
    mean = np.asarray(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return (x - mean) / std


def load_cifar10(directory: str | os.PathLike | None) -> DataSplit:
    """CIFAR-10 from the "python version" batches in ``directory`` or its ``cifar-10-batches-py``.

    Security: the batches are Python pickles, and unpickling an untrusted file can execute
    arbitrary code. Load only files you trust. As a safeguard the loader uses a restricted
    unpickler that resolves only numpy arrays, numpy dtypes and builtin types, and refuses any
    other global (e.g. ``os.system``) with a DataError.
    """
    if directory is None:
        raise DataError(
            "CIFAR-10 cannot be downloaded here: pass the directory holding data_batch_1..5 and test_batch"
        )
    root = _cifar_directory(Path(directory))
    train = [_read_cifar_batch(root / name) for name in CIFAR10_TRAIN_FILES]
    test_data, test_labels = _read_cifar_batch(root / CIFAR10_TEST_FILE)
    train_data = np.concatenate([data for data, _ in train])
    train_labels = np.concatenate([labels for _, labels in train])
    if len(train_labels) == 0 or len(test_labels) == 0:
        raise DataError(f"{root}: CIFAR-10 batches hold no training or no test examples")
    train_set = array_dataset(_cifar_images(train_data), train_labels, 10, "cifar10")
    test_set = array_dataset(_cifar_images(test_data), test_labels, 10, "cifar10")
    description = f"CIFAR-10 from {root} ({len(train_set)} train / {len(test_set)} test)"
    return DataSplit(train_set, test_set, description)
