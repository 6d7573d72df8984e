"""A/B timing of dptrain's step against non-private PyTorch, step by step: one non-private step, then one dptrain
step, ``--steps`` times, so both see the same machine at every moment (these machines are noisy). Prints the median
step times, their ratio and the spread of the ratio over 20 blocks of steps.

    python benchmarks/alternate.py --model logistic --batch 1024 --steps 2000
    python benchmarks/alternate.py --model resnet20 --batch 128 --steps 40

Random data (N = 60000, seeded), fixed-size batches, freed memory kept (as ``dptrain train`` does), a seed (the
not-private warning is silenced: this is a benchmark). To compare two versions of dptrain, run the same command with
``PYTHONPATH`` pointing at the other version's ``src``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from common import SHAPES, N, random_data

from dptrain.engine.api import make_private
from dptrain.models.builders import build_model
from dptrain.runs.cpu_memory import keep_freed_memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="logistic")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    keep_freed_memory()
    shape, b = SHAPES[args.model], args.batch
    x, y, g = random_data(shape)

    def fresh():
        torch.manual_seed(1)
        m = build_model(args.model, shape, 10)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    model, opt = fresh()

    def nonprivate():
        idx = torch.randint(0, N, (b,), generator=g)
        model.train()
        loss = F.cross_entropy(model(x.index_select(0, idx)), y.index_select(0, idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    dp_model, dp_opt = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make_private(
            dp_model, dp_opt, (x, y), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=b, sampling="fixed_size",
            seed=0,
        )
    for _ in range(5):
        nonprivate()
        trainer.step()
    a, d = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        nonprivate()
        t1 = time.perf_counter()
        trainer.step()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        d.append(t2 - t1)
    block = max(1, args.steps // 20)
    blocks = [sum(a[i : i + block]) / sum(d[i : i + block]) for i in range(0, args.steps, block)]
    ma, md = statistics.median(a), statistics.median(d)
    print(
        f"{args.model}, batch {b}, {args.steps} alternated steps: non-private {ma * 1e3:.3f} ms, dptrain "
        f"{md * 1e3:.3f} ms per step (medians); non-private / dptrain {ma / md:.2f}x "
        f"(over 20 blocks: median {statistics.median(blocks):.2f}, {min(blocks):.2f}..{max(blocks):.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
