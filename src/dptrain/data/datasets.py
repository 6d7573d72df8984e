"""The data sets a loader returns: examples held in memory (:class:`ArrayDataset`) and a training set with its test
set (:class:`DataSplit`), and :func:`as_tensors`, the (x, y) tensors of training data given in any of the in-memory
forms. The loaders (:mod:`dptrain.data.loaders` for files read into memory, :mod:`dptrain.data.memmap` for memory-mapped ones)
build them; the engine's sources (:mod:`dptrain.data.batches`) read them. torch only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from dptrain.errors import DataError


@dataclass
class ArrayDataset:
    """Examples held in memory: ``x`` float32 (N x C x H x W or N x D), ``y`` int64 labels."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def as_tensors(data) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of training data given as an :class:`ArrayDataset`, a ``TensorDataset`` or an (x, y) pair, with one
    label per example (a one-line DataError otherwise)."""
    if hasattr(data, "x") and hasattr(data, "y"):
        x, y = data.x, data.y
    elif isinstance(data, torch.utils.data.TensorDataset):
        if len(data.tensors) != 2:  # (inputs..., labels) elsewhere; these models read one input tensor
            raise DataError(
                f"this model reads one input tensor and its labels, TensorDataset(x, y); got a TensorDataset of "
                f"{len(data.tensors)} tensor(s)"
            )
        x, y = data.tensors
    elif isinstance(data, tuple | list) and len(data) == 2:
        x, y = data
    else:
        raise DataError("training data must be an ArrayDataset, a TensorDataset or an (x, y) pair of tensors")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise DataError(
            f"training data must hold one label per example: x has shape {list(x.shape)}, y has shape "
            f"{list(y.shape)}"
        )
    return x, y


@dataclass
class DataSplit:
    """A training set and its test set, as a loader returns them, with a one-line description (public facts)."""

    train: ArrayDataset
    test: ArrayDataset
    description: str
    #: False when the test set was split off the same examples as the training set (by a seed): adding or removing
    #: one example then moves others between the splits, so the test set cannot stand as public data
    separate_test: bool = True




def array_dataset(x: np.ndarray, y: np.ndarray, num_classes: int, name: str) -> ArrayDataset:
    return ArrayDataset(
        x=torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
        y=torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)),
        num_classes=num_classes,
        name=name,
    )


#: A loader refuses bad labels by naming the rule, never what the labels hold: a label value, their range or the
#: number of bad ones is a statistic of the private data, and error messages end up in logs. (A dtype is named by its
#: type, str_ and not <U7: the width of a text dtype is the length of the longest entry.)
TEN_CLASSES = "labels must be integers in 0..9 (the 10 classes)"


def labels_in_range(labels: np.ndarray, num_classes: int) -> bool:
    """Whether every label is an integer in [0, num_classes) (integer-valued floats included; vacuous when empty)."""
    if labels.dtype.kind not in "iuf":
        return False
    if labels.dtype.kind == "f" and not np.all(np.isfinite(labels) & (labels == np.round(labels))):
        return False
    return not len(labels) or bool(labels.min() >= 0 and labels.max() < num_classes)


def fingerprint(split: DataSplit) -> str:
    """SHA-256 of a data split's examples (every tensor or array a training or test set holds, with its name, dtype
    and shape, also inside a dict, list or tuple: a text data set keeps its inputs as a dict of tensors): kept with a
    run's frozen config, so that data replaced between a stop and a resume are refused
    (:func:`dptrain.runs.resume.check_data`). Secret like the data (it lives in the private checkpoint). Computed once
    per split object (about 0.1 s for Fashion-MNIST's 220 MB)."""
    cached = split.__dict__.get("_fingerprint")
    if cached is not None:
        return cached
    h = hashlib.sha256()
    for part, ds in (("train", split.train), ("test", split.test)):
        h.update(f"{part}:{type(ds).__name__}:{len(ds)}:{getattr(ds, 'num_classes', None)}".encode())
        for name, value in sorted(vars(ds).items()):
            _hash_value(h, name, value)
    split.__dict__["_fingerprint"] = h.hexdigest()
    return split.__dict__["_fingerprint"]


def _hash_value(h, name: str, value) -> None:
    """Feed ``value`` (a tensor, an array, or a dict, list or tuple of them, nested) to the hash ``h``."""
    if torch.is_tensor(value):
        value = value.detach().cpu().contiguous()
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, np.ndarray):
        h.update(f"{name}:{value.dtype.str}:{value.shape}".encode())
        h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _hash_value(h, f"{name}.{key}", value[key])
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _hash_value(h, f"{name}[{i}]", item)


__all__ = ["TEN_CLASSES", "ArrayDataset", "DataSplit", "array_dataset", "as_tensors", "fingerprint", "labels_in_range"]
