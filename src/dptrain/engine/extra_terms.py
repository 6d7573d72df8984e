"""The ``extra`` term of your own training loop (``loop.backward(losses, extra=fn)``): a function of the parameters whose
gradient is added to the private gradient after the release, unclipped and unnoised, so it must read nothing of the
private examples. What the loop can verify, and how (docs/training_loop.md says what it cannot):

- ``extra`` is a function, ``extra(params) -> scalar tensor``, which the loop calls itself (``params``: name -> the
  trainable parameter); a tensor computed in the loop body could not be checked, and is refused;
- its autograd graph reaches no tensor of the chunk (the floating inputs the loop handed out, the outputs of the
  model's layers on them, the model's outputs) and no leaf but a parameter the loop privatizes
  (:func:`extra_gradients`);
- called again with every tensor of the chunk holding other values (:func:`check_reads_no_example`), it gives the
  same gradient bit for bit: a value of the chunk read inside the call by any path autograd does not record (a
  detached copy, ``.item()``, ``.numpy()``, integer indices, a mask) changes it, and is refused.

Not seen: a value computed from the examples before the call and captured by the function (``m = x.mean().item();
extra=lambda p: m * p["w"].sum()``). torch only.
"""

from __future__ import annotations

import contextlib

import torch


class ExtraRefused(Exception):
    """An extra term the loop cannot add to the private gradient (the message says why, in one line)."""


def graph_leaves(tensor: torch.Tensor) -> set[int]:
    """The ids of the leaves that require grad in ``tensor``'s autograd graph (what ``backward`` would accumulate into)."""
    found, seen, todo = set(), set(), [tensor.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # (an AccumulateGrad node: its leaf)
        if variable is not None:
            found.add(id(variable))
        todo.extend(f for f, _ in fn.next_functions)
    return found


def _term(extra, params: dict[str, torch.Tensor]) -> torch.Tensor:
    if torch.is_tensor(extra) or not callable(extra):
        raise ExtraRefused(
            "extra is a function of the parameters, extra=lambda params: term (a scalar, e.g. a weight regularizer), "
            "which the loop calls itself to check that it reads no example; a tensor computed in the loop body cannot "
            "be checked"
        )
    term = extra(dict(params))
    if not torch.is_tensor(term) or term.numel() != 1 or not term.requires_grad:
        raise ExtraRefused(
            "extra(params) must return a scalar tensor computed from the trainable parameters (e.g. a weight "
            "regularizer)"
        )
    return term.reshape(())


def extra_gradients(extra, params: dict[str, torch.Tensor], data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradient of ``extra(params)`` with respect to ``params`` (the privatized parameters, by name), after checking
    its graph: no tensor of ``data`` (the chunk's tensors that require grad) in it, no leaf but a parameter of
    ``params``. Call it before the chunk's own backward pass (the chunk's graph is read)."""
    term = _term(extra, params)
    data = [t for t in data if t.requires_grad]
    grads = torch.autograd.grad(term, [*params.values(), *data], allow_unused=True, retain_graph=True)
    if any(g is not None for g in grads[len(params) :]):
        raise ExtraRefused(
            "extra depends on the chunk's examples (its inputs or the model's activations on them): it would release "
            "their gradient without clipping or noise; only terms of the parameters alone may be extra"
        )
    if graph_leaves(term) - {id(p) for p in params.values()}:
        raise ExtraRefused(
            "extra reads a tensor that requires grad and is not a parameter the loop privatizes (a parameter added "
            "after make_private_loop, or a tensor of your own): only terms of the privatized parameters may be extra"
        )
    return {n: g for n, g in zip(params, grads[: len(params)], strict=True) if g is not None}


@contextlib.contextmanager
def _replaced(tensors: list[torch.Tensor]):
    """Every tensor of a chunk holding other values (in place, restored after): floating ones drawn from a fixed public
    generator, integer ones zero (one where they were all zero), booleans negated. Yields whether there was any."""
    saved = [(t, t.detach().clone()) for t in tensors if torch.is_tensor(t) and t.numel()]
    try:
        with torch.no_grad():
            for t, old in saved:
                if t.dtype == torch.bool:
                    t.copy_(~old)
                elif t.dtype.is_floating_point or t.dtype.is_complex:
                    g = torch.Generator(device=t.device).manual_seed(0)
                    t.copy_(torch.randn(t.shape, generator=g, device=t.device).to(t.dtype))
                else:
                    t.copy_(torch.ones_like(old) if not old.any() else torch.zeros_like(old))
        yield bool(saved)
    finally:
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)


def check_reads_no_example(
    extra, gradients: dict[str, torch.Tensor], params: dict[str, torch.Tensor], chunk: list[torch.Tensor]
) -> None:
    """Refuse an ``extra`` whose gradient changes when every tensor of ``chunk`` (those the loop handed out) holds other
    values: it reads the examples by a path autograd does not record. The parameters are the same in both calls, so a
    term of the parameters alone gives the same gradient bit for bit. Call it after the chunk's own backward pass (the
    chunk's tensors are written in place, then restored)."""
    with _replaced(chunk) as any_replaced:
        if not any_replaced:
            return
        try:
            with torch.enable_grad():
                term = _term(extra, params)
                names = [n for n in params if n in gradients]
                again = torch.autograd.grad(term, [params[n] for n in names], allow_unused=True)
        except ExtraRefused:
            raise
        except Exception:  # (a term that fails on other values of the chunk reads them)
            again = None
    if again is None or any(g is None or not torch.equal(g, gradients[n]) for n, g in zip(names, again, strict=True)):
        raise ExtraRefused(
            "extra reads the chunk's examples (its gradient changes with their values: a detached copy, .item(), "
            "indices or a mask of them): it would release them without clipping or noise; only terms of the "
            "parameters alone may be extra"
        )


__all__ = ["ExtraRefused", "check_reads_no_example", "extra_gradients", "graph_leaves"]
