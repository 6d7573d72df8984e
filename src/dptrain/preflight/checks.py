"""What a trainer checks on the user's model and data before the first step, and the physical chunk size it settles.

Each check refuses in one line what DP-SGD cannot train correctly, before anything is released or written:

- the model has trainable parameters, and with the default cross-entropy loss the labels are integer class
  indices in range (a one-line error instead of a raw torch error in the middle of a step);
- buffers written from a private batch (:mod:`dptrain.preflight.buffers`) and examples that influence each other
  (:mod:`dptrain.preflight.independence`), both probed on real training examples, as many as one physical chunk of the run
  holds: the chunk size is settled first (:func:`auto_physical_batch_size`), so the probe sees what training sees.

Errors name the rule that failed, never a statistic of the private data (a label's value, a count of bad rows).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dptrain.data.batches import TensorSource, call_model, probe_like, take, with_first_replaced
from dptrain.errors import DataError, ModelError
from dptrain.preflight import buffers, gradient_check, independence
from dptrain.stages.devices import to_device
from dptrain.stages.per_example import cross_entropy_per_example

#: Memory the materialized per-example gradients of one physical chunk may take by default.
PER_EXAMPLE_GRADIENT_MEMORY = 256 * 2**20


def eager(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile``d one wraps: per-example gradients need the modules' own forward passes (hooks, and
    torch.func over the module), which a compiled graph hides. Training on the eager model keeps the fast backend
    (a compiled model used to send every model silently to torch.func, and transformers models to a failure); the
    parameters are the same objects, so the optimizer and the compiled wrapper see every update."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def check_trainable(params: dict[str, torch.Tensor]) -> None:
    if not params:
        raise ModelError(
            "the model has no trainable parameters (none with requires_grad=True): there is nothing to train"
        )


def auto_physical_batch_size(params: dict[str, torch.Tensor], factored: dict[str, int] | None = None) -> int:
    """Largest chunk whose per-example gradients fit in PER_EXAMPLE_GRADIENT_MEMORY: materialized, except the
    parameters in ``factored`` (name -> elements one example's factors take, e.g. an Embedding's positions x dim)."""
    factored = factored or {}
    per_example = sum(
        (factored[n] if n in factored else p.numel()) * p.element_size() for n, p in params.items()
    )
    return max(1, PER_EXAMPLE_GRADIENT_MEMORY // max(1, per_example))


def factored_sizes(model: nn.Module, params: dict[str, torch.Tensor], example) -> dict[str, int]:
    """Elements per example of the Embedding gradients the layerwise backend keeps factored: positions x (dim + 1 +
    positions) (the output gradients, the ids, the Gram matrix of the norm), the
    positions being the largest integer input of one example (its token ids)."""
    ids = [t.numel() for t in tree_flatten(example)[0] if torch.is_tensor(t) and not t.dtype.is_floating_point]
    positions = max(ids, default=1)
    out = {}
    for prefix, m in model.named_modules():
        name = f"{prefix}.weight" if prefix else "weight"
        if type(m) is nn.Embedding and name in params:
            out[name] = positions * (m.embedding_dim + 1 + positions)  # (and its Gram matrix, for the norm)
    return out


@contextlib.contextmanager
def loss_errors_named():
    """An IndexError of the loss (a label out of range for the model's outputs: a Dataset's labels are only seen batch
    by batch, so :func:`check_labels` cannot cover them) as a one-line DataError naming the rule."""
    try:
        yield
    except IndexError:  # (torch's message names the offending label: a value of the private data, not repeated)
        raise DataError(
            "the loss function failed on a batch of training examples with an IndexError: labels must be class "
            "indices in [0, number of the model's outputs)"
        ) from None


def check_labels(model: nn.Module, source, loss_fn, device: torch.device, own_backend: bool = True) -> None:
    """With the default cross-entropy loss, labels must be integer class indices that index the model's outputs (a
    one-line DataError, not a raw torch error in the middle of a step). The model is run on one all-zero input; the
    message names the rule, never the labels' values. ``own_backend`` False: the gradients come from the caller's
    own backend (closed-form gradients of a GLM on real-valued labels), which need not use the loss."""
    if loss_fn is not cross_entropy_per_example or not isinstance(source, TensorSource):
        return  # a Dataset's labels are read batch by batch, never all at once (the step names a bad batch)
    y = source.labels
    if not len(y):
        return
    if y.dtype.is_floating_point and y.dim() == 1 and own_backend:
        raise DataError(
            f"labels must be integer class indices for the default cross-entropy loss, got {y.dtype} labels; convert "
            "them (labels.long()) or pass a loss_fn for real-valued targets"
        )
    if y.dtype.is_floating_point:
        return  # class probabilities, one row per example
    inputs, _ = to_device(source.example(), device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        was_training = model.training
        model.eval()
        outputs = call_model(model, tree_map(torch.zeros_like, inputs))
        model.train(was_training)
    if not torch.is_tensor(outputs) or outputs.dim() != 2 or y.dim() != 1:
        return
    k = outputs.shape[1]
    if bool(((y < 0) | (y >= k)).any()):
        raise DataError(f"labels must be class indices in [0, {k}) for a model with {k} outputs")


def largest_batch(sampler) -> int:
    """The largest logical batch the run will plausibly draw: its expected size (the largest of a growing schedule),
    plus four standard deviations for Poisson sampling."""
    steps = sampler.max_steps
    b = max(sampler.expected_batch_size_at(i) for i in range(steps)) if steps else sampler.expected_batch_size
    if sampler.scheme == "poisson":
        b += 4 * math.sqrt(b) + 1
    return max(1, math.ceil(b))


def probe_batch(source, k: int, device: torch.device):
    """(x, y, other_x, other_y): the first ``k`` training examples and one more to replace example 0 with (example k,
    or when the data set has no more, a public synthetic input with example 0's label), on ``device``."""
    n = len(source)
    k = min(k, n)
    if n > k:  # collated together: a collator padding each batch to its longest sequence pads all k + 1 alike
        x, y = to_device(source.batch(torch.arange(k + 1, device="cpu")), device)
        first, last = torch.arange(k, device=y.device), torch.tensor([k], device=y.device)
        x, y, other_x, other_y = take(x, first), y[:k], take(x, last), y[k:]
    else:
        x, y = to_device(source.batch(torch.arange(k, device="cpu")), device)
        generator = torch.Generator().manual_seed(20231)  # public and fixed
        other_x, other_y = probe_like(take(x, torch.arange(1, device=y.device)), 1, generator), y[:1]
    return x, y, other_x, other_y


def _settle(grad_sampler, source, device) -> None:
    """One pass of the backend on two real examples: the automatic backend switches to torch.func, if it must, at its
    first pass (the chunk size depends on which backend trains)."""
    x, y = to_device(source.batch(torch.arange(min(2, len(source)), device="cpu")), device)
    with torch.random.fork_rng(devices=[]), loss_errors_named():
        grad_sampler(x, y)


def chunk_size(trainer, requested: int | None, settled: bool) -> int:
    """The run's physical chunk: ``requested``, or the largest whose per-example gradients fit the memory budget."""
    if requested:
        return int(requested)
    factored = factored_sizes(trainer.model, trainer.params, trainer.data.example()[0]) if settled else None
    return auto_physical_batch_size(trainer.params, factored)


def probe_model(
    trainer, requested_chunk: int | None, check_independence: bool, buffer_updates: str, check_gradients: bool = True
):
    """Settle the backend and the chunk size, then probe the model on real training examples at that chunk size:
    buffers, the backend's per-example gradients against single-example backward passes (:mod:`dptrain.preflight.gradient_check`,
    which may settle on another backend), independence. Returns (physical chunk size, names of the buffers written
    from the batch: empty unless ``buffer_updates == "not_private"``, the gradient check or None). The model's buffers
    and torch's generator are left as they were."""
    model, source, device = trainer.model, trainer.data, trainer.device
    with buffers.restored(model):
        if check_independence:
            _settle(trainer.grad_sampler, source, device)
    # Automatic chunks count an Embedding's gradients as factored only once the backend is known to keep them so; on
    # torch.func, or without the settling pass, all are materialized.
    settled = check_independence and getattr(trainer.grad_sampler, "name", "").startswith("layerwise")
    chunk = chunk_size(trainer, requested_chunk, settled)
    x, y, other_x, other_y = probe_batch(source, min(chunk, largest_batch(trainer.sampler)), device)
    changed = with_first_replaced(x, other_x)
    k = len(y)

    def forward(inputs):
        def run():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                was_training = model.training
                model.train()
                try:
                    call_model(model, inputs)
                finally:
                    model.train(was_training)

        return run

    forwards = [forward(x), forward(changed)] + ([forward(take(x, torch.arange(k - 1, device=y.device)))] if k > 1 else [])
    written = buffers.check_buffers(buffers.batch_dependent_buffers(model, forwards), buffer_updates)

    def independent() -> None:
        if check_independence:
            with loss_errors_named():
                independence.check_independence(model, trainer.grad_sampler, x, y, other_x, other_y)

    independent()  # first: a model that mixes examples gets that diagnosis, not a gradient mismatch
    checked = None
    if check_gradients:
        backend = getattr(trainer.grad_sampler, "name", None)
        with buffers.restored(model), loss_errors_named():
            checked = gradient_check.verified_backend(trainer, x, y)
        if checked.backend != backend:  # the backend that trains changed: probe it too
            independent()
            if not requested_chunk:  # (torch.func materializes what layerwise kept factored)
                chunk = min(chunk, chunk_size(trainer, None, checked.backend.startswith("layerwise")))
    return chunk, written, checked


__all__ = [
    "PER_EXAMPLE_GRADIENT_MEMORY",
    "auto_physical_batch_size",
    "check_labels",
    "check_trainable",
    "largest_batch",
    "probe_batch",
    "probe_model",
]
