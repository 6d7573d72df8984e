"""Cost of banded matrix factorization (``noise = "bandmf"``, docs/bandmf.md): a BandMF step on cnn28 against a DP-SGD
step, in one process.

Data: random tensors shaped like Fashion-MNIST (N = 60000, x ~ N(0, 1), 10 classes), expected batch 256 (Poisson for
DP-SGD; cyclic Poisson over b groups at rate b q for BandMF: the same expected batch), layerwise per-example
gradients, flat clipping at 1, noise multiplier 1. BandMF's coefficients are optimized for 10 epochs (2344 steps);
b = 234 is the most bands with b q <= 1 at this batch. Rounds are interleaved (the order rotated between rounds) and
each round takes ``--steps`` steps of every way, one step of each way in turn, after warm-up (so that the load of a
shared machine hits every way alike); the ratio of the medians over rounds is printed (target: BandMF /
DP-SGD <= 1.10). The noise stage alone (C^{-1} Z from the b - 1 previous noise vectors against one Gaussian draw) is
timed the same way, on cnn28's parameters, and the extra memory is the noise history: b - 1 vectors of the model's
size (float32; float64 with secure noise).

Usage:  python benchmarks/bandmf_step.py [--bands 8,64,234] [--steps 20] [--rounds 5] [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import warnings

import torch

from dptrain.engine.api import make_private
from dptrain.models.builders import build_model
from dptrain.randomness.generators import Randomness
from dptrain.stages.correlated_noise import BandedNoise
from dptrain.stages.noise import add_gaussian_noise

N, BATCH, TARGET, PLANNED = 60_000, 256, 1.10, 2344


def _trainer(bands: int | None, x, y, device: str):
    torch.manual_seed(1)
    model = build_model("cnn28", (1, 28, 28), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = {} if bands is None else {"noise": "bandmf", "bands": bands, "planned_steps": PLANNED}
    return make_private(
        model,
        optimizer,
        (x, y),
        noise_multiplier=1.0,
        batch_size=BATCH,
        accountant="rdp",
        grad_sampler="layerwise",
        randomness=Randomness(),
        device=device,
        **noise,
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_steps(trainer, steps: int) -> float:
    _sync(str(trainer.device))
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    _sync(str(trainer.device))
    return (time.perf_counter() - start) / steps


def _time_noise(stage, params, repeats: int = 20) -> float:
    """One step's noise: a fresh sum of every parameter's shape noised by ``stage`` (BandMF's with a full history)."""
    summed = {n: torch.zeros_like(p) for n, p in params}
    stream = Randomness().stream("noise")
    device = str(params[0][1].device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        stage(dict(summed), 1.0, stream)
        if isinstance(stage, BandedNoise):
            stage.commit()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bands", default="8,64,234", help="comma-separated numbers of bands")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model, its gradients and the noise)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    bands = [int(b) for b in args.bands.split(",")]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 1, 28, 28, generator=g), torch.randint(0, 10, (N,), generator=g)
    dev = args.device
    ways = {"dpsgd": _trainer(None, x, y, dev), **{f"bandmf b={b}": _trainer(b, x, y, dev) for b in bands}}
    params = list(ways["dpsgd"].params.items())
    size = sum(p.numel() for _, p in params)
    stages = {"dpsgd": add_gaussian_noise}
    for b in bands:
        t = ways[f"bandmf b={b}"]
        stage, count = BandedNoise(t.bandmf.coefficients, lambda: 0), {"t": 0}
        stage.index_of = lambda c=count, s=stage: c.__setitem__("t", s.count) or s.count
        stages[f"bandmf b={b}"] = stage
        _time_noise(stage, params, repeats=b)  # fill the history: the steady state
    for t in ways.values():
        _time_steps(t, 3)  # warm-up
    step_times = {k: [] for k in ways}
    noise_times = {k: [] for k in ways}
    order = list(ways)
    for r in range(args.rounds):
        spent = dict.fromkeys(ways, 0.0)
        for i in range(args.steps):  # one step of each way in turn (the order rotated): load hits every way alike
            j = (r * args.steps + i) % len(order)
            for k in order[j:] + order[:j]:
                spent[k] += _time_steps(ways[k], 1)
        for k in order:
            step_times[k].append(spent[k] / args.steps)
            noise_times[k].append(_time_noise(stages[k], params))
    med = {k: statistics.median(v) for k, v in step_times.items()}
    noise = {k: statistics.median(v) for k, v in noise_times.items()}
    print(
        f"cnn28 ({size} parameters), expected batch {BATCH}, N = {N}, {args.rounds} interleaved rounds of "
        f"{args.steps} steps, {torch.get_num_threads()} threads, device {dev}"
    )
    rows = {}
    for k in ways:
        b = ways[k].bandmf.bands if ways[k].bandmf is not None else 1
        ratio = med[k] / med["dpsgd"]
        extra = (b - 1) * size * 4
        rows[k] = {
            "ms_per_step": 1000 * med[k],
            "ms_noise_stage": 1000 * noise[k],
            "ratio_over_dpsgd": ratio,
            "noise_history_bytes": extra,
        }
        verdict = "" if k == "dpsgd" else f"  {ratio:.3f} x DP-SGD ({'meets' if ratio <= TARGET else 'MISSES'} <= {TARGET})"
        print(
            f"  {k:>13}: {1000 * med[k]:7.2f} ms/step (noise stage {1000 * noise[k]:6.3f} ms; extra memory "
            f"{extra / 2**20:6.2f} MiB = {b - 1} model copies){verdict}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": datetime.date.today().isoformat(),
                    "machine": platform.platform(),
                    "threads": torch.get_num_threads(),
                    "device": dev if dev == "cpu" else torch.cuda.get_device_name(),
                    "parameters": size,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "ways": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
