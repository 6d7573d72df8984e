"""Throughput and peak-memory benchmark: dptrain against non-private PyTorch and Opacus.

Trains one of the scale issue's models (``--model``: the 28x28 CNN ``cnn28`` and ``logistic`` on 1x28x28 inputs,
``resnet20`` with GroupNorm on 3x32x32) on random data (x ~ N(0, 1), y uniform in 0..9, N = 60000 by default,
generated once with a fixed seed).

Throughput (all ways in this one process, logical batch --batch (256 by default), interleaved rounds with rotated order; the
median samples/second over rounds is reported, samples = examples actually processed):

  1. non-private PyTorch: SGD(lr=0.1), 256 random indices per step, mean cross-entropy.
  2. dptrain, layerwise per-example gradients (``grad_sampler="layerwise"``), Poisson sampling.
  3. dptrain, torch.func (vmap) per-example gradients (``grad_sampler="func"``), Poisson sampling.
  4. dptrain with ModelMix's update (Xiao, Wan & Devadas, Algorithm 1; tau = 0.05 lr), layerwise: one mix per
     step on top of DP-SGD; target: its step costs at most 1.1x a DP-SGD step (ratio of throughputs >= 1/1.1).
  5. Opacus (if installed: ``pip install -e '.[bench]'``): PrivacyEngine.make_private with its
     default grad_sample_mode ("hooks") and Poisson sampling, iterating its DataLoader.

Peak memory (``--memory``, on by default; measured first, see memory()): each configuration runs in a
fresh child process (this script with the hidden ``--memory-child WAY LOGICAL PHYSICAL`` mode), which
reports ru_maxrss after building data, model and wrapper (its baseline) and after 3 steps of expected
logical batch 4096.

``--malloc tuned`` first calls ``dptrain.runs.cpu_memory.keep_freed_memory()`` (as ``dptrain train`` does), for the whole
process and so for every way; ``system`` (default) leaves malloc as configured.

``--fixed-batches`` gives every way exactly ``--batch`` examples per step (dptrain's fixed_size sampling, Opacus'
DataLoader without Poisson sampling), so that the ways process the same number of examples per step.

Usage:  python benchmarks/throughput.py [--model cnn28] [--batch 256] [--fixed-batches] [--malloc system|tuned] [--steps 40]
        [--rounds 3] [--n 60000] [--no-memory] [--json PATH] [--ways a,b,...]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from dptrain.engine.api import make_private
from dptrain.modelmix import ModelMixSGD
from dptrain.models.builders import build_model
from dptrain.runs.cpu_memory import keep_freed_memory

try:  # Opacus is optional (the "bench" extra); its rows are skipped without it.
    import opacus
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    OPACUS_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the environment
    opacus = None
    OPACUS_ERROR = str(exc)

#: The models of the scale issue's targets, with the input shape each is benchmarked on.
MODELS = {"cnn28": (1, 28, 28), "resnet20": (3, 32, 32), "logistic": (1, 28, 28)}
NUM_CLASSES = 10
DATA_SEED = 0
MODEL_SEED = 1
LR = 0.1
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0

# Set by main() from --model, --batch and --fixed-batches (module-level so the memory children see them too).
MODEL = "cnn28"
INPUT_SHAPE = MODELS[MODEL]
BATCH = 256
DEVICE = "cpu"  # --device: where the model, its gradients and the noise live (the data stays in CPU memory)
MALLOC = "system"  # or "tuned": dptrain.runs.cpu_memory.keep_freed_memory() for the whole process (every way)
FIXED = False  # every way gets exactly BATCH examples per step (dptrain: fixed_size sampling; Opacus: no Poisson)
WARMUP_STEPS = 3
MEMORY_STEPS = 3
MEMORY_LOGICAL = 4096
MEMORY_PHYSICAL = 256
TARGET_VS_NONPRIVATE = 0.85
TARGET_VS_OPACUS = 1.5  # the scale issue's targets: >= 1.5x Opacus hooks, >= 1.3x Opacus ghost
TARGET_VS_OPACUS_GHOST = 1.3
TARGET_MODELMIX_VS_DPSGD = 1 / 1.1  # a ModelMix step costs at most 1.1x a DP-SGD step

WAYS = (
    "nonprivate",
    "nonprivate-channels-last",
    "dptrain-layerwise",
    "dptrain-layerwise-channels-last",
    "dptrain-func",
    "dptrain-modelmix",
    "opacus",
    "opacus-ghost",
)
LABELS = {
    "nonprivate": "non-private PyTorch",
    "nonprivate-channels-last": "non-private PyTorch, channels_last",
    "nonprivate-fastest": "non-private PyTorch, fastest layout",
    "dptrain-layerwise-channels-last": "dptrain (layerwise), channels_last",
    "dptrain-layerwise": "dptrain (layerwise)",
    "dptrain-func": "dptrain (func/vmap)",
    "dptrain-modelmix": "dptrain + ModelMix (layerwise)",
    "opacus": "Opacus (hooks)",
    "opacus-ghost": "Opacus (ghost clipping)",
}
# (way, logical, physical) for the memory part; opacus with physical < logical uses BatchMemoryManager.
MEMORY_CONFIGS = (
    ("dptrain-layerwise", MEMORY_LOGICAL, MEMORY_PHYSICAL),
    ("dptrain-layerwise", MEMORY_LOGICAL, MEMORY_LOGICAL),
    ("dptrain-func", MEMORY_LOGICAL, MEMORY_PHYSICAL),
    ("opacus", MEMORY_LOGICAL, MEMORY_PHYSICAL),
    ("opacus", MEMORY_LOGICAL, MEMORY_LOGICAL),
    ("opacus-ghost", MEMORY_LOGICAL, MEMORY_LOGICAL),
)


# --- data, models and the ways to train ---------------------------------------------------------------------


def make_data(n: int, seed: int = DATA_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *INPUT_SHAPE, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return x, y


def fresh_model() -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return build_model(MODEL, INPUT_SHAPE, NUM_CLASSES).to(DEVICE)


def synchronize() -> None:
    """Wait for the device's queued work (timings on CUDA must not stop the clock before the kernels finish)."""
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


class Runner:
    """One way of training; ``step()`` takes one logical step and returns the examples it processed."""

    load_s = 0.0  # seconds spent fetching batches from a DataLoader (Opacus only)

    def step(self) -> int:
        raise NotImplementedError


def channels_last(model: torch.nn.Module, x: torch.Tensor):
    """The model and the data in channels_last memory format (NHWC): max_pool2d and the convolutions run faster so."""
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


class NonPrivate(Runner):
    def __init__(self, x, y, batch: int, seed: int, last: bool = False):
        self.x, self.y, self.batch = x, y, batch
        self.model = fresh_model()
        if last:
            self.model, self.x = channels_last(self.model, x)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> int:
        idx = torch.randint(0, len(self.x), (self.batch,), generator=self.gen)
        self.model.train()
        # rows gathered as dptrain gathers them (index_select: twice as fast as x[idx] on the CPU)
        xb = self.x.index_select(0, idx).to(DEVICE, non_blocking=True)
        yb = self.y.index_select(0, idx).to(DEVICE, non_blocking=True)
        loss = F.cross_entropy(self.model(xb), yb)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return self.batch


class DptrainRunner(Runner):
    def __init__(self, x, y, backend: str, logical: int, physical: int, seed: int):
        self.model = fresh_model()
        if backend.endswith("-channels-last"):
            backend = backend.removesuffix("-channels-last")
            self.model, x = channels_last(self.model, x)
        modelmix = backend == "modelmix"
        backend = "layerwise" if modelmix else backend
        opt = (ModelMixSGD if modelmix else torch.optim.SGD)(
            self.model.parameters(), lr=LR, **({"tau": 0.05} if modelmix else {})
        )
        self.trainer = make_private(
            self.model,
            opt,
            (x, y),
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            batch_size=logical,
            max_physical_batch_size=physical,
            grad_sampler=backend,
            sampling="fixed_size" if FIXED else "poisson",
            device=DEVICE,
            seed=seed,
            report_not_private=True,
        )
        if self.trainer.grad_sampler.name != backend:
            raise RuntimeError(f"asked for backend {backend!r}, got {self.trainer.grad_sampler.name!r}")

    def step(self) -> int:
        return self.trainer.step().not_private["batch_size"]  # the realized Poisson batch (random data here)


class OpacusRunner(Runner):
    def __init__(self, x, y, logical: int, physical: int, seed: int, ghost: bool = False):
        torch.manual_seed(seed)  # Opacus' Poisson sampler and noise draw from the global RNG here
        model = fresh_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=logical, shuffle=FIXED, drop_last=FIXED
        )
        common = dict(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            poisson_sampling=not FIXED,
        )
        if ghost:  # fast gradient clipping: Opacus wraps the loss, whose backward does the two passes
            self.model, self.opt, self.criterion, self.loader = PrivacyEngine().make_private(
                **common, criterion=torch.nn.CrossEntropyLoss(), grad_sample_mode="ghost"
            )
        else:
            self.model, self.opt, self.loader = PrivacyEngine().make_private(**common)
            self.criterion = F.cross_entropy
        self.physical = physical if physical is not None and physical < logical else None
        self._batches = self._forever()

    def _forever(self):
        if self.physical is None:
            while True:
                yield from self.loader
        else:
            with BatchMemoryManager(
                data_loader=self.loader, max_physical_batch_size=self.physical, optimizer=self.opt
            ) as split_loader:
                while True:
                    yield from split_loader

    def step(self) -> int:
        # With BatchMemoryManager one logical step spans several physical batches; the DP optimizer
        # only really steps (noise + update) on the last one, which it records in _is_last_step_skipped.
        n = 0
        self.model.train()
        while True:
            t0 = time.perf_counter()
            xb, yb = next(self._batches)
            xb, yb = xb.to(DEVICE, non_blocking=True), yb.to(DEVICE, non_blocking=True)
            self.load_s += time.perf_counter() - t0
            loss = self.criterion(self.model(xb), yb)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            n += len(yb)
            if not self.opt._is_last_step_skipped:
                return n


def make_runner(way: str, x, y, logical: int, physical: int | None, seed: int) -> Runner:
    if way in ("nonprivate", "nonprivate-channels-last"):
        return NonPrivate(x, y, logical, seed, last=way.endswith("channels-last"))
    if way.startswith("dptrain-"):
        return DptrainRunner(x, y, way.removeprefix("dptrain-"), logical, physical, seed)
    if way in ("opacus", "opacus-ghost"):
        return OpacusRunner(x, y, logical, physical, seed, ghost=way == "opacus-ghost")
    raise ValueError(f"unknown way {way!r}")


# --- throughput ---------------------------------------------------------------------------------------------


def time_way(way: str, x, y, steps: int, seed: int) -> dict:
    # physical None: dptrain's automatic chunk (a Poisson batch a little over BATCH is not split in two; Opacus does
    # not split it either)
    runner = make_runner(way, x, y, BATCH, None, seed)
    for _ in range(WARMUP_STEPS):
        runner.step()
    runner.load_s = 0.0
    examples = 0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        examples += runner.step()
    synchronize()
    seconds = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    result = {"examples": examples, "seconds": seconds, "samples_per_s": examples / seconds}
    result["page_faults_per_step"] = faults / steps  # minor faults: memory taken back from the system
    if way.startswith("opacus"):
        result["dataloader_s"] = runner.load_s
    del runner
    gc.collect()
    return result


def throughput(x, y, ways: list[str], steps: int, rounds: int, captured: list[str]) -> dict:
    per_way: dict[str, list[dict]] = {w: [] for w in ways}
    for r in range(rounds):
        order = ways[r % len(ways) :] + ways[: r % len(ways)]
        print(f"  round {r + 1}/{rounds}: " + ", ".join(order), flush=True)
        for way in order:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                per_way[way].append(time_way(way, x, y, steps, seed=r))
            captured.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    summary = {}
    for way, runs in per_way.items():
        rates = [run["samples_per_s"] for run in runs]
        summary[way] = {
            "median_samples_per_s": statistics.median(rates),
            "median_page_faults_per_step": statistics.median(run["page_faults_per_step"] for run in runs),
            "min_samples_per_s": min(rates),
            "max_samples_per_s": max(rates),
            "rounds": runs,
        }
    return summary


def ratios(summary: dict) -> list[dict]:
    rows = []
    for num in ("dptrain-layerwise", "dptrain-func", "dptrain-layerwise-channels-last"):
        for den, target in (
            ("nonprivate", TARGET_VS_NONPRIVATE),
            ("nonprivate-channels-last", TARGET_VS_NONPRIVATE),
            ("opacus", TARGET_VS_OPACUS),
            ("opacus-ghost", TARGET_VS_OPACUS_GHOST),
        ):
            if num in summary and den in summary:
                value = summary[num]["median_samples_per_s"] / summary[den]["median_samples_per_s"]
                rows.append(
                    {
                        "numerator": num,
                        "denominator": den,
                        "ratio": value,
                        "target": target,
                        "met": value >= target,
                    }
                )
    layouts = [w for w in ("nonprivate", "nonprivate-channels-last") if w in summary]
    if len(layouts) == 2:  # against whichever non-private layout was faster in this run
        fastest = max(layouts, key=lambda w: summary[w]["median_samples_per_s"])
        for num in ("dptrain-layerwise", "dptrain-layerwise-channels-last"):
            if num in summary:
                value = summary[num]["median_samples_per_s"] / summary[fastest]["median_samples_per_s"]
                rows.append(
                    {
                        "numerator": num,
                        "denominator": "nonprivate-fastest",
                        "fastest_layout": fastest,
                        "ratio": value,
                        "target": TARGET_VS_NONPRIVATE,
                        "met": value >= TARGET_VS_NONPRIVATE,
                    }
                )
    if "dptrain-modelmix" in summary and "dptrain-layerwise" in summary:
        value = (
            summary["dptrain-modelmix"]["median_samples_per_s"] / summary["dptrain-layerwise"]["median_samples_per_s"]
        )
        rows.append(
            {
                "numerator": "dptrain-modelmix",
                "denominator": "dptrain-layerwise",
                "ratio": value,
                "target": TARGET_MODELMIX_VS_DPSGD,
                "met": value >= TARGET_MODELMIX_VS_DPSGD,
            }
        )
    return rows


# --- peak memory --------------------------------------------------------------------------------------------


def maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def vm_hwm_kib() -> int | None:
    """Peak RSS of this process image (VmHWM, Linux), a cross-check of ru_maxrss; None if unavailable."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
    except OSError:
        return None


def memory_child(way: str, logical: int, physical: int, n: int) -> None:
    """Hidden mode: build data + model + wrapper, report ru_maxrss, take MEMORY_STEPS steps, report again."""
    start_kib = maxrss_kib()  # after imports; includes anything inherited from the parent (see memory())
    x, y = make_data(n)
    runner = make_runner(way, x, y, logical, physical, seed=0)
    baseline, baseline_hwm = maxrss_kib(), vm_hwm_kib()
    examples = [runner.step() for _ in range(MEMORY_STEPS)]
    peak, peak_hwm = maxrss_kib(), vm_hwm_kib()
    out = {"way": way, "logical": logical, "physical": physical, "baseline_kib": baseline, "peak_kib": peak}
    out |= {"start_kib": start_kib, "baseline_vmhwm_kib": baseline_hwm, "peak_vmhwm_kib": peak_hwm}
    out["steps"], out["examples_per_step"] = MEMORY_STEPS, examples
    print("MEMORY_RESULT " + json.dumps(out), flush=True)


def memory(n: int, captured: list[str]) -> list[dict]:
    """Run each memory configuration in a fresh child process.

    Call this before the parent allocates anything large: on Linux a child's ru_maxrss starts from the
    RSS high-water mark of the process that spawned it (fork/vfork + exec carries it over), so a parent
    that already holds the data set and has trained would mask the children's own peaks. The children
    also report VmHWM (the peak of their own process image only) as a cross-check.
    """
    rows = []
    for way, logical, physical in MEMORY_CONFIGS:
        if way.startswith("opacus") and opacus is None:
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--n", str(n), "--model", MODEL]
        cmd += ["--fixed-batches"] if FIXED else []
        cmd += ["--malloc", MALLOC]
        cmd += ["--memory-child", way, str(logical), str(physical)]
        print(f"  {LABELS[way]} {logical}/{physical} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        captured.extend(
            re.sub(r"^.*?:\d+: (?=\w*Warning:)", "", line.strip())
            for line in proc.stderr.splitlines()
            if "Warning:" in line
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("MEMORY_RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            print(f"    failed (exit {proc.returncode}):\n{tail}", flush=True)
            rows.append({"way": way, "logical": logical, "physical": physical, "error": tail})
            continue
        rows.append(json.loads(lines[-1].removeprefix("MEMORY_RESULT ")))
    return rows


# --- reporting ----------------------------------------------------------------------------------------------


def machine_info() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    nproc = None
    if shutil.which("nproc"):
        try:
            nproc = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
        except (subprocess.CalledProcessError, ValueError):
            pass
    if nproc is None:
        nproc = len(os.sched_getaffinity(0))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "opacus": opacus.__version__ if opacus is not None else None,
        "nproc": nproc,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_model": cpu,
        # the vector instructions torch's CPU kernels use here: hosts sold under one model name differ, and the
        # ratios with them (README, Performance)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def print_throughput(summary: dict, ratio_rows: list[dict], steps: int, rounds: int) -> None:
    print(
        f"\nThroughput: {MODEL}, logical batch {BATCH} ({'fixed size' if FIXED else 'Poisson for the private ways'}), "
        f"malloc {MALLOC}, device {DEVICE}, {steps} timed steps after {WARMUP_STEPS} warm-up, "
        f"median over {rounds} interleaved rounds"
    )
    print(f"  {'way':<22} {'samples/s (median)':>19}  {'min..max over rounds':>22}  {'page faults/step':>17}")
    for way, s in summary.items():
        span = f"{s['min_samples_per_s']:.0f}..{s['max_samples_per_s']:.0f}"
        faults = s["median_page_faults_per_step"]
        print(f"  {LABELS[way]:<22} {s['median_samples_per_s']:>19.0f}  {span:>22}  {faults:>17.0f}")
    if "opacus" in summary:
        share = [r["dataloader_s"] / r["seconds"] for r in summary["opacus"]["rounds"]]
        print(
            f"  (Opacus time spent in its DataLoader: median {100 * statistics.median(share):.0f}% "
            f"of its timed steps)"
        )
    print("\nRatios of medians (target beside each):")
    for r in ratio_rows:
        name = f"{LABELS[r['numerator']]} / {LABELS[r['denominator']]}"
        if "fastest_layout" in r:
            name += f" ({'NCHW' if r['fastest_layout'] == 'nonprivate' else 'channels_last'})"
        verdict = "met" if r["met"] else "NOT met"
        print(f"  {name:<46} {r['ratio']:5.2f}x   target >= {r['target']:.2f}x  ({verdict})")


def print_memory(rows: list[dict]) -> None:
    print(
        f"\nPeak CPU memory (ru_maxrss) in fresh processes, Poisson with expected logical batch "
        f"{MEMORY_LOGICAL}, {MEMORY_STEPS} steps; increase = peak - the child's own baseline "
        f"(after building data + model)"
    )
    print(f"  {'way':<22} {'logical/physical':>17} {'baseline MiB':>13} {'peak MiB':>9} {'increase MiB':>13}")
    for r in rows:
        lp = f"{r['logical']}/{r['physical']}"
        label = LABELS[r["way"]]
        if r["way"] == "opacus":
            label += " +BMM" if r["physical"] < r["logical"] else ""
        if "error" in r:
            print(f"  {label:<22} {lp:>17}   failed")
            continue
        base, peak = r["baseline_kib"] / 1024, r["peak_kib"] / 1024
        print(f"  {label:<22} {lp:>17} {base:>13.0f} {peak:>9.0f} {peak - base:>13.0f}")
    print(
        "  (+BMM: Opacus BatchMemoryManager(max_physical_batch_size=256); dptrain chunks by "
        "max_physical_batch_size)"
    )
    for r in rows:
        hwm = r.get("peak_vmhwm_kib")
        if "error" not in r and hwm and abs(r["peak_kib"] - hwm) > 0.05 * hwm:
            print(
                f"  note: {LABELS[r['way']]} {r['logical']}/{r['physical']}: ru_maxrss {r['peak_kib'] / 1024:.0f} MiB "
                f"differs from VmHWM {hwm / 1024:.0f} MiB (inherited high-water mark?)"
            )


def main(argv: list[str] | None = None) -> int:
    global MODEL, INPUT_SHAPE, BATCH, FIXED, MALLOC, DEVICE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per way and round (default 40)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--n", type=int, default=60000, help="training-set size (default 60000)")
    p.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure peak memory in child processes (default on)",
    )
    p.add_argument("--json", metavar="PATH", help="write all numbers and machine info to this JSON file")
    p.add_argument(
        "--ways",
        default=",".join(WAYS),
        help=f"comma-separated subset of {', '.join(WAYS)} (default: all; e.g. dptrain-layerwise,dptrain-modelmix)",
    )
    p.add_argument("--model", choices=tuple(MODELS), default="cnn28", help="model (default cnn28)")
    p.add_argument("--batch", type=int, default=256, help="logical batch size (default 256)")
    p.add_argument(
        "--fixed-batches",
        action="store_true",
        help="every way gets exactly --batch examples per step (dptrain fixed_size sampling, Opacus without Poisson)",
    )
    p.add_argument(
        "--malloc",
        choices=("system", "tuned"),
        default="system",
        help="system: malloc as configured; tuned: dptrain.runs.cpu_memory.keep_freed_memory() first, as dptrain train "
        "does (the whole process: every way)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda[:N]: the model, gradients and noise of every way on that device; the data stays in "
        "CPU memory and each batch is moved (peak memory is measured on the CPU only)",
    )
    p.add_argument("--memory-child", nargs=3, metavar=("WAY", "LOGICAL", "PHYSICAL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    MODEL, INPUT_SHAPE, BATCH, FIXED = args.model, MODELS[args.model], args.batch, args.fixed_batches
    MALLOC = args.malloc
    DEVICE = args.device
    if not (DEVICE == "cpu" or (DEVICE.startswith("cuda") and torch.cuda.is_available())):
        p.error(f"--device {DEVICE}: accepted: cpu, or cuda[:N] where torch sees a GPU")
    if DEVICE != "cpu" and args.memory:
        print("  --device is not cpu: skipping the peak-memory part (it measures CPU memory)")
        args.memory = False
    if MALLOC == "tuned" and not keep_freed_memory():
        p.error("--malloc tuned: this system's malloc does not take the setting (glibc's mallopt)")

    if args.memory_child:
        way, logical, physical = args.memory_child
        memory_child(way, int(logical), int(physical), args.n)
        return 0

    start = time.perf_counter()
    info = machine_info()
    print(f"dptrain throughput benchmark  {info['date']}")
    print(
        f"  torch {info['torch']}, opacus {info['opacus'] or 'not installed'}, python {info['python']}, "
        f"nproc {info['nproc']}, torch threads {info['torch_num_threads']}"
    )
    print(f"  CPU: {info['cpu_model']} ({info['cpu_capability']})")
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = [w for w in ways if w not in WAYS]
    if unknown or not ways:
        p.error(f"--ways: unknown {', '.join(unknown) or '(none given)'}; accepted: {', '.join(WAYS)}")
    if opacus is None:
        ways = [w for w in ways if not w.startswith("opacus")]
        print(
            f"  Opacus is not importable ({OPACUS_ERROR}): skipping its rows. "
            "Install it with: pip install -e '.[bench]'"
        )

    captured: list[str] = []
    memory_rows = None
    if args.memory:  # first, while this process is still small (see memory())
        print("\nMeasuring peak memory in child processes ...", flush=True)
        memory_rows = memory(args.n, captured)

    x, y = make_data(args.n)
    print(f"\nData: N={args.n} random examples of shape {tuple(x.shape[1:])}, 10 classes (seed {DATA_SEED})")
    print("Timing throughput ...", flush=True)
    summary = throughput(x, y, ways, args.steps, args.rounds, captured)
    del x, y
    gc.collect()
    ratio_rows = ratios(summary)

    print_throughput(summary, ratio_rows, args.steps, args.rounds)
    if memory_rows is not None:
        print_memory(memory_rows)
    unique = list(dict.fromkeys(captured))
    if unique:
        print("\nWarnings raised during the runs (each shown once):")
        for w in unique:
            print(f"  - {w}")
    wall = time.perf_counter() - start
    print(f"\nTotal wall time: {wall:.0f} s")

    if args.json:
        record = {
            "machine": info,
            "settings": {
                "n": args.n,
                "steps": args.steps,
                "rounds": args.rounds,
                "warmup_steps": WARMUP_STEPS,
                "batch_size": BATCH,
                "noise_multiplier": NOISE_MULTIPLIER,
                "max_grad_norm": MAX_GRAD_NORM,
                "lr": LR,
                "model": MODEL,
                "input_shape": list(INPUT_SHAPE),
                "fixed_size_batches": FIXED,
                "malloc": MALLOC,
                "device": DEVICE,
                "device_name": torch.cuda.get_device_name(DEVICE) if DEVICE.startswith("cuda") else info["cpu_model"],
                "memory_logical": MEMORY_LOGICAL,
                "memory_physical": MEMORY_PHYSICAL,
                "memory_steps": MEMORY_STEPS,
            },
            "throughput": summary,
            "ratios": ratio_rows,
            "memory": memory_rows,
            "warnings": unique,
            "opacus_skipped_reason": OPACUS_ERROR,
            "wall_seconds": wall,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
