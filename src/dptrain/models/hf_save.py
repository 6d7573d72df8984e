"""A trained Hugging Face model as ``save_pretrained`` directories, loadable with ``from_pretrained`` alone (no dptrain,
no config.toml): what a run with ``model.name = "hf"`` writes beside ``model.pt`` (docs/huggingface.md, "What a run
writes").

- ``hf_model/``: the model as transformers saves it (a peft model with its adapters merged into the weights, where
  peft can merge them), with the run's tokenizer: ``AutoModelForCausalLM.from_pretrained(run / "hf_model")`` (or the
  task's Auto class) is the trained model;
- ``hf_adapter/`` (peft models only): the adapter as peft saves it, with the tokenizer, its ``base_model_name_or_path``
  the absolute path of the base model's directory; a base built from a config table (random weights drawn when the run
  started, no data in them) is saved in ``hf_adapter/base/`` and named there:
  ``AutoPeftModelForCausalLM.from_pretrained(run / "hf_adapter")``.

Only released quantities go in: the weights (the base and the privately trained parameters), the model's config and
the tokenizer (public: it is an input of the run). No optimizer state, no generator state, nothing of the data.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

from torch import nn

from dptrain.errors import ModelError, one_line

MODEL_DIR, ADAPTER_DIR, BASE_DIR = "hf_model", "hf_adapter", "base"


def is_peft(model: nn.Module) -> bool:
    return type(model).__module__.startswith("peft") and hasattr(model, "peft_config")


def _inference_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for saving: on the CPU, its config's key/value cache on again (the builder turns it off for
    training; generation wants it)."""
    saved = copy.deepcopy(model).cpu()
    config = getattr(saved, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = True
    return saved


def save_model_directory(model: nn.Module, directory: Path, tokenizer=None) -> None:
    """``hf_model``: the model (a peft model merged into its base) and the tokenizer, written into ``directory``."""
    saved = _inference_copy(model)
    if is_peft(saved):
        try:
            saved = saved.merge_and_unload()
        except Exception as exc:  # (peft's errors vary by adapter type: NotImplementedError, ValueError, ...)
            raise ModelError(f"peft cannot merge this model's adapters ({one_line(exc, 200)})") from None
    saved.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def can_merge(model: nn.Module) -> bool:
    """Whether peft can merge ``model``'s adapters into its weights (LoRA and its kind; not prompt or prefix tuning)."""
    return is_peft(model) and hasattr(model, "merge_and_unload") and not any(
        getattr(c, "is_prompt_learning", False) for c in model.peft_config.values()
    )


def save_adapter_directory(model: nn.Module, directory: Path, base_path: str, tokenizer=None,
                           save_base: bool = False) -> None:
    """``hf_adapter``: the peft adapter and the tokenizer, written into ``directory``, its config naming the base model
    ``base_path`` (absolute: where the directory will be read from). ``save_base``: the base model (the adapters
    unloaded) is written into ``directory / "base"`` (a base built from a config table exists nowhere else)."""
    saved = _inference_copy(model)
    if save_base:
        _inference_copy(model).unload().save_pretrained(directory / BASE_DIR)
    for config in saved.peft_config.values():
        config.base_model_name_or_path = base_path
    with warnings.catch_warnings():  # (peft looks for the base's config at base_path, where it is not yet renamed)
        warnings.filterwarnings("ignore", message="Could not find a config file", category=UserWarning)
        saved.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


__all__ = ["ADAPTER_DIR", "BASE_DIR", "MODEL_DIR", "can_merge", "is_peft", "save_adapter_directory", "save_model_directory"]
