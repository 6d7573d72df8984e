"""Per-example gradients: the gradient of each example's loss with respect to every trainable parameter.

Two backends compute the same thing (``tests/test_per_example.py`` checks both against a loop of
single-example backward passes):

- ``func``: torch.func (``functional_call`` + ``vmap`` + ``grad``). Works for any model whose output
  for one example does not depend on the others. The general path.
- ``layerwise``: forward hooks record each layer's input and output; one backward pass asks autograd
  only for the gradients of the layer *outputs* (so it never computes the batch-summed weight
  gradient it would throw away), and each layer's per-example weight gradient is formed from its
  input and output gradient: an outer product for Linear (on [B, in] or sequences [B, T, in]), a grouped
  convolution backward for Conv1d/Conv2d, torch's fused GroupNorm kernels on the batch seen as one example for
  GroupNorm, the normalized input for LayerNorm/RMSNorm, the looked-up ids for Embedding, each on the rows of the
  layer's tensors that are each example's (measured, not read off a size: :mod:`dptrain.stages.batch_layout`;
  OPT's feed-forward layers see [B*T, d]). About twice as fast as
  ``func`` on the small CNNs of the DP literature. A module with parameters but no rule (attention, PReLU, a custom
  layer) is differentiated per example by torch.func on its own, from its recorded inputs and output gradient: the
  fallback is per module, not for the whole model.

``make_grad_sampler(model, loss_fn, "auto")`` uses ``layerwise`` with that per-module fallback, and ``func`` for the
whole model only when a module cannot be differentiated on its own; ``"layerwise"`` is strict (rules only).
A loss function takes (outputs, targets) and returns one loss per example (shape [B]).

A backend returns a :class:`PerExampleGrads`: clipping rules ask it for per-example squared norms and
for weighted sums sum_i f_i g_i, and only materialize the [B, ...] tensors when they need them. For a
Linear layer on [B, in] inputs the layerwise backend never materializes: ||g_i||^2 = ||delta_i||^2 ||a_i||^2
("ghost" norms, Goodfellow 2015; Li et al. 2022) and sum_i f_i g_i = (f * delta)^T a is one matmul
(the book-keeping trick of Bu et al. 2023). On sequences it keeps the factors too (the Gram form over positions)
where that is cheaper, decided per layer from its shapes (:func:`ghost_pays`), and an Embedding never builds a
[B, vocabulary, dim] tensor unless asked to materialize.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.func import grad, vmap
from torch.utils._pytree import tree_flatten

from dptrain.data.batches import batch_len, call_model, take, unsqueezed
from dptrain.errors import ConfigError, ModelError, one_line
from dptrain.models.losses import cross_entropy_per_example  # noqa: F401  (the default classification loss, re-exported)
from dptrain.stages.batch_layout import (
    REPLACE,
    ROOT,
    ROWS,
    SHARED,
    CallLayout,
    Expanded,
    Layouts,
    expanded,
    rows_per_example,
    view_rows,
)
from dptrain.stages.batch_layout import tensors as _tensors
from dptrain.stages.coverage import Call, check_coverage, input_nodes, nearest_called_ancestor
from dptrain.stages.dropout_replay import Recorder
from dptrain.stages.gradient_factors import (
    PerExampleGrads,
    shared,
)
from dptrain.stages.layer_rules import _layerwise_rule, layerwise_supported
from dptrain.stages.module_func import FallbackError, call_with, per_module_gradients, separated
from dptrain.stages.precision import LOW, upcast
from dptrain.stages.recurrent import refusal as recurrent_refusal

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GRAD_SAMPLERS = ("auto", "func", "layerwise", "loop")


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class FuncGradSampler:
    """Per-example gradients with torch.func: vmap over examples of grad of the single-example loss."""

    name = "func"

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model = model

        def loss_one(params, buffers, x, y):
            one = unsqueezed(x)
            if isinstance(one, dict):
                out = call_with(model, {**params, **buffers}, (), one)
            else:
                out = call_with(model, {**params, **buffers}, tuple(one) if isinstance(one, tuple | list) else (one,))
            loss = loss_fn(out, y.unsqueeze(0)).reshape(())
            return loss, loss.detach()

        # randomness="different": dropout masks differ per example, as in ordinary training.
        self._per_example = vmap(
            grad(loss_one, has_aux=True), in_dims=(None, None, 0, 0), randomness="different"
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[PerExampleGrads, torch.Tensor]:
        params = {n: p.detach() for n, p in trainable_parameters(self.model).items()}
        buffers = dict(self.model.named_buffers())
        try:
            grads, losses = self._per_example(params, buffers, x, y)
        except RuntimeError as e:
            # whatever torch.func refuses inside its transforms: a branch on a tensor's value (transformers' masking
            # code), an in-place write to a captured tensor (torch's parametrizations, as peft's target_parameters
            # LoRA registers on every call), ... The automatic backend goes on to the loop of single examples, which
            # runs the model as plain training does (and raises a model's own error there).
            raise FallbackError(
                f"torch.func cannot differentiate this model per example ({one_line(e, 160)}); use "
                "grad_sampler='auto' or 'loop'"
            ) from None
        return PerExampleGrads({n: upcast(g) for n, g in grads.items()}), losses

    def close(self) -> None:
        pass


class LoopGradSampler:
    """Per-example gradients by a loop of single-example backward passes: exact for any model (data-dependent control
    flow included), and slow; the last resort of the automatic backend."""

    name = "loop"

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model, self.loss_fn = model, loss_fn

    def __call__(self, x, y) -> tuple[PerExampleGrads, torch.Tensor]:
        params = trainable_parameters(self.model)
        n = batch_len(y)
        grads = {name: p.new_zeros((n, *p.shape), dtype=_grad_dtype(p)) for name, p in params.items()}
        losses = []
        for i in range(n):
            idx = torch.tensor([i], device=y.device)
            with torch.enable_grad():
                loss = self.loss_fn(call_model(self.model, take(x, idx)), y[i : i + 1]).reshape(())
                parts = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            for (name, _), g in zip(params.items(), parts, strict=True):
                if g is not None:  # (an Embedding(sparse=True)'s gradient is sparse: the same values, dense here)
                    grads[name][i] = g.to_dense() if g.is_sparse else g
            losses.append(loss.detach())
        return PerExampleGrads(grads), torch.stack(losses) if losses else y.new_zeros(0, dtype=torch.float32)

    def close(self) -> None:
        pass


# --- layerwise backend --------------------------------------------------------------------------------------


class LayoutChanged(FallbackError):
    """A recorded call the layout measurement did not see (the sampler measures again, once)."""


#: Rules of layers that treat every leading dimension as positions of one example (Linear on sequences, Embedding on
#: ids of any shape, the normalizations): k rows per example are k positions of it.
_ROWWISE = {"_linear", "_embedding", "_layer_norm", "_rms_norm"}


def _by_rows(rule, m: nn.Module, a: torch.Tensor, go: torch.Tensor, n: int, k: int) -> dict:
    """A layer's per-example gradients when example i owns rows i k .. i k + k - 1 of its input and output (k = 1:
    [B, ...] as usual): row-wise rules see [B, k, ...] (k more positions), the others each row as an example, their
    gradients then summed over each example's rows."""
    if k == 1 and a.dim() and a.shape[0] == n:
        return rule(m, a, go)
    if not a.dim():
        a, go = a.reshape(1), go.reshape(1, *go.shape)
    if rule.__name__ in _ROWWISE:
        return rule(m, view_rows(a, n), view_rows(go, n))
    return {p: view_rows(g.materialize() if hasattr(g, "materialize") else g, n).sum(1)
            for p, g in rule(m, a, go).items()}


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype per-example gradients of ``p`` are formed in: float32 for a bfloat16/float16 parameter."""
    return torch.float32 if p.dtype in LOW else p.dtype


class InplaceOutputError(ModelError):
    """A recorded layer output was overwritten in place during the forward pass. ``modules``: the modules whose
    outputs were (the sampler then hands the model copies of their outputs, and records again)."""

    def __init__(self, message: str, modules: frozenset = frozenset()):
        super().__init__(message)
        self.modules = modules


class LayerwiseGradSampler:
    """Per-example gradients from recorded layer inputs and output gradients (see module docstring)."""

    name = "layerwise"

    def __init__(self, model: nn.Module, loss_fn: LossFn, fallback: bool = True, to_func: frozenset = frozenset()):
        """``to_func``: modules differentiated by torch.func (per module) even where a rule exists (the gradient
        check found their rule's gradients wrong on this model)."""
        if not fallback and not layerwise_supported(model):
            raise ModelError(
                "the layerwise backend has rules for Linear, Conv1d, Conv2d, Embedding, GroupNorm, LayerNorm and "
                "RMSNorm parameters; other modules need fallback=True (torch.func for that module only)"
            )
        self.model, self.loss_fn = model, loss_fn
        self._layers: dict[nn.Module, tuple[str, Callable]] = {}
        self._to_func = to_func
        #: modules without a rule: differentiated per example by torch.func, each on its own (their whole subtree)
        self._fallback: dict[nn.Module, str] = {}
        covered: set[int] = set()
        for prefix, m in model.named_modules():
            if id(m) in covered:
                continue
            if m in to_func and not any(p.requires_grad for p in m.parameters(recurse=False)):
                if any(p.requires_grad for p in m.parameters()):  # (a module that reads its children's parameters)
                    self._fallback[m] = prefix
                    covered.update(id(sub) for sub in m.modules())
                continue
            if not any(p.requires_grad for p in m.parameters(recurse=False)):
                continue
            rule = None if m in to_func else _layerwise_rule(m)
            if rule is not None:
                self._layers[m] = (prefix, rule)
            else:
                self._fallback[m] = prefix
                covered.update(id(sub) for sub in m.modules())
        #: fallback modules refused by their configuration (a recurrent layer's dropout between layers), and why
        self._refused = {m: why for m in self._fallback if isinstance(m, nn.RNNBase) and (why := recurrent_refusal(m))}
        # a module with a rule inside a fallback subtree is covered by the fallback
        self._layers = {m: v for m, v in self._layers.items() if not any(m in f.modules() for f in self._fallback)}
        self._records: dict[nn.Module, list] | None = None
        self._recorded: dict[nn.Module, list] | None = None
        #: modules whose outputs the model modifies in place (Falcon adds its attention output to its MLP's in place):
        #: the model is handed a copy of each recorded output, so the recorded one keeps the values its gradient is of
        self._copied: set[nn.Module] = set()
        self._batch = 0
        #: the layout of each recorded call (rows or shared per tensor), measured on the first forward pass of two
        #: examples or more (dptrain.stages.batch_layout)
        self._layout_of = Layouts(model, set(self._layers), set(self._fallback))
        #: the trainable parameters when the hooks were placed (the engine's, too: it fixes them when it is made)
        self._params = trainable_parameters(model)
        #: a parameter's name in the model by identity: a tied parameter (GPT-2's token embedding, also its output
        #: layer's weight) is reached from several modules under several names, and every use adds to its gradient
        self._names = {id(p): n for n, p in self._params.items()}
        #: module -> ids of the parameters whose per-example gradients its calls record (a layer's own, a fallback
        #: module's whole subtree's): what :func:`dptrain.stages.coverage.check_coverage` holds every use against
        self._covers = {m: {id(p) for p in m.parameters(recurse=False) if p.requires_grad} for m in self._layers}
        self._covers.update({m: {id(p) for p in m.parameters() if p.requires_grad} for m in self._fallback})
        self._calls: list[Call] = []  # the recorded calls of the forward pass being recorded (for coverage)
        self._without_autograd: list[nn.Module] = []  # covering modules it ran with autograd off
        self._recorded_calls: tuple[list[Call], list[nn.Module]] | None = None
        self._handles = [model.register_forward_pre_hook(self._before_forward, with_kwargs=True)]
        # The hooks run eagerly, never inside a compiled graph (the tensors they record must be the layers' own, not a
        # graph's). torch.compiler.disable is applied here, not as a decorator of the class: it imports torch._dynamo
        # (about 1.5 s), which a command that never makes a model private (a refused config) need not pay.
        record, record_call = torch.compiler.disable(self._record), torch.compiler.disable(self._record_call)
        self._handles += [m.register_forward_hook(record) for m in self._layers]
        self._handles += [m.register_forward_hook(record_call, with_kwargs=True) for m in self._fallback]
        #: the dropout recorders of the fallback modules running on the batch now (:mod:`dptrain.stages.dropout_replay`)
        self._recorders: list[tuple[nn.Module, Recorder]] = []
        self._handles += [m.register_forward_pre_hook(torch.compiler.disable(self._enter_fallback))
                          for m in self._fallback]

    def _before_forward(self, module, args, kwargs):
        """A forward pass of the model begins (the first one recorded on two examples or more measures the layout of
        every call first, so that the recording can expand what must be)."""
        if self._records is not None:
            self._layout_of.forward_begins(args, kwargs, self._batch)

    def _record(self, module, inputs, output):
        if self._layout_of.probing:
            return self._layout_of.probe_record(module, [inputs[0]], output)
        if self._records is not None and not torch.is_grad_enabled() and module not in self._without_autograd:
            self._without_autograd.append(module)
        if self._records is None or not (torch.is_tensor(output) and output.requires_grad):
            return None  # (not recording, or a forward under no_grad: nothing to differentiate)
        a, b = inputs[0].detach(), self._batch
        layout = self._layout_of.call(module)
        if isinstance(layout, CallLayout) and layout.expand == REPLACE and not (a.dim() and a.shape[0] == 1):
            layout = None  # (not the shape the measurement saw: measured again)
        if b > 1 and isinstance(layout, CallLayout) and layout.expand:
            # A layer applied to an input shared by the whole batch (Hugging Face's position_ids of shape [1, T]): its
            # output is broadcast against the batch later, where autograd would sum the examples' output gradients.
            # The layer's output expanded to the batch (a view of the same values) gives each example its own; the
            # measurement verified that the model's outputs do not change (dptrain.stages.batch_layout).
            rows = b * layout.expand_rows
            output, a = expanded(output, rows, layout.expand), expanded(a, rows, layout.expand)
            self._records.setdefault(module, []).append((a, output, output._version, Expanded(layout.expand_rows)))
            self._calls.append(Call(module, [output], input_nodes(inputs[0])))
            return output
        self._records.setdefault(module, []).append((a, output, output._version, layout))
        self._calls.append(Call(module, [output], input_nodes(inputs[0])))
        return output.clone() if module in self._copied else None

    def _enter_fallback(self, module, args):
        """A fallback module starts on the batch being recorded: its dropouts' masks are kept from here to its end, for
        its calls example by example to replay (:mod:`dptrain.stages.dropout_replay`)."""
        if self._records is not None and not self._layout_of.probing:
            recorder = Recorder()
            recorder.__enter__()
            self._recorders.append((module, recorder))

    def _leave_fallback(self, module) -> list[torch.Tensor]:
        """The masks of the dropouts ``module`` drew on the batch (its recorder ended), or none."""
        if not (self._recorders and self._recorders[-1][0] is module):
            return []
        _, recorder = self._recorders.pop()
        recorder.__exit__(None, None, None)
        return recorder.masks

    def _record_call(self, module, args, kwargs, output):
        masks = self._leave_fallback(module)
        if self._layout_of.probing:
            return self._layout_of.probe_record(module, tree_flatten((tuple(args), dict(kwargs)))[0], output)
        if self._records is not None and not torch.is_grad_enabled() and module not in self._without_autograd:
            self._without_autograd.append(module)
        if self._records is not None and any(t.requires_grad for t in _tensors(output)):
            layout = self._layout_of.call(module)
            if self._batch > 1 and isinstance(layout, CallLayout) and layout.expand == REPLACE and torch.is_tensor(
                output
            ) and output.dim() and output.shape[0] == 1:
                # (its one output computed once for the batch and only broadcast against it, verified by the
                # measurement: expanded, each example gets its own output gradient, as for a layer with a rule)
                output = expanded(output, self._batch * layout.expand_rows, REPLACE)
                layout = dataclasses.replace(layout, outputs=(ROWS,))
            nodes = input_nodes(args, kwargs)
            args = tuple(a.detach() if torch.is_tensor(a) else a for a in args)
            output, outs = separated(output)  # (each output's own gradient, not also another's flowing into it)
            recorded = _tensors(output) if outs is None else outs
            versions = [t._version for t in recorded]
            record = (args, dict(kwargs), recorded, layout, outs is not None, versions, masks)
            self._records.setdefault(module, []).append(record)
            self._calls.append(Call(module, _tensors(output), nodes))
            if module in self._copied and outs is not None:  # (the model gets copies; the records keep their values)
                output, _ = separated(output, copy=True)
            return output
        return None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[PerExampleGrads, torch.Tensor]:
        measured = copied = False
        while True:
            with self.recording(batch_len(y)):
                with torch.enable_grad():
                    losses = self.loss_fn(call_model(self.model, x), y)
            try:
                return self.from_losses(losses), losses.detach()
            except LayoutChanged:
                if measured:
                    raise
                measured = True
                self._layout_of.forget()  # measured again on this chunk
            except InplaceOutputError as e:
                if copied or not e.modules:
                    raise
                copied = True
                self._copied |= e.modules  # recorded again, the model handed copies of these modules' outputs

    @contextlib.contextmanager
    def recording(self, batch: int):
        """Record the layers' inputs and outputs of the forward pass(es) run inside (``batch`` examples), for
        :meth:`from_losses`. A caller's own training loop runs its forward pass inside it."""
        self._records, self._batch = {}, int(batch)
        self._calls, self._without_autograd = [], []
        try:
            yield
        finally:
            while self._recorders:  # (a fallback module's forward raised: its recorder is still on torch's mode stack)
                self._recorders.pop()[1].__exit__(None, None, None)
            self._recorded, self._records = self._records, None
            self._recorded_calls = (self._calls, self._without_autograd)
            self._calls, self._without_autograd = [], []

    def _rows(self, m: nn.Module, a: torch.Tensor, out: torch.Tensor, layout) -> int:
        """Rows per example of a recorded call of a layer with a rule (module docstring of batch_layout)."""
        n = self._batch
        if n == 1:  # one example: whatever the layer saw is that example's
            return a.shape[0] if a.dim() else 1
        if isinstance(layout, Expanded):
            return layout.rows
        if layout is ROOT:
            layout = CallLayout((ROWS,), (ROWS,)) if a.dim() and a.shape[0] == n else CallLayout((SHARED,), (SHARED,))
        if layout is None:
            raise LayoutChanged(f"{self._layers[m][0] or type(m).__name__} was called in a way the layout measurement "
                                f"did not see {self._layout_of.failure}".rstrip())
        if layout.shared:
            raise FallbackError(
                f"{self._layers[m][0] or type(m).__name__} is computed once for the whole chunk (its input does not hold "
                "the examples' rows) and its output's gradient sums every example's"
            )
        k = rows_per_example(a, n)
        if not layout.consistent or k is None or k != rows_per_example(out, n):
            raise FallbackError(f"{self._layers[m][0] or type(m).__name__} sees tensors whose rows are not laid out by "
                                "example (e.g. the examples along another dimension than the first)")
        return k

    def _fallback_layout(self, m, args, kwargs, outs, layout) -> CallLayout | None:
        if layout is ROOT:  # the model's inputs and outputs: the examples along dimension 0
            n = self._batch
            kind = lambda t: "-" if not torch.is_tensor(t) else ROWS if t.dim() and t.shape[0] == n else SHARED  # noqa: E731
            return CallLayout(tuple(map(kind, tree_flatten((tuple(args), dict(kwargs)))[0])), tuple(map(kind, outs)))
        if layout is None and self._batch > 1:
            raise LayoutChanged(f"{type(m).__name__} was called in a way the layout measurement did not see "
                                f"{self._layout_of.failure}".rstrip())
        return layout

    def from_losses(self, losses: torch.Tensor) -> PerExampleGrads:
        """The per-example gradients of ``losses`` (one per example, computed from the forward pass recorded by the
        last :meth:`recording`): one backward pass to the recorded layer outputs, then each layer's rule on the rows
        of each example (dptrain.stages.batch_layout). The records are used once."""
        records, self._recorded = self._recorded, None
        (recorded, without_autograd), self._recorded_calls = self._recorded_calls or ([], []), None
        if records is None:
            raise ModelError("per-example gradients need the forward pass recorded first (and use it once)")
        if torch.is_tensor(losses):  # every use of every trainable parameter is in a recorded call, or refused
            check_coverage(losses, recorded, self._covers, self._names, without_autograd)
        calls = [(m, *r) for m, recs in records.items() if m in self._layers for r in recs]
        fallbacks = [(m, *r) for m, recs in records.items() if m in self._fallback for r in recs]
        overwritten = frozenset(
            [m for m, _, out, v, _ in calls if out._version != v]
            + [f[0] for f in fallbacks if any(t._version != v for t, v in zip(f[3], f[6], strict=True))]
        )
        if overwritten:
            raise InplaceOutputError(
                "a layer's output is modified in place (e.g. ReLU(inplace=True)), which the layerwise "
                "per-example gradient backend cannot see through; use grad_sampler='func'", overwritten
            )
        n = self._batch
        if losses.shape != (n,):  # (by the rule, never the shapes: a chunk's size is a secret batch size's)
            raise ModelError(
                "the loss function must return one loss per example: a vector as long as the chunk's labels, not "
                "a mean or a tensor of another shape"
            )
        if n == 0:  # (an empty Poisson batch: no example, no gradient)
            calls, fallbacks = [], []
        outs = [out for _, _, out, _, _ in calls]
        fb_outs = [o for _, _, _, fouts, _, _, _, _ in fallbacks for o in fouts if o.requires_grad]
        everything = outs + fb_outs
        grads_all = torch.autograd.grad(losses.sum(), everything, allow_unused=True) if everything else []
        grads_out, fb_grads = list(grads_all[: len(outs)]), dict(zip(map(id, fb_outs), grads_all[len(outs) :], strict=True))
        per_example: dict = {}

        def add(m: nn.Module, pname: str, g) -> None:
            """Every use of a parameter adds to its gradient: a layer called twice, a weight tied to another layer's."""
            key = self._names.get(id(m.get_parameter(pname)))
            if key is not None:  # (a frozen parameter has no gradient to report)
                g = upcast(g)  # (a bfloat16 model's per-example gradients are formed and clipped in float32)
                per_example[key] = shared(per_example[key], g) if key in per_example else g

        for m, args, kwargs, fouts, layout, separable, _, masks in fallbacks:
            gos = [fb_grads.get(id(o)) for o in fouts]
            if all(g is None for g in gos):
                continue  # (an output that does not reach the loss: no gradient, whatever its layout)
            if not separable and sum(g is not None for g in gos) > 1:
                raise FallbackError(f"{type(m).__name__} returns several tensors in a container that cannot be rebuilt "
                                    "to tell their gradients apart")
            if m in self._refused:
                raise FallbackError(f"per-example gradients of {type(m).__name__}: {self._refused[m]}")
            # (a recurrent layer's layout is its kind's: batch_first or not, h_n's examples along dimension 1)
            layout = None if isinstance(m, nn.RNNBase) else self._fallback_layout(m, args, kwargs, fouts, layout)
            gos = [None if g is None else g.detach() for g in gos]
            for pname, g in per_module_gradients(m, args, kwargs, gos, fouts, layout, n, masks).items():
                add(m, pname, g)
        for (m, a, out, _, layout), go in zip(calls, grads_out, strict=True):
            if go is None:
                continue  # (an output that does not reach the loss, such as DoRA's weight norm: no gradient)
            k = self._rows(m, a, out, layout)
            _, rule = self._layers[m]
            with torch.autocast(a.device.type, enabled=False):  # (mixed precision: formed in float32)
                for pname, g in _by_rows(rule, m, upcast(a), upcast(go.detach()), n, k).items():
                    add(m, pname, g)
        result = {}
        for name, p in self._params.items():  # parameters the forward pass did not use: zero
            result[name] = (
                per_example[name] if name in per_example else p.new_zeros((n, *p.shape), dtype=_grad_dtype(p))
            )
        return PerExampleGrads(result)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class WholeModelError(ModelError):
    """A forward pass of the caller's cannot be differentiated per example: the model needs torch.func (or the loop
    of single-example passes) for the whole of it, which recomputes the forward pass itself. ``reason``: why (the
    layer the layerwise backend could not record), or None."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class AutoGradSampler:
    """``layerwise``: its rules where a module has one, torch.func for each other module on its own (per module,
    not for the whole model); switches to ``func`` for the whole model for good if a layer output turns out to be
    modified in place or a module cannot be differentiated on its own (which only a forward pass reveals)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model, self.loss_fn = model, loss_fn
        self.backend = LayerwiseGradSampler(model, loss_fn)
        #: why the layerwise backend was left for torch.func on the whole model (its FallbackError), or None
        self.reason: str | None = None

    @property
    def name(self) -> str:
        if isinstance(self.backend, LayerwiseGradSampler) and self.backend._fallback:
            return "layerwise+func"
        return self.backend.name

    def __call__(self, x, y):
        while True:
            try:
                return self.backend(x, y)
            except (InplaceOutputError, FallbackError) as e:
                if isinstance(self.backend, LoopGradSampler):
                    raise
                if isinstance(self.backend, LayerwiseGradSampler):
                    self.reason = str(e)
                self._next()

    def _next(self) -> None:
        """The next backend of the ladder: layerwise -> torch.func for the whole model -> a loop of single examples."""
        self.backend.close()
        # (torch.func has no batching rule for torch's fused recurrent kernels, and running them under functional_call
        # rewrites their flat-weight bookkeeping, which the state watch would take for a release: straight to the loop)
        recurrent = any(isinstance(m, nn.RNNBase) for m in self.model.modules())
        nxt = FuncGradSampler if isinstance(self.backend, LayerwiseGradSampler) and not recurrent else LoopGradSampler
        self.backend = nxt(self.model, self.loss_fn)

    def recording(self, batch: int):
        """The layerwise backend's recording of a caller's forward pass (:meth:`LayerwiseGradSampler.recording`);
        a model that needs torch.func for the whole of it cannot be differentiated from a caller's forward pass."""
        if not isinstance(self.backend, LayerwiseGradSampler):
            why = f" ({self.reason.rstrip('.')})" if self.reason else ""
            raise WholeModelError(
                f"this model's per-example gradients need torch.func for the whole model{why}, which recomputes the "
                "forward pass itself: train it with the trainer's own step (make_private) instead of your own loop",
                self.reason,
            )
        return self.backend.recording(batch)

    def from_losses(self, losses: torch.Tensor) -> PerExampleGrads:
        return self.backend.from_losses(losses)

    def move_to_func(self, names: list[str]) -> bool:
        """Differentiate the parameters ``names`` another way (their gradients were found wrong): the modules owning
        them by torch.func, per module; if they were so already, the whole model by torch.func. False when the whole
        model already is (nothing left to try)."""
        backend = self.backend
        if isinstance(backend, LoopGradSampler):
            return False
        if isinstance(backend, LayerwiseGradSampler):
            wanted = {id(p) for n, p in backend._params.items() if n in names}
            owners = {m for m in backend._layers if any(id(p) in wanted for p in m.parameters(recurse=False))}
            if owners:
                backend.close()
                self.backend = LayerwiseGradSampler(
                    self.model, self.loss_fn, to_func=frozenset(owners | backend._to_func)
                )
                return True
            self.reason = (f"the gradient of {names[0]!r} from its module differentiated on its own did not match a "
                           "backward pass on the example alone")  # (what a loop of the caller's own is told)
        self._next()
        return True

    def cover(self, names: list[str], called: set[nn.Module]) -> bool:
        """Cover the parameters ``names``, some of whose uses no recorded call covered (a CoverageError): the nearest
        module above their covering modules that the forward pass called (in ``called``) is differentiated by
        torch.func, per module; the model itself, or a model on torch.func already, goes to torch.func whole (covered
        by construction). False when nothing is left to try."""
        backend = self.backend
        if not isinstance(backend, LayerwiseGradSampler):
            return False
        wider = set()
        for n in names:
            p = backend._params[n]
            inside = [m for m, ids in backend._covers.items() if id(p) in ids]
            a = nearest_called_ancestor(self.model, n, called, inside)
            if a is None or a is self.model:
                self.reason = (f"parameter {n!r} is used outside every module that can be differentiated on its own "
                               "(e.g. returned inside a nested container)")
                self._next()
                return True
            wider.add(a)
        backend.close()
        self.backend = LayerwiseGradSampler(self.model, self.loss_fn, to_func=frozenset(wider | backend._to_func))
        return True

    def close(self) -> None:
        self.backend.close()


def make_grad_sampler(model: nn.Module, loss_fn: LossFn, backend: str = "auto"):
    if backend not in GRAD_SAMPLERS:
        raise ConfigError(
            f"unknown per-example gradient backend {backend!r}; accepted: {', '.join(GRAD_SAMPLERS)}"
        )
    if backend == "auto":
        return AutoGradSampler(model, loss_fn)
    if backend == "layerwise":
        return LayerwiseGradSampler(model, loss_fn, fallback=False)
    if backend == "loop":
        return LoopGradSampler(model, loss_fn)
    return FuncGradSampler(model, loss_fn)
