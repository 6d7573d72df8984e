"""The per-example independence check: does changing one example move another example's output or gradient?

DP-SGD's sensitivity bound assumes that example i's clipped gradient depends on example i alone. A layer
that mixes the examples of a batch (BatchNorm, ``h - h.mean(0)``, attention across the batch dimension, ...)
breaks that silently: the "per-example" gradient of example 1 then changes when example 0 changes, so one
person's data moves several clipped contributions and the noise no longer covers it. Layer types cannot reveal
every such operation, so before training dptrain runs the model itself:

1. a probe batch of :data:`PROBE_SIZE` synthetic examples with the training data's shape and dtype (public
   values: standard normals for floating inputs, 0/1 for integer ones, drawn from a fixed public generator;
   no private example is used);
2. the outputs and the per-example gradients (through the same backend that will train) of the batch as it
   is and with example 0 replaced;
3. any output or gradient of examples 1.. that moves by more than float tolerance refuses the model with a
   :class:`~dptrain.errors.ModelError` naming this check.

Dropout and other randomness are replayed identically in both passes. The check can be skipped for a model
the user vouches for (``check_independence=False`` in the Python API), which the run records.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from dptrain.batches import call_model, probe_like, with_first_replaced
from dptrain.errors import ModelError

PROBE_SIZE = 4
RTOL, ATOL = 1e-4, 1e-6

CHECK_NAME = "the per-example independence check"


def _probe_labels(y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    shape = (PROBE_SIZE, *y.shape[1:])
    if y.dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=y.dtype).to(y.device)
    return y.new_zeros(shape)


def _pass(model, grad_sampler, x, y, rng_seed: int):
    """Outputs and per-example gradients (examples 1..) of one probe batch, with replayed randomness."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng_seed)
        with torch.no_grad():
            outputs = call_model(model, x)
        torch.manual_seed(rng_seed)
        grads, _ = grad_sampler(x, y)
    first = next(model.parameters(), None)
    dtype, device = (torch.float32, None) if first is None else (first.dtype, first.device)
    rows = []
    for i in range(1, PROBE_SIZE):
        onehot = torch.zeros(PROBE_SIZE, dtype=dtype, device=device)
        onehot[i] = 1.0
        rows.append({n: g.detach().clone() for n, g in grads.weighted_sum(onehot).items()})
    # the outputs' tensors with a batch dimension (a model may return a tuple, a dict, ...)
    leaves = [t.detach() for t in tree_flatten(outputs)[0] if torch.is_tensor(t) and t.dim() and len(t) == PROBE_SIZE]
    return leaves, rows


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL, equal_nan=True))


def check_independence(model: torch.nn.Module, grad_sampler, x: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse ``model`` (ModelError) if changing example 0 of a probe batch moves the output or the per-example
    gradient of another example. ``x``, ``y``: a batch of training inputs (any structure: :mod:`dptrain.batches`)
    and labels (only their shapes and dtypes are read)."""
    generator = torch.Generator().manual_seed(20231)  # public and fixed: the probe is not private data
    probe_x = probe_like(x, PROBE_SIZE, generator)
    probe_y = _probe_labels(y, generator)
    changed = with_first_replaced(probe_x, probe_like(x, PROBE_SIZE, generator))
    was_training = model.training
    model.train()
    try:
        out_a, grads_a = _pass(model, grad_sampler, probe_x, probe_y, 1)
        out_b, grads_b = _pass(model, grad_sampler, changed, probe_y, 1)
    finally:
        model.train(was_training)
    if not all(_close(a[1:], b[1:]) for a, b in zip(out_a, out_b, strict=True)):
        raise ModelError(
            f"{CHECK_NAME} failed: changing one example of a batch changed the model's outputs for the others, so "
            "the model mixes examples (batch statistics, a mean over the batch, ...) and per-example clipping "
            "does not bound one example's influence; remove the cross-example operation (BatchNorm -> "
            "GroupNorm), or pass check_independence=False only if you are sure"
        )
    for i, (a, b) in enumerate(zip(grads_a, grads_b, strict=True), start=1):
        moved = [n for n in a if not _close(a[n], b[n])]
        if moved:
            raise ModelError(
                f"{CHECK_NAME} failed: changing example 0 of a batch changed the per-example gradient of example "
                f"{i} (parameter {moved[0]}), so one example moves several clipped gradients and the noise does "
                "not cover it; remove the cross-example operation, or pass check_independence=False only if you "
                "are sure"
            )
