"""Generate the small public text data set of configs/hf_gpt2_lora.toml (run from the repository root):

    .venv/bin/python configs/data/make_months.py

Each line is a direction followed by consecutive months in that direction, wrapping around the year, e.g.
``up nov dec jan feb`` or ``down mar feb jan dec``: after the first month every next word follows from the direction
and the word before it, a rule a small causal language model learns. Written, seeded (the same files on every
machine):

- ``months_train.jsonl`` (600 lines) and ``months_test.jsonl`` (200 lines, drawn separately: a public test set),
  JSON lines ``{"text": "..."}``;
- ``months_tokenizer/``: a word-level tokenizer over the fixed vocabulary below (``[PAD]``, ``[UNK]``, ``[EOS]``,
  the two directions, the twelve months), built with ``tokenizers`` and saved with transformers'
  ``PreTrainedTokenizerFast.save_pretrained``. Its vocabulary is the generator's, fixed in advance, never learnt
  from the text (a vocabulary learnt from private text would publish words of it).

Needs the hf extra (``pip install 'dptrain[hf]'``) for the tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DIRECTIONS = ("up", "down")
SPECIAL = ("[PAD]", "[UNK]", "[EOS]")
VOCAB = (*SPECIAL, *DIRECTIONS, *MONTHS)
TRAIN, TEST, SEED = 600, 200, 2026


def lines(count: int, rng: np.random.Generator) -> list[str]:
    out = []
    for _ in range(count):
        step = 1 if rng.random() < 0.5 else -1
        start, length = int(rng.integers(12)), int(rng.integers(3, 9))
        words = [MONTHS[(start + step * i) % 12] for i in range(length)]
        out.append(" ".join([DIRECTIONS[step < 0], *words]))
    return out


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(directory)


def main(out: Path) -> None:
    rng = np.random.default_rng(SEED)
    out.mkdir(parents=True, exist_ok=True)
    for name, count in (("months_train.jsonl", TRAIN), ("months_test.jsonl", TEST)):
        text = "".join(json.dumps({"text": line}) + "\n" for line in lines(count, rng))
        (out / name).write_text(text)
    write_tokenizer(out / "months_tokenizer")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
