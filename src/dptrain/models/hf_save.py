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


def _adapted(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by a peft adapter layer (it is one's ``base_layer``, or is the layer itself)."""
    return hasattr(module, "base_layer") and type(module).__module__.startswith("peft")


def untie_adapted(model: nn.Module) -> list[str]:
    """Give every module its own copy of a parameter it shares with other modules (tied weights: GPT-2's token
    embedding and output layer, T5's and BART's ``shared`` embedding) where an adapter wraps one of them. Merging an
    adapter writes its delta into the base weight in place: a tied weight would carry it into every other use (the
    output layer of a LoRA on the embedding; both deltas into both, where both are adapted), and the merged model
    would compute another function than the trained one. Untied, each module merges its own; the config's
    ``tie_word_embeddings`` is turned off so that ``from_pretrained`` does not tie them again. Returns the parameters
    untied (their names at each use)."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    adapted: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        wrapped = _adapted(module)
        for local, p in module._parameters.items():
            if p is None:
                continue
            uses = owners.setdefault(id(p), [])
            if not any(m is module and k == local for _, m, k in uses):
                uses.append((f"{name}.{local}" if name else local, module, local))
        if wrapped:
            adapted.update(id(p) for p in module.base_layer._parameters.values() if p is not None)
    untied = []
    for key, uses in owners.items():
        if key not in adapted or len({id(m) for _, m, _ in uses}) < 2:
            continue
        for name, module, local in uses[1:]:
            p = module._parameters[local]
            module._parameters[local] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            untied.append(name)
    if untied:
        for config in {id(c): c for c in _configs(model)}.values():
            config.tie_word_embeddings = False
    return untied


def _configs(model: nn.Module):
    """The transformers configs of ``model`` and its submodules (a composite model's text config too)."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "tie_word_embeddings"):
            yield config
            text = getattr(config, "get_text_config", lambda: None)()
            if text is not None and text is not config and hasattr(text, "tie_word_embeddings"):
                yield text


def save_model_directory(model: nn.Module, directory: Path, tokenizer=None) -> None:
    """``hf_model``: the model (a peft model merged into its base, tied weights an adapter wraps untied first:
    :func:`untie_adapted`) and the tokenizer, written into ``directory``."""
    saved = _inference_copy(model)
    if is_peft(saved):
        untie_adapted(saved)
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


__all__ = ["ADAPTER_DIR", "BASE_DIR", "MODEL_DIR", "can_merge", "is_peft", "save_adapter_directory", "save_model_directory",
           "untie_adapted"]
