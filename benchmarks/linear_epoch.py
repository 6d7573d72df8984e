"""One epoch of DP logistic regression on Fashion-MNIST (the model of Sun, Suresh & Menon's DPSGD-F): seconds per epoch, against
non-private SGD in the same process.

Multinomial logistic regression (784 x 10 + 10 parameters) on the 60,000 training images (raw pixels in
[0, 1], normalized to norm 1; random data of that shape if Fashion-MNIST is not installed). Ways, interleaved
over rounds (median reported):

  1. non-private PyTorch: SGD on random batches of B indices, mean cross-entropy, one backward per step;
  2. dptrain, closed-form per-example gradients (the layerwise backend: for a Linear layer the per-example
     gradient is the outer product of the features and the residuals p - e_y, taken from ONE batched backward
     pass; its norm is ||x|| ||p - e_y|| and the clipped sum is one matmul), Poisson sampling;
  3. dptrain with the torch.func backend (vmap over autograd), for comparison.

Usage:  python benchmarks/linear_epoch.py [--batch 1024] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch


def load(n_fallback: int = 60000) -> tuple[torch.Tensor, torch.Tensor, str]:
    from dptrain.dpsgd_f import normalize_features

    try:
        from dptrain.data.loaders import load_dataset

        data = load_dataset("fashion-mnist", pixels="raw")
        return normalize_features(data.train.x, 1.0), data.train.y, "Fashion-MNIST train (60,000)"
    except Exception:  # noqa: BLE001  (a benchmark: fall back to data of the same shape)
        g = torch.Generator().manual_seed(0)
        x = torch.rand(n_fallback, 784, generator=g)
        return (
            normalize_features(x, 1.0),
            torch.randint(0, 10, (n_fallback,), generator=g),
            "random [0,1] pixels",
        )


def non_private_epoch(x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    model = torch.nn.Linear(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for _ in range(max(1, len(x) // batch)):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def private_epoch(x: torch.Tensor, y: torch.Tensor, batch: int, backend: str) -> float:
    from dptrain.engine.api import make_private

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = make_private(
        model, opt, (x, y), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=batch, grad_sampler=backend
    )
    start = time.perf_counter()
    trainer.train(epochs=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    x, y, what = load()
    ways = {
        "non-private PyTorch": lambda: non_private_epoch(x, y, args.batch),
        "dptrain closed form (layerwise)": lambda: private_epoch(x, y, args.batch, "layerwise"),
        "dptrain torch.func (vmap)": lambda: private_epoch(x, y, args.batch, "func"),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
        for k in order:
            times[k].append(ways[k]())
    base = statistics.median(times["non-private PyTorch"])
    print(
        f"one epoch of {what}, logical batch {args.batch}, median of {args.rounds} rounds, {torch.get_num_threads()} threads"
    )
    print(f"{'way':<34}{'s/epoch':>10}{'vs non-private':>16}")
    rows = []
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append({"way": k, "seconds_per_epoch": med, "ratio_vs_non_private": med / base, "all": ts})
        print(f"{k:<34}{med:>10.3f}{med / base:>15.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "machine": platform.platform(),
                    "processor": platform.processor(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "batch": args.batch,
                    "data": what,
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
