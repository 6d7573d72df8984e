"""Timings of single pieces of a DP step, the figures behind choices in the code (milliseconds, mean of repeats
after a warm-up, freed memory kept, torch's default threads).

    python benchmarks/micro.py conv       # per-example conv weight gradients: the forms dptrain chooses between
    python benchmarks/micro.py groupnorm  # per-example GroupNorm gradients: dptrain's rule and the former form
    python benchmarks/micro.py gather     # a batch of rows: advanced indexing vs index_select
    python benchmarks/micro.py sampling   # drawing a batch from a secret stream: fixed-size and Poisson

``conv`` times, for the layers of ResNet-20 (128 examples) and cnn28 (256 examples): dptrain's per-example weight
gradients (the form it picks), the grouped convolution backward and the forward-convolution form each, the unfold
and batched product that Opacus' way amounts to (written here for the comparison, not Opacus' code), two forms
tried and not kept (the patches by a depthwise convolution with one-hot filters, then a batched product; for stride
1, one batched product per kernel offset over a shifted window of the padded input, no patches copied), and the
batched weight gradient of a non-private backward as the reference.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import dptrain.stages.layer_rules as rules
import dptrain.stages.per_example as pe
from dptrain.runs.cpu_memory import keep_freed_memory

#: (name, examples, in channels, out channels, input size, kernel, stride, padding)
CONV_LAYERS = (
    ("resnet20 conv1", 128, 3, 16, 32, 3, 1, 1),
    ("resnet20 16->16", 128, 16, 16, 32, 3, 1, 1),
    ("resnet20 32->32", 128, 32, 32, 16, 3, 1, 1),
    ("resnet20 64->64", 128, 64, 64, 8, 3, 1, 1),
    ("cnn28 conv1", 256, 1, 16, 28, 8, 2, 3),
    ("cnn28 conv2", 256, 16, 32, 13, 4, 2, 0),
    # where the forward form stops paying (dptrain.stages.layer_rules.CONV_FORWARD_BELOW_CHANNELS)
    ("1->16, 32x32", 128, 1, 16, 32, 3, 1, 1),
    ("6->16, 32x32", 128, 6, 16, 32, 3, 1, 1),
    ("8->16, 32x32", 128, 8, 16, 32, 3, 1, 1),
)


def timed(f, repeat: int) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - t0) / repeat * 1e3


def conv_row(b, c_in, c_out, size, k, s, p, repeat: int) -> list[float]:
    layer = torch.nn.Conv2d(c_in, c_out, k, stride=s, padding=p)
    a = torch.randn(b, c_in, size, size)
    go = torch.randn_like(layer(a))

    def unfold():
        u = F.unfold(a, layer.kernel_size, padding=layer.padding, stride=layer.stride)
        return torch.einsum("bol,bil->boi", go.flatten(2), u)

    def batched():
        return torch.ops.aten.convolution_backward(
            go, a, layer.weight, None, list(layer.stride), list(layer.padding), list(layer.dilation), False,
            [0, 0], 1, [False, True, False],
        )[1]

    def depthwise_unfold():  # the patches by a depthwise convolution with one-hot filters, then a batched product
        eye = torch.eye(k * k).reshape(k * k, 1, k, k).repeat(c_in, 1, 1, 1)
        u = F.conv2d(a, eye, None, stride=s, padding=p, groups=c_in)  # [B, c_in k k, positions]
        return torch.bmm(go.flatten(2), u.flatten(2).transpose(1, 2))

    def shifted():  # stride 1: per kernel offset, one batched product over a shifted window of the padded input
        h, w = a.shape[2:]
        hp, wp, ho = h + 2 * p, w + 2 * p, go.shape[2]
        buf = a.new_zeros(b * c_in * hp * wp + wp * k + k)  # (slack: the last window reads past the last row)
        buf[: b * c_in * hp * wp].view(b, c_in, hp, wp)[:, :, p : p + h, p : p + w] = a
        g = go.new_zeros(b, c_out, ho, wp)
        g[..., : go.shape[3]] = go  # the padding columns are zero: their products vanish
        g = g.view(b, c_out, ho * wp)
        out = a.new_empty(k, k, b, c_out, c_in)
        for u in range(k):
            for v in range(k):
                window = buf.as_strided((b, ho * wp, c_in), (c_in * hp * wp, 1, hp * wp), u * wp + v)
                torch.bmm(g, window, out=out[u, v])
        return out.permute(2, 3, 4, 0, 1)

    def grouped():
        threshold = rules.CONV_FORWARD_BELOW_CHANNELS
        rules.CONV_FORWARD_BELOW_CHANNELS = 0
        try:
            return rules._conv_weight_per_example(layer, a, go)
        finally:
            rules.CONV_FORWARD_BELOW_CHANNELS = threshold

    return [
        timed(lambda: rules._conv_weight_per_example(layer, a, go), repeat),
        timed(grouped, repeat),
        timed(lambda: rules._conv_weight_by_forward(layer, a, go), repeat),
        timed(unfold, repeat),
        timed(depthwise_unfold, repeat),
        timed(shifted, repeat) if s == 1 else math.nan,
        timed(batched, repeat),
    ]


def conv(repeat: int) -> None:
    columns = ("dptrain", "grouped", "forward", "unfold", "dw-unf", "shifted", "batched")
    print(f"{'layer':18s} " + " ".join(f"{c:>8s}" for c in columns) + "  (ms)")
    for name, *shape in CONV_LAYERS:
        print(f"{name:18s} " + " ".join(f"{v:8.2f}" for v in conv_row(*shape, repeat)))


#: (name, examples, channels, groups, size): ResNet-20's GroupNorm layers at 128 examples
GROUPNORM_LAYERS = (("resnet20 16 ch", 128, 16, 4, 32), ("resnet20 32 ch", 128, 32, 4, 16), ("resnet20 64 ch", 128, 64, 4, 8))


def groupnorm_row(b: int, c: int, groups: int, size: int, repeat: int) -> list[float]:
    layer = torch.nn.GroupNorm(groups, c)
    a, go = torch.randn(b, c, size, size), torch.randn(b, c, size, size)

    def xhat():
        return (go * F.group_norm(a, groups, None, None, layer.eps)).sum((2, 3)), go.sum((2, 3))

    return [timed(lambda: pe._group_norm(layer, a, go), repeat), timed(xhat, repeat)]


def groupnorm(repeat: int) -> None:
    """dptrain's per-example GroupNorm rule (torch's fused kernels on the batch as one example) against the form it
    replaced on 2026-11-26 (the normalized input, times the output gradient, summed)."""
    print(f"{'layer':18s} {'dptrain':>8s} {'xhat':>8s}  (ms)")
    for name, *shape in GROUPNORM_LAYERS:
        print(f"{name:18s} " + " ".join(f"{v:8.2f}" for v in groupnorm_row(*shape, repeat)))


def gather_times(x: torch.Tensor, b: int, repeat: int, g: torch.Generator) -> tuple[float, float]:
    """(x[idx], x.index_select(0, idx)) in ms, each on fresh random indices."""
    idx = [torch.randint(0, len(x), (b,), generator=g) for _ in range(repeat + 1)]
    first, second = iter(idx), iter(idx)
    return timed(lambda: x[next(first)], repeat), timed(lambda: x.index_select(0, next(second)), repeat)


def gather(repeat: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60000, 1, 28, 28, generator=g)
    for b in (256, 1024):
        t_index, t_select = gather_times(x, b, repeat, g)
        print(f"{b} random rows of 60,000 28x28 images: x[idx] {t_index:.3f} ms, x.index_select(0, idx) {t_select:.3f} ms")


def sampling_times(stream, b: int, repeat: int) -> tuple[float, float]:
    from dptrain.stages.batch_selection import poisson_indices, uniform_subset

    return (
        timed(lambda: uniform_subset(stream, 60000, b), repeat),
        timed(lambda: poisson_indices(stream, 60000, b / 60000), repeat),
    )


def sampling(repeat: int) -> None:
    from dptrain.randomness.generators import Randomness

    stream = Randomness(None).stream("sampling")
    for b in (256, 1024):
        fixed, poisson = sampling_times(stream, b, repeat)
        print(f"batch {b} of 60,000 from the secret stream: fixed size {fixed:.3f} ms, Poisson {poisson:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["conv", "groupnorm", "gather", "sampling"])
    parser.add_argument("--repeat", type=int, default=None, help="repeats per timing (default: 10 conv, 1000 others)")
    args = parser.parse_args(argv)
    keep_freed_memory()
    repeat = args.repeat or {"conv": 10, "groupnorm": 50}.get(args.what, 1000)
    {"conv": conv, "groupnorm": groupnorm, "gather": gather, "sampling": sampling}[args.what](repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
