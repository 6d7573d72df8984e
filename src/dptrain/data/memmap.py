"""Training data that does not fit in memory: memory-mapped ``.npz`` members and IDX files as map-style Datasets.

The arrays stay on disk; the engine reads only the examples of each batch (:class:`dptrain.data.batches.DatasetSource`).

- :func:`npz_dataset`: arrays ``x`` and ``y`` (or ``x_test`` and ``y_test``) of an ``.npz`` archive written by
  ``numpy.savez`` (members stored, not compressed: ``savez_compressed`` archives cannot be mapped and are refused).
- :func:`idx_dataset`: an images IDX file and a labels IDX file (the MNIST / Fashion-MNIST format), uncompressed
  (gunzip ``.gz`` files first; :func:`dptrain.data.loaders.read_idx` reads those into memory instead).

numpy and torch only.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from dptrain.data.datasets import ArrayDataset, DataSplit
from dptrain.errors import DataError

# IDX dtype code -> big-endian numpy dtype (the format's byte order)
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class ArraysDataset(Dataset):
    """(inputs[i], labels[i]) items of two arrays of equal length (memory-mapped or not), as torch tensors in
    native byte order; ``__getitems__`` reads a batch with one indexing per array."""

    def __init__(self, inputs: np.ndarray, labels: np.ndarray, name: str = "arrays"):
        if len(inputs) != len(labels):
            raise DataError(f"{name}: {len(inputs)} examples but {len(labels)} labels")
        if labels.ndim != 1:
            raise DataError(f"{name}: labels must be one number per example, got shape {labels.shape}")
        self.inputs, self.labels, self.name = inputs, labels, name

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def _tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=a.dtype.newbyteorder("="), order="C", copy=True))  # off the map

    def __getitem__(self, i: int):
        return self._tensor(np.asarray(self.inputs[i])), self._tensor(np.asarray(self.labels[i]))

    def __getitems__(self, indices: list[int]):
        x = self._tensor(np.asarray(self.inputs[indices]))
        y = self._tensor(np.asarray(self.labels[indices]))
        return list(zip(x, y, strict=True))


class MappedArrays(ArraysDataset):
    """A memory-mapped training set as the config path uses it: float32 inputs, int64 labels, with the public
    metadata a data set carries (``num_classes``, ``name``, ``input_shape``)."""

    def __init__(self, inputs: np.ndarray, labels: np.ndarray, num_classes: int, name: str):
        super().__init__(inputs, labels, name)
        self.num_classes = num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.inputs.shape[1:])

    @staticmethod
    def _tensor(a: np.ndarray) -> torch.Tensor:
        kind = np.float32 if a.dtype.kind == "f" or a.ndim else np.int64  # (labels are 0-dim per item)
        return torch.from_numpy(np.array(a, dtype=kind, order="C", copy=True))

    def __getitems__(self, indices: list[int]):
        x = torch.from_numpy(np.array(self.inputs[indices], dtype=np.float32, order="C"))
        y = torch.from_numpy(np.array(self.labels[indices], dtype=np.int64))
        return list(zip(x, y, strict=True))


def load_npz_mapped(path: str | os.PathLike, num_classes: int):
    """``data.name = "npz"`` with ``options = { mmap = true }``: the training arrays ``x``, ``y`` memory-mapped (read
    batch by batch), the test arrays ``x_test``, ``y_test`` (required: a test set split off a mapped training set is
    not supported) read into memory. The labels are checked against ``num_classes`` (they are read; the inputs are
    not)."""
    path = Path(path)
    x, y = memmap_npz_member(path, "x"), memmap_npz_member(path, "y")
    try:
        xt, yt = memmap_npz_member(path, "x_test"), memmap_npz_member(path, "y_test")
    except DataError:
        raise DataError(
            f"{path}: data.options.mmap needs the test arrays 'x_test' and 'y_test' in the archive (a test set split "
            "off a memory-mapped training set is not supported)"
        ) from None
    for name, labels in (("y", y), ("y_test", yt)):
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise DataError(
                f"{path}: '{name}' must be integer labels of shape (N,), found {labels.dtype.type.__name__} {labels.shape}"
            )
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):  # (the rule, not the labels)
            raise DataError(f"{path}: '{name}' must hold integer class labels in [0, num_classes = {num_classes})")
    if x.ndim < 2 or x.shape[1:] != xt.shape[1:] or x.dtype.kind not in "fiu":
        raise DataError(f"{path}: 'x' and 'x_test' must be numeric arrays (N, ...) of the same example shape")
    for name, inputs in (("x", x), ("x_test", xt)):
        _check_finite(path, name, inputs)
    train = MappedArrays(x, y, num_classes, "npz")
    test = ArrayDataset(
        torch.from_numpy(np.array(xt, dtype=np.float32)), torch.from_numpy(np.array(yt, dtype=np.int64)), num_classes,
        "npz",
    )
    return DataSplit(train, test, f"npz file {path} ({len(train)} train, memory-mapped / {len(test)} test)")


#: Bytes of a mapped array read at a time by :func:`_check_finite`.
CHECK_BYTES = 64 * 2**20


def _check_finite(path: Path, name: str, inputs: np.ndarray) -> None:
    """Refuse inputs with a NaN or an infinity as training reads them (float32: a float64 beyond 3.4e38 is inf there),
    block by block, before the first step: a non-finite row met at a late step would stop the run at a moment that
    depends on the data (and label it not private), and one in the test set would make its accuracy meaningless.
    One read of the file, like its fingerprint's."""
    if inputs.dtype.kind != "f":
        return
    rows = max(1, CHECK_BYTES // max(1, inputs[:1].nbytes))
    for start in range(0, len(inputs), rows):
        if not np.isfinite(np.asarray(inputs[start : start + rows], dtype=np.float32)).all():
            raise DataError(f"{path}: '{name}' must hold finite numbers (no NaN or infinity)")


def memmap_npz_member(path: str | os.PathLike, key: str) -> np.memmap:
    """The array ``key`` of an uncompressed ``.npz`` archive, memory-mapped (read-only)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as zf:
            try:
                info = zf.getinfo(f"{key}.npy")
            except KeyError:
                found = ", ".join(n.removesuffix(".npy") for n in zf.namelist()) or "none"
                raise DataError(f"{path}: no array {key!r} (found {found})") from None
            if info.compress_type != zipfile.ZIP_STORED:
                raise DataError(
                    f"{path}: array {key!r} is compressed (numpy.savez_compressed); memory mapping needs an archive "
                    "written by numpy.savez"
                )
            with open(path, "rb") as f:
                f.seek(info.header_offset)
                local = f.read(30)
                if local[:4] != b"PK\x03\x04":
                    raise DataError(f"{path}: corrupt zip entry for {key!r}")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                f.seek(start)
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = read_header(f)
                offset = f.tell()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npz archive ({' '.join(str(e).split())})") from None
    if dtype.hasobject:
        raise DataError(f"{path}: array {key!r} holds Python objects; only numeric arrays are read")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def npz_dataset(path: str | os.PathLike, split: str = "train") -> ArraysDataset:
    """Arrays ``x``, ``y`` (``split="train"``) or ``x_test``, ``y_test`` (``"test"``) of an ``.npz`` archive,
    memory-mapped."""
    if split not in ("train", "test"):
        raise DataError(f"split must be 'train' or 'test', got {split!r}")
    suffix = "" if split == "train" else "_test"
    x, y = memmap_npz_member(path, f"x{suffix}"), memmap_npz_member(path, f"y{suffix}")
    return ArraysDataset(x, y, str(path))


def memmap_idx(path: str | os.PathLike) -> np.memmap:
    """An uncompressed IDX file, memory-mapped (big-endian, as stored)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with open(path, "rb") as f:
        head = f.read(4)
        if head[:2] == b"\x1f\x8b":
            raise DataError(f"{path}: gzip-compressed; memory mapping needs the plain IDX file (gunzip it)")
        if len(head) < 4 or head[:2] != b"\x00\x00" or head[2] not in _IDX_DTYPES or head[3] == 0:
            raise DataError(f"{path}: not an IDX file (expected magic bytes 00 00 <dtype> <ndim>)")
        ndim = head[3]
        dims_raw = f.read(4 * ndim)
        if len(dims_raw) < 4 * ndim:
            raise DataError(f"{path}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", dims_raw)
    dtype = np.dtype(_IDX_DTYPES[head[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if path.stat().st_size - offset != expected:
        raise DataError(
            f"{path}: IDX data of dims {dims} needs {expected} bytes, the file holds {path.stat().st_size - offset}"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=dims)


def idx_dataset(images: str | os.PathLike, labels: str | os.PathLike) -> ArraysDataset:
    """An images IDX file and its labels IDX file, memory-mapped, as (image, label) items."""
    return ArraysDataset(memmap_idx(images), memmap_idx(labels), str(images))


__all__ = [
    "ArraysDataset",
    "MappedArrays",
    "idx_dataset",
    "load_npz_mapped",
    "memmap_idx",
    "memmap_npz_member",
    "npz_dataset",
]
