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


def _correct(logits: torch.Tensor, labels: torch.Tensor, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example of a batch: (correct predictions, predictions scored). One of one for [B, K] scores; for
    [B, T, K] scores, over its tokens whose label is not -100 (the next token's for a causal language model)."""
    if logits.dim() == 3 and labels.dim() == 2:
        logits, labels = scored_tokens(loss_fn, logits, labels)
        counted = labels != IGNORE_INDEX
        return ((logits.argmax(-1) == labels) & counted).sum(1), counted.sum(1)
    return (logits.argmax(-1) == labels).long(), torch.ones_like(labels, dtype=torch.long)


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
        right, scored = _correct(logits_of(call_model(model, inputs)), labels, loss_fn)
        correct += int(right.sum())
        total += int(scored.sum())
    return correct / max(1, total)


@torch.no_grad()
def example_scores(model, source, idx: torch.Tensor, device, batch_size: int = 1024, loss_fn=None) -> torch.Tensor:
    """Each example ``idx`` of ``source``'s share of correct predictions, in [0, 1] (float64): 1 or 0 for [B, K]
    scores, the share of its labelled tokens predicted right for [B, T, K] scores (0 for an example with none). Their
    sum moves by at most 1 when one example is added or removed, whatever the task (a count of correct tokens would
    move by up to T): the held-out score of a search's trial (:mod:`dptrain.tuning.search`). Leaves the model in
    evaluation mode."""
    model.eval()
    out = []
    for chunk in idx.cpu().split(batch_size):
        inputs, labels = to_device(source.batch(chunk), device)
        right, scored = _correct(logits_of(call_model(model, inputs)), labels, loss_fn)
        out.append((right.double() / scored.clamp(min=1).double()).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


__all__ = ["accuracy", "evaluation_source", "example_scores"]
