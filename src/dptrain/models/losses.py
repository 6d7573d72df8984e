"""Per-example losses: one loss per example, what per-example clipping needs (a batch-mean loss would mix examples).

The default loss (:func:`default_loss`) reads what a model returns as transformers builds it: a tensor, or a
``ModelOutput`` / dict / tuple whose ``logits`` (or first element) are the scores.

- logits [B, K] and labels [B]: cross-entropy (classification);
- a Hugging Face sequence, image, video or audio classifier (``*ForSequenceClassification`` ...): the loss its own
  ``forward`` computes when given labels, per example (:class:`ClassificationHeadLoss`): its config's
  ``problem_type``, or as transformers infers it (one label: regression, mean squared error; integer labels:
  cross-entropy; otherwise multi-label, binary cross-entropy on each logit);
- a Hugging Face question-answering head (``*ForQuestionAnswering``) and labels [B, 2], each example's start and end
  positions: the loss its own ``forward`` computes from them, per example (:func:`question_answering_per_example`);
- logits [B, T, K] and labels [B, T]: token-level cross-entropy, tokens labelled ``-100`` ignored (Hugging Face's
  convention: padding), averaged over each example's own tokens; for a causal language model (Hugging Face's
  ``*ForCausalLM`` / ``*LMHeadModel``, also behind a peft wrapper) position t predicts label t + 1 (the shift
  transformers applies when it is given ``labels``).

An example whose tokens are all ignored has loss 0 (and gradient 0), never NaN. A causal language model behind a peft
prompt-learning adapter that prepends virtual tokens to the sequence (prompt tuning, p-tuning) returns logits for those
first: the labels get as many ignored positions in front (:func:`virtual_tokens`), as peft does when it is given the
labels. Labels that do not fit the logits are a one-line DataError.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.errors import DataError, ModelError

IGNORE_INDEX = -100


def logits_of(outputs) -> torch.Tensor:
    """The scores a model returned: the tensor itself, or the ``logits`` of a ModelOutput or dict, or the first
    element of a tuple."""
    if torch.is_tensor(outputs):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, dict):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, tuple | list) and outputs and torch.is_tensor(outputs[0]):
        logits = outputs[0]
    if logits is None:  # (CLIP's and SigLIP's outputs: scores of every pair of the batch's examples, no logits)
        raise ModelError(
            f"the model returned a {type(outputs).__name__} without logits; pass loss_fn(outputs, labels) returning one "
            "loss per example"
        )
    return logits


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T, K] scores and [B, T] labels -> [B]: the mean cross-entropy of each example's labelled tokens."""
    if logits.shape[:2] != labels.shape:
        raise DataError(
            f"token labels of shape {list(labels.shape)} do not fit the model's scores {list(logits.shape)}: each "
            "example needs one label per position (-100 where none)"
        )
    per_token = F.cross_entropy(
        logits.transpose(1, 2).to(torch.promote_types(logits.dtype, torch.float32)), labels, ignore_index=IGNORE_INDEX,
        reduction="none",
    )  # [B, T], 0 where ignored
    counted = (labels != IGNORE_INDEX).sum(1)
    return per_token.sum(1) / counted.clamp_min(1)


def cross_entropy_per_example(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Classification (logits [B, K], labels [B]) or token classification (logits [B, T, K], labels [B, T], ``-100``
    ignored, mean over each example's tokens). Computed in float32 at least (mixed precision keeps its loss exact)."""
    logits = logits_of(outputs)
    if logits.dim() == 3 and targets.dim() == 2:
        return _token_loss(logits, targets)
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets, reduction="none")


def causal_lm_per_example(outputs, labels: torch.Tensor) -> torch.Tensor:
    """Causal language modelling: position t's scores predict label t + 1 (``-100`` ignored), mean over each example's
    predicted tokens."""
    logits = logits_of(outputs)
    return _token_loss(logits[:, :-1], labels[:, 1:])


def _hf_model_named(model: nn.Module, suffixes: tuple[str, ...]) -> nn.Module | None:
    """The Hugging Face model (behind a peft wrapper too) whose class name ends with one of ``suffixes``, or None."""
    base = model
    for _ in range(4):  # peft: PeftModel -> LoraModel -> the transformers model
        name = type(base).__name__
        if name.endswith(suffixes):
            return base
        # peft: PeftModel.base_model is the LoraModel, whose .model is the transformers model (its .base_model
        # would be the transformers model's own trunk, e.g. GPT2Model, no longer a causal LM)
        inner = getattr(base, "model", None) if type(base).__module__.startswith("peft") else None
        inner = inner if isinstance(inner, nn.Module) else getattr(base, "base_model", None)
        if not isinstance(inner, nn.Module) or inner is base:
            break
        base = inner
    return None


def is_causal_lm(model: nn.Module) -> bool:
    """A Hugging Face causal language model (behind a peft wrapper too), by its class name."""
    return _hf_model_named(model, ("ForCausalLM", "LMHeadModel")) is not None


#: The Hugging Face heads whose own loss is transformers' ``ForSequenceClassificationLoss`` (its ``LOSS_MAPPING``).
CLASSIFICATION_HEADS = (
    "ForSequenceClassification", "ForImageClassification", "ForVideoClassification", "ForAudioClassification",
)
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


class ClassificationHeadLoss:
    """The loss a Hugging Face classifier computes when given labels (transformers' ``ForSequenceClassificationLoss``),
    one value per example: its config's ``problem_type``, or where that is unset, as transformers infers it (one
    label: regression; integer labels: single-label; otherwise multi-label). Regression: the mean over the example's
    labels of the squared error; single-label: cross-entropy; multi-label: the mean over the example's labels of the
    binary cross-entropy of each logit. Each is transformers' batch loss with the batch mean left out. The config is
    read, never written (transformers writes the inferred problem_type into it)."""

    def __init__(self, config):
        self.config = config
        kind = getattr(config, "problem_type", None)
        if kind is not None and kind not in PROBLEM_TYPES:
            raise ModelError(f"config.problem_type {kind!r} is not one of transformers' {', '.join(PROBLEM_TYPES)}")

    def problem_type(self, labels: torch.Tensor) -> str:
        kind, k = getattr(self.config, "problem_type", None), int(getattr(self.config, "num_labels", 0) or 0)
        if kind is not None:
            return kind
        if k == 1:
            return "regression"
        return "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)
        kind = self.problem_type(labels)
        if kind == "single_label_classification":
            return cross_entropy_per_example(logits, labels)
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        target = labels.to(scores.dtype)
        if kind == "regression" and scores.dim() == 2 and scores.shape[1] == 1 and target.dim() == 1:
            target = target[:, None]  # (transformers squeezes both: one value per example)
        if target.shape != scores.shape:
            raise DataError(
                f"{kind} labels of shape {list(labels.shape)} do not fit the model's scores {list(logits.shape)}: one "
                "value per example and logit (the config's num_labels)"
            )
        if kind == "regression":
            per = (scores - target).square()
        else:
            per = F.binary_cross_entropy_with_logits(scores, target, reduction="none")
        return per.flatten(1).mean(1)


#: The Hugging Face heads whose own loss is transformers' ``ForQuestionAnsweringLoss`` (XLM's is "...Simple").
QUESTION_ANSWERING_HEADS = ("ForQuestionAnswering", "ForQuestionAnsweringSimple")


def question_answering_per_example(outputs, labels: torch.Tensor) -> torch.Tensor:
    """A question-answering head's loss when given ``start_positions`` and ``end_positions`` (transformers'
    ``ForQuestionAnsweringLoss``), one value per example: ``labels`` [B, 2] holds each example's start and end
    positions (a DPTrainer stacks its two label names so); the mean of the cross-entropies of the start and end
    scores, a position outside the sequence clamped to its length and then ignored (0), as transformers does."""
    start, end = getattr(outputs, "start_logits", None), getattr(outputs, "end_logits", None)
    if start is None or end is None:
        raise ModelError("a question-answering head returned no start_logits and end_logits; pass loss_fn")
    if labels.dim() != 2 or labels.shape[1] != 2:
        raise DataError(
            f"question-answering labels must be [examples, 2] (each example's start and end positions), got "
            f"{list(labels.shape)}"
        )
    ignored = start.shape[1]
    positions = labels.long().clamp(0, ignored)
    losses = [F.cross_entropy(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, positions[:, j],
                              ignore_index=ignored, reduction="none") for j, s in enumerate((start, end))]
    return (losses[0] + losses[1]) / 2


def virtual_tokens(model: nn.Module) -> int:
    """Positions a peft prompt-learning adapter prepends to the sequence (prompt tuning, p-tuning: ``torch.cat((prompts,
    inputs_embeds), dim=1)``), so that the logits hold them first; 0 for any other model (prefix tuning's prefix lives
    in the attention cache, not in the sequence)."""
    try:
        config = getattr(model, "active_peft_config", None)
    except (AttributeError, KeyError, ValueError):
        return 0
    if config is None or not getattr(config, "is_prompt_learning", False):
        return 0
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    return 0 if kind in ("PREFIX_TUNING", "CARTRIDGE") else int(getattr(config, "num_virtual_tokens", 0) or 0)


class _AfterVirtualTokens:
    """Causal-LM cross-entropy of a model whose sequence starts with ``n`` virtual tokens: the labels get ``n`` ignored
    positions in front, as peft gives them to the model (the last virtual token predicts the first real one)."""

    def __init__(self, n: int):
        self.n = n

    def labels(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 3 and labels.dim() == 2 and logits.shape[1] == labels.shape[1] + self.n:
            return torch.cat([labels.new_full((labels.shape[0], self.n), IGNORE_INDEX), labels], 1)
        return labels

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)
        return causal_lm_per_example(logits, self.labels(logits, labels))


def scored_tokens(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The [B, T, K] scores and [B, T] labels that ``loss_fn`` (a default loss) compares: shifted by one for a causal
    language model, after its virtual tokens for prompt tuning."""
    if isinstance(loss_fn, _AfterVirtualTokens):
        labels = loss_fn.labels(logits, labels)
        return logits[:, :-1], labels[:, 1:]
    if loss_fn is causal_lm_per_example:
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


class LabelSmoothed:
    """transformers' label smoothing (``TrainingArguments.label_smoothing_factor``, the Trainer's ``LabelSmoother``) as
    one loss per example: each scored position's cross-entropy with ``epsilon`` of the target spread evenly over the
    classes ((1 - epsilon) x its negative log-likelihood + epsilon x the mean over classes of -log p, torch's
    ``label_smoothing``), averaged over the example's own labelled positions (``-100`` ignored; the positions of
    ``base``: shifted for a causal language model, after prompt tuning's virtual tokens). The Trainer's smoother averages
    over the batch's labelled tokens, which mixes examples. ``base``: the default loss of the model
    (:func:`default_loss`); a regression, multi-label or question-answering head has no label to smooth."""

    def __init__(self, base: Callable, epsilon: float):
        if base is question_answering_per_example:
            raise ModelError("label smoothing takes a head that scores classes; a question-answering head's loss is "
                             "not smoothed: leave label_smoothing_factor 0 or pass loss_fn")
        self.base, self.epsilon = base, float(epsilon)

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits = logits_of(outputs)
        if isinstance(self.base, ClassificationHeadLoss) and self.base.problem_type(labels) != PROBLEM_TYPES[1]:
            raise DataError(f"label smoothing takes class labels; this head's problem is "
                            f"{self.base.problem_type(labels)}: leave label_smoothing_factor 0 or pass loss_fn")
        scores, targets = scored_tokens(self.base, logits, labels)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        if scores.dim() == 3 and targets.dim() == 2:
            per = F.cross_entropy(scores.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none",
                                  label_smoothing=self.epsilon)
            return per.sum(1) / (targets != IGNORE_INDEX).sum(1).clamp_min(1)
        return F.cross_entropy(scores, targets, reduction="none", label_smoothing=self.epsilon)


def default_loss(model: nn.Module) -> Callable:
    """The per-example loss a model gets when none is given: causal-LM cross-entropy for a causal language model
    (after the virtual tokens of prompt tuning), a Hugging Face classifier's own loss (:class:`ClassificationHeadLoss`),
    a question-answering head's (:func:`question_answering_per_example`), else :func:`cross_entropy_per_example`."""
    if not is_causal_lm(model):
        if _hf_model_named(model, QUESTION_ANSWERING_HEADS) is not None:
            return question_answering_per_example
        head = _hf_model_named(model, CLASSIFICATION_HEADS)
        config = getattr(head, "config", None)
        return cross_entropy_per_example if config is None else ClassificationHeadLoss(config)
    n = virtual_tokens(model)
    return _AfterVirtualTokens(n) if n else causal_lm_per_example


__all__ = [
    "CLASSIFICATION_HEADS",
    "IGNORE_INDEX",
    "QUESTION_ANSWERING_HEADS",
    "ClassificationHeadLoss",
    "LabelSmoothed",
    "causal_lm_per_example",
    "cross_entropy_per_example",
    "default_loss",
    "is_causal_lm",
    "logits_of",
    "question_answering_per_example",
    "scored_tokens",
    "virtual_tokens",
]
