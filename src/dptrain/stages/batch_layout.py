"""Which rows of a layer's input and output belong to which example: found by running the model at two batch sizes,
never guessed from a size.

A layerwise rule forms example i's gradient from the rows of the layer's input and output gradient that belong to
example i. The model's own inputs have the examples along dimension 0 (the data convention of
:mod:`dptrain.data.batches`), but inside the model a layer may see

- the examples' rows flattened: OPT's feed-forward layers see [B*T, d], Swin's attention [B*windows, N, C];
- a tensor computed once for the whole batch: T5's relative position buckets [T, T], the positions [1, T] of GPT-2,
  a prompt [1, n] that peft repeats afterwards, DoRA's identity matrix [in, in];
- the examples along another dimension (a sequence-first layer [T, B, d]), or rows in a data-dependent order (the
  tokens routed to one expert of a mixture).

A size cannot tell these apart: T5's buckets are [B, B] when the sequence is as long as the chunk, a sequence-first
input is [B, B, d] then too. So the layout of every recorded call is *measured*: the model runs (in evaluation mode,
under forked randomness, buffers restored) on the batch of B examples and on its first B - 1, and each tensor of each
call is classified by how it changes:

- ``rows`` (k rows per example): dimension 0 is k B, then k (B - 1), the rest of the shape is the same, and the first
  k (B - 1) rows are the same values in both passes: example i owns rows i k .. i k + k - 1 (k = 1: the usual
  [B, ...]);
- ``shared``: the same shape and values in both passes: one tensor for every example;
- anything else (the shape's other dimensions change, or rows move): no layout, and a layer with trainable
  parameters there is differentiated by torch.func over the whole model.

A shared call's output gradient is the sum of every example's, so a layer with a rule and a shared output (GPT-2's
position embeddings [1, T, d], a nanoGPT's ``wpe(arange(T))`` [T, d]) has its output expanded to the batch while it is
recorded ([B, T, d], a view of the same values): each example then gets its own output gradient. That is only right
where the model broadcasts the output against the batch, so the measurement runs the model a third time with the
expansion and keeps it only if the model's outputs do not change (peft's prompt tuning repeats its prompt to the
batch: expanded, it would hold B x B rows; T5 permutes its [T, T, heads] bias: expanded, it fails); a shared output
that cannot be expanded and whose gradient reaches the loss sends the whole model to torch.func.

A call of a module is laid out the same way in every forward pass (it is the model's code, not its data); the shape of
each later call is checked against its class (rows: divisible by the chunk), and a call the measurement did not see
sends the sampler back to measuring. What the measurement cannot see: code whose layout depends on the data in ways
two passes on the same examples do not show (rows per example that vary with each example's length, as a
padding-free collator's packed rows would): the gradient check against single-example passes is the net under it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from dptrain.models.quiet import quiet_passes

ROWS, SHARED = "rows", "shared"


@dataclass(frozen=True)
class CallLayout:
    """The layout of one call of a module: the kind of each tensor leaf of its arguments (positional and keyword, in
    ``tree_flatten`` order; "-" for a leaf that is not a tensor, None for a tensor without a layout) and of each
    tensor of its output; ``expand``: how the sampler expands the shared output (and input) of this call to the batch
    while recording (:func:`expanded`), verified not to change the model's outputs; "" for not at all."""

    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    expand: str = ""
    #: rows per example of the expansion: 1 ([B, ...]), or k where the model broadcasts the output against the
    #: examples' rows flattened k per example (a multiple-choice head's [B * choices, T, d])
    expand_rows: int = 1

    @property
    def consistent(self) -> bool:
        """Every tensor has a layout (rows or shared)."""
        return None not in self.inputs and None not in self.outputs

    @property
    def shared(self) -> bool:
        """Computed once for the whole batch: no input and no output is laid out by example."""
        return self.consistent and ROWS not in self.inputs and ROWS not in self.outputs


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples/lists/dicts holding some, nested: an LSTM's (output,
    (h_n, c_n))), in order, as the sampler records them."""
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, tuple | list):
        return [t for o in out for t in tensors(o)]
    return []


def _leaves(value) -> list:
    return tree_flatten(value)[0]


def rows_per_example(t: torch.Tensor, batch: int) -> int | None:
    """k when ``t`` holds k rows per example of a batch of ``batch`` (its dimension 0 a multiple of it), else None."""
    if not torch.is_tensor(t) or t.dim() == 0 or batch < 1 or t.shape[0] % batch:
        return None
    return t.shape[0] // batch


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of a batched computation (the alternative, another example's rows, differs by the
    values' own scale); NaN and infinities where the other has them."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a, b))
    rtol = 3e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-3
    a, b = a.detach().double(), b.detach().double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a.isnan(), b.isnan()):
        return False
    if not bool((a[a.isinf()] == b[b.isinf()]).all()):
        return False
    if not bool(finite.any()):
        return True
    a, b = a[finite], b[finite]
    return bool((a - b).abs().max() <= rtol * float(a.abs().max()) + 1e-9)


def kind(full, sub, batch: int, sub_batch: int) -> str | None:
    """The layout of one tensor seen in a pass on ``batch`` examples (``full``) and on their first ``sub_batch``
    (``sub``): ROWS, SHARED, or None (neither). "-" for a leaf that is not a tensor."""
    if not torch.is_tensor(full) or not torch.is_tensor(sub):
        return "-" if not torch.is_tensor(full) and not torch.is_tensor(sub) else None
    if full.dim() != sub.dim():
        return None
    if full.dim() == 0 or full.shape == sub.shape:
        return SHARED if _same(full, sub) else None
    if full.shape[1:] != sub.shape[1:]:
        return None
    k = rows_per_example(full, batch)
    if k is None or sub.shape[0] != k * sub_batch:
        return None
    return ROWS if _same(full[: k * sub_batch], sub) else None


def classify(full: list, sub: list, batch: int, sub_batch: int) -> CallLayout:
    """A call's layout from its records in the two passes: (input leaves, output tensors) each."""
    (fin, fout), (sin, sout) = full, sub
    if len(fin) != len(sin) or len(fout) != len(sout):
        return CallLayout((None,), (None,))
    return CallLayout(
        tuple(kind(a, b, batch, sub_batch) for a, b in zip(fin, sin, strict=True)),
        tuple(kind(a, b, batch, sub_batch) for a, b in zip(fout, sout, strict=True)),
    )


REPLACE, PREPEND = "replace", "prepend"
#: At most this many shared calls are expanded (each costs a few forward passes, once); the others of a model with more
#: send it to torch.func.
MAX_EXPANSIONS = 8
#: At most this many row counts k > 1 are tried for an expansion (each a forward pass, once).
MAX_ROW_COUNTS = 2


def expansion(layout: CallLayout, record, whole: bool = False) -> str:
    """How a shared call of a layer (one input, one output) would be expanded to the batch: REPLACE a leading
    dimension of 1 of both ([1, T] -> [1, T, d] becomes [B, T] -> [B, T, d]), PREPEND one ([T] -> [T, d] becomes
    [B, T] -> [B, T, d]), or "" (not a shared call of one tensor). ``whole``: a module differentiated by torch.func on
    its own, whose inputs are split by their layout whatever it is: only its one output, shared with a leading
    dimension of 1, is expanded (REPLACE: BART's decoder positions [1, T, d] from the shared [T] positions; each
    example's recomputation gives [1, T, d] again)."""
    ins, outs = record
    if whole:
        out = outs[0] if len(outs) == 1 else None
        ok = out is not None and layout.outputs == (SHARED,) and None not in layout.inputs and out.dim() > 0
        return REPLACE if ok and out.shape[0] == 1 else ""
    if not layout.shared or len(ins) != 1 or len(outs) != 1 or not torch.is_tensor(ins[0]):
        return ""
    ones = all(t.dim() and t.shape[0] == 1 for t in (ins[0], outs[0]))
    return REPLACE if ones else PREPEND


def expanded(t: torch.Tensor, batch: int, how: str) -> torch.Tensor:
    """``t`` expanded to ``batch`` rows (a view): its leading dimension of 1 replaced, or one prepended."""
    if how == REPLACE:
        return t.expand(batch, *t.shape[1:])
    return t.unsqueeze(0).expand(batch, *t.shape)


def first_examples(inputs, batch: int, keep: int):
    """The model's inputs (a pytree: the data convention puts the examples along dimension 0 of every tensor) for
    their first ``keep`` examples; tensors without that dimension are passed whole."""

    def cut(t):
        return t[:keep] if torch.is_tensor(t) and t.dim() and t.shape[0] == batch else t

    return tree_map(cut, inputs)


def same_outputs(a, b) -> bool:
    """Two forward passes' outputs agree (every tensor leaf)."""
    la, lb = _leaves(a), _leaves(b)
    if len(la) != len(lb):
        return False
    return all(_same(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else type(x) is type(y) for x, y in zip(la, lb, strict=True))


def measuring(model: torch.nn.Module):
    """The model as the layout measurement runs it (:func:`dptrain.models.quiet.quiet_passes`): evaluation mode (no
    dropout, so that two passes can be compared), gradients on (a call records what training records: outputs that
    require grad), torch's generators forked, and every buffer and the training flags of every module as they were."""
    return quiet_passes(model, grad=True)


def view_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """[k B, ...] -> [B, k, ...]: example i's rows along dimension 1."""
    return t.reshape(batch, t.shape[0] // batch, *t.shape[1:])


@dataclass(frozen=True)
class Expanded:
    """Marker of a recorded call whose shared output was expanded while recording to ``rows`` rows per example."""

    rows: int = 1


#: Marker of a recorded call of the model itself (its inputs are the examples along dimension 0, by the data
#: convention).
ROOT = object()


def row_counts(records: dict, layouts: dict, batch: int) -> list[int]:
    """The rows per example (k > 1) of the tensors a pass laid out by example, most frequent first: the sizes the model
    may broadcast a shared tensor against (BERT's multiple-choice head adds its positions [1, T, d] to the examples'
    choices flattened, [B * choices, T, d])."""
    counts: dict[int, int] = {}
    for slot, (ins, outs) in records.items():
        lay = layouts.get(slot)
        if lay is None:
            continue
        for t, kind_ in zip([*ins, *outs], [*lay.inputs, *lay.outputs], strict=False):
            k = rows_per_example(t, batch) if kind_ == ROWS else None
            if k is not None and k > 1:
                counts[k] = counts.get(k, 0) + 1
    return sorted(counts, key=lambda k: (-counts[k], k))


class Layouts:
    """The layout of every recorded call of a model's modules, by (module, its i-th recorded call in one forward pass of
    the model): measured on the first forward pass of two examples or more, again after :meth:`forget`. The sampler's
    hooks report each call (:meth:`call`) and, while a measuring pass runs (:attr:`probing`), what it saw
    (:meth:`probe_record`). ``expandable_modules``: the modules whose shared output may be expanded to the batch
    (the layers with a rule); ``whole_modules``: those differentiated by torch.func on their own, whose one shared output
    may be (:func:`expansion`)."""

    def __init__(self, model: torch.nn.Module, expandable_modules: set, whole_modules: set = frozenset()):
        self.model, self.expandable_modules, self.whole_modules = model, expandable_modules, whole_modules
        self.layouts: dict[tuple, CallLayout] | None = None
        self._calls: dict = {}  # recorded calls per module in the current forward pass
        self._probe: dict | None = None  # the records of a measuring pass
        self._expanding: dict = {}  # the calls a measuring pass expands, and how
        self._batch = 0
        #: why the last measurement knows nothing ("" when it succeeded)
        self.failure = ""

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def forget(self) -> None:
        self.layouts, self.failure = None, ""

    def forward_begins(self, args, kwargs, batch: int) -> None:
        if self._probe is None:
            if self.layouts is None and batch > 1:
                self.measure(args, kwargs, batch)
            self._calls = {}

    def _slot(self, module) -> tuple:
        i = self._calls.get(module, 0)
        self._calls[module] = i + 1
        return module, i

    def call(self, module):
        """The layout of a recorded call (counted): a CallLayout, ROOT, or None when not measured."""
        slot = self._slot(module)
        if module is self.model:
            return ROOT
        return None if self.layouts is None else self.layouts.get(slot)

    def probe_record(self, module, leaves: list, output):
        outs = tensors(output)
        if not any(t.requires_grad for t in outs):
            return None
        slot = self._slot(module)
        self._probe[slot] = ([t.detach() if torch.is_tensor(t) else t for t in leaves], [o.detach() for o in outs])
        if slot in self._expanding:
            how, k = self._expanding[slot]
            return expanded(output, self._batch * k, how)
        return None

    def _pass(self, args, kwargs, batch: int, expanding: dict):
        self._probe, self._calls, self._expanding, self._batch = {}, {}, expanding, batch
        try:
            out = self.model.forward(*args, **kwargs)  # (not through __call__: the model's own hooks stay out of it)
            return self._probe, out
        finally:
            self._probe, self._expanding = None, {}

    def measure(self, args, kwargs, batch: int) -> None:
        """A pass on the chunk's examples and one on all but the last classify every call (module docstring). Then,
        in the order the model calls them, the shared outputs of layers whose expansion to the batch leaves the
        model's outputs unchanged are marked to be expanded, one at a time, the calls measured again after each (a
        layer fed an expanded output, as nanoGPT's projection of its positions, is no longer shared). An output is
        expanded to one row per example, or where the model broadcasts it against the examples' rows flattened k
        per example (a multiple-choice head), to k rows per example: each k the pass laid out is tried
        (:func:`row_counts`), at most MAX_ROW_COUNTS of them."""
        b = batch
        fewer_inputs = first_examples((tuple(args), dict(kwargs)), b, b - 1)
        kept, rejected, layouts = {}, set(), {}
        with measuring(self.model):
            try:
                full, out = self._pass(args, kwargs, b, {})
            except Exception as e:  # (the model fails in evaluation mode: nothing is known, nothing is guessed)
                self.failure = f"(the model fails in evaluation mode: {type(e).__name__})"
                full = None

            def unchanged(expanding: dict) -> bool:
                try:
                    return same_outputs(self._pass(args, kwargs, b, expanding)[1], out)
                except Exception:  # (an expanded output the model cannot take: peft repeats its prompt to the batch)
                    return False

            for _ in range(MAX_EXPANSIONS + 1 if full is not None else 0):
                if kept:
                    full, _ = self._pass(args, kwargs, b, kept)
                fewer, _ = self._pass(*fewer_inputs, b - 1, kept)
                missing = CallLayout((None,), (None,))
                layouts = {s: classify(r, fewer[s], b, b - 1) if s in fewer else missing for s, r in full.items()}
                candidates = [(s, expansion(lay, full[s], s[0] in self.whole_modules)) for s, lay in layouts.items()
                              if (s[0] in self.expandable_modules or s[0] in self.whole_modules) and s not in kept
                              and s not in rejected]
                ks = [1, *row_counts(full, layouts, b)[:MAX_ROW_COUNTS]]
                found = None
                for slot, how in candidates:
                    if how and found is None:
                        found = next(((slot, (how, k)) for k in ks if unchanged({**kept, slot: (how, k)})), None)
                        if found is None:
                            rejected.add(slot)
                if found is None or len(kept) == MAX_EXPANSIONS:
                    break
                kept[found[0]] = found[1]
        self.layouts = {s: dataclasses.replace(lay, expand=kept[s][0], expand_rows=kept[s][1]) if s in kept else lay
                        for s, lay in layouts.items()}
        self._calls = {}


__all__ = [
    "Expanded",
    "ROOT",
    "ROWS",
    "Layouts",
    "SHARED",
    "CallLayout",
    "classify",
    "PREPEND",
    "REPLACE",
    "expanded",
    "expansion",
    "first_examples",
    "kind",
    "measuring",
    "row_counts",
    "rows_per_example",
    "same_outputs",
    "tensors",
    "view_rows",
]
