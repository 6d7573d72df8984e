"""Where the time of a DP step goes: dptrain's step and a non-private step alternated in one process, each split into
its stages, so that the DP overhead (dptrain's step time minus the non-private one) can be read stage by stage.

    python benchmarks/breakdown.py --model resnet20 --batch 128 --steps 20
    python benchmarks/breakdown.py --model cnn28 --batch 256 --steps 200
    python benchmarks/breakdown.py --model logistic --batch 1024 --steps 2000

Stages of dptrain's step (timed by wrapping the stage objects of one trainer; the rest is the step's own work):
batch selection, gathering the batch, forward pass (with the layer records), backward pass to the layer outputs,
per-example gradients by layer type (the layerwise rules), clipping (norms, weighted sums), noise, optimizer, and the
rest (non-finite checks, ledger entry, atomic step, signal deferral, Python). Stages of the non-private step: indices,
gathering, forward, backward (input and weight gradients), optimizer.

"Kernel floor" is what a DP step would take with no engine at all: the non-private step, minus its batched weight
gradients, plus dptrain's per-example gradients, clipping and noise (the batched weight gradients are measured as the
non-private backward pass minus a backward pass to the layer outputs only, both in this process). Its ratio to the
non-private step bounds what any engine using the same per-example kernels can reach on this machine.

Random data (N = 60000, seeded), fixed-size batches, freed memory kept (as ``dptrain train`` does), a seed (the
not-private warning is silenced: this is a benchmark). Medians over the alternated steps.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from common import SHAPES, N, random_data

import dptrain.engine.trainer as engine
from dptrain.models.builders import build_model
from dptrain.runs.cpu_memory import keep_freed_memory

#: the layer types of the per-example rules this breakdown names (others are counted under "other layers")
LAYER_TYPES = (torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.Linear, torch.nn.LayerNorm)


#: autograd.grad as torch defines it (dptrain's calls to it are timed by a wrapper; the non-private ones are not)
AUTOGRAD_GRAD = torch.autograd.grad


class TimedClipping:
    """A clipping rule whose clip_and_sum is timed as the "clipping" stage."""

    def __init__(self, rule, clock: Clock):
        self.sensitivity, self.facts = rule.sensitivity, getattr(rule, "facts", {})
        self.clip_and_sum = clock.wrap("clipping", rule.clip_and_sum)


class Clock:
    """Seconds per named stage within one step (reset before each step)."""

    def __init__(self):
        self.now: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, f):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.now[name] += time.perf_counter() - t0

        return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="resnet20")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--channels-last", action="store_true", help="model and data in channels_last (NHWC), both ways")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()
    shape, b = SHAPES[args.model], args.batch
    x, y, g = random_data(shape)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=layout)

    def fresh():
        torch.manual_seed(1)
        m = build_model(args.model, shape, 10).to(memory_format=layout)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    # -- the non-private step, stage by stage, and its backward pass to the layer outputs only ------------------
    model, opt = fresh()
    outputs: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, LAYER_TYPES):
            m.register_forward_hook(lambda mod, i, o: outputs.append(o))

    def nonprivate(to_outputs: bool = False) -> dict[str, float]:
        t = [time.perf_counter()]

        def mark():
            t.append(time.perf_counter())

        idx = torch.randint(0, N, (b,), generator=g)
        mark()
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        mark()
        outputs.clear()
        loss = F.cross_entropy(model(xb), yb)
        mark()
        if to_outputs:
            AUTOGRAD_GRAD(loss, outputs)
            mark()
            return {"backward to outputs": t[4] - t[3]}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark()
        opt.step()
        mark()
        names = ("batch selection", "gather", "forward", "backward", "optimizer")
        return {n: t[i + 1] - t[i] for i, n in enumerate(names)}

    # -- dptrain's step, its stages wrapped ----------------------------------------------------------------------
    dp_model, dp_opt = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the seed's not-private warning: expected in a benchmark
        trainer = engine.make_private(
            dp_model, dp_opt, (x, y), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=b, sampling="fixed_size",
            seed=0,
        )
    clock = Clock()
    sampler = trainer.sampler
    object.__setattr__(sampler, "sample", clock.wrap("batch selection", sampler.sample))
    trainer.data.batch = clock.wrap("gather", trainer.data.batch)
    grad_sampler = trainer.grad_sampler
    backend = getattr(grad_sampler, "backend", grad_sampler)
    trainer.grad_sampler = clock.wrap("per-example total", grad_sampler)
    for m, (prefix, rule) in list(getattr(backend, "_layers", {}).items()):
        kind = type(m).__name__ if isinstance(m, LAYER_TYPES) else "other layers"
        backend._layers[m] = (prefix, clock.wrap(f"per-example {kind}", rule))
    trainer.clipping = TimedClipping(trainer.clipping, clock)
    real_noise = engine.add_gaussian_noise
    engine.add_gaussian_noise = clock.wrap("noise", real_noise)
    torch.autograd.grad = clock.wrap("backward to outputs", AUTOGRAD_GRAD)
    dp_opt.step = clock.wrap("optimizer", dp_opt.step)

    def dp() -> dict[str, float]:
        clock.now.clear()
        t0 = time.perf_counter()
        trainer.step()
        total = time.perf_counter() - t0
        s = dict(clock.now)
        inner = s.pop("per-example total", 0.0)
        rules = sum(v for k, v in s.items() if k.startswith("per-example"))
        s["forward"] = inner - rules - s.get("backward to outputs", 0.0)
        s["rest of the step"] = total - sum(s.values())
        s["total"] = total
        return s

    try:
        for _ in range(3):
            nonprivate(), nonprivate(True), dp()
        np_times, np_out, dp_times = collections.defaultdict(list), [], collections.defaultdict(list)
        for _ in range(args.steps):
            for k, v in nonprivate().items():
                np_times[k].append(v)
            np_out.append(nonprivate(True)["backward to outputs"])
            for k, v in dp().items():
                dp_times[k].append(v)
    finally:
        engine.add_gaussian_noise, torch.autograd.grad = real_noise, AUTOGRAD_GRAD
        trainer.grad_sampler = grad_sampler
        trainer.close()

    med_np = {k: statistics.median(v) for k, v in np_times.items()}
    med_np["total"] = statistics.median([sum(step) for step in zip(*np_times.values(), strict=True)])
    med_dp = {k: statistics.median(v) for k, v in dp_times.items()}
    batched_weight_grads = med_np["backward"] - statistics.median(np_out)
    per_example = sum(v for k, v in med_dp.items() if k.startswith("per-example"))
    floor = med_np["total"] - batched_weight_grads + per_example + med_dp.get("clipping", 0) + med_dp.get("noise", 0)

    print(f"{args.model}, batch {b}, {'channels_last, ' if args.channels_last else ''}{args.steps} alternated steps, "
          f"torch threads {torch.get_num_threads()} (medians, ms)")
    order = ["batch selection", "gather", "forward", "backward", "backward to outputs",
             *sorted(k for k in med_dp if k.startswith("per-example")), "clipping", "noise", "optimizer",
             "rest of the step", "total"]
    print(f"  {'stage':28s} {'non-private':>12s} {'dptrain':>10s}")
    for k in order:
        a = f"{med_np[k] * 1e3:12.3f}" if k in med_np else " " * 12
        d = f"{med_dp[k] * 1e3:10.3f}" if k in med_dp else " " * 10
        print(f"  {k:28s} {a} {d}")
    print(f"  batched weight gradients in the non-private backward: {batched_weight_grads * 1e3:.3f} ms")
    print(f"  non-private / dptrain: {med_np['total'] / med_dp['total']:.2f}x; kernel floor {floor * 1e3:.3f} ms, "
          f"non-private / floor: {med_np['total'] / floor:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "model": args.model, "batch": b, "channels_last": args.channels_last, "steps": args.steps, "threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "nonprivate_median_s": med_np, "dptrain_median_s": med_dp,
                "batched_weight_gradients_s": batched_weight_grads, "kernel_floor_s": floor,
            }, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
