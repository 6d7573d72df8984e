"""The decoder inputs an encoder-decoder model derives from its labels, for batches that hold the labels only.

transformers' encoder-decoder models (T5, BART, mBART, Pegasus, Marian, ...) called with ``labels`` and without
``decoder_input_ids`` derive the decoder's inputs from the labels (the labels shifted right behind the decoder's start
token, -100 read as padding): a Trainer script with ``DataCollatorForSeq2Seq(tokenizer)`` (no ``model=``), or a Dataset
of input/label pairs, relies on it. dptrain takes the labels out of the model's inputs (the per-example loss reads
them), so such a model would be called without them: T5 raises, and BART-like models silently feed the decoder their
*encoder* input shifted, training another function than the user's, exactly. :func:`with_decoder_inputs` adds to each
batch the decoder inputs the model derives from that batch's labels (``model.prepare_decoder_input_ids_from_labels``,
what ``DataCollatorForSeq2Seq(tokenizer, model=model)`` adds), row by row: each example's from its own labels. A model
that takes both ``labels`` and ``decoder_input_ids`` but has no such method (Whisper derives them in its forward
alone) is refused in one line naming ``decoder_input_ids``.
"""

from __future__ import annotations

import inspect

from torch import nn

from dptrain.errors import DataError

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


def with_decoder_inputs(source, model: nn.Module):
    """``source`` itself, unless ``model`` derives decoder inputs from its labels and the source's examples hold no
    decoder inputs: then a source whose batches carry them (:class:`DecoderInputsFromLabels`), or a one-line
    DataError when the model has no public way to derive them."""
    if not derives_decoder_inputs(model):
        return source
    inputs, _ = source.example()
    if not isinstance(inputs, dict) or any(k in inputs for k in DECODER_KEYS):
        return source
    derive = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if derive is None:
        raise DataError(
            f"{type(model).__name__} derives its decoder's inputs from its labels inside forward, and dptrain calls "
            "the model without the labels (the per-example loss reads them): put decoder_input_ids in each batch "
            "(the labels shifted right behind the decoder's start token, as the model's forward shifts them)"
        )
    return DecoderInputsFromLabels(source, derive)


__all__ = ["DecoderInputsFromLabels", "derives_decoder_inputs", "with_decoder_inputs"]
