"""Text from a user's local files (``data.name = "text_files"``): JSON lines or CSV, one example per row, for a
causal language model or a sequence classifier (dptrain.models.huggingface).

A row holds either text (``text_field``, tokenized by a local tokenizer: ``tokenizer`` names a directory transformers
can load, usually the model's own) or pre-tokenized ids (``ids_field``: a JSON list of integers; in CSV also
integers separated by spaces or commas), and for classification an integer label (``label_field``). Each example is
truncated to ``max_length`` tokens and padded on the right to that length, with an attention mask (1 on its tokens, 0
on the padding). Inputs are a dict ``{input_ids, attention_mask}`` per example, passed to the model as keyword
arguments (dptrain.data.batches); labels are, for ``task = "causal_lm"``, the input ids with the padding set to -100 (the
loss shifts them: dptrain.models.losses), for ``"sequence_classification"`` one class per example.

Public facts only decide the shapes and the checks: the vocabulary size (the tokenizer's, or ``vocab_size`` for
pre-tokenized ids), the pad id (``pad_token_id``, else the tokenizer's pad or end-of-sequence token, else 0 for
pre-tokenized ids), the number of classes (``num_classes``, never read from the labels), ``max_length``. A separate
test file (``test_path``) is a public test set (``DataSplit.separate_test``); without one, a ``test_fraction`` of the
training file is split off by the seed, and its metrics are not public. Every problem is a one-line DataError naming
the file and the rule, never the text, a label, a line number or a count of bad rows (error messages end up in logs).
transformers is imported only to load a tokenizer.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dptrain.data.datasets import DataSplit
from dptrain.data.splits import array_contents, example_split
from dptrain.errors import DataError

TASKS = ("causal_lm", "sequence_classification")
FORMATS = ("jsonl", "csv")
#: Options of ``load_text_files`` (``data.options``), beside the training file (``data.path``) and the split's seed.
OPTIONS = ("task", "test_path", "tokenizer", "max_length", "num_classes", "vocab_size", "pad_token_id", "text_field",
           "label_field", "ids_field", "test_fraction", "format")
IGNORE_INDEX = -100  # labels of padding (dptrain.models.losses.IGNORE_INDEX; Hugging Face's convention)
HF_EXTRA = "pip install 'dptrain[hf]'"


class TextDataset(torch.utils.data.Dataset):
    """Padded token ids in memory: ``x`` = {input_ids, attention_mask} ([N, T] int64 each), ``y`` the labels ([N]
    classes or [N, T] token ids with -100 on padding). A map-style Dataset whose items are dicts with a ``labels``
    entry (what dptrain.data.batches reads), with the attributes of an ArrayDataset (num_classes: the number of classes, or
    the vocabulary size for a language model; vocab_size and pad_token_id: public facts of the tokenization)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, num_classes: int,
                 name: str, vocab_size: int, pad_token_id: int):
        self.x = {"input_ids": input_ids, "attention_mask": attention_mask}
        self.y = labels
        self.num_classes, self.name, self.vocab_size, self.pad_token_id = num_classes, name, vocab_size, pad_token_id

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x["input_ids"].shape[1:])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x["input_ids"][i], "attention_mask": self.x["attention_mask"][i], "labels": self.y[i]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self[i] for i in indices]

    def subset(self, idx: np.ndarray) -> TextDataset:
        t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        return TextDataset(self.x["input_ids"][t], self.x["attention_mask"][t], self.y[t], self.num_classes, self.name,
                           self.vocab_size, self.pad_token_id)


# --- checks of the options (public) ------------------------------------------------------------------------------


def _int_option(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataError(f"data.options.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _str_option(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise DataError(f"data.options.{key} must be a non-empty string, got {value!r}")
    return value


def _format(path: Path, fmt: str | None) -> str:
    if fmt is None:
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"{path}: cannot tell the format from the name (.jsonl or .csv); set data.options.format")
    if fmt not in FORMATS:
        raise DataError(f"data.options.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


# --- reading rows (the private data: errors name the rule, never a value or a position) --------------------------


def _rows(path: Path, fmt: str) -> Iterator[dict]:
    if not path.is_file():
        raise DataError(f"{path}: file not found (expected a .jsonl or .csv file of examples)")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if fmt == "csv":
                reader = csv.DictReader(f)
                if reader.fieldnames is None:
                    raise DataError(f"{path}: a CSV file needs a header row naming its columns")
                yield from reader
                return
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"{path}: every line must be a JSON object (JSON lines)") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}: every line must be a JSON object (JSON lines)")
                yield row
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    except csv.Error:
        raise DataError(f"{path}: not a readable CSV file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({type(exc).__name__})") from None


def _field(path: Path, row: dict, key: str, option: str, hint: str = "") -> Any:
    value = row.get(key)
    if value is None:  # (absent, JSON null, or a CSV row shorter than its header)
        raise DataError(f"{path}: every row needs a field {key!r} (data.options.{option}){hint}")
    return value


def _ids(path: Path, value: Any, key: str, vocab_size: int) -> list[int]:
    rule = f"{path}: {key!r} must be a list of integer token ids in [0, vocab_size = {vocab_size})"
    if isinstance(value, str):  # CSV: a JSON list, or integers separated by spaces or commas
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [int(v) for v in text.replace(",", " ").split()]
        except ValueError:
            raise DataError(rule) from None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataError(rule)
    if value and (min(value) < 0 or max(value) >= vocab_size):
        raise DataError(rule)
    return value


def _label(path: Path, value: Any, key: str, num_classes: int) -> int:
    if isinstance(value, str):  # CSV
        try:
            value = int(value.strip())
        except ValueError:
            value = None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_classes:
        raise DataError(f"{path}: {key!r} must hold integer class labels in [0, num_classes = {num_classes})")
    return value


# --- tokenization ---------------------------------------------------------------------------------------------------


def load_tokenizer(directory: str | os.PathLike):
    """A tokenizer from a local directory (transformers' AutoTokenizer, nothing downloaded, no remote code)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"data.options.tokenizer: {directory} is not a directory (a local tokenizer: nothing is downloaded)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(f"data.options.tokenizer needs transformers: {HF_EXTRA}") from None
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers' errors vary (OSError, ValueError, KeyError...); they describe the files
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DataError(f"data.options.tokenizer: {directory} holds no tokenizer transformers can load ({first})") from None


def _pad_id(tokenizer, pad_token_id: Any, vocab_size: int) -> int:
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise DataError("the tokenizer has no pad token and no end-of-sequence token: set data.options.pad_token_id")
    pad = _int_option("pad_token_id", 0 if pad_token_id is None else pad_token_id, 0)
    if pad >= vocab_size:
        raise DataError(f"data.options.pad_token_id must be < the vocabulary size {vocab_size}, got {pad}")
    return pad


def _encode(path: Path, fmt: str, *, task: str, tokenizer, fields: dict, vocab_size: int, num_classes: int | None,
            max_length: int, pad: int, name: str) -> TextDataset:
    ids, labels = [], []
    for row in _rows(path, fmt):
        if tokenizer is not None:
            text = _field(path, row, fields["text"], "text_field")
            if not isinstance(text, str):
                raise DataError(f"{path}: {fields['text']!r} must be a string in every row")
            ids.append(text)
        else:
            hint = " (pre-tokenized ids; or set data.options.tokenizer to a local tokenizer directory)"
            ids.append(_ids(path, _field(path, row, fields["ids"], "ids_field", hint), fields["ids"], vocab_size))
        if task == "sequence_classification":
            labels.append(_label(path, _field(path, row, fields["label"], "label_field"), fields["label"], num_classes))
    if not ids:
        raise DataError(f"{path}: no examples")
    if tokenizer is not None:
        ids = tokenizer(ids, truncation=True, max_length=max_length)["input_ids"]
        if any(v < 0 or v >= vocab_size for row in ids for v in row):  # (an added token beyond len(tokenizer))
            raise DataError(f"data.options.tokenizer gives token ids beyond its vocabulary size {vocab_size}")
    n = len(ids)
    input_ids = torch.full((n, max_length), pad, dtype=torch.int64)
    mask = torch.zeros((n, max_length), dtype=torch.int64)
    for i, row in enumerate(ids):
        row = row[:max_length]
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[i, : len(row)] = 1
    if task == "causal_lm":
        y, classes = input_ids.masked_fill(mask == 0, IGNORE_INDEX), vocab_size
    else:
        y, classes = torch.tensor(labels, dtype=torch.int64), num_classes
    return TextDataset(input_ids, mask, y, classes, name, vocab_size, pad)


def _check_not_the_training_file(path: Path, test_path: Path) -> None:
    """A test file is a public test set (accuracy on it is released unaccounted, a search may select on it): one that
    is the training file, or a copy of it, is the private examples, refused."""
    try:
        same = path.exists() and test_path.exists() and (
            os.path.samefile(path, test_path)
            or (path.stat().st_size == test_path.stat().st_size and path.read_bytes() == test_path.read_bytes())
        )
    except OSError:
        return  # (a file that cannot be read is reported by the reader, with its own message)
    if same:
        raise DataError(
            f"data.options.test_path {test_path} is the training file {path} (or a copy of it): the test set is public "
            "and must hold other examples; give a separate test file, or leave test_path out to split one off"
        )


def load_text_files(
    path: str | os.PathLike | None,
    *,
    task: str = "causal_lm",
    test_path: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    max_length: int = 128,
    num_classes: int | None = None,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
    text_field: str = "text",
    label_field: str = "label",
    ids_field: str = "input_ids",
    test_fraction: float | None = None,
    format: str | None = None,
    seed: int = 0,
) -> DataSplit:
    """Examples of a JSON lines or CSV file ``path`` (and of ``test_path``, a public test set), tokenized by the local
    ``tokenizer`` or given as ids; see the module's docstring."""
    if path is None:
        raise DataError("dataset 'text_files' needs a path: data.path, a .jsonl or .csv file of training examples")
    if task not in TASKS:
        raise DataError(f"data.options.task must be one of {', '.join(TASKS)}, got {task!r}")
    max_length = _int_option("max_length", max_length, 2 if task == "causal_lm" else 1)
    if task == "sequence_classification":
        if num_classes is None:
            raise DataError("sequence_classification needs data.options.num_classes (public metadata: the number of "
                            "classes is not read from the private labels)")
        num_classes = _int_option("num_classes", num_classes, 2)
    elif num_classes is not None:
        raise DataError("data.options.num_classes is for task = \"sequence_classification\" (a language model's "
                        "classes are its vocabulary)")
    fields = {"text": _str_option("text_field", text_field), "label": _str_option("label_field", label_field),
              "ids": _str_option("ids_field", ids_field)}
    if test_path is not None and test_fraction is not None:
        raise DataError("data.options.test_fraction does not apply with data.options.test_path (the test file is the "
                        "test set)")
    test_fraction = 0.2 if test_fraction is None else test_fraction
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, int | float) or not 0 < test_fraction < 1:
        raise DataError(f"data.options.test_fraction must be a number strictly between 0 and 1, got {test_fraction!r}")
    tok = None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        if vocab_size is not None:
            raise DataError("data.options.vocab_size is the tokenizer's with data.options.tokenizer: remove it")
        vocab = len(tok)
    elif vocab_size is None:
        raise DataError("pre-tokenized ids need data.options.vocab_size (public: the model's vocabulary), or set "
                        "data.options.tokenizer to a local tokenizer directory")
    else:
        vocab = _int_option("vocab_size", vocab_size, 2)
    pad = _pad_id(tok, pad_token_id, vocab)
    path = Path(path)
    common = dict(task=task, tokenizer=tok, fields=fields, vocab_size=vocab, num_classes=num_classes,
                  max_length=max_length, pad=pad, name="text_files")
    source = f"{'tokenized by ' + str(tokenizer) if tok is not None else 'token ids'}, {max_length} tokens, {task}"
    train = _encode(path, _format(path, format), **common)
    if test_path is not None:
        test_path = Path(test_path)
        _check_not_the_training_file(path, test_path)
        test = _encode(test_path, _format(test_path, format), **common)
        description = f"text files {path} / {test_path} ({len(train)} train / {len(test)} test, {source})"
        return DataSplit(train, test, description, separate_test=True)
    n = len(train)
    if n < 2:
        raise DataError(f"{path}: too few examples to split off a test set (set data.options.test_path)")
    seed = _int_option("seed", seed, 0)
    train_idx, test_idx = example_split(
        array_contents(train.x["input_ids"].numpy(), train.x["attention_mask"].numpy(), train.y.numpy()),
        test_fraction, seed,
    )
    if len(test_idx) == 0 or len(train_idx) == 0:
        raise DataError(f"{path}: too few examples ({n}) to split off a test set of fraction {test_fraction} (split "
                        f"seed {seed} sent every one to one part; set data.options.test_path)")
    test, train = train.subset(test_idx), train.subset(train_idx)
    description = f"text file {path} ({len(train)} train / {len(test)} test, split seed {seed}, {source})"
    return DataSplit(train, test, description, separate_test=False)


__all__ = ["OPTIONS", "TASKS", "TextDataset", "load_text_files", "load_tokenizer"]
