"""The per-example independence check: does changing one example move another example's output or gradient?

DP-SGD's sensitivity bound assumes that example i's clipped gradient depends on example i alone. A layer
that mixes the examples of a batch (BatchNorm, ``h - h.mean(0)``, attention across the batch dimension, ...)
breaks that silently: the "per-example" gradient of example 1 then changes when example 0 changes, so one
person's data moves several clipped contributions and the noise no longer covers it. Layer types cannot reveal
every such operation, so before training dptrain runs the model itself:

1. a probe batch of real training examples, as many as one physical chunk of the run holds (a model may mix
   examples only in large batches, or only on inputs like the real data: a synthetic batch of 4 missed both);
2. the outputs and the per-example gradients (through the same backend that will train) of the batch as it is and
   with example 0 replaced by another example (and its label);
3. any output, per-example gradient norm or random combination of the other examples' gradients that moves by
   more than float tolerance refuses the model with a :class:`~dptrain.errors.ModelError` naming this check.

Dropout and other randomness are replayed identically in both passes, and the model's buffers are restored after
them (:mod:`dptrain.preflight.buffers`): the check leaves no trace of the examples it read. Its only outcome is pass or
refuse, before anything is trained or written. The check can be skipped for a model the user vouches for
(``check_independence=False`` in the Python API), which the run records. A model written to detect the probe
(to mix examples only after the first steps, say) is out of scope: the check catches mistakes, not adversaries.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten

from dptrain.data.batches import call_model, with_first_replaced
from dptrain.errors import ModelError
from dptrain.preflight.buffers import restored

RTOL, ATOL = 1e-4, 1e-6
#: Random combinations of the other examples' gradients compared (each catches any change of any one of them).
COMBINATIONS = 2

CHECK_NAME = "the per-example independence check"


def _devices(model: torch.nn.Module) -> list:
    """The accelerators whose generators a pass must fork (CPU's is always forked)."""
    return sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)


def _pass(model, grad_sampler, x, y, rng_seed: int):
    """Outputs (the leaves with a batch dimension), per-example squared norms and random combinations of the
    per-example gradients of examples 1.. of one probe batch, with replayed randomness."""
    k = len(y)
    with torch.random.fork_rng(devices=_devices(model)):
        torch.manual_seed(rng_seed)
        with torch.no_grad():
            outputs = call_model(model, x)
        torch.manual_seed(rng_seed)
        grads, _ = grad_sampler(x, y)
    first_only = torch.zeros(k, dtype=torch.bool, device=y.device)
    first_only[0] = True
    others = grads.zero_examples(first_only)  # example 0's gradient differs between the passes by design
    norms = {n: v[1:].detach().clone() for n, v in others.sq_norms().items()}
    first = next(iter(grads.sq_norms().values()))
    generator = torch.Generator().manual_seed(20231)  # public and fixed: only the two passes' agreement matters
    combos = []
    for _ in range(COMBINATIONS):
        f = torch.randn(k, generator=generator, dtype=torch.float64, device="cpu")
        f[0] = 0.0
        sums = others.weighted_sum(f.to(first.dtype).to(first.device))
        combos.append({n: s.detach().clone() for n, s in sums.items()})
    leaves = [t.detach() for t in tree_flatten(outputs)[0] if torch.is_tensor(t) and t.dim() and len(t) == k]
    return leaves, norms, combos


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL, equal_nan=True))


def _close_overall(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding relative to the tensor's size (a sum over many examples: its entries may cancel)."""
    a, b = a.double(), b.double()
    scale = float(a.abs().max()) if a.numel() else 0.0
    diff = (a - b).abs().nan_to_num(nan=math.inf)
    return bool((diff <= RTOL * scale + ATOL).all())


def check_independence(model: torch.nn.Module, grad_sampler, x, y: torch.Tensor, other_x, other_y) -> None:
    """Refuse ``model`` (ModelError) if replacing example 0 of the batch (``x``, ``y``: real training examples, any
    input structure of :mod:`dptrain.data.batches`, at least 2) by the example (``other_x``, ``other_y``, a batch of one)
    moves the output or the per-example gradient of another example."""
    if len(y) < 2:
        return  # one example per chunk: there is no other example to move
    changed_x = with_first_replaced(x, other_x)
    changed_y = y.clone()
    changed_y[0] = other_y[0]
    was_training = model.training
    model.train()
    try:
        with restored(model):
            out_a, norms_a, combos_a = _pass(model, grad_sampler, x, y, 1)
            out_b, norms_b, combos_b = _pass(model, grad_sampler, changed_x, changed_y, 1)
    finally:
        model.train(was_training)
    if not all(_close(a[1:], b[1:]) for a, b in zip(out_a, out_b, strict=True)):
        raise ModelError(
            f"{CHECK_NAME} failed: changing one example of a batch changed the model's outputs for the others, so "
            "the model mixes examples (batch statistics, a mean over the batch, ...) and per-example clipping "
            "does not bound one example's influence; remove the cross-example operation (BatchNorm -> "
            "GroupNorm), or pass check_independence=False only if you are sure"
        )
    moved = [n for n in norms_a if not _close(norms_a[n], norms_b[n])]
    moved += [n for a, b in zip(combos_a, combos_b, strict=True) for n in a if not _close_overall(a[n], b[n])]
    if moved:
        raise ModelError(
            f"{CHECK_NAME} failed: changing example 0 of a batch changed the per-example gradients of other "
            f"examples (parameter {moved[0]}), so one example moves several clipped gradients and the noise does "
            "not cover it; remove the cross-example operation, or pass check_independence=False only if you are sure"
        )
