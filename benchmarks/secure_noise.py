"""Cost of ``privacy.secure_noise``: a DP-SGD step on cnn28 with the AES-256-CTR stream (hardened Gaussian sampler,
secure Poisson sampling) against the same step with the default torch stream, in one process.

Data: random tensors shaped like Fashion-MNIST (N = 60000, x ~ N(0, 1), 10 classes), Poisson sampling with expected
batch 256, layerwise per-example gradients, flat clipping at 1, noise multiplier 1. Rounds are interleaved
(default stream, then secure, then default, ...) and each round times ``--steps`` steps after warm-up; the ratio of
the medians is printed (target: secure / default <= 1.10). The noise stage alone is timed the same way, on
cnn28's parameter shapes.

Usage:  python benchmarks/secure_noise.py [--steps 20] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from dptrain.engine.api import make_private
from dptrain.models.builders import build_model
from dptrain.randomness.generators import Randomness
from dptrain.stages.noise import add_gaussian_noise

N, BATCH, TARGET = 60_000, 256, 1.10


def _trainer(secure: bool, x, y):
    torch.manual_seed(1)
    model = build_model("cnn28", (1, 28, 28), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return make_private(
        model,
        optimizer,
        (x, y),
        noise_multiplier=1.0,
        batch_size=BATCH,
        accountant="rdp",
        grad_sampler="layerwise",
        randomness=Randomness(secure=secure),
    )


def _time_steps(trainer, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    return (time.perf_counter() - start) / steps


def _time_noise(stream, params, repeats: int = 20) -> float:
    summed = {n: torch.zeros_like(p) for n, p in params}
    start = time.perf_counter()
    for _ in range(repeats):
        add_gaussian_noise(summed, 1.0, stream)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 1, 28, 28, generator=g), torch.randint(0, 10, (N,), generator=g)
    trainers = {"default": _trainer(False, x, y), "secure": _trainer(True, x, y)}
    params = list(trainers["default"].params.items())
    streams = {"default": Randomness().stream("noise"), "secure": Randomness(secure=True).stream("noise")}
    for t in trainers.values():
        _time_steps(t, 3)  # warm-up
    step_times = {k: [] for k in trainers}
    noise_times = {k: [] for k in trainers}
    for r in range(args.rounds):
        for k in sorted(trainers, reverse=bool(r % 2)):  # alternate the order between rounds
            step_times[k].append(_time_steps(trainers[k], args.steps))
            noise_times[k].append(_time_noise(streams[k], params))
    med = {k: statistics.median(v) for k, v in step_times.items()}
    noise = {k: statistics.median(v) for k, v in noise_times.items()}
    ratio = med["secure"] / med["default"]
    print(f"cnn28, expected batch {BATCH}, N = {N}, {args.rounds} interleaved rounds of {args.steps} steps")
    for k in trainers:
        print(f"  {k:>8} stream: {1000 * med[k]:7.2f} ms/step   (noise stage alone {1000 * noise[k]:6.2f} ms)")
    verdict = "meets" if ratio <= TARGET else "MISSES"
    print(f"  secure / default: {ratio:.3f} per step ({verdict} the target <= {TARGET})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "machine": platform.platform(),
                    "threads": torch.get_num_threads(),
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "ms_per_step": {k: 1000 * v for k, v in med.items()},
                    "ms_noise_stage": {k: 1000 * v for k, v in noise.items()},
                    "ratio_secure_over_default": ratio,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
