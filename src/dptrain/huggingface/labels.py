"""A Trainer's several label names as one label per example.

transformers names a model's labels after its forward's arguments (``Trainer.label_names``): ``labels`` for most heads,
but a question-answering head takes two, ``start_positions`` and ``end_positions``. dptrain's private loop takes one
label tensor per batch (one row per example, which its sampler and chunks index), so :class:`StackedLabels` collates
the Trainer's items as its collator does and stacks the named labels into one tensor, ``labels[:, j]`` being
``label_names[j]`` (for a question-answering head: [B, 2], the start and end positions, which the default loss reads:
:func:`dptrain.models.losses.question_answering_per_example`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dptrain.errors import DataError

#: The key of the stacked labels in a collated batch (a name no model's forward takes).
STACKED_KEY = "dptrain_stacked_labels"


class StackedLabels:
    """A collator: ``collate``'s batch with the entries ``names`` taken out and stacked along dimension 1 under
    :data:`STACKED_KEY` (each must hold one row per example, of one shape)."""

    def __init__(self, collate: Callable, names: list[str]):
        self.collate, self.names = collate, list(names)

    def __call__(self, items):
        batch = self.collate(items)
        if not isinstance(batch, Mapping) or any(k not in batch for k in self.names):
            raise DataError(
                f"the Trainer's label_names {self.names} must each be an entry of every collated batch (a dict)"
            )
        labels = [torch.as_tensor(batch[k]) for k in self.names]
        if any(t.dim() == 0 or t.shape != labels[0].shape for t in labels):
            raise DataError(
                f"the labels {self.names} must hold one row per example, of one shape, to be stacked into each "
                "example's label (labels[:, j] for label_names[j]); set TrainingArguments(label_names=[...]) to one "
                "entry holding them"
            )
        inputs = {k: v for k, v in batch.items() if k not in self.names}
        return {**inputs, STACKED_KEY: torch.stack(labels, 1)}


__all__ = ["STACKED_KEY", "StackedLabels"]
