"""Why an example's output in its batch differs from the same example's alone: the other examples' values, or only the
batch's size and the example's place in it.

The independence check (:mod:`dptrain.preflight.gradient_check`) sees that example i's output or loss computed in a
batch is not its output alone. Two different models do that, and the way out differs:

- the model or the loss **mixes the examples**: a statistic of the batch (its mean or maximum, BatchNorm), experts
  whose capacity the batch's tokens share (NLLB-MoE), a loss comparing the examples with each other (CLIP's or
  SigLIP's contrastive loss: there is no loss of one example). Per-example clipping does not bound one example's
  influence: remove the cross-example operation;
- the output depends on the batch's **shape** only: random numbers drawn for the whole batch inside the forward pass
  (Wav2Vec2's and HuBERT's SpecAugment masks, ViTMAE's random masking: example i gets row i of a draw of the batch's
  shape, so alone it gets other numbers). Nothing of the other examples reaches it, but its per-example gradient
  cannot be verified against the example alone: turn the randomness off in training, or pass it as an input of
  each example.

One more comparison tells them apart (:func:`depends_on_others`): the batch with every other example replaced by a
copy of example i, at the same size and place, the same random numbers drawn (torch's, NumPy's and Python's
generators replayed). Example i's output is unchanged when only the shape matters, and changes when the others'
values reach it (a batch of copies has example i's statistics).

Where only the shape matters, a third tells randomness from rounding (:func:`draws_random_numbers`): the batch run
twice in a row, the generators going on between the passes. A model that draws no random number gives the same
outputs twice; its example's output moved with the batch's shape by rounding beyond its parameters' precision: a part
computed in a lower precision than the model (Llama4's router and Mixtral-like experts in float32 inside a float64
model) rounds differently at another batch size. That model is deterministic and its examples independent; it is
refused naming the precision, not randomness it does not draw.
"""

from __future__ import annotations

import contextlib
import random

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from dptrain.data.batches import call_model, copied, take
from dptrain.errors import ModelError
from dptrain.preflight.buffers import restored

CHECK_NAME = "the per-example independence check"
#: Examples of the batch whose dependence on the others is tried (the one the check saw move, and the first ones).
ROWS = 4


@contextlib.contextmanager
def replayed_randomness(device_type: str = "cpu"):
    """A block after which torch's (CPU and the run's accelerator), NumPy's and Python's global generators are back
    where they were: two such blocks in a row draw the same numbers."""
    import numpy as np

    python, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if device_type == "cuda" and torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


def randomness_state(device_type: str = "cpu") -> tuple:
    """The state of torch's (CPU and the run's accelerator), NumPy's and Python's global generators: two equal states
    (:func:`same_randomness`) around a pass say it drew no random number."""
    import numpy as np

    cuda = torch.cuda.get_rng_state() if device_type == "cuda" and torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def same_randomness(a: tuple, b: tuple) -> bool:
    """Whether two :func:`randomness_state` readings are equal (no random number drawn between them)."""
    import numpy as np

    same_tensor = lambda s, t: (s is None) == (t is None) and (s is None or torch.equal(s, t))  # noqa: E731
    numpy_same = all(np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v
                     for u, v in zip(a[2], b[2], strict=True))
    return same_tensor(a[0], b[0]) and same_tensor(a[1], b[1]) and numpy_same and a[3] == b[3]


def output_leaves(out) -> dict[str, object]:
    """A model output's leaves (tensors detached) by their path in it (a tensor, or tuples, lists, dicts and
    ModelOutputs holding some): two passes' outputs are compared leaf by leaf at the same path."""
    leaves, _ = tree_flatten_with_path(out)
    return {keystr(path): v.detach() if torch.is_tensor(v) else v for path, v in leaves}


def example_rows(batched: dict, alone: dict, k: int) -> list[str]:
    """The paths of the outputs holding one row per example: a tensor of ``k`` rows in the pass on ``k`` examples
    (``batched``) whose same path holds one row of the same shape in the pass on one example (``alone``). Measured,
    never read off a size: Llava returns each image's features [patches, d] in a tuple, one tensor per example, which
    has as many rows as the batch has examples when it has as many patches."""
    rows = []
    for path, b in batched.items():
        a = alone.get(path)
        if (torch.is_tensor(a) and torch.is_tensor(b) and a.dim() and b.dim() and len(a) == 1 and len(b) == k
                and a.shape[1:] == b.shape[1:]):
            rows.append(path)
    return rows


def _row_of(model, loss_fn, x, y, i: int, autocast) -> list[torch.Tensor]:
    """Example i's rows of every output of the model with a row per example (:func:`example_rows`), and its loss, on
    the batch ``x`` (``autocast``: makes the training precision's autocast context)."""
    k = len(y)
    device = next(t for t in tree_flatten(x)[0] if torch.is_tensor(t)).device.type
    with replayed_randomness(device), restored(model), torch.no_grad(), autocast():
        out = call_model(model, copied(x))
        try:
            loss = loss_fn(out, copied(y)).reshape(-1)
        except Exception:  # noqa: BLE001 (a loss that fails here is the check's to report, not this diagnosis')
            loss = None
        out = output_leaves(out)
        alone = output_leaves(call_model(model, take(x, torch.tensor([i], device=y.device))))
    rows = [out[path][i] for path in example_rows(out, alone, k)]
    return rows + ([loss[i]] if loss is not None and len(loss) == k else [])


def depends_on_others(model, loss_fn, x, y, rows, autocast, rtol: float) -> bool:
    """Whether, for some example i of ``rows``, its outputs or loss in the batch (``x``, ``y``) change when every other
    example is replaced by a copy of example i (same size, same place, the same random numbers): the others' values
    reach it. (Several rows: where the others' values reach an example may depend on its place, as experts filled in
    the batch's order take the first examples' tokens and drop the later ones' whatever they are.)"""
    for i in rows:
        copies = torch.full((len(y),), i, dtype=torch.long, device=y.device)
        batch = _row_of(model, loss_fn, x, y, i, autocast)
        alike = _row_of(model, loss_fn, take(x, copies), take(y, copies), i, autocast)
        if len(batch) != len(alike):
            return True
        for a, b in zip(batch, alike, strict=True):
            if a.shape != b.shape:
                return True
            a, b = a.double(), b.double()
            if not float((a - b).norm()) <= rtol * float(b.norm()) + 1e-30:  # (NaN: depends)
                return True
    return False


def draws_random_numbers(model, x, autocast) -> bool:
    """Whether two passes of the model on the batch ``x`` in a row (torch's, NumPy's and Python's generators going on
    between them, put back after) give different outputs: the forward pass draws random numbers."""
    device = next(t for t in tree_flatten(x)[0] if torch.is_tensor(t)).device.type
    with replayed_randomness(device), restored(model), torch.no_grad(), autocast():
        first = output_leaves(call_model(model, copied(x)))
        second = output_leaves(call_model(model, copied(x)))
    for path, a in first.items():
        b = second.get(path)
        if torch.is_tensor(a) and (not torch.is_tensor(b) or a.shape != b.shape or not torch.equal(a, b)):
            return True
    return False


def mixing_refusal(model, loss_fn, x, y, i: int, autocast, rtol: float, also=()) -> ModelError:
    """The independence check's refusal for example i of the batch (``x``, ``y``), naming the way out of the kind of
    dependence it is (module docstring); ``also``: other rows seen to move (the places a mixing model reaches). Only
    computed to refuse (2 forward passes for each of up to 2 ROWS examples, and 2 of the batch)."""
    k = len(y)
    rows = list(dict.fromkeys([i, *list(also)[:ROWS], *range(min(k, ROWS))]))
    shape_only = not depends_on_others(model, loss_fn, x, y, rows, autocast, rtol)
    if shape_only and not draws_random_numbers(model, x, autocast):
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
        return ModelError(
            f"{CHECK_NAME} failed: an example's output or loss computed in a batch of {k} differs from the same "
            "example's computed alone, not with the other examples' values, and the model draws no random number: "
            "it rounds differently at another batch size or place, beyond what its parameters' precision "
            f"({', '.join(dtypes)}) allows for, as a part computed in a lower precision does (Llama4's router in "
            "float32 inside a float64 model); train the model in the precision it computes in (float32), or pass "
            "check_independence=False only if you are sure"
        )
    if shape_only:
        return ModelError(
            f"{CHECK_NAME} failed: an example's output or loss computed in a batch of {k} differs from the same "
            "example's computed alone, not with the other examples' values but with the batch's size or the example's "
            "place in it (random numbers drawn for the whole batch inside the forward pass, such as Wav2Vec2's or "
            "HuBERT's SpecAugment masks or ViTMAE's random masking), so its per-example gradient cannot be verified "
            "against the example alone; turn that randomness off in training (Wav2Vec2, HuBERT: config.mask_time_prob "
            "= 0 and config.mask_feature_prob = 0) or pass it as an input of each example (ViTMAE: noise=)"
        )
    return ModelError(
        f"{CHECK_NAME} failed: an example's output or loss computed in a batch of {k} depends on the other examples "
        "of the batch, so the model or the loss mixes the examples of a batch (a statistic of the batch: its mean, its "
        "maximum, BatchNorm; experts whose capacity the batch's tokens share; a loss comparing the examples with each "
        "other, such as CLIP's or SigLIP's contrastive loss, which has no loss of one example) and per-example clipping "
        "does not bound one example's influence; remove the cross-example operation (BatchNorm -> GroupNorm, a loss "
        "of each example on its own), or pass check_independence=False only if you are sure"
    )


__all__ = ["CHECK_NAME", "depends_on_others", "draws_random_numbers", "example_rows", "mixing_refusal", "output_leaves",
           "randomness_state", "replayed_randomness", "same_randomness"]
