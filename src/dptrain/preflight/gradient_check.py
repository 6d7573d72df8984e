"""Per-example gradients verified on the user's own model: each example's gradient computed inside its batch, by the
backend that trains, against the same example's gradient computed alone.

One comparison answers both questions a per-example gradient raises. Example i's loss and gradient computed in a
batch must equal its loss and gradient computed on a batch of i alone:

- if they differ for the **loss**, the model mixes examples (its output for one example depends on the others: a
  normalization by the batch maximum, ``h - h.mean(0)``, a layer that mixes only in batches of some sizes), and
  per-example clipping would not bound one example's influence: the model is refused (the independence check);
- if the losses agree but a **parameter's gradient** differs, the backend's rule for it is wrong or incomplete on this
  model (or the model mixes examples in its backward pass only): the automatic backend differentiates the modules
  owning it by torch.func, then the whole model, and checks again; a backend the user chose is refused naming the
  parameter.

Removing every other example at once sees any dependence on them, whichever example carries it: a model normalizing
by the batch maximum moves the gradient of every example but the one holding the maximum. Each parameter is compared
on its own scale, not against the whole gradient (a missing adapter is 100% wrong on its own parameters and 2e-4 of
the whole), in training mode with dropout off (:mod:`dptrain.preflight.exact`). The tolerance depends on the precision
(:class:`Tolerance`): in float64 (:data:`EXACT`) rounding is about 1e-11 of a parameter's gradient, so 1e-6 tells a
rule 1e-3 off from rounding; in float32 (:data:`FLOAT`) rounding of a cancellation reaches 4e-3 of a parameter's
gradient, so a parameter fails only beyond 5e-2 of its own gradient and 1e-4 of the example's whole gradient (a
missing gradient, a mixing model; a rule 1e-3 off is the float64 check's to find).

:func:`settle` runs one batch through the backend and compares chosen rows (:func:`compare`), widening the automatic
backend until every parameter is covered and agrees; :func:`forward_check` compares the model's outputs only, by
forward passes (mixing, at a batch size the backward passes were not compared at). The model probe
(:mod:`dptrain.preflight.checks`) settles in float64 on a few examples and checks forward at the run's largest chunk;
the sentinel (:mod:`dptrain.preflight.sentinel`) checks forward at every new batch size of training and compares
forward and backward at secret chunks. Their only outcomes are the backend that trains, or a one-line refusal.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dptrain.data.batches import call_model, copied, take
from dptrain.errors import DPTrainError, ModelError, one_line
from dptrain.preflight.batch_dependence import CHECK_NAME, example_rows, mixing_refusal, output_leaves
from dptrain.preflight.buffers import BufferWatch, check_buffers, restored
from dptrain.stages.coverage import CoverageError, ModuleCalls
from dptrain.stages.per_example import AutoGradSampler, LayerwiseGradSampler, trainable_parameters
from dptrain.stages.precision import LOW, MixedPrecision, autocast_of


@dataclass(frozen=True)
class Tolerance:
    """A parameter's gradient agrees when ||batch - alone|| <= param x ||its alone gradient|| + whole x ||the example's
    whole alone gradient||; a loss when |batch - alone| <= loss x |alone loss| (+ loss x 1e-12)."""

    param: float
    whole: float
    loss: float


#: float64: rounding is about 1e-11 of a parameter's gradient.
EXACT = Tolerance(1e-6, 1e-9, 1e-9)
#: float32: rounding reaches 4e-3 of a tiny parameter gradient (a cancellation), about 1e-6 of the whole.
FLOAT = Tolerance(5e-2, 1e-4, 1e-4)
#: bf16 / fp16 (autocast or weights): a batched and a single pass round differently, about 1e-2 of the whole.
HALF = Tolerance(0.0, 5e-2, 5e-2)


def tolerance_of(sampler, model) -> Tolerance:
    """The tolerance for the precision a backend runs in: its autocast dtype, else its parameters' dtype."""
    if getattr(sampler, "dtype", None) in LOW or any(p.dtype in LOW for p in trainable_parameters(model).values()):
        return HALF
    if all(p.dtype == torch.float64 for p in trainable_parameters(model).values()):
        return EXACT
    return FLOAT


@dataclass
class Settled:
    """What a settle did: the examples it compared, the parameters moved to torch.func (coverage or mismatch), the
    buffers the passes wrote."""

    rows: int = 0
    moved: list[str] = field(default_factory=list)
    written: set[str] = field(default_factory=set)


def auto_of(sampler) -> AutoGradSampler | None:
    inner = sampler.backend if isinstance(sampler, MixedPrecision) else sampler
    return inner if isinstance(inner, AutoGradSampler) else None


def batched_forward(sampler) -> bool:
    """Whether the backend's losses come from one forward pass on the batch (layerwise), not example by example."""
    inner = sampler.backend if isinstance(sampler, MixedPrecision) else sampler
    inner = inner.backend if isinstance(inner, AutoGradSampler) else inner
    return isinstance(inner, LayerwiseGradSampler)


@contextlib.contextmanager
def _one_example(model, inputs):
    """A model that fails on ``inputs``, a batch of one example, as a one-line refusal (:func:`alone_error`)."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, DPTrainError):
            raise
        raise alone_error(e, raising_layer(model, inputs)) from None


def _alone(model, loss_fn, x, y, params, i: int, autocast):
    """Example i's loss and gradient (by parameter name) from a backward pass on a batch of that example alone, and
    the names of the parameters its loss does not depend on at all (not in autograd's graph)."""
    idx = torch.tensor([i], device=y.device)
    with torch.enable_grad(), autocast, _one_example(model, take(x, idx)):
        loss = loss_fn(call_model(model, take(x, idx)), y[i : i + 1]).reshape(())
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    out = {n: torch.zeros_like(p) if g is None else g.detach().to_dense() if g.is_sparse else g.detach()
           for (n, p), g in zip(params.items(), grads, strict=True)}  # (an Embedding(sparse=True)'s: sparse)
    return out, loss.detach(), {n for n, g in zip(params, grads, strict=True) if g is None}


def _row(grads, i: int, n: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    """Row i of a chunk's per-example gradients (the others zeroed, not multiplied by 0: a NaN must not leak)."""
    others = torch.ones(n, dtype=torch.bool, device=like.device)
    others[i] = False
    return grads.zero_examples(others).weighted_sum(torch.ones(n, dtype=like.dtype, device=like.device))


def _fails_alone(model, x) -> bool:
    """Whether the model's forward pass runs on the batch ``x`` but raises on its first example alone."""

    def runs(inputs) -> bool:
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), restored(model):
                call_model(model, inputs)
        except Exception:  # noqa: BLE001 (the model's own error, whatever it is)
            return False
        return True

    return runs(x) and not runs(take(x, torch.arange(1, device=_device_of(x))))


def _device_of(x) -> torch.device:
    return next(t for t in tree_flatten(x)[0] if torch.is_tensor(t)).device


#: Layers that normalize each example on its own: one failing on a batch of one example does not need the others; it
#: normalizes a single value (GroupNorm's groups of one channel on a 1 x 1 map), which torch refuses for one example.
PER_EXAMPLE_NORMS = (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm)


def raising_layer(model, inputs) -> tuple[str, nn.Module] | None:
    """(name, module) of the innermost module whose forward raises on ``inputs``, or None if the forward runs."""
    names = {m: n for n, m in model.named_modules()}
    stack: list = []

    def enter(module, args) -> None:
        stack.append(module)

    def leave(module, args, output) -> None:  # (returns None: the output is the module's own)
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in names]
    handles += [m.register_forward_hook(leave) for m in names]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), restored(model):
            call_model(model, inputs)
    except Exception:  # noqa: BLE001 (the model's own error, whatever it is)
        return (names[stack[-1]], stack[-1]) if stack else None
    finally:
        for h in handles:
            h.remove()
    return None


def alone_error(e: BaseException, where: tuple[str, nn.Module] | None = None) -> ModelError:
    """A model that cannot compute one example without the others, naming the layer that raised (``where``): a
    normalization of each example on its own over a single value, or else a layer needing the batch (BatchNorm)."""
    if where is not None and isinstance(where[1], PER_EXAMPLE_NORMS):
        return ModelError(
            f"{CHECK_NAME} failed: layer {where[0]!r} ({type(where[1]).__name__}) cannot compute an example alone "
            f"({one_line(e, 120)}): it normalizes a single value of each example (a group of one channel on a 1 x 1 "
            "map), which torch refuses for a batch of one example and which makes its output a constant; normalize "
            "over more values (fewer groups, e.g. GroupNorm(1, channels), or larger inputs)"
        )
    layer = f" (layer {where[0]!r}, {type(where[1]).__name__})" if where is not None and where[0] else ""
    return ModelError(
        f"{CHECK_NAME} failed: the model cannot compute an example alone{layer} ({one_line(e, 120)}), so its output for "
        "one example needs the other examples of its batch (a statistic of the batch: BatchNorm, its mean or maximum, "
        "...) and per-example clipping does not bound one example's influence (and a chunk of training may hold one "
        "example); remove the cross-example operation (BatchNorm -> GroupNorm)"
    )


def refusal(name: str, backend: str, k: int) -> ModelError:
    return ModelError(
        f"the per-example gradient of parameter {name!r} from the {backend} backend, computed in a batch of {k}, does "
        "not match a backward pass on the example alone, so this model cannot be trained with correct per-example "
        "clipping (the backend's rule is wrong for it, or the model mixes examples in its backward pass); report the "
        "model, or try grad_sampler='func' or 'loop'"
    )


def compare(model, sampler, loss_fn, x, y, grads, losses, rows: list[int], tol: Tolerance, *,
            mixing: bool, gradients: bool, reference: str = "autograd", floor: float = 0.0,
            params: dict | None = None, warn_unused_parameters: bool = False) -> tuple[list[int], list[str]]:
    """(rows whose loss moved, names of the parameters whose gradient disagrees) between the batch's per-example
    ``grads`` / ``losses`` and each row of ``rows`` computed alone. ``reference``: "autograd" (a backward pass on the
    example alone) or "backend" (the backend itself on a batch of one: a backend of the caller's own that need not use
    ``loss_fn``, checked for mixing only). ``floor``: an absolute tolerance added to every gradient's (during training,
    a tiny fraction of the clip norm: a well-fit example's gradient is a cancellation, e.g. 1 - p, whose rounding is
    large beside it and nothing beside what clipping bounds). ``params``: the parameters compared (default: the
    model's trainable ones; during training the trainer's, those its backend privatizes). ``warn_unused_parameters``:
    warn of the parameters no row's loss reaches (:func:`warn_unused`), for the probe before training only: which
    parameters a row's loss reaches can depend on its values (a mixture of experts routes each example), and a
    warning printed from the sentinel's secret chunks during training would be a statistic of private examples on
    stderr, unaccounted (its text and how often it is printed changed with the data)."""
    params = trainable_parameters(model) if params is None else {n: p for n, p in params.items() if p.requires_grad}
    first = next(iter(params.values()))
    n = len(y)
    autocast = autocast_of(sampler)
    gradients = gradients or (mixing and reference == "backend")  # (a backend's own: mixing shows in its rows)
    if mixing and reference == "autograd" and (losses is None or not batched_forward(sampler)):
        with torch.no_grad(), autocast:  # (torch.func and the loop compute each loss alone: the batch's, here)
            losses = loss_fn(call_model(model, copied(x)), copied(y))
    moved, bad = [], []
    unused = set(params) if warn_unused_parameters and reference == "autograd" and gradients and rows else set()
    for i in rows:
        if reference == "autograd":
            with restored(model):
                alone, alone_loss, not_in_graph = _alone(model, loss_fn, x, y, params, i, autocast)
            unused &= not_in_graph
        else:
            with restored(model):
                one, alone_loss = sampler(take(x, torch.tensor([i], device=y.device)), y[i : i + 1])
            alone = _row(one, 0, 1, first)
            alone_loss = None if alone_loss is None else alone_loss.reshape(-1)[0]
        if mixing and losses is not None and alone_loss is not None:
            a, b = float(alone_loss), float(losses[i])
            if not abs(a - b) <= tol.loss * (abs(a) + 1e-12):  # (NaN fails too)
                if abs(a) < float("inf"):
                    moved.append(i)
                    continue
        if not gradients:
            continue
        batched = _row(grads, i, n, first)
        whole = float(torch.sqrt(sum((g.double() ** 2).sum() for g in alone.values())))
        if not whole < float("inf"):
            continue  # a non-finite gradient is the step's to refuse (NonFiniteError), not the backend's
        for name, g in alone.items():
            err = float((batched[name].reshape(g.shape).double() - g.double()).norm())
            own = float(g.double().norm())
            if not err <= tol.param * own + tol.whole * whole + floor and name not in bad:  # (NaN fails too)
                bad.append(name)
    if unused and not moved:
        warn_unused(sorted(unused))
    return moved, bad


class UnusedParameterWarning(UserWarning):
    """Trainable parameters that no example's loss depends on: their update is the noise alone."""


def warn_unused(names: list[str]) -> None:
    """Warn (once per set of names) that the trainable parameters ``names`` are not used by the loss."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    warnings.warn(UnusedParameterWarning(
        f"dptrain: trainable parameter(s) {', '.join(map(repr, names[:3]))}{more} are not used by the model's loss on "
        "the examples checked (an adapter on a module the forward pass does not call, a head the task does not "
        "read): their per-example gradients are zero and their update is the noise alone; freeze them "
        "(requires_grad=False) or target the modules the model calls"
    ), stacklevel=2)


#: The path under which :func:`forward_check` compares the losses beside the model's outputs (``losses=True``).
LOSS_PATH = "<loss>"


def _pass_leaves(trainer, x, y, idx: torch.Tensor | None, losses: bool) -> dict[str, object]:
    """The leaves of the model's output on the examples ``idx`` of (``x``, ``y``) (None: all), and, with ``losses``,
    their losses (one per example, in float64) under :data:`LOSS_PATH`; a loss that cannot be computed or is not one
    per example is left out (the step's to refuse)."""
    xs, ys = (x, y) if idx is None else (take(x, idx), take(y, idx))
    out = call_model(trainer.model, xs)
    leaves = output_leaves(out)
    if losses:
        try:
            loss = trainer.loss_fn(out, ys).detach().reshape(-1).double()
        except Exception as e:  # noqa: BLE001 (a loss failing here fails in the step, which names it)
            if isinstance(e, DPTrainError):
                raise
        else:
            if loss.numel() == len(ys):
                leaves[LOSS_PATH] = loss
    return leaves


def forward_check(trainer, x, y, rows: list[int], tol: Tolerance, buffer_updates: str, written: set[str],
                  sampler=None, order: torch.Tensor | None = None, losses: bool = False,
                  trained: dict | None = None) -> None:
    """The mixing half of the comparison, forward passes only, run as training runs them (training mode, autograd
    recording): the model's outputs (every tensor with a batch dimension) for ``rows`` of the batch against each
    example's outputs alone, and, with ``order`` (a permutation of the batch), every row of the batch against the
    same example's row in the batch permuted. A mixing model is refused (ModelError). The forwards' buffer writes are
    added to ``written`` (and refused unless ``buffer_updates`` says not private). For a batch size the backward passes
    were not compared at: mixing shows in the outputs.

    The two comparisons cover each other's blind spot. A model whose outputs mix examples symmetrically (a batch mean,
    BatchNorm) gives every example's row the permutation's row, but moves every row away from the example alone; a
    model that mixes into some places only (the last row, a row and its neighbour) may leave the rows compared alone
    untouched, but moves an example's output when the permutation takes it to another place. Only a dependence on the
    others that is both symmetric and absent from the rows compared alone goes unseen, and a symmetric dependence
    reaches every row.

    With ``losses``, each example's loss is compared the same way beside the outputs: a loss may mix the examples where
    the model does not (a batch mean added only in chunks of some sizes); its passes are the outputs' own.

    ``trained``: the leaves of the model's outputs in training's own pass on the batch (:func:`output_leaves`), compared
    instead of a pass of the check's own: a model computing otherwise when it is run again (state kept outside it that
    a pass on the same batch leaves unused) is compared as it trained."""
    model, k = trainer.model, len(y)
    autocast = autocast_of(trainer.grad_sampler if sampler is None else sampler)
    refuse = lambda i, also=(): mixing_refusal(  # noqa: E731
        model, trainer.loss_fn, x, y, i, lambda: autocast_of(trainer.grad_sampler if sampler is None else sampler),
        tol.loss, also)
    if trained is not None:
        batched = trained
    else:
        watch = BufferWatch(model)
        try:
            with torch.enable_grad(), autocast:
                batched = _pass_leaves(trainer, copied(x), copied(y), None, losses)
        finally:
            written.update(watch.written())
            watch.restore()
        check_buffers(sorted(written), buffer_updates, watch.kinds)
    per_example: set[str] = set()  # (the outputs holding a row per example, at the same path in both passes)
    for i in rows:
        index = torch.tensor([i], device=y.device)
        with restored(model), torch.enable_grad(), autocast, _one_example(model, take(x, index)):
            alone = _pass_leaves(trainer, x, y, index, losses)
        for path in example_rows(batched, alone, k):
            per_example.add(path)
            a, b = alone[path][0].double(), batched[path][i].double()
            if not float((a - b).norm()) <= tol.loss * float(a.norm()) + 1e-30 and bool(a.isfinite().all()):
                # (a non-finite output of the example alone is the step's to refuse)
                raise refuse(i)
    if order is None or k < 2:
        return
    order = order.to(y.device)
    with restored(model), torch.enable_grad(), autocast:
        permuted = _pass_leaves(trainer, x, y, order, losses)
    for path in sorted(per_example):
        a, b = permuted.get(path), batched[path]
        if not torch.is_tensor(a) or a.shape != b.shape:
            continue
        a, b = a.double().reshape(k, -1), b[order].double().reshape(k, -1)  # (row r: example order[r], both times)
        finite = a.isfinite().all(1) & b.isfinite().all(1)
        moved = ((a - b).norm(dim=1) > tol.loss * b.norm(dim=1) + 1e-30) & finite
        if bool(moved.any()):
            places = moved.nonzero().flatten().tolist()
            examples = [int(order[r]) for r in places]
            raise refuse(examples[0], examples[1:] + places)


def settle(trainer, x, y, rows: list[int], tol: Tolerance, *, mixing: bool, gradients: bool, buffer_updates: str,
           backend=None, reference: str = "autograd") -> Settled:
    """Run the batch (``x``, ``y``) through the trainer's backend (or ``backend``, the one under the trainer's mixed
    precision) and compare ``rows`` with each example alone; the automatic backend widens what torch.func
    differentiates until every parameter is covered and agrees. Refuses (ModelError) a written buffer (unless
    ``buffer_updates`` says not private), a mixing model, a parameter no backend gets right."""
    model, loss_fn = trainer.model, trainer.loss_fn
    sampler = backend if backend is not None else trainer.grad_sampler
    auto = auto_of(sampler)
    names = {id(p): n for n, p in trainable_parameters(model).items()}
    out = Settled(rows=len(rows) if (mixing or gradients) else 0)
    while True:
        watch, calls = BufferWatch(model), ModuleCalls(model)
        try:
            with calls.watching():
                grads, losses = sampler(*copied((x, y)))  # (the batch as drawn stays for the examples alone)
        except CoverageError as e:
            if e.fixable and auto is not None and auto.cover(e.names, calls.called):
                out.moved += [n for n in e.names if n not in out.moved]
                continue
            raise
        except (RuntimeError, ValueError) as e:  # (not a DPTrainError: those are ValueErrors too, and pass through)
            if isinstance(e, DPTrainError) or not _fails_alone(model, x):
                raise
            raise alone_error(e, raising_layer(model, take(x, torch.arange(1, device=_device_of(x))))) from None
        finally:
            out.written.update(watch.written())
            watch.restore()
        check_buffers(sorted(out.written), buffer_updates, watch.kinds)
        if not batched_forward(sampler):  # (the layerwise backend refuses those itself, on every chunk)
            calls.refuse_without_autograd(names)
        if not (mixing or gradients):
            return out
        moved, bad = compare(model, sampler, loss_fn, x, y, grads, losses, rows, tol, mixing=mixing,
                             gradients=gradients, reference=reference, warn_unused_parameters=True)
        if moved:
            raise mixing_refusal(model, loss_fn, x, y, moved[0], lambda: autocast_of(sampler), tol.loss)
        if not bad:
            return out
        if auto is not None and auto.move_to_func(bad):
            out.moved += [n for n in bad if n not in out.moved]
            continue
        raise refusal(bad[0], getattr(sampler, "name", type(sampler).__name__), len(y))


@dataclass
class GradientCheck:
    """What the checks before training did: the backend they settled on, the examples compared with single-example
    passes (in float64 and at the run's largest chunk), the parameters handed to torch.func, their cost (``seconds``: not
    in :meth:`to_dict`, which goes to shareable summaries; a time depends on the private examples' shapes)."""

    backend: str
    examples: int
    seconds: float
    moved_to_func: list[str] = field(default_factory=list)
    precision: str = "float64"
    chunk: int = 0

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "examples": self.examples,
            "moved_to_func": self.moved_to_func,
            "precision": self.precision,
            "chunk": self.chunk,
        }


__all__ = ["EXACT", "FLOAT", "HALF", "GradientCheck", "Settled", "Tolerance", "compare", "forward_check", "settle",
           "tolerance_of"]
