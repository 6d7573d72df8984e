"""Hugging Face in: a ``transformers.Trainer`` script made private (docs/huggingface.md, "The Trainer").

- :mod:`dptrain.huggingface.arguments`: :class:`PrivacyArguments`, read by ``HfArgumentParser`` beside
  ``TrainingArguments`` (imports neither torch nor transformers);
- :mod:`dptrain.huggingface.trainer`: :class:`DPTrainer`, the Trainer whose steps are dptrain's private loop's;
- :mod:`dptrain.huggingface.refusals`: the Trainer options it cannot make private, refused in one line.

Hugging Face out (the ``save_pretrained`` directory of a run) is :mod:`dptrain.models.hf_save`. Names are read from
:mod:`dptrain.huggingface.trainer` on first use, so importing this package imports no transformers.
"""

from dptrain._lazy import lazy_exports
from dptrain.huggingface.arguments import PrivacyArguments

__getattr__, __dir__ = lazy_exports(__name__, "trainer")

__all__ = ["DPTrainer", "PrivacyArguments"]
