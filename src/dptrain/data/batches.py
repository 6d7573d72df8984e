"""Training examples of any structure, in memory or read through a ``torch.utils.data.Dataset``.

An example's *inputs* are a tensor, a tuple/list of tensors, or a dict of tensors (a pytree); its label is one
tensor. Conventions (docs/python_api.md, "Data of any shape"):

- a batch of tuple inputs is passed to the model as positional arguments, a dict batch as keyword arguments;
- a map-style Dataset item is ``(inputs..., label)`` (a tuple or list whose last element is the label) or a dict
  whose ``label_key`` entry (default ``"labels"``) is the label and whose other entries are the inputs;
- ``loss_fn(outputs, labels)`` returns one loss per example.

A :class:`Source` gives the engine what it needs: the number of examples, a batch of given indices (collated with
torch's ``default_collate`` for Datasets, indexed for tensors), and one example's structure (the independence
probe's shapes). Nothing here reads more than the examples of the batch asked for.

A ``torch.utils.data.DataLoader`` is read through its dataset and its ``collate_fn`` (:func:`loader_source`): its
sampler, batch size, shuffling and workers are replaced by dptrain's secret batch sampling, which
:class:`SamplerReplacedWarning` says once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_structure

from dptrain.data.datasets import ArrayDataset
from dptrain.errors import DataError

Inputs = Any  # a tensor, or a tuple/list/dict of tensors


def call_model(model: Callable, inputs: Inputs):
    """``model(x)``, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple | list):
        return model(*inputs)
    return model(inputs)


def batch_len(inputs: Inputs) -> int:
    """The batch dimension shared by every tensor of ``inputs``."""
    leaves = tree_flatten(inputs)[0]
    if not leaves:
        raise DataError("a batch holds no tensor")
    sizes = {int(t.shape[0]) if t.dim() else -1 for t in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise DataError(
            f"every input of a batch must have the same first (batch) dimension, got sizes {sorted(sizes)}; an input "
            "packing all the examples' rows into one (Qwen2-VL's pixel_values, a padding-free collator's tokens) "
            "cannot be split by example: give each example its own rows ([examples, rows, ...], padded) and flatten "
            "them in a wrapper module's forward"
        )
    return sizes.pop()


def take(inputs: Inputs, idx: torch.Tensor) -> Inputs:
    """The examples ``idx`` (a 1-D integer tensor) of a batch. index_select copies whole rows: for 1,024 random rows of
    60,000 28x28 images it takes 0.26 ms where ``t[idx]`` (advanced indexing, element by element) takes 0.68 ms
    (``python benchmarks/micro.py gather``, 2026-11-25)."""
    if torch.is_tensor(inputs):  # (the pytree machinery costs more than the copy for a small batch)
        return inputs.index_select(0, idx)
    return tree_map(lambda t: t.index_select(0, idx), inputs)


def copied(batch):
    """Every tensor of a batch (inputs, labels, or both) copied: what a pass that may write its inputs in place gets,
    so that the batch as drawn is still there for the passes compared with it (a model centering its input in place,
    ``x.sub_(x.mean(0))``, would otherwise hand every later pass the centered rows, and its examples alone would
    agree with the mixed batch)."""
    return tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, batch)


def unsqueezed(inputs: Inputs) -> Inputs:
    """One example as a batch of one."""
    return tree_map(lambda t: t.unsqueeze(0), inputs)


def probe_like(inputs: Inputs, n: int, generator: torch.Generator) -> Inputs:
    """A batch of ``n`` public synthetic examples with the structure, shapes and dtypes of ``inputs`` (a batch):
    standard normals for floating tensors, 0/1 for integer and boolean ones (valid token ids, masks)."""

    def probe(t: torch.Tensor) -> torch.Tensor:  # drawn on the CPU (the generator's), then moved to t's device
        shape = (n, *t.shape[1:])
        if t.dtype.is_floating_point:
            out = torch.randn(shape, generator=generator, dtype=t.dtype, device="cpu")
        elif t.dtype == torch.bool:
            out = torch.randint(0, 2, shape, generator=generator, device="cpu").bool()
        else:
            out = torch.randint(0, 2, shape, generator=generator, dtype=t.dtype, device="cpu")
        return out.to(t.device)

    return tree_map(probe, inputs)


def with_first_replaced(inputs: Inputs, other: Inputs) -> Inputs:
    """A copy of the batch ``inputs`` whose example 0 is example 0 of ``other``."""

    def replace(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = a.clone()
        out[0] = b[0]
        return out

    return tree_map(replace, inputs, other)


class TensorSource:
    """Examples held in memory: inputs (a tensor or a pytree of tensors) and labels indexed by example."""

    def __init__(self, inputs: Inputs, labels: torch.Tensor):
        n = batch_len(inputs)
        if labels.dim() == 0 or labels.shape[0] != n:
            raise DataError(
                f"training data must hold one label per example: {n} examples, labels of shape {list(labels.shape)}"
            )
        # NaN is never data (an infinity may be: an additive attention mask): refused before the first step, not at the
        # step that first samples its example (a moment that depends on the data: the run would be labelled not private)
        for name, leaves in (("inputs", tree_flatten(inputs)[0]), ("labels", [labels])):
            if any(torch.is_tensor(t) and (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any())
                   for t in leaves):
                raise DataError(f"the data's {name} hold NaN (an example with NaN can be neither trained on nor evaluated): "
                                "clean or drop those examples (NaN marking missing values: fill them with a finite "
                                "value and pass a mask of them as an input the model reads)")
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, idx: torch.Tensor) -> tuple[Inputs, torch.Tensor]:
        return take(self.inputs, idx), self.labels.index_select(0, idx)

    def example(self) -> tuple[Inputs, torch.Tensor]:
        """One example as a batch of one (its structure, shapes and dtypes)."""
        return self.batch(torch.arange(1, device="cpu"))


class DatasetSource:
    """Examples read through a map-style ``torch.utils.data.Dataset`` (``__len__`` and ``__getitem__``), collated
    batch by batch; the user's Dataset is used unchanged."""

    def __init__(
        self,
        dataset,
        label_key: str = "labels",
        collate: Callable | None = None,
        collate_items: Callable | None = None,
    ):
        """``collate``: (inputs, label) pairs -> (inputs, labels) batch (default: torch's ``default_collate``).
        ``collate_items``: instead, a DataLoader's ``collate_fn``, which collates the Dataset's items as they are; its
        batch is then split into inputs and labels by the conventions items follow (a dict holding ``label_key``, or
        ``(inputs..., labels)``)."""
        from torch.utils.data import default_collate

        self.dataset, self.label_key = dataset, label_key
        self.collate = collate or default_collate
        self.collate_items = collate_items
        try:
            self.n = len(dataset)
        except TypeError:
            raise DataError("a training Dataset must be map-style: it needs __len__ and __getitem__") from None
        if self.n < 1:
            raise DataError("the training Dataset holds no example")
        self._structure = None

    def __len__(self) -> int:
        return self.n

    def _split(self, item, what: str = "a Dataset item"):
        """(inputs, label) of one Dataset item (or of a batch a DataLoader's collate_fn made: ``what``), by the
        conventions of the module doc. Its errors name the rule, not the item: which example breaks it (its index, its
        keys or structure) is a fact about the private data."""
        if isinstance(item, Mapping):  # (a dict, or a Mapping such as transformers' BatchEncoding)
            if self.label_key not in item:
                raise DataError(
                    f"{what} is a dict without the label key {self.label_key!r}: dict items must hold their "
                    "label under label_key (set label_key to the key of the label)"
                )
            return {k: v for k, v in item.items() if k != self.label_key}, item[self.label_key]
        if isinstance(item, tuple | list) and len(item) >= 2:
            inputs = tuple(item[:-1])
            return (inputs[0] if len(inputs) == 1 else inputs), item[-1]
        raise DataError(
            f"{what} must be an (inputs..., label) tuple or list, or a dict with a {self.label_key!r} entry"
        )

    def _items(self, indices: list[int]) -> list:
        getitems = getattr(self.dataset, "__getitems__", None)  # torch's batched fetching, where a Dataset has it
        return getitems(indices) if getitems is not None and indices else [self.dataset[i] for i in indices]

    def _collated_by_items(self, indices: list[int]) -> tuple[Inputs, torch.Tensor]:
        """A batch by the DataLoader's collate_fn, split into inputs and labels, each holding one row per example."""
        try:
            batch = self.collate_items(self._items(indices))
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError) as e:  # (its message may quote the examples)
            raise DataError(
                f"the DataLoader's collate_fn failed on a batch of training examples ({type(e).__name__}); it must "
                "collate any subset of the Dataset's items"
            ) from None
        inputs, labels = self._split(batch, "a batch of the DataLoader's collate_fn")
        labels = _tensor(labels)
        leaves = tree_flatten(inputs)[0]
        if not leaves or not all(torch.is_tensor(t) for t in leaves):
            raise DataError("the batches of the DataLoader's collate_fn must hold tensors (inputs and labels)")
        if labels.dim() == 0 or labels.shape[0] != len(indices) or batch_len(inputs) != len(indices):
            raise DataError(
                "a batch of the DataLoader's collate_fn must hold one row per example in every input and in the labels "
                "(a padding-free collator, such as transformers' DataCollatorWithFlattening, packs the examples into "
                "one row, where their gradients cannot be told apart: pad them, e.g. DataCollatorWithPadding)"
            )
        return inputs, labels

    def batch(self, idx: torch.Tensor) -> tuple[Inputs, torch.Tensor]:
        pairs = []
        indices = idx.tolist()
        if self.collate_items is not None:
            return self._collated_by_items(indices) if indices else self.empty()
        items = self._items(indices)
        for _, item in zip(indices, items, strict=True):
            inputs, label = self._split(item)
            structure = tree_structure((inputs, label))
            if self._structure is None:
                self._structure = structure
            elif structure != self._structure:
                raise DataError(
                    "every Dataset item must have the same structure (the same inputs and label): an item has another "
                    "structure than the items before it"
                )
            pairs.append((inputs, label))
        if not pairs:
            return self.empty()
        try:
            inputs, labels = self.collate(pairs)
        except (RuntimeError, TypeError):  # (torch's message quotes the shapes of the examples and their positions)
            raise DataError(
                "the Dataset's items must collate into a batch: each input and the label a tensor (or number) of the "
                "same shape and dtype in every item (pad variable-length inputs, or train on "
                "dptrain.data.batches.DatasetSource(dataset, collate=...))"
            ) from None
        return inputs, _tensor(labels)

    def empty(self) -> tuple[Inputs, torch.Tensor]:
        inputs, labels = self.example()
        return take(inputs, torch.arange(0, device="cpu")), labels[:0]

    def example(self) -> tuple[Inputs, torch.Tensor]:
        return self.batch(torch.arange(1, device="cpu"))


def _tensor(v) -> torch.Tensor:
    """``v`` as a tensor where it is (a tensor stays on its device; anything else goes to the CPU, never to an implicit
    default device)."""
    return v if torch.is_tensor(v) else torch.as_tensor(v, device="cpu")


class SamplerReplacedWarning(UserWarning):
    """Training data came as a DataLoader: its dataset and collate_fn are used, its sampling is replaced."""


SAMPLER_REPLACED = (
    "dptrain: the DataLoader's dataset and collate_fn are used, read in this process; its sampler, batch_size, "
    "shuffle and workers are replaced by dptrain's secret batch sampling (Poisson by default) at the batch size "
    "given to dptrain (the loader's batch_size when none is given)"
)


def loader_batch_size(data) -> int | None:
    """The batch size of a DataLoader (None for anything else, or a loader without one)."""
    return data.batch_size if isinstance(data, torch.utils.data.DataLoader) else None


def loader_source(loader, label_key: str = "labels", warn: bool = True):
    """A DataLoader's examples: its map-style dataset, collated by its ``collate_fn`` (torch's default collation of
    ``TensorDataset``/``ArrayDataset`` rows is the same as indexing them: :class:`TensorSource`). Its sampling is not
    used: training says so once, by a :class:`SamplerReplacedWarning` (``warn``: evaluation reads every example in
    order and says nothing)."""
    from torch.utils.data import IterableDataset, default_collate, default_convert

    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        raise DataError(
            "a DataLoader of an IterableDataset cannot be sampled: DP-SGD's batch sampling needs a map-style Dataset "
            "(__len__ and __getitem__)"
        )
    if warn:
        warnings.warn(SAMPLER_REPLACED, SamplerReplacedWarning, stacklevel=3)
    collate = loader.collate_fn
    if collate in (default_collate, default_convert):  # (default_convert: a loader without automatic batching)
        return as_source(dataset, label_key)
    if loader.batch_size is None and loader.batch_sampler is None:
        raise DataError(
            "a DataLoader whose collate_fn converts single items (batch_size=None) cannot be batched by dptrain: give "
            "it a batch_size"
        )
    return DatasetSource(dataset, label_key, collate_items=collate)


def as_source(data, label_key: str = "labels"):
    """The engine's view of training data: an :class:`~dptrain.data.datasets.ArrayDataset`, a ``TensorDataset``, an
    ``(inputs, labels)`` pair (inputs a tensor or a tuple/dict of tensors) -> :class:`TensorSource`; any other
    map-style Dataset -> :class:`DatasetSource`; a ``DataLoader`` -> its dataset read through its collate_fn
    (:func:`loader_source`, with a one-time :class:`SamplerReplacedWarning`)."""
    if isinstance(data, TensorSource | DatasetSource):
        return data
    if isinstance(data, torch.utils.data.DataLoader):
        return loader_source(data, label_key)
    if isinstance(data, ArrayDataset):  # (a user's Dataset with x and y attributes is read through __getitem__)
        return TensorSource(_tensor(data.x), _tensor(data.y))
    if isinstance(data, torch.utils.data.TensorDataset):
        # (inputs..., labels), the convention of every item (DatasetSource): the label is the last tensor
        tensors = data.tensors
        if len(tensors) < 2:
            raise DataError(
                f"a TensorDataset of training data holds its inputs and then its labels, got {len(tensors)} tensor(s): "
                "TensorDataset(inputs..., labels)"
            )
        return TensorSource(tensors[0] if len(tensors) == 2 else tuple(tensors[:-1]), tensors[-1])
    if isinstance(data, tuple | list) and len(data) == 2 and hasattr(data[1], "shape"):
        inputs, labels = data
        inputs = tree_map(_tensor, inputs) if isinstance(inputs, tuple | list | dict) else _tensor(inputs)
        return TensorSource(inputs, _tensor(labels))
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return DatasetSource(data, label_key)
    raise DataError(
        "training data must be an ArrayDataset, a TensorDataset, an (inputs, labels) pair of tensors or a "
        "map-style torch Dataset"
    )


__all__ = [
    "SAMPLER_REPLACED",
    "DatasetSource",
    "SamplerReplacedWarning",
    "TensorSource",
    "as_source",
    "batch_len",
    "call_model",
    "loader_batch_size",
    "loader_source",
    "probe_like",
    "take",
    "unsqueezed",
    "with_first_replaced",
]
