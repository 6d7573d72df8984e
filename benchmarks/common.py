"""What the step benchmarks share: their models' input shapes and the random data they train on (N = 60000
examples, 10 classes, seeded: a benchmark, not a private run)."""

from __future__ import annotations

import torch

#: input shape of each benchmark model (dptrain.models.builders.build_model's names)
SHAPES = {"logistic": (1, 28, 28), "cnn28": (1, 28, 28), "resnet20": (3, 32, 32)}
N = 60000


def random_data(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    """(x, y, g): N random examples of ``shape`` and labels in 0..9, and the generator that drew them (seed 0), which
    the benchmarks go on drawing their non-private batches from."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, *shape, generator=g)
    y = torch.randint(0, 10, (N,), generator=g)
    return x, y, g
