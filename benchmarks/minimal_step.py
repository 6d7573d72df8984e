"""How close to non-private speed can a DP-SGD step of softmax regression get on this machine?

Three steps alternate, one after the other, for ``--steps`` rounds (so that all three see the same machine):

- non-private PyTorch: a batch of ``--batch`` random rows (index_select), cross-entropy, backward, SGD;
- a minimal DP-SGD step written by hand for this one model: the same batch, the softmax regression's closed-form
  per-example gradients (p - e_y) x^T kept as their two factors, norms ||p - e_y|| sqrt(||x||^2 + 1), one matmul for
  the clipped sum, Gaussian noise, SGD. No secret streams, no sampling without replacement, no non-finite checks, no
  ledger, no atomic step: a floor for what any engine can reach, NOT a private implementation;
- dptrain's step (``make_private``, fixed-size batches, the layerwise backend, a seed).

It prints the medians of the three step times and the ratios of non-private time to each DP step's time
(the scale issue's target for dptrain: >= 0.85x).

    python benchmarks/minimal_step.py [--batch 1024] [--steps 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from common import SHAPES, N, random_data

from dptrain.engine.api import make_private
from dptrain.models.builders import build_model
from dptrain.runs.cpu_memory import keep_freed_memory

SHAPE, CLASSES = SHAPES["logistic"], 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()
    b = args.batch
    x, y, g = random_data(SHAPE)

    def model():
        torch.manual_seed(1)
        m = build_model("logistic", SHAPE, CLASSES)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m_np, opt_np = model()

    def nonprivate():
        idx = torch.randint(0, N, (b,), generator=g)
        loss = F.cross_entropy(m_np(x.index_select(0, idx)), y.index_select(0, idx))
        opt_np.zero_grad(set_to_none=True)
        loss.backward()
        opt_np.step()

    m_min, opt_min = model()
    lin, noise = m_min[1], torch.Generator().manual_seed(2)

    def minimal():
        idx = torch.randint(0, N, (b,), generator=g)
        xb, yb = x.index_select(0, idx).flatten(1), y.index_select(0, idx)
        with torch.no_grad():
            delta = torch.addmm(lin.bias, xb, lin.weight.T).softmax(1)
            delta[torch.arange(b), yb] -= 1  # d loss_i / d logits_i
            norms = (delta.square().sum(1) * (xb.square().sum(1) + 1)).sqrt()
            delta *= torch.clamp(1.0 / norms.clamp_min(1e-12), max=1.0)[:, None]  # clip to 1
            gw, gb = delta.T @ xb, delta.sum(0)
            gw.add_(torch.randn(gw.shape, generator=noise)).mul_(1 / b)
            gb.add_(torch.randn(gb.shape, generator=noise)).mul_(1 / b)
        lin.weight.grad, lin.bias.grad = gw, gb
        opt_min.step()
        opt_min.zero_grad(set_to_none=True)

    m_dp, opt_dp = model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seed's not-private warning: expected in a benchmark
        trainer = make_private(
            m_dp, opt_dp, (x, y), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=b, sampling="fixed_size", seed=0
        )
    ways = {"nonprivate": nonprivate, "minimal": minimal, "dptrain": trainer.step}
    for _ in range(20):
        for f in ways.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.steps):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"softmax regression, batch {b}, {args.steps} alternated steps each, torch threads {torch.get_num_threads()}")
    for k, v in med.items():
        ratio = "" if k == "nonprivate" else f"   non-private / this: {med['nonprivate'] / v:.2f}x"
        print(f"  {k:11s} {v * 1e3:7.3f} ms per step (median){ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": b, "steps": args.steps, "median_s": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
