"""The checks before the first step of a 2-layer GPT-2 + LoRA: how long make_private takes, against the steps.

    python benchmarks/preflight.py --repeats 5

The model: transformers' GPT2LMHeadModel from a config object (2 layers, width 256, 4 heads, vocabulary 2000, 64
positions, random weights), peft LoRA r = 8 on c_attn and c_proj (fan_in_fan_out), 4096 random sequences of 64 tokens,
Poisson batches of expected size 32 (the probe reads the largest batch the sampler plausibly draws: 56 examples), the
causal-LM loss, one thread by default (``--threads``). Each repeat builds the model afresh and times
``make_private`` (every check: labels, the float64 comparison of each example with itself alone, coverage, buffers,
mixing at the probe's chunk), then the first step (which may compare its chunk's new batch size) and a later step.
Prints the median and the range. To time another version: ``PYTHONPATH=<its src> python benchmarks/preflight.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

VOCAB, T, B, N = 2000, 64, 32, 4096


def build(seed: int):
    import peft
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=256, n_layer=2, n_head=4, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    return peft.get_peft_model(model, lora)


def once(ids: torch.Tensor, sampling: str) -> dict[str, float]:
    from dptrain.engine.api import make_private

    model = build(0)
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        trainer = make_private(model, torch.optim.SGD(params, lr=0.1), ({"input_ids": ids}, ids), noise_multiplier=1.0,
                               max_grad_norm=1.0, batch_size=B, sampling=sampling)
        checks = time.perf_counter() - start
        times = []
        for _ in range(3):
            start = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - start)
    check = trainer.gradient_check
    return {"checks": checks, "gradient_check": check.seconds if check is not None else float("nan"),
            "first_step": times[0], "step": statistics.median(times[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sampling", default="poisson", choices=["poisson", "fixed_size"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (N, T), generator=g)
    once(ids, args.sampling)  # (warm-up: first calls into torch and transformers)
    runs = [once(ids, args.sampling) for _ in range(args.repeats)]
    import dptrain

    print(f"2-layer GPT-2 + LoRA, {args.sampling} batches of {B} x {T} tokens, {args.threads} thread(s), "
          f"{args.repeats} repeats ({dptrain.__file__})")
    for key, label in [("checks", "make_private (all checks)"), ("gradient_check", "  of which the gradient check"),
                       ("first_step", "first step"), ("step", "later step")]:
        values = [r[key] for r in runs]
        print(f"  {label:<30} median {statistics.median(values):6.2f} s   range {min(values):.2f}-{max(values):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
