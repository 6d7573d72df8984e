"""Accuracy of a released model on held-out data, read in the structures training takes.

Held-out data only: accuracy on the training examples is a statistic of the private data (docs/privacy.md, "Test
metrics").
"""

from __future__ import annotations

import torch

from dptrain.data.batches import as_source, call_model, loader_source
from dptrain.models.losses import IGNORE_INDEX, logits_of, scored_tokens
from dptrain.stages.devices import to_device


def evaluation_source(x, y=None):
    """(inputs, labels) or a Dataset/DataLoader as a source of batches (:mod:`dptrain.data.batches`)."""
    if y is None:
        if isinstance(x, torch.utils.data.DataLoader):  # its dataset, collated by its collate_fn
            return loader_source(x, getattr(x, "label_key", "labels"), warn=False)
        return as_source(x, getattr(x, "label_key", "labels"))
    return as_source((x, y))


@torch.no_grad()
def accuracy(model, source, device, batch_size: int = 1024, loss_fn=None) -> float:
    """Fraction of correct predictions: argmax of [B, K] scores against labels [B]; for [B, T, K] scores, over the
    tokens whose label is not -100 (the next token's for a causal language model, ``loss_fn`` the causal-LM loss).
    Leaves the model in evaluation mode (a trainer's next step puts it back in training mode)."""
    model.eval()
    correct = total = 0
    n = len(source)
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size), device="cpu")
        inputs, labels = to_device(source.batch(idx), device)
        logits = logits_of(call_model(model, inputs))
        if logits.dim() == 3 and labels.dim() == 2:
            logits, labels = scored_tokens(loss_fn, logits, labels)
            counted = labels != IGNORE_INDEX
            correct += int(((logits.argmax(-1) == labels) & counted).sum())
            total += int(counted.sum())
        else:
            correct += int((logits.argmax(-1) == labels).sum())
            total += len(labels)
    return correct / max(1, total)


__all__ = ["accuracy", "evaluation_source"]
