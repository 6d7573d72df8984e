"""What a trainer checks on the user's model and data before the first step, and the physical chunk size it settles.

Each check refuses in one line what DP-SGD cannot train correctly, before anything is released or written:

- the model has trainable parameters, and with the default cross-entropy loss the labels are integer class
  indices in range (a one-line error instead of a raw torch error in the middle of a step);
- every example of real training batches against the same example alone (:mod:`dptrain.preflight.gradient_check`):
  in float64 on EXACT_EXAMPLES examples, every parameter's gradient on its own scale (which settles the backend and
  proves coverage, :mod:`dptrain.stages.coverage`), then by forward passes at the run's largest chunk (the chunk size
  is settled in between, :func:`auto_physical_batch_size`); mixing examples is refused, a wrong rule moved to
  torch.func or refused; any buffer these training-mode passes write (:mod:`dptrain.preflight.buffers`);
- the sentinel that continues these checks on the chunks of training (:func:`sentinel_for`).

Errors name the rule that failed, never a statistic of the private data (a label's value, a count of bad rows).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from dptrain.data.batches import TensorSource, call_model, take
from dptrain.errors import DataError, DPTrainError, ModelError
from dptrain.models.losses import ClassificationHeadLoss
from dptrain.preflight import buffers, exact, gradient_check
from dptrain.preflight.padding import check_padding
from dptrain.preflight.sentinel import Sentinel
from dptrain.stages.devices import to_device
from dptrain.stages.per_example import (
    AutoGradSampler,
    FuncGradSampler,
    LayerwiseGradSampler,
    LoopGradSampler,
    cross_entropy_per_example,
)
from dptrain.stages.precision import MixedPrecision, autocast_of

#: Memory the materialized per-example gradients of one physical chunk may take by default.
PER_EXAMPLE_GRADIENT_MEMORY = 256 * 2**20
#: Examples compared with a backward pass on each alone in float64 before training (every one of them).
EXACT_EXAMPLES = 6
#: The backends whose per-example gradients are those of the trainer's loss (compared with backward passes).
OWN_BACKENDS = (AutoGradSampler, LayerwiseGradSampler, FuncGradSampler, LoopGradSampler)


def eager(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile``d one wraps: per-example gradients need the modules' own forward passes (hooks, and
    torch.func over the module), which a compiled graph hides. Training on the eager model keeps the fast backend
    (a compiled model used to send every model silently to torch.func, and transformers models to a failure); the
    parameters are the same objects, so the optimizer and the compiled wrapper see every update."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def check_trainable(params: dict[str, torch.Tensor]) -> None:
    """The model has trainable parameters, and each is real: a complex parameter's coordinates are pairs of reals, and
    clipping, the noise (torch draws a complex normal with half the variance in each part: sigma / sqrt(2) per real
    coordinate) and the gradient check (which compares real parts) are defined on real tensors."""
    if not params:
        raise ModelError(
            "the model has no trainable parameters (none with requires_grad=True): there is nothing to train"
        )
    for name, p in params.items():
        if p.is_complex():
            raise ModelError(
                f"parameter {name!r} is complex ({str(p.dtype).removeprefix('torch.')}): per-example clipping and the "
                "noise are defined on real coordinates; keep it as a real parameter of its real and imaginary parts "
                "and view it as complex in forward (nn.Parameter(torch.view_as_real(w)), then torch.view_as_complex("
                "self.w)): the same model, noised exactly"
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


def zero_example(source, device: torch.device):
    """The inputs of one example, all zeros (its structure, shapes and dtypes, none of its values), on ``device``."""
    inputs, _ = to_device(source.example(), device)
    return tree_map(torch.zeros_like, inputs)


def warm_up(model: nn.Module, source, device: torch.device) -> None:
    """The model's first call made on a data-independent input, before any private example is read: one
    training-mode forward pass on an all-zero example (the structure, shapes and dtypes of one), its buffers put back.
    What frameworks set up on a model's first call (transformers' output-capturing hooks and the flag that says they
    are installed, a lazy module's parameters) is set up here, from no example; a module attribute that a later pass
    on private examples writes is then the examples' to answer for (the state watch refuses it). A model that cannot
    run on zeros is left as it is (the model probe reports what fails on real examples)."""
    try:
        zeros = zero_example(source, device)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError):
        return
    watch = buffers.BufferWatch(model, kinds=("buffer",))
    was_training = model.training
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        model.train()
        try:
            call_model(model, zeros)
        except Exception as e:  # noqa: BLE001 (any failure of the model on zeros: the probe meets it on examples)
            if isinstance(e, DPTrainError):
                raise
        finally:
            model.train(was_training)
            watch.restore()


def check_labels(model: nn.Module, source, loss_fn, device: torch.device, own_backend: bool = True) -> None:
    """With the default cross-entropy loss, labels must be integer class indices that index the model's outputs (a
    one-line DataError, not a raw torch error in the middle of a step). The model is run on one all-zero input; the
    message names the rule, never the labels' values. ``own_backend`` False: the gradients come from the caller's
    own backend (closed-form gradients of a GLM on real-valued labels), which need not use the loss."""
    if not isinstance(source, TensorSource):
        return  # a Dataset's labels are read batch by batch, never all at once (the step names a bad batch)
    y = source.labels
    if isinstance(loss_fn, ClassificationHeadLoss) and loss_fn.problem_type(y) == "single_label_classification":
        loss_fn = cross_entropy_per_example  # (a Hugging Face classifier's cross-entropy: the same rule)
    if loss_fn is not cross_entropy_per_example:
        return
    if not len(y):
        return
    if y.dtype.is_floating_point and y.dim() == 1 and own_backend:
        raise DataError(
            f"labels must be integer class indices for the default cross-entropy loss, got {y.dtype} labels; convert "
            "them (labels.long()) or pass a loss_fn for real-valued targets"
        )
    if y.dtype.is_floating_point:
        return  # class probabilities, one row per example
    zeros = zero_example(source, device)
    with torch.no_grad(), torch.random.fork_rng(devices=[]), buffers.restored(model):
        was_training = model.training
        model.eval()
        try:
            outputs = call_model(model, zeros)
        except (RuntimeError, ValueError) as e:  # (a model that cannot run one example: the probe refuses it)
            if isinstance(e, DPTrainError):
                raise
            return
        finally:
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
    """(x, y): the first ``k`` training examples (all of them if fewer), on ``device``."""
    k = min(k, len(source))
    return to_device(source.batch(torch.arange(k, device="cpu")), device)


def chunk_size(trainer, requested: int | None, settled: bool) -> int:
    """The run's physical chunk: ``requested``, or the largest whose per-example gradients fit the memory budget."""
    if requested:
        return int(requested)
    factored = factored_sizes(trainer.model, trainer.params, trainer.data.example()[0]) if settled else None
    return auto_physical_batch_size(trainer.params, factored)


def _rows(k: int) -> list[int]:
    """The rows of a probe chunk compared with each example alone: the first, the middle and the last."""
    return sorted({0, k // 2, k - 1})


def _shuffled(k: int) -> torch.Tensor:
    """The probe's permutation of a chunk of ``k`` examples (public: the probe reads the first examples of the training
    set; a fixed generator, not the run's streams)."""
    return torch.randperm(k, generator=torch.Generator(device="cpu").manual_seed(k), device="cpu")


def _reference(sampler) -> str:
    """How an example alone is computed: a backward pass ("autograd"), or, for a backend object of the caller's own
    (a GLM's closed form, which need not use the loss), that backend on a batch of one ("backend")."""
    inner = sampler.backend if isinstance(sampler, MixedPrecision) else sampler
    return "autograd" if isinstance(inner, OWN_BACKENDS) else "backend"


def probe_model(
    trainer, requested_chunk: int | None, check_independence: bool, buffer_updates: str, check_gradients: bool = True
):
    """The checks before the first step, on real training examples, in training mode with dropout off
    (:mod:`dptrain.preflight.exact`), each example of a batch against the same example alone
    (:func:`dptrain.preflight.gradient_check.settle`):

    1. in float64 on the first EXACT_EXAMPLES examples, every one compared (the backend's rules exactly, per
       parameter; coverage; mixing): this settles the backend, which the chunk size depends on;
    2. in the training precision at the run's largest chunk (its physical chunk, or the largest batch the sampler
       will plausibly draw if smaller): coverage, buffers and mixing at the shape training uses, three rows compared
       alone and every row against the chunk permuted.

    Returns (physical chunk size, names of the buffers a training-mode pass writes: empty unless ``buffer_updates ==
    "not_private"``, the gradient check or None when ``check_gradients`` is off, the chunk size the probe verified).
    The model's buffers and torch's generator are left as they were."""
    start = time.perf_counter()
    model, source, device = trainer.model, trainer.data, trainer.device
    sampler = trainer.grad_sampler
    reference = _reference(sampler)
    mixing = bool(check_independence)
    gradients = bool(check_gradients) and reference == "autograd"
    written: set[str] = set()
    precision = "float64"
    xs, ys = probe_batch(source, EXACT_EXAMPLES, device)
    with _probing(model):
        history = _alone_outputs(trainer, xs, mixing)  # (before any pass on a batch of real examples)
        inner = sampler.backend if isinstance(sampler, MixedPrecision) else sampler
        try:
            with exact.float64(model):
                first = gradient_check.settle(
                    trainer, exact.as_float64(xs), exact.as_float64(ys), list(range(len(ys))), gradient_check.EXACT,
                    mixing=mixing, gradients=gradients, buffer_updates=buffer_updates, backend=inner,
                    reference=reference,
                )
                if mixing:
                    check_padding(model, trainer.loss_fn, source, exact.as_float64(xs), exact.as_float64(ys),
                                  list(range(len(ys))), gradient_check.EXACT.loss,
                                  lambda b: tuple(exact.as_float64(t) for t in to_device(b, device)))
        except (RuntimeError, TypeError) as e:  # a model that cannot run in float64 (a dtype fixed in its code)
            if isinstance(e, DPTrainError):
                raise
            precision = str(next(iter(trainer.params.values())).dtype).removeprefix("torch.")
            first = gradient_check.settle(
                trainer, xs, ys, list(range(len(ys))), gradient_check.tolerance_of(sampler, model), mixing=mixing,
                gradients=gradients, buffer_updates=buffer_updates, reference=reference,
            )
            if mixing:
                check_padding(model, trainer.loss_fn, source, xs, ys, list(range(len(ys))),
                              gradient_check.tolerance_of(sampler, model).loss, lambda b: to_device(b, device))
    written |= first.written
    # Automatic chunks count an Embedding's gradients as factored only when the settled backend keeps them so.
    chunk = chunk_size(trainer, requested_chunk, getattr(trainer.grad_sampler, "name", "").startswith("layerwise"))
    x, y = probe_batch(source, min(chunk, largest_batch(trainer.sampler)), device)
    with _probing(model):
        if mixing:
            gradient_check.forward_check(trainer, x, y, _rows(len(y)), gradient_check.tolerance_of(sampler, model),
                                         buffer_updates, written, order=_shuffled(len(y)))
        else:  # (the buffers a training-mode forward writes at the run's chunk, all the same)
            gradient_check.forward_check(trainer, x, y, [], gradient_check.FLOAT, buffer_updates, written)
        _same_history(history, _alone_outputs(trainer, xs, mixing), gradient_check.tolerance_of(sampler, model))
    kept = buffers.check_buffers(sorted(written), buffer_updates)
    checked = None
    if gradients:
        checked = gradient_check.GradientCheck(
            trainer.grad_sampler.name, first.rows, time.perf_counter() - start, first.moved, precision, len(y)
        )
    return chunk, kept, checked, len(y)


#: The refusal of a model whose output for an example changed after passes on other examples (:func:`_same_history`).
OUTSIDE_STATE = (
    "the model's output for an example changed after it ran on other examples, with its parameters, buffers and "
    "attributes put back: it keeps state outside its modules (a global, a closure, another object) that its passes "
    "write, a statistic of the examples or a count of the chunks, so one example's output depends on others unseen; "
    'keep no state across passes (or keep it in the model, where it is refused or released with buffer_updates='
    '"not_private")'
)


#: Examples run alone before and after the probe's passes (:func:`_same_history`): the first (each pass costs a forward).
HISTORY_EXAMPLES = 1


def _alone_outputs(trainer, x, mixing: bool) -> list[list[torch.Tensor]] | None:
    """The first HISTORY_EXAMPLES examples of the batch ``x``, each run alone as training runs it (inside the probe's
    ``_probing``: training mode, dropout off; the training precision), torch's generator reset to one public seed (a
    model drawing random numbers draws the same ones each time), the model's state put back after them: what
    :func:`_same_history` compares before and after the probe's passes. None when the independence check is off, when the model cannot run an example alone, or when the passes
    write a slot of its state (the probe's comparisons refuse those, naming why)."""
    if not mixing:
        return None
    model, device = trainer.model, trainer.device
    outputs, watch = [], buffers.BufferWatch(model)  # (a slot these passes write: put back, and the probe names it)
    try:
        for i in range(min(HISTORY_EXAMPLES, len(tree_flatten(x)[0][0]))):
            one = take(x, torch.tensor([i], device=device))
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), \
                    autocast_of(trainer.grad_sampler):
                torch.manual_seed(0)
                out = tree_flatten(call_model(model, one))[0]
            outputs.append([t.detach().double() for t in out if torch.is_tensor(t) and t.is_floating_point()])
    except Exception as e:  # noqa: BLE001 (a model that fails alone: the probe's comparisons refuse it, naming why)
        if isinstance(e, DPTrainError):
            raise
        return None
    finally:
        wrote = watch.written()
        if wrote:
            watch.restore()
    return None if wrote else outputs


def _same_history(before, after, tol: gradient_check.Tolerance) -> None:
    """Refuse (OUTSIDE_STATE) a model whose output for an example alone differs after the probe's passes on other
    examples from the same output before them: with its parameters and every watched slot of its state the same, only
    state kept outside the model can carry the other examples in (a running maximum in a global passes every
    comparison of a chunk with its examples run after it: the statistic is already the chunk's)."""
    if before is None or after is None:
        return
    for one, again in zip(before, after, strict=True):
        for a, b in zip(one, again, strict=False):
            if a.shape == b.shape and bool(a.isfinite().all()) and not (
                float((a - b).norm()) <= tol.loss * float(a.norm()) + 1e-30
            ):
                raise ModelError(OUTSIDE_STATE)


def sentinel_for(trainer, probed: int, check_independence: bool, check_gradients: bool, buffer_updates: str):
    """The sentinel of a trainer's run (:mod:`dptrain.preflight.sentinel`): the probe's comparisons on the chunks of
    training, from the batch size ``probed`` on, at places keyed by the run's secret entropy."""
    reference = _reference(trainer.grad_sampler)
    mixing = bool(check_independence)
    gradients = bool(check_gradients) and reference == "autograd"
    return Sentinel(trainer, {probed} if mixing else set(), mixing=mixing, gradients=gradients, reference=reference,
                    buffer_updates=buffer_updates)


@contextlib.contextmanager
def _probing(model):
    with exact.probing(model), loss_errors_named():
        yield


__all__ = [
    "PER_EXAMPLE_GRADIENT_MEMORY",
    "auto_physical_batch_size",
    "check_labels",
    "check_trainable",
    "largest_batch",
    "probe_batch",
    "probe_model",
    "sentinel_for",
]
