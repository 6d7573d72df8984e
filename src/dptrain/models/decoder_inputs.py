"""The decoder inputs an encoder-decoder model derives from its labels, for batches that hold the labels only.

transformers' encoder-decoder models (T5, BART, mBART, Pegasus, Marian, ...) called with ``labels`` and without
``decoder_input_ids`` derive the decoder's inputs from the labels (the labels shifted right behind the decoder's start
token, -100 read as padding): a Trainer script with ``DataCollatorForSeq2Seq(tokenizer)`` (no ``model=``), or a Dataset
of input/label pairs, relies on it. dptrain takes the labels out of the model's inputs (the per-example loss reads
them), so such a model would be called without them: T5 raises, and BART-like models silently feed the decoder their
*encoder* input shifted, training another function than the user's, exactly. :func:`with_decoder_inputs` adds to each
batch the decoder inputs the model derives from that batch's labels (``model.prepare_decoder_input_ids_from_labels``,
what ``DataCollatorForSeq2Seq(tokenizer, model=model)`` adds), row by row: each example's from its own labels. A model
that has no such method (Whisper and M2M100 shift the labels inside their forward) gets the labels shifted right behind
its config's ``decoder_start_token_id`` (-100 read as ``pad_token_id``), what transformers' ``shift_tokens_right``
does, if that is verified on the first example to give the model's own outputs with the labels; else it is refused
in one line naming ``decoder_input_ids``.

Whether a model derives its decoder's inputs from its labels is measured, not read off its signature: an
encoder-decoder's sequence classifier (BART's, T5's, mBART's, ...) takes ``labels`` and ``decoder_input_ids`` too, but
its labels are class indices and its decoder reads ``input_ids`` shifted, with or without labels. A model whose
outputs on the first examples are the same with and without their labels (:func:`labels_reach_outputs`) is called
as it is.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dptrain.errors import DataError
from dptrain.models.quiet import quiet_passes

DECODER_KEYS = ("decoder_input_ids", "decoder_inputs_embeds")


def _forward_parameters(model: nn.Module) -> set[str]:
    """The keyword parameters of the model's forward (a peft wrapper's, and its base model's)."""
    names: set[str] = set()
    for m in (model, getattr(model, "get_base_model", lambda: None)()):
        if m is not None:
            try:
                names |= set(inspect.signature(m.forward).parameters)
            except (TypeError, ValueError):
                pass
    return names


def derives_decoder_inputs(model: nn.Module) -> bool:
    """Whether the model's forward takes ``labels`` and ``decoder_input_ids`` (an encoder-decoder that derives the
    decoder's inputs from the labels when it is not given them)."""
    return {"labels", "decoder_input_ids"} <= _forward_parameters(model)


class DecoderInputsFromLabels:
    """A source (:mod:`dptrain.data.batches`) whose dict batches lacking decoder inputs get those the model derives
    from their labels; everything else is the wrapped source's."""

    def __init__(self, source, derive):
        self.source, self.derive = source, derive

    def __len__(self) -> int:
        return len(self.source)

    def __getattr__(self, name):
        return getattr(self.source, name)

    def _with(self, batch):
        inputs, labels = batch
        if isinstance(inputs, dict) and not any(k in inputs for k in DECODER_KEYS):
            inputs = {**inputs, "decoder_input_ids": self.derive(labels=labels)}
        return inputs, labels

    def batch(self, idx):
        return self._with(self.source.batch(idx))

    def example(self):
        return self._with(self.source.example())


def shifted_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """The labels shifted one position right behind ``start``, -100 replaced by ``pad`` (each row on its own)."""
    out = labels.new_full(labels.shape, start)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == -100, pad)


def _derives_as(model: nn.Module, derive, inputs, labels) -> bool:
    """Whether the model called with ``derive(labels=labels)`` as its decoder inputs gives the outputs it gives with
    the labels (one example)."""
    device = next(model.parameters()).device
    inputs, labels = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, (inputs, labels))
    try:
        with quiet_passes(model, grad=False):
            own = model(**inputs, labels=labels).logits
            ours = model(**inputs, decoder_input_ids=derive(labels=labels)).logits
    except Exception:  # noqa: BLE001 (the model's own error: nothing verified)
        return False
    return own.shape == ours.shape and bool(torch.allclose(own, ours, rtol=1e-4, atol=1e-6))


#: Examples on which :func:`labels_reach_outputs` compares the model's outputs with and without their labels (one
#: example could have labels that happen to equal its input, which a decoder fed either shifted cannot tell apart).
PROBED = 4


def labels_reach_outputs(model: nn.Module, source) -> bool:
    """Whether the model's outputs (those it returns with and without labels, but the loss) on the source's first
    examples change when it is given their labels or the other examples' (rolled by one), or it cannot run without them
    (T5's conditional generation needs decoder inputs or labels). A model that cannot run on them with their labels
    either fails for another reason (BART's classifier on examples without an end-of-sequence token): False, and its own
    error is the model probe's to report (it was refused for deriving its decoder's inputs from its labels)."""
    device = next(model.parameters()).device
    idx = torch.arange(min(len(source), PROBED))
    inputs, labels = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, source.batch(idx))
    try:
        with quiet_passes(model, grad=False):
            passes = [model(**inputs, labels=labels)]
    except Exception:  # noqa: BLE001 (a model that cannot run on these inputs with their labels either: its own error)
        return False
    try:
        with quiet_passes(model, grad=False):
            passes.insert(0, model(**inputs))
            if len(labels) > 1:  # (the other examples' labels: a copy task's labels equal to its inputs look unused)
                passes.append(model(**inputs, labels=labels.roll(1, 0)))
    except Exception:  # noqa: BLE001 (a model that needs its labels to run: they reach it)
        return True
    if not all(hasattr(out, "keys") for out in passes):
        return True
    # (the outputs every pass holds: given labels, a model returns its loss, and turns its key/value cache off)
    keys = [k for k in passes[1].keys() if all(k in out.keys() for out in passes) and k != "loss"]  # noqa: SIM118
    if not keys:
        return True
    for k in keys:
        first = tree_flatten(passes[0][k])[0]
        for out in passes[1:]:
            other = tree_flatten(out[k])[0]
            if len(first) != len(other):
                return True
            for u, v in zip(first, other, strict=True):
                if torch.is_tensor(u) and (not torch.is_tensor(v) or u.shape != v.shape or not torch.equal(u, v)):
                    return True
    return False


def with_decoder_inputs(source, model: nn.Module):
    """``source`` itself, unless ``model`` derives decoder inputs from its labels and the source's examples hold no
    decoder inputs: then a source whose batches carry them (:class:`DecoderInputsFromLabels`), or a one-line
    DataError when the model has no public way to derive them."""
    if not derives_decoder_inputs(model):
        return source
    inputs, _ = source.example()
    if not isinstance(inputs, dict) or any(k in inputs for k in DECODER_KEYS):
        return source
    if not labels_reach_outputs(model, source):  # (a classifier's labels: classes, its decoder reads input_ids)
        return source
    derive = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if derive is None:
        config = getattr(model, "config", None)
        start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
        if isinstance(start, int) and isinstance(pad, int):
            derive = lambda labels: shifted_right(labels, start, pad)  # noqa: E731
            if not _derives_as(model, derive, *source.example()):
                derive = None
    if derive is None:
        raise DataError(
            f"{type(model).__name__} derives its decoder's inputs from its labels inside forward, and dptrain calls "
            "the model without the labels (the per-example loss reads them): put decoder_input_ids in each batch "
            "(the labels shifted right behind the decoder's start token, as the model's forward shifts them)"
        )
    return DecoderInputsFromLabels(source, derive)


__all__ = ["DecoderInputsFromLabels", "derives_decoder_inputs", "labels_reach_outputs", "shifted_right",
           "with_decoder_inputs"]
