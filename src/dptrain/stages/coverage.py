"""Coverage: every use of every trainable parameter in a forward pass is inside a call that records its per-example
gradient, or the pass is refused naming the parameter.

The layerwise backend forms a parameter's per-example gradient from the calls it recorded: a layer's rule from the
layer's input and output gradient, the per-module torch.func fallback from a module's arguments and output gradient.
What it does not see it leaves at zero, and a zero gradient looks like any other: a parameter read outside its layer
(``F.linear(x, self.lin.weight)``), one kept in a container that is never called (peft's IA3, LoHa and VeRA read
theirs from a ``ParameterDict`` inside another module's forward), a layer run under ``torch.no_grad`` (gradient
checkpointing with ``use_reentrant=True`` runs the layers so and differentiates them later, on the side), a forward
pass compiled by ``torch.compile`` (the layers' outputs are values of one compiled graph). So coverage is not inferred
from gradients looking plausible: :func:`check_coverage` reads autograd's graph of the very losses whose gradients are
formed, on every chunk, and proves it:

- a recorded call's *region* is the part of the graph between its outputs and its inputs (the operations it ran),
  less the regions of the recorded calls it made;
- every edge of the graph into a trainable parameter (a use of it) lies in the region of a call that covers the
  parameter (a layer owning it, or a fallback module containing it); an edge anywhere else is an uncovered use;
- a covering layer called with autograd off is an uncovered use too (its use is not in the graph at all).

The check walks each node of the losses' graph once (a 2-layer GPT-2 with LoRA: about 200 nodes, 0.1 ms).
An uncovered use is a :class:`CoverageError` naming the parameter; the automatic backend then differentiates a
larger module by torch.func (the nearest one that was called: :func:`nearest_called_ancestor`), checks again, and
ends with torch.func for the whole model, where coverage holds by construction.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dptrain.errors import ModelError

REENTRANT = (
    "enable gradient checkpointing with use_reentrant=False (model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False}))"
)
COMPILED = (
    "call the model itself in the training step, not a torch.compile'd wrapper or a model.compile()d module "
    "(per-example gradients are formed from the eager layers' inputs and outputs; make_private(torch.compile(model)) "
    "trains the eager model it wraps): compile the model before make_private / make_private_loop and pass it, or do "
    "not compile it"
)


class CoverageError(ModelError):
    """A use of a trainable parameter that no recorded call covers. ``names``: the parameters; ``fixable``: a larger
    module differentiated by torch.func would cover it (not so for a layer run without autograd or a compiled
    graph)."""

    def __init__(self, message: str, names: list[str], fixable: bool):
        super().__init__(message)
        self.names, self.fixable = list(names), fixable


@dataclass
class Call:
    """One recorded call of a covering module: its output tensors and the autograd nodes of its tensor inputs (where
    its region of the graph ends)."""

    module: nn.Module
    outputs: list[torch.Tensor]
    exits: frozenset = field(default_factory=frozenset)


def input_nodes(*inputs) -> frozenset:
    """The autograd nodes that produced the tensors among ``inputs`` (any nesting of tuples, lists and dicts)."""
    return frozenset(t.grad_fn for t in tree_flatten(inputs)[0] if torch.is_tensor(t) and t.grad_fn is not None)


def _is_compiled(node) -> bool:
    return "CompiledFunction" in node.name()


def check_coverage(losses: torch.Tensor, calls: list[Call], covers: dict[nn.Module, set[int]],
                   names: dict[int, str], without_autograd: list[nn.Module] = ()) -> None:
    """Raise :class:`CoverageError` unless every use of a trainable parameter (``names``: id -> name) in the graph of
    ``losses`` lies in the region of a call in ``calls`` whose module covers it (``covers``: module -> ids of the
    parameters its rule or its torch.func pass differentiates). ``without_autograd``: covering modules that were called
    with autograd off during the recorded forward."""
    refuse_without_autograd(without_autograd, covers, names)
    entries: dict = {}
    for c in calls:
        for o in c.outputs:
            if o.grad_fn is not None:
                entries.setdefault(o.grad_fn, []).append(c)
    uncovered: dict[str, bool] = {}  # name -> seen next to a compiled graph
    compiled = any(_is_compiled(node) for node in entries)
    outside, walked, stack = set(), set(), [losses.grad_fn]

    def use(node, var, allowed: set[int]) -> None:
        """A use of ``var`` by ``node``: uncovered unless ``allowed``; a compiled graph's use never is covered (which of
        its operations belong to which layer is not in the graph)."""
        i = id(var)
        if i in names and (i not in allowed or _is_compiled(node)):
            uncovered[names[i]] = uncovered.get(names[i], False) or _is_compiled(node)

    while stack:
        node = stack.pop()
        if node is None or node in outside:
            continue
        if node in entries:
            for c in entries[node]:
                if id(c) not in walked:
                    walked.add(id(c))
                    stack.extend(_region(c, covers.get(c.module, set()), use, entries))
            continue
        outside.add(node)
        compiled = compiled or _is_compiled(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):
                use(node, nxt.variable, set())
            else:
                stack.append(nxt)
    if uncovered:
        first = next(iter(uncovered))
        if compiled or any(uncovered.values()):
            raise CoverageError(
                f"parameter {first!r} is used inside a graph compiled by torch.compile, where its layer's inputs and "
                f"outputs cannot be recorded, so its per-example gradient would be missed; {COMPILED}",
                list(uncovered), fixable=False,
            )
        raise CoverageError(
            f"parameter {first!r} is used outside every call that records its per-example gradient (read by another "
            "module's forward, or kept in a container that is never called), so its per-example gradient would be "
            "missed; use grad_sampler='auto' (it differentiates the module that uses it by torch.func) or 'func'",
            list(uncovered), fixable=True,
        )


def _region(call: Call, allowed: set[int], use, entries: dict) -> list:
    """Walk the region of ``call`` (from its outputs to its inputs), reporting each use of a parameter to ``use``;
    returns the nodes where it ends, for the walk outside: its inputs' nodes, and the outputs of other recorded calls
    it made (a call nested in it, as DoRA's magnitude layer calls the LoRA layers handed to it: a region of its own)."""
    starts = {o.grad_fn for o in call.outputs if o.grad_fn is not None}
    seen, stack, ends = set(), list(starts), []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node not in starts and (node in call.exits or node in entries):  # (an output's own node is the call's)
            ends.append(node)
            continue
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):
                use(node, nxt.variable, allowed)
            else:
                stack.append(nxt)
    return ends


class ModuleCalls:
    """Which modules a forward pass called, and which modules owning trainable parameters it called with autograd off
    (a forward hook on every module, for the checks before training whatever the backend)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.called: set[nn.Module] = set()
        self.without_autograd: list[nn.Module] = []
        self._handles: list = []

    def _hook(self, module, args, output) -> None:
        self.called.add(module)
        if not torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters(recurse=False)):
            if module not in self.without_autograd:
                self.without_autograd.append(module)

    @contextlib.contextmanager
    def watching(self):
        self._handles = [m.register_forward_hook(self._hook) for m in self.model.modules()]
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []

    def refuse_without_autograd(self, names: dict[int, str]) -> None:
        """CoverageError (not fixable) if a module owning a trainable parameter ran with autograd off."""
        covers = {m: {id(p) for p in m.parameters(recurse=False)} for m in self.without_autograd}
        refuse_without_autograd(self.without_autograd, covers, names)


def refuse_without_autograd(modules, covers: dict[nn.Module, set[int]], names: dict[int, str]) -> None:
    """CoverageError naming the first trainable parameter covered by one of ``modules`` (called with autograd off)."""
    for m in modules:
        owned = [names[i] for i in covers.get(m, ()) if i in names]
        if owned:
            raise CoverageError(
                f"parameter {owned[0]!r} is used by a layer that ran without autograd inside the training forward pass "
                "(under torch.no_grad, as gradient checkpointing with use_reentrant=True runs its layers, and as a "
                "model's own reversible layers do, which recompute their activations in a backward pass of their own: "
                "Reformer's), so its per-example gradient cannot be recorded; with gradient checkpointing, "
                f"{REENTRANT}; a model whose own layers run so cannot be trained with per-example gradients (fine-tune "
                "another architecture)", owned, fixable=False,
            )


def nearest_called_ancestor(model: nn.Module, name: str, called: set[nn.Module], inside: list[nn.Module]):
    """The innermost module on the path of parameter ``name`` that a forward pass called and that strictly contains
    every module of ``inside`` on that path (the modules covering the parameter so far), or None. An IA3 adapter's
    ``ia3_l.default``: its ``ParameterDict`` is never called, the IA3 layer that reads it is."""
    parts = name.split(".")[:-1]
    path = [model] + [model.get_submodule(".".join(parts[: k + 1])) for k in range(len(parts))]
    limit = min((k for k, m in enumerate(path) if m in inside), default=len(path))
    for k in range(limit - 1, -1, -1):
        if path[k] in called:
            return path[k]
    return None


__all__ = ["COMPILED", "REENTRANT", "Call", "CoverageError", "ModuleCalls", "check_coverage", "input_nodes",
           "nearest_called_ancestor"]
