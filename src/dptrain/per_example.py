"""Per-example gradients: the gradient of each example's loss with respect to every trainable parameter.

Two backends compute the same thing (``tests/test_per_example.py`` checks both against a loop of
single-example backward passes):

- ``func``: torch.func (``functional_call`` + ``vmap`` + ``grad``). Works for any model whose output
  for one example does not depend on the others. The general path.
- ``layerwise``: forward hooks record each layer's input and output; one backward pass asks autograd
  only for the gradients of the layer *outputs* (so it never computes the batch-summed weight
  gradient it would throw away), and each layer's per-example weight gradient is formed from its
  input and output gradient: an outer product for Linear, a grouped convolution backward for Conv2d,
  the normalized input for GroupNorm/LayerNorm. Used when every trainable parameter belongs to
  such a layer; about twice as fast as ``func`` on the small CNNs of the DP literature.

``make_grad_sampler(model, loss_fn, "auto")`` picks ``layerwise`` when it applies, else ``func``.
A loss function takes (outputs, targets) and returns one loss per example (shape [B]).

A backend returns a :class:`PerExampleGrads`: clipping rules ask it for per-example squared norms and
for weighted sums sum_i f_i g_i, and only materialize the [B, ...] tensors when they need them. For a
Linear layer on [B, in] inputs the layerwise backend never materializes: ||g_i||^2 = ||delta_i||^2 ||a_i||^2
("ghost" norms, Goodfellow 2015; Li et al. 2022) and sum_i f_i g_i = (f * delta)^T a is one matmul
(the book-keeping trick of Bu et al. 2023).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dptrain.batches import batch_len, call_model, unsqueezed
from dptrain.errors import ConfigError, ModelError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
GRAD_SAMPLERS = ("auto", "func", "layerwise")


def cross_entropy_per_example(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, reduction="none")


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class PerExampleGrads:
    """Per-example gradients of one (physical) batch, by parameter name."""

    def __init__(self, parts: dict[str, torch.Tensor | _LinearFactors]):
        self._parts = parts

    def names(self) -> list[str]:
        return list(self._parts)

    def sq_norms(self) -> dict[str, torch.Tensor]:
        """name -> [B]: each example's squared L2 norm of its gradient for that parameter."""
        return {n: _sq_norms(part) for n, part in self._parts.items()}

    def weighted_sum(self, factors: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """name -> sum_i f_i g_i (one factor per example, or one [B] vector per parameter)."""
        return {
            n: _weighted_sum(part, factors[n] if isinstance(factors, dict) else factors)
            for n, part in self._parts.items()
        }

    def zero_examples(self, mask: torch.Tensor) -> PerExampleGrads:
        """The same gradients with those of the examples in boolean ``mask`` [B] set to exactly zero."""
        keep = ~mask

        def zeroed(part):
            if isinstance(part, _LinearFactors):
                return _LinearFactors(_zero_rows(part.delta, keep), _zero_rows(part.a, keep))
            return _zero_rows(part, keep)

        return PerExampleGrads({n: zeroed(part) for n, part in self._parts.items()})

    def materialize(self) -> dict[str, torch.Tensor]:
        """name -> [B, *parameter shape]."""
        return {
            n: part.materialize() if isinstance(part, _LinearFactors) else part
            for n, part in self._parts.items()
        }


@dataclass(frozen=True)
class _LinearFactors:
    """Per-example gradients delta_i a_i^T of a Linear weight, kept as their two factors."""

    delta: torch.Tensor  # [B, out]
    a: torch.Tensor  # [B, in]

    def materialize(self) -> torch.Tensor:
        return torch.einsum("bo,bi->boi", self.delta, self.a)


def _zero_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows where ``keep`` is False replaced by zeros (where(), so NaN and inf do not survive)."""
    return torch.where(keep.reshape(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype))


def _sq_norms(part) -> torch.Tensor:
    if isinstance(part, _LinearFactors):
        return part.delta.pow(2).sum(1) * part.a.pow(2).sum(1)
    flat = part.flatten(1)
    return torch.linalg.vecdot(flat, flat)


def _weighted_sum(part, f: torch.Tensor) -> torch.Tensor:
    if isinstance(part, _LinearFactors):
        return (part.delta * f[:, None]).T @ part.a
    return torch.tensordot(f, part, dims=1)


class FuncGradSampler:
    """Per-example gradients with torch.func: vmap over examples of grad of the single-example loss."""

    name = "func"

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model = model

        def loss_one(params, buffers, x, y):
            one = unsqueezed(x)
            if isinstance(one, dict):
                out = functional_call(model, (params, buffers), (), one)
            else:
                out = functional_call(model, (params, buffers), tuple(one) if isinstance(one, tuple | list) else (one,))
            loss = loss_fn(out, y.unsqueeze(0)).reshape(())
            return loss, loss.detach()

        # randomness="different": dropout masks differ per example, as in ordinary training.
        self._per_example = vmap(
            grad(loss_one, has_aux=True), in_dims=(None, None, 0, 0), randomness="different"
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[PerExampleGrads, torch.Tensor]:
        params = {n: p.detach() for n, p in trainable_parameters(self.model).items()}
        buffers = dict(self.model.named_buffers())
        grads, losses = self._per_example(params, buffers, x, y)
        return PerExampleGrads(grads), losses

    def close(self) -> None:
        pass


# --- layerwise backend --------------------------------------------------------------------------------------


def _conv_weight_per_example(conv: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """Per-example Conv2d weight gradients as one grouped-convolution weight gradient (batch as groups)."""
    b = a.shape[0]
    w = conv.weight
    _, gw, _ = torch.ops.aten.convolution_backward(
        go.reshape(1, b * go.shape[1], *go.shape[2:]),
        a.reshape(1, b * a.shape[1], *a.shape[2:]),
        w.new_empty((b * w.shape[0], *w.shape[1:])),  # only its shape is read when just grad_weight is asked
        None,
        list(conv.stride),
        list(conv.padding),
        list(conv.dilation),
        False,
        [0, 0],
        b * conv.groups,
        [False, True, False],
    )
    return gw.reshape(b, *w.shape)


def _linear(m: nn.Linear, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor | _LinearFactors]:
    if a.dim() == 2:
        out = {"weight": _LinearFactors(go, a)}
        bias = go
    else:  # [B, ..., features]: sum over the middle dimensions of each example
        a3, go3 = a.flatten(1, -2), go.flatten(1, -2)
        out = {"weight": torch.einsum("bto,bti->boi", go3, a3)}
        bias = go3.sum(1)
    if m.bias is not None:
        out["bias"] = bias
    return out


def _conv2d(m: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"weight": _conv_weight_per_example(m, a, go)}
    if m.bias is not None:
        out["bias"] = go.sum((2, 3))
    return out


def _group_norm(m: nn.GroupNorm, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    xhat = F.group_norm(a, m.num_groups, None, None, m.eps)
    dims = tuple(range(2, a.dim()))
    return {"weight": (go * xhat).sum(dims), "bias": go.sum(dims)}


def _layer_norm(m: nn.LayerNorm, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    xhat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
    dims = tuple(range(1, a.dim() - len(m.normalized_shape)))
    out = {"weight": (go * xhat).sum(dims) if dims else go * xhat}
    if m.bias is not None:
        out["bias"] = go.sum(dims) if dims else go
    return out


def _layerwise_rule(m: nn.Module):
    """The per-example rule for a module, or None if the layerwise backend cannot handle it."""
    if type(m) is nn.Linear:
        return _linear
    if type(m) is nn.Conv2d and m.padding_mode == "zeros" and not isinstance(m.padding, str):
        return _conv2d
    if type(m) is nn.GroupNorm and m.affine:
        return _group_norm
    if type(m) is nn.LayerNorm and m.elementwise_affine:
        return _layer_norm
    return None


def layerwise_supported(model: nn.Module) -> bool:
    """True when every trainable parameter belongs directly to a layer the layerwise backend handles."""
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own and _layerwise_rule(m) is None:
            return False
    return True


class InplaceOutputError(ModelError):
    """A recorded layer output was overwritten in place during the forward pass."""


class LayerwiseGradSampler:
    """Per-example gradients from recorded layer inputs and output gradients (see module docstring)."""

    name = "layerwise"

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        if not layerwise_supported(model):
            raise ModelError(
                "the layerwise backend supports Linear, Conv2d, GroupNorm and LayerNorm parameters only"
            )
        self.model, self.loss_fn = model, loss_fn
        self._layers: dict[nn.Module, tuple[str, Callable]] = {}
        prefix_of = {m: name for name, m in model.named_modules()}
        for m in model.modules():
            if any(p.requires_grad for p in m.parameters(recurse=False)):
                self._layers[m] = (prefix_of[m], _layerwise_rule(m))
        self._records: dict[nn.Module, list] | None = None
        self._handles = [m.register_forward_hook(self._record) for m in self._layers]

    def _record(self, module, inputs, output) -> None:
        if self._records is not None:
            self._records.setdefault(module, []).append((inputs[0].detach(), output, output._version))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[PerExampleGrads, torch.Tensor]:
        self._records = {}
        try:
            with torch.enable_grad():
                losses = self.loss_fn(call_model(self.model, x), y)
            calls = [(m, a, out) for m, recs in self._records.items() for a, out, _ in recs]
            if any(out._version != v for recs in self._records.values() for _, out, v in recs):
                raise InplaceOutputError(
                    "a layer's output is modified in place (e.g. ReLU(inplace=True)), which the layerwise "
                    "per-example gradient backend cannot see through; use grad_sampler='func'"
                )
        finally:
            self._records = None
        n = batch_len(x)
        if losses.shape != (n,):
            raise ModelError(
                f"the loss function must return one loss per example (shape [{n}]), got shape {list(losses.shape)}"
            )
        outs = [out for _, _, out in calls]
        grads_out = torch.autograd.grad(losses.sum(), outs, allow_unused=True) if outs else []
        per_example: dict[str, torch.Tensor | _LinearFactors] = {}
        for (m, a, out), go in zip(calls, grads_out, strict=True):
            if go is None:
                go = torch.zeros_like(out)
            prefix, rule = self._layers[m]
            for pname, g in rule(m, a, go.detach()).items():
                key = f"{prefix}.{pname}" if prefix else pname
                if key in per_example:  # a layer called more than once (shared weights): gradients add up
                    prev = per_example[key]
                    g = (prev.materialize() if isinstance(prev, _LinearFactors) else prev) + (
                        g.materialize() if isinstance(g, _LinearFactors) else g
                    )
                per_example[key] = g
        result = {}
        for name, p in trainable_parameters(self.model).items():  # parameters the forward pass did not use: zero
            result[name] = (
                per_example[name] if name in per_example else torch.zeros(n, *p.shape, dtype=p.dtype)
            )
        return PerExampleGrads(result), losses.detach()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class AutoGradSampler:
    """``layerwise`` where it applies, else ``func``; switches to ``func`` for good if a layer output turns out
    to be modified in place (which only a forward pass reveals)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model, self.loss_fn = model, loss_fn
        self.backend = (
            LayerwiseGradSampler(model, loss_fn)
            if layerwise_supported(model)
            else FuncGradSampler(model, loss_fn)
        )

    @property
    def name(self) -> str:
        return self.backend.name

    def __call__(self, x, y):
        try:
            return self.backend(x, y)
        except InplaceOutputError:
            self.backend.close()
            self.backend = FuncGradSampler(self.model, self.loss_fn)
            return self.backend(x, y)

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
        return LayerwiseGradSampler(model, loss_fn)
    return FuncGradSampler(model, loss_fn)
