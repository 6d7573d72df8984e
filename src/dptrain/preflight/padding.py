"""An example's loss must not depend on how much a collator pads it.

A DataLoader whose collator pads each batch to its own longest sequence (transformers' ``DataCollatorWithPadding``,
``DataCollatorForLanguageModeling``, ``DataCollatorForTokenClassification``) pads an example to the longest of the
examples it is chunked with. With the attention mask right, the padding is invisible and the example's gradient is
the same at every padded length. A model that reads its padding (ConvBERT's span convolution over padding tokens, a
question-answering head whose softmax runs over the padded positions, Funnel's pooling) gives an example a gradient
that depends on the lengths of the other examples of its chunk: adding or removing one example changes the others'
gradients, which per-example clipping does not bound (and the gradient check, comparing an example with itself at
the chunk's padded length, cannot see it). So before training the probe computes each of its examples' losses
collated alone, unpadded, and compares them with the same example's in the padded probe batch; a difference refuses
the run in one line (:func:`check_padding`). A collator that draws random numbers (``DataCollatorForLanguageModeling``
with ``mlm=True`` draws each batch's masks) collates an example differently each time: its examples cannot be compared
this way and are not. What tells it (:func:`collates_randomly`) is the probe's examples collated together many times
over: a collator that draws no random number gives every copy of an example the same row. (Two collations of one
example alone did not tell it reliably: a short sentence drew no mask in both with probability 0.85^(2n) for n
tokens, 1 in 14 at n = 8, and the run was refused for "reading its padding", the loss alone 0 against the row's.)
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from dptrain.data.batches import call_model, take
from dptrain.errors import ModelError
from dptrain.preflight.buffers import restored


def _shapes(inputs) -> list:
    return [tuple(t.shape) for t in tree_flatten(inputs)[0] if torch.is_tensor(t)]


def _equal(a, b) -> bool:
    """Two collations of the same examples hold the same tensors (and the same other leaves)."""
    a, b = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(a) != len(b):
        return False
    for s, t in zip(a, b, strict=True):
        if torch.is_tensor(s) or torch.is_tensor(t):
            if not (torch.is_tensor(s) and torch.is_tensor(t) and s.shape == t.shape and torch.equal(s, t)):
                return False
        elif not (s is t or s == t):
            return False
    return True


#: Rows a randomness test collates (copies of the probe's examples): a masking collator of rate p leaves all copies
#: of an example of n maskable tokens unmasked with probability (1 - p)^(n x copies), 3e-5 at p = 0.15, n = 1.
COPIES = 64


def collates_randomly(source, indices: list[int]) -> bool:
    """Whether ``source``'s collator draws random numbers: the examples ``indices``, each repeated about
    COPIES / len(indices) times (at least twice), collated together, and two copies of one example differ (torch's
    generators forked: the run's untouched)."""
    repeats = max(2, -(-COPIES // max(1, len(indices))))
    order = torch.tensor([i for i in indices for _ in range(repeats)], device="cpu")
    with torch.random.fork_rng(devices=[]):
        batch = source.batch(order)
    for t in tree_flatten(batch)[0]:
        if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == len(order):
            rows = t.reshape(len(indices), repeats, *t.shape[1:])
            if not torch.equal(rows, rows[:, :1].expand_as(rows)):
                return True
    return False


def check_padding(model, loss_fn, source, x, y, indices: list[int], rtol: float, convert=None) -> None:
    """Refuse (ModelError) when example ``indices[r]``'s loss as row r of the collated batch (``x``, ``y``) differs
    from its loss collated alone by ``source`` (beyond ``rtol`` of it). Examples whose tensors have the same shapes
    both ways (no padding to tell apart) are skipped. ``convert``: applied to a batch read from ``source`` (the
    probe's float64 and device). Nothing is compared when the collator draws random numbers
    (:func:`collates_randomly`)."""
    random = None
    for r, i in enumerate(indices):
        row = take(x, torch.tensor([r], device=y.device)), y[r : r + 1]
        with torch.random.fork_rng(devices=[]):  # (the run's generators untouched)
            alone, again = source.batch(torch.tensor([i], device="cpu")), source.batch(torch.tensor([i], device="cpu"))
        if _shapes(row) == _shapes(alone):
            continue
        if random is None:
            random = not _equal(alone, again) or collates_randomly(source, indices)
        if random:
            return
        alone = convert(alone) if convert is not None else alone
        with restored(model), torch.no_grad():
            padded = loss_fn(call_model(model, row[0]), row[1]).double().reshape(())
            single = loss_fn(call_model(model, alone[0]), alone[1]).double().reshape(())
        if not bool(padded.isfinite()) or not bool(single.isfinite()):
            continue  # (a non-finite loss is the step's to refuse)
        if float((padded - single).abs()) > rtol * float(single.abs()) + 1e-12:
            raise ModelError(
                f"example {i}'s loss depends on how much the DataLoader's collator pads it ({float(single):.6g} alone, "
                f"{float(padded):.6g} padded to the longest of {len(indices)} examples): the model reads the padding "
                "(a convolution over padding tokens, a softmax over padded positions), so with a collator padding each "
                "batch to its own longest sequence one example's gradient depends on the lengths of the others, which "
                "per-example clipping does not bound; pad every batch to one length (tokenizer padding=\"max_length\", "
                "DataCollatorWithPadding(tokenizer, padding=\"max_length\", max_length=N)) or mask the padding in the "
                "model and its loss"
            )


__all__ = ["COPIES", "check_padding", "collates_randomly"]
