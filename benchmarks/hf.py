"""Hugging Face models: dptrain's DP step against Opacus' (hooks and ghost clipping), alternated step by step in one
process, under the same settings (threads, data, batch, clip norm, noise multiplier, plain SGD).

    python benchmarks/hf.py --case gpt2-lora --steps 60
    python benchmarks/hf.py --case bert-full --steps 60

Cases (random weights from config objects; random token ids, a binary label per sequence; sequence classification):

- ``gpt2-lora``: GPT-2 (4 layers, width 256, 4 heads, vocabulary 2000), peft LoRA r = 8 on c_attn and c_proj: only
  the adapters and the score head train;
- ``bert-full``: BERT (4 layers, width 256, 4 heads, vocabulary 2000), every parameter trains.

Ways: dptrain's own step (``make_private``), dptrain in your own loop (``make_private_loop``, as a Trainer script
uses it), Opacus' hooks and ghost clipping.

Batches of 32 sequences of 64 tokens (fixed size for every way: Opacus' Poisson sampler and dptrain's are not the
same draw), one thread by default (``--threads``). dptrain's checks on the model before training (the probe and the
gradient check) are made once, before the timing, and reported beside it. Prints median milliseconds per step and
the ratios of Opacus' times to dptrain's (above 1: dptrain is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T, B, N = 2000, 64, 32, 4096


class Logits(nn.Module):
    """The model's logits (Opacus' loop calls the module and a criterion on its output), with position ids (and BERT's
    token type ids) passed per example: Opacus' hooks fail on the broadcast ones transformers makes by itself (the
    workaround its users write; dptrain takes the model as it is)."""

    def __init__(self, model: nn.Module, bert: bool):
        super().__init__()
        self.model, self.bert = model, bert

    def forward(self, input_ids):
        b, t = input_ids.shape
        extra = {"position_ids": torch.arange(t).expand(b, t).contiguous()}
        if self.bert:
            extra["token_type_ids"] = torch.zeros_like(input_ids)
        return self.model(input_ids=input_ids, **extra).logits


def build(case: str, seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    if case == "gpt2-lora":
        import peft

        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=256, n_layer=4, n_head=4,
                                      num_labels=2, pad_token_id=0, bos_token_id=1, eos_token_id=1)
        model = transformers.GPT2ForSequenceClassification(cfg)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                               modules_to_save=["score"], task_type="SEQ_CLS")
        return peft.get_peft_model(model, lora)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=1024, max_position_embeddings=T, num_labels=2)
    return transformers.BertForSequenceClassification(cfg)


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (N, T), generator=g)
    return ids, (ids[:, 0] % 2)


class DptrainWay:
    name = "dptrain"

    def __init__(self, case: str, ids, y):
        from dptrain.engine.api import make_private

        model = build(case, 0)
        params = [p for p in model.parameters() if p.requires_grad]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            self.trainer = make_private(model, torch.optim.SGD(params, lr=0.1), ({"input_ids": ids}, y),
                                        noise_multiplier=1.0, max_grad_norm=1.0, batch_size=B, sampling="fixed_size",
                                        seed=0)
            self.setup_s = time.perf_counter() - start
        self.backend = self.trainer.grad_sampler.name

    def step(self) -> None:
        self.trainer.step()


class LoopWay:
    """dptrain in your own loop (``make_private_loop``: the loop body calls the model, ``loop.backward`` and the
    optimizer, as a Trainer script does), with its checks of the model's state at each point of the loop."""

    name = "dptrain loop"

    def __init__(self, case: str, ids, y):
        from dptrain.engine.private_loop import make_private_loop

        self.model = build(case, 0)
        self.opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.loop = make_private_loop(self.model, self.opt, ({"input_ids": ids}, y), noise_multiplier=1.0,
                                          max_grad_norm=1.0, batch_size=B, sampling="fixed_size", seed=0)
        self.batches = iter(self.loop.batches(steps=10**6))

    def step(self) -> None:
        """One logical batch: its chunks, until the optimizer's step applies the release."""
        while True:
            inputs, labels = next(self.batches)
            self.loop.backward(F.cross_entropy(self.model(**inputs).logits, labels, reduction="none"))
            self.opt.step()
            self.opt.zero_grad()
            if not self.loop.step_skipped:
                return


class OpacusWay:
    def __init__(self, case: str, ids, y, mode: str):
        from opacus import PrivacyEngine

        self.name = f"opacus {mode}"
        torch.manual_seed(0)
        model = Logits(build(case, 0), bert=case == "bert-full")
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y), batch_size=B, shuffle=True,
                                             drop_last=True)
        common = dict(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                      poisson_sampling=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode == "ghost":
                self.model, self.opt, self.criterion, self.loader = PrivacyEngine().make_private(
                    **common, criterion=nn.CrossEntropyLoss(), grad_sample_mode="ghost"
                )
            else:
                self.model, self.opt, self.loader = PrivacyEngine().make_private(**common, grad_sample_mode=mode)
                self.criterion = F.cross_entropy
        self.batches = self._forever()

    def _forever(self):
        while True:
            yield from self.loader

    def step(self) -> None:
        xb, yb = next(self.batches)
        self.model.train()
        loss = self.criterion(self.model(xb), yb)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["gpt2-lora", "bert-full"], default="gpt2-lora")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ids, y = data()
    ways = [DptrainWay(args.case, ids, y), LoopWay(args.case, ids, y)]
    for mode in ("hooks", "ghost"):
        try:
            ways.append(OpacusWay(args.case, ids, y, mode))
        except Exception as e:  # noqa: BLE001  (a way Opacus refuses is reported, not fatal)
            print(f"opacus {mode}: refused at make_private ({type(e).__name__}: {' '.join(str(e).split())[:120]})")
    times: dict[str, list[float]] = {w.name: [] for w in ways}
    for i in range(args.steps + 3):
        for w in list(ways):
            t0 = time.perf_counter()
            try:
                w.step()
            except Exception as e:  # noqa: BLE001
                print(f"{w.name}: fails at step ({type(e).__name__}: {' '.join(str(e).split())[:120]})")
                ways.remove(w)
                continue
            if i >= 3:  # warm-up steps not timed
                times[w.name].append(time.perf_counter() - t0)
    d = ways[0]
    print(f"{args.case}, batch {B} x {T} tokens, {args.threads} thread(s), {args.steps} alternated steps "
          f"(dptrain backend {d.backend}; its model checks before training: {d.setup_s:.2f} s, of which the gradient "
          f"check {d.trainer.gradient_check.seconds:.2f} s, not in the step time)")
    base = statistics.median(times["dptrain"])
    for w in ways:
        med = statistics.median(times[w.name])
        print(f"  {w.name:<14} {med * 1e3:8.1f} ms/step   {w.name} / dptrain {med / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
