"""Hugging Face transformers models for ``model.name = "hf"``, as transformers builds them, optionally with peft LoRA
adapters. Nothing is downloaded: a model comes from a local directory (``path``: ``from_pretrained`` with
``local_files_only``, no remote code) or from a config table (``config = { model_type = "gpt2", n_layer = 2, ... }``:
random weights, seeded by the run's init stream).

Options (``model.options``):

- ``path`` or ``config`` (exactly one);
- ``task``: ``"causal_lm"`` (AutoModelForCausalLM; the default loss shifts the labels, dptrain.models.losses) or
  ``"sequence_classification"`` (AutoModelForSequenceClassification, ``num_labels`` = the data's public number of
  classes); for a directory, the default is its config's architecture when that names one of them;
- ``lora = { r = 8, alpha = 16, target_modules = [...], dropout = 0.0 }``: peft adapters; the base is frozen, only the
  adapters (and, for classification, a copy of the head, peft's ``modules_to_save``) are trained. ``target_modules``
  absent: peft's default for the model type.

What the builder reads of the data is public: the sequence length (checked against the model's positions), the
number of classes for classification, and for a language model the vocabulary size of the tokenization (its
``num_classes``), which must fit the model's. For classification, the model's ``pad_token_id`` must be known (GPT-2
style models find each example's last token with it): from the config, else from the tokenizer of the model's
directory (its pad, else its end-of-sequence token), the rule dptrain.data.text_files pads with. transformers and peft are
imported only here, when such a model is built; without them the error says ``pip install 'dptrain[hf]'``.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from dptrain.errors import DataError, ModelError, one_line

TASKS = ("causal_lm", "sequence_classification")
LORA_KEYS = ("r", "alpha", "target_modules", "dropout")
HF_EXTRA = "pip install 'dptrain[hf]'"
_PEFT_TASK = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError(f"model 'hf' needs transformers: {HF_EXTRA}") from None
    return transformers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _config_from_table(transformers, table: Any):
    if not isinstance(table, dict) or not isinstance(table.get("model_type"), str):
        raise ModelError('model.options.config must be a table with a model_type (e.g. { model_type = "gpt2", ... })')
    fields = {k: v for k, v in table.items() if k != "model_type"}
    mapping = transformers.CONFIG_MAPPING
    model_type = table["model_type"]
    if model_type not in mapping:
        raise ModelError(f"model.options.config: unknown model_type {model_type!r} for transformers "
                         f"{transformers.__version__}")
    cls = mapping[model_type]
    default, accepted = cls(), set(inspect.signature(cls.__init__).parameters)
    unknown = sorted(k for k in fields if k not in accepted and not hasattr(default, k))
    if unknown:  # (transformers would keep a misspelt key as an unused attribute)
        raise ModelError(f"model.options.config: {model_type} configs have no key {unknown[0]!r}")
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"model.options.config: transformers refuses it ({one_line(exc, 300)})") from None


def _directory(path: Any) -> Path:
    if not isinstance(path, str) or not path:
        raise ModelError(f"model.options.path must be a local directory (a string), got {path!r}")
    directory = Path(path)
    if not directory.is_dir():
        raise ModelError(f"model.options.path: {directory} is not a directory (a model saved with save_pretrained; "
                         "nothing is downloaded)")
    return directory


def _task(task: Any, config, table: bool) -> str:
    if task is None and not table:
        kinds = {t for arch in (getattr(config, "architectures", None) or []) for t in TASKS
                 if arch.endswith(("ForCausalLM", "LMHeadModel") if t == "causal_lm" else "ForSequenceClassification")}
        if len(kinds) == 1:
            return kinds.pop()
    if task not in TASKS:
        raise ModelError(f"model.options.task must be one of {', '.join(TASKS)}, got {task!r}")
    return task


def _directory_pad_id(directory: Path) -> int | None:
    """The pad id dptrain.data.text_files pads with when given the model's directory as its tokenizer (None without one)."""
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from dptrain.data.text_files import load_tokenizer

    try:
        tok = load_tokenizer(directory)
    except DataError:  # (then the model's pad_token_id is asked for)
        return None
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def _positions(config) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if _is_int(value):
            return value
    return None


def _check_fit(config, task: str, shape: tuple[int, ...], num_classes: int, directory: Path | None,
               stated_labels: Any) -> None:
    if len(shape) != 1:
        raise ModelError(f"model 'hf' takes token ids of shape (length,) (data.name = \"text_files\"), got {shape}")
    positions = _positions(config)
    if positions is not None and shape[0] > positions:
        raise ModelError(f"the data's max_length {shape[0]} exceeds the model's {positions} positions")
    vocab = getattr(config, "vocab_size", None)
    if task == "causal_lm":
        if _is_int(vocab) and num_classes > vocab:
            raise ModelError(f"the data's vocabulary ({num_classes} token ids) does not fit the model's vocab_size "
                             f"{vocab}")
        return
    if stated_labels is not None and stated_labels != num_classes:
        raise ModelError(f"model.options.config.num_labels {stated_labels!r} differs from data.options.num_classes "
                         f"{num_classes}")
    config.num_labels = num_classes
    if config.pad_token_id is None and directory is not None:
        config.pad_token_id = _directory_pad_id(directory)
    if config.pad_token_id is None:
        raise ModelError("sequence classification needs the model's pad_token_id (the data's pad id: its tokenizer's, "
                         "or data.options.pad_token_id): set model.options.config.pad_token_id")


def _lora(model: nn.Module, lora: Any, task: str) -> nn.Module:
    if not isinstance(lora, dict):
        raise ModelError(f"model.options.lora must be a table ({', '.join(LORA_KEYS)}), got {lora!r}")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ModelError(f"model.options.lora has no key {unknown[0]!r}; accepted: {', '.join(LORA_KEYS)}")
    r = lora.get("r", 8)
    if not _is_int(r) or r < 1:
        raise ModelError(f"model.options.lora.r must be an integer >= 1, got {r!r}")
    alpha, dropout, targets = lora.get("alpha", 2 * r), lora.get("dropout", 0.0), lora.get("target_modules")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ModelError(f"model.options.lora.alpha must be a number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ModelError(f"model.options.lora.dropout must be in [0, 1), got {dropout!r}")
    if targets is not None and not (
        targets == "all-linear"
        or (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets))
    ):
        raise ModelError(f"model.options.lora.target_modules must be a list of module names (or \"all-linear\"), "
                         f"got {targets!r}")
    try:
        import peft
    except ImportError:
        raise ModelError(f"model.options.lora needs peft: {HF_EXTRA}") from None

    def targeted(name: str) -> bool:
        return targets is None or targets == "all-linear" or name.rsplit(".", 1)[-1] in targets

    # GPT-2's Conv1D stores its weight as (in, out): peft needs fan_in_fan_out for it (it would warn and set it)
    fan_in_fan_out = any(type(m).__name__ == "Conv1D" and targeted(n) for n, m in model.named_modules())
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=targets,
                             fan_in_fan_out=fan_in_fan_out, task_type=_PEFT_TASK[task])
    try:
        with warnings.catch_warnings():  # (peft asks the model a deprecated question: transformers' FutureWarning)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"model.options.lora: peft cannot adapt this model ({one_line(exc, 300)})") from None


def build_hf_model(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    path: str | None = None,
    config: dict | None = None,
    task: str | None = None,
    lora: dict | None = None,
) -> nn.Module:
    """A transformers model for token ids of ``input_shape`` = (length,) (see the module's docstring);
    ``num_classes``: the number of classes, or for a language model the vocabulary size of the data."""
    if (path is None) == (config is None):
        raise ModelError("model 'hf' needs exactly one of model.options.path (a local directory) and "
                         "model.options.config (a table with a model_type)")
    directory = None if path is None else _directory(path)
    transformers = _import_transformers()
    if directory is not None:
        try:
            hf_config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # (OSError, ValueError, KeyError...: they describe the model's files)
            raise ModelError(f"model.options.path: {directory} holds no config transformers can load "
                             f"({one_line(exc, 300)})") from None
    else:
        hf_config = _config_from_table(transformers, config)
    task = _task(task, hf_config, directory is None)
    stated_labels = None if config is None else config.get("num_labels")
    _check_fit(hf_config, task, tuple(input_shape), num_classes, directory, stated_labels)
    hf_config.use_cache = False  # (training: no key/value cache in the outputs)
    auto = transformers.AutoModelForCausalLM if task == "causal_lm" else transformers.AutoModelForSequenceClassification
    try:
        if directory is None:
            model = auto.from_config(hf_config)
        else:
            model = auto.from_pretrained(directory, config=hf_config, local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # (a size mismatch, missing weights, an architecture without this task...)
        where = f"model.options.path: {directory}" if directory is not None else "model.options.config"
        raise ModelError(f"{where}: transformers cannot build a {task} model from it ({one_line(exc, 300)})") from None
    return model if lora is None else _lora(model, lora, task)


__all__ = ["LORA_KEYS", "TASKS", "build_hf_model"]
