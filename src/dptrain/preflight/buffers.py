"""Buffers are part of the released model: a buffer that a training-mode forward writes is a release.

DP-SGD's guarantee covers the noisy gradients and what is computed from them. A module whose training-mode forward
writes into a buffer (BatchNorm's running mean, a running maximum of |x|, an outlier counter, torch.ao's
``MinMaxObserver``) puts something computed from the private batch, unnoised, into ``model.state_dict()`` and
``model.pt``. Which statistic it is does not matter (a counter of calls counts the chunks, hence the secret batch
sizes), so the rule is the sound one: any write is a release. And not only to buffers: a frozen Parameter holding a
running mean is in ``state_dict()`` too, a plain tensor or number kept as a module attribute (or in any object one
holds: a deque, a dataclass, a NumPy array, an attribute set on a parameter) is read by the next steps and pickled
with the model, and a trainable parameter changes only in the optimizer's step. So a
:class:`BufferWatch` sees every kind of write to every slot of the model's state (:func:`state_slots`: buffers,
parameters, the modules' own attributes) between two points: the object in the slot replaced (``self.buf = ...``),
a tensor written in place (its version counter), its storage swapped (``set_``), or its value changed by a path that
bypasses the version counter (``buf.data.copy_(...)``, through numpy). Before training the model probe watches its training-mode passes; during
training every chunk's forward and backward are watched (:mod:`dptrain.preflight.sentinel`). A written buffer refuses
the model with one line naming it (:func:`check_buffers`), unless the user opts out: ``buffer_updates="restore"`` puts
every written slot but a parameter back after each chunk's passes (nothing of a batch stays in the model, and every
chunk runs the function the probe checked, from the same state), ``"not_private"`` keeps them and labels the whole run
not private. The probe restores every buffer and attribute exactly: it leaves no trace of
the examples it read.
"""

from __future__ import annotations

import collections
import contextlib
import types
from collections import deque
from collections.abc import Mapping, Set

import numpy as np
import torch
from torch import nn

from dptrain.errors import ConfigError, ModelError

#: What a run does with buffers written from private batches: refuse the model (default); put them back after every
#: chunk's passes ("restore": nothing of a batch stays in the model, which trains as if it never wrote them: a cache
#: of the last batch such as Qwen2-VL's ``rope_deltas``; never a parameter); or train and label the run not private
#: (the buffers are released unnoised).
BUFFER_UPDATES = ("refuse", "restore", "not_private")


def check_buffer_updates(value: str, key: str = "buffer_updates") -> str:
    if value not in BUFFER_UPDATES:
        raise ConfigError(f"{key} must be one of {', '.join(BUFFER_UPDATES)}, got {value!r}")
    return value


@contextlib.contextmanager
def restored(model: nn.Module):
    """Run a block and put every buffer and module attribute back as it was before it (a probe leaves no trace: a
    counter of calls, a statistic kept in a plain attribute). Parameters are the watch's to see written
    (:class:`BufferWatch`): copying them for every comparison would cost a model's memory."""
    watch = BufferWatch(model, kinds=("buffer", "attribute"))
    try:
        yield
    finally:
        watch.restore()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors: one shape and dtype, equal values (NaN equal to NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):  # (one pass, no temporaries: the common case)
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


#: State tensors up to this size (bytes) have their values copied during training (put back exactly after a write);
#: larger ones are watched by slot, version counter, storage and a float64 checksum (their sum and norm). Before
#: training every value is copied.
COMPARED_BYTES = 2**22
#: Items of a module attribute read into its fingerprint (the items of its containers, the fields of its objects);
#: beyond them, and deeper than ATTRIBUTE_DEPTH, an object is watched by identity only.
ATTRIBUTE_ITEMS = 256
ATTRIBUTE_DEPTH = 8
#: The attributes every nn.Module has (its slots, hooks and flags): the rest of a module's ``__dict__`` is its own
#: state.
_MODULE_KEYS = frozenset(vars(nn.Module())) | {"_compiled_call_impl", "_version"}
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
#: Objects that are code, not state (pickled by reference, if at all): watched by identity.
_CODE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.BuiltinMethodType, nn.Module)


def _tensor_record(t: torch.Tensor, max_bytes: int | None):
    """What a watch keeps of one tensor: the object, its version counter, storage and shape, a copy of its value (at
    most ``max_bytes``) or else its float64 sum and norm (a write through ``.data`` bypasses the version), and the
    fingerprint of the Python attributes set on it (``param.stat = ...``: pickled with it, read by later steps)."""
    keep = max_bytes is None or t.numel() * t.element_size() <= max_bytes
    own = _own_attributes(t)
    attrs = (own, _leaves(own, max_bytes)) if own else None
    if keep:
        return (t, t._version, t.data_ptr(), t.shape, t.detach().clone(), None, attrs)
    return (t, t._version, t.data_ptr(), t.shape, None, _checksum(t), attrs)


#: Attributes torch's own machinery sets on tensors (torch.compile marks the parameters a graph reads): not state.
_TORCH_TENSOR_FLAGS = ("_dynamo_",)


def _own_attributes(t: torch.Tensor) -> dict:
    """The Python attributes set on a tensor, but torch's own flags (:data:`_TORCH_TENSOR_FLAGS`)."""
    return {k: v for k, v in vars(t).items() if not k.startswith(_TORCH_TENSOR_FLAGS)}


def _checksum(t: torch.Tensor):
    with torch.no_grad():
        d = t.detach()
        if not (d.is_floating_point() or d.is_complex()):
            d = d.to(torch.float64)
        return torch.stack([d.sum(dtype=torch.float64).real, torch.linalg.vector_norm(d, dtype=torch.float64)]).cpu()


def _tensor_same(record, t) -> bool:
    before, version, ptr, shape, value, checksum, attrs = record
    if t is not before or t.shape != shape:
        return False
    # with a copy of the value, the value decides: a write that puts back what was there releases nothing (peft's
    # target_parameters LoRA re-registers its frozen weight on every call: version and storage change, not the value);
    # with a checksum only, any write counts (a permutation keeps the sum and the norm)
    if value is None and (t._version != version or t.data_ptr() != ptr):
        return False
    own = _own_attributes(t)
    if (attrs is None) != (not own) or (attrs is not None and not _leaves_same(attrs[1], _leaves(own, 0))):
        return False
    if value is not None:
        return _same(value, t)
    return _same(checksum, _checksum(t))


def _array_record(a: np.ndarray, max_bytes: int | None):
    """A NumPy array's record: the object, its shape and dtype, and a copy of its value (at most ``max_bytes``; else its
    float64 sum and norm). Arrays have no version counter: ``self.hist += ...`` writes in place."""
    if max_bytes is None or a.nbytes <= max_bytes:
        return (a, a.shape, a.dtype, a.copy(), None)
    return (a, a.shape, a.dtype, None, _array_checksum(a))


def _array_checksum(a: np.ndarray):
    try:
        d = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
        return (complex(d.sum()).__repr__(), float(np.linalg.norm(d.ravel())).hex())
    except (TypeError, ValueError):  # (an array of objects: compared by identity)
        return ("object", id(a))


def _array_same(record, a) -> bool:
    before, shape, dtype, value, checksum = record
    if a is not before or a.shape != shape or a.dtype != dtype:
        return False
    if value is not None:
        return bool(np.array_equal(value, a, equal_nan=value.dtype.kind in "fc"))
    return checksum == _array_checksum(a)


def _state_of(value):
    """What pickling saves of ``value`` besides its class (its reduce's arguments, state, items), or None for code
    and for objects that cannot be pickled (watched by identity)."""
    if isinstance(value, _CODE):
        return None
    try:
        reduced = value.__reduce_ex__(4)
    except Exception:  # noqa: BLE001 (a lock, a C object: not picklable, so not released with the model)
        return None
    if not isinstance(reduced, tuple):  # (a global, pickled by reference)
        return None
    rest = list(reduced[1:])
    for k in (3, 4):  # (list items and dict items come as iterators)
        if len(rest) > k - 1 and rest[k - 1] is not None and not isinstance(rest[k - 1], list | tuple | dict):
            rest[k - 1] = list(rest[k - 1])
    return tuple(rest)


def _leaves(value, max_bytes, path: str = "", out: dict | None = None, budget: list | None = None,
            seen: dict | None = None, depth: int = 0) -> dict:
    """A module attribute's fingerprint, path -> leaf: a tensor (its record, with the attributes set on it), a NumPy
    array (its record), an immutable scalar (its value; a float by its hex, so that NaN equals NaN), a container
    (lists, tuples, deques, dicts, sets: item by item), any other object by what pickling it saves (a dataclass's or
    a SimpleNamespace's fields, an object's ``__dict__``: field by field), code and unpicklable objects by identity.
    Up to ATTRIBUTE_ITEMS items in all, ATTRIBUTE_DEPTH levels deep (beyond: unread); an object met twice is read
    once; ``seen``: id -> where it was met (objects read by identity only: nn.Module's machinery)."""
    out = {} if out is None else out
    budget = [ATTRIBUTE_ITEMS] if budget is None else budget
    seen = {} if seen is None else seen
    if torch.is_tensor(value):
        try:
            out[path] = ("tensor", _tensor_record(value, max_bytes))
        except RuntimeError:  # (no storage to read: a tensor a torch.func transform left in the slot, a pass's own)
            out[path] = ("object", id(value))
        return out
    if isinstance(value, np.ndarray):
        out[path] = ("array", _array_record(value, max_bytes))
        return out
    if isinstance(value, float):
        out[path] = ("value", float, value.hex())
        return out
    if isinstance(value, _SCALARS):
        out[path] = ("value", type(value), value)
        return out
    if isinstance(value, np.generic):  # (a NumPy scalar: immutable)
        out[path] = ("value", type(value), value.tobytes())
        return out
    if id(value) in seen:  # (an object met before in this walk: where, not its id, which a copy made to read changes)
        out[path] = ("again", seen[id(value)][0])
        return out
    if depth >= ATTRIBUTE_DEPTH or budget[0] <= 0:
        out[path] = ("unread", type(value))
        return out
    seen[id(value)] = (path, value)  # (kept alive: a copy made to read it must not lend its id to another)
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple | deque):
        items = list(enumerate(value))
    elif isinstance(value, Set):
        items = list(enumerate(sorted(value, key=lambda v: (type(v).__name__, repr(v)))))
    else:
        state = _state_of(value)
        if state is None:
            out[path] = ("object", id(value))
            return out
        items = list(enumerate(state))
    if len(items) > budget[0]:
        out[path] = ("unread", type(value), len(items))
        return out
    budget[0] -= len(items)
    out[path] = ("container", type(value), len(items))  # (by content: an equal copy holds nothing new)
    for k, v in items:
        _leaves(v, max_bytes, f"{path}[{k!r}]", out, budget, seen, depth + 1)
    return out


def value_record(value) -> dict:
    """The fingerprint of any value a watch keeps (a tensor by its object, version counter, storage and checksum; a
    number by its value; containers item by item): what :class:`BufferWatch` keeps of a module attribute, for other
    watches (the optimizer's state: :class:`dptrain.engine.loop_state.OptimizerWatch`)."""
    return _leaves(value, 0)


def same_record(before: dict, now: dict) -> bool:
    """Whether two :func:`value_record` fingerprints describe the same, unwritten value."""
    return _leaves_same(before, now)


def _leaves_same(before: dict, now: dict, tensors_only: bool = False) -> bool:
    if tensors_only:  # (the tensors and arrays an attribute holds, whatever else changed around them)
        before = {k: v for k, v in before.items() if v[0] in _DATA}
        now = {k: v for k, v in now.items() if v[0] in _DATA}
    if before.keys() != now.keys():
        return False
    for path, a in before.items():
        b = now[path]
        if a[0] != b[0]:
            return False
        if a[0] == "tensor":
            if not _tensor_same(a[1], b[1][0]):
                return False
        elif a[0] == "array":
            if not _array_same(a[1], b[1][0]):
                return False
        elif a != b:
            return False
    return True


_DATA = ("tensor", "array")


def _holds_tensor(value) -> bool:
    return any(leaf[0] in _DATA for leaf in _leaves(value, 0).values())


def state_slots(model: nn.Module) -> dict[str, tuple[str, nn.Module, str, object]]:
    """Full name -> (kind, owning module, local name, value) of every slot of the model's state: its buffers, its
    parameters (trainable or not) and its modules' own attributes (what ``__dict__`` holds besides nn.Module's slots
    and hooks: a plain tensor, a number, a list...)."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        def full(local: str, prefix: str = prefix) -> str:
            return f"{prefix}.{local}" if prefix else local

        for local, t in module._buffers.items():
            out[full(local)] = ("buffer", module, local, t)
        for local, p in module._parameters.items():
            out[full(local)] = ("parameter", module, local, p)
        for local, v in vars(module).items():
            if local not in _MODULE_KEYS and not isinstance(v, nn.Module):
                out[full(local)] = ("attribute", module, local, v)
    return out


class BufferWatch:
    """Every slot of a model's state at one point (:func:`state_slots`: buffers, parameters, the modules' own
    attributes): the object in it and, for a tensor, its version counter, its storage and a copy of its value (tensors
    of at most ``max_bytes``, every one by default; larger ones: a float64 checksum). :meth:`written` names the slots
    written since; :meth:`restore` puts them back. A training-mode pass writes none of them: buffers and attributes are
    released (or read by later steps) unnoised, and a parameter changes only in the optimizer's step."""

    def __init__(self, model: nn.Module, max_bytes: int | None = None,
                 kinds: tuple[str, ...] = ("buffer", "parameter", "attribute")):
        self.model, self.max_bytes, self.watched = model, max_bytes, kinds
        self.slots, self.kinds = {}, {}
        for name, (kind, _, _, v) in self._now().items():
            self.kinds[name] = kind
            if kind == "attribute":
                self.slots[name] = (v, _leaves(v, max_bytes, seen=self._plumbing()))
            else:  # (a trainable parameter by its checksum during training: copying a model per chunk costs a pass)
                cap = 0 if max_bytes is not None and kind == "parameter" and v is not None and v.requires_grad else max_bytes
                self.slots[name] = (v, None if v is None else _tensor_record(v, cap))

    def _plumbing(self) -> collections.ChainMap:
        """The ids of nn.Module's own machinery (every module's parameter, buffer, submodule and hook dicts): an
        attribute reaching them (a hook's RemovableHandle) reads them by identity; their contents are slots of their
        own, or code."""
        if getattr(self, "_machinery", None) is None:
            self._machinery = {id(v): (f"<{type(m).__name__}.{k} {id(v)}>", v) for m in self.model.modules()
                               for k, v in vars(m).items() if k in _MODULE_KEYS and isinstance(v, dict)}
        return collections.ChainMap({}, self._machinery)  # (a walk's own entries go to the new map, not a copy)

    def _now(self) -> dict:
        return {n: slot for n, slot in state_slots(self.model).items() if slot[0] in self.watched}

    def kind(self, name: str) -> str:
        return self.kinds.get(name) or state_slots(self.model).get(name, ("state",))[0]

    def written(self, tensors_only: bool = False) -> list[str]:
        """The slots written since the watch began. ``tensors_only``: of a module attribute, only the tensors it holds
        (frameworks set flags and hooks as attributes between steps: accelerate's ``_is_accelerate_prepared``)."""
        now = self._now()
        names = []
        for name in sorted(set(now) | set(self.slots)):
            if name not in now or name not in self.slots or now[name][0] != self.kinds[name]:
                slot = now.get(name) or (self.kinds[name], None, None, self.slots[name][0])
                if not tensors_only or slot[0] != "attribute" or _holds_tensor(slot[3]):
                    names.append(name)
                continue
            kind, _, _, value = now[name]
            before, record = self.slots[name]
            if kind == "attribute":
                if not _leaves_same(record, _leaves(value, self.max_bytes, seen=self._plumbing()), tensors_only):
                    names.append(name)
            elif before is None or value is None:
                if before is not value:
                    names.append(name)
            elif not _tensor_same(record, value):
                names.append(name)
        return names

    def restore(self) -> list[str]:
        """Every slot as it was: the same objects, tensors with their values put back where a copy was kept. Returns
        the slots that could not be put back exactly (a large tensor written in place, a container changed in place):
        what was written there stays in the model."""
        current = self._now()
        lost = []
        for name, (kind, module, local, _) in current.items():
            if name not in self.slots or kind != self.kinds[name]:
                _put(module, kind, local, None, delete=True)
        for name, (before, record) in self.slots.items():
            kind = self.kinds[name]
            # (the module now at the slot's path: the current reading's, or found by the path where it is gone)
            module, local = current[name][1:3] if name in current else _owner(self.model, name)
            if kind == "attribute":
                _put(module, kind, local, before)
                if not all(_put_value(leaf[1]) if leaf[0] == "tensor" else _put_array(leaf[1])
                           for leaf in record.values() if leaf[0] in _DATA):
                    lost.append(name)
                elif not _leaves_same(record, _leaves(before, self.max_bytes, seen=self._plumbing())):
                    lost.append(name)  # (a list or dict of the model changed in place)
                continue
            elif record is not None and not _put_value(record):
                lost.append(name)
            _put(module, kind, local, before)
        return sorted(set(lost))


def _put_value(record) -> bool:
    """The tensor of ``record`` with its recorded value and Python attributes; False when no copy was kept and it
    changed."""
    tensor, value, attrs = record[0], record[4], record[6]
    for k in _own_attributes(tensor):
        del vars(tensor)[k]
    vars(tensor).update(attrs[0] if attrs is not None else {})
    if value is None:
        return _tensor_same(record, tensor)
    with torch.no_grad():
        if tensor.shape != value.shape or tensor.dtype != value.dtype:
            tensor.set_(value.clone())
        else:
            tensor.copy_(value)
    return True


def _put_array(record) -> bool:
    """The array of ``record`` with its recorded value; False when no copy was kept and it changed."""
    array, value = record[0], record[3]
    if value is None or array.shape != value.shape or array.dtype != value.dtype:
        return _array_same(record, array)
    np.copyto(array, value)
    return True


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, local = name.rpartition(".")
    return (model.get_submodule(prefix) if prefix else model), local


def _put(module: nn.Module, kind: str, local: str, value, delete: bool = False) -> None:
    if kind == "attribute":
        if delete:
            vars(module).pop(local, None)
        else:
            vars(module)[local] = value
        return
    slots = module._buffers if kind == "buffer" else module._parameters
    if delete:
        slots.pop(local, None)
    else:
        slots[local] = value


def check_buffers(names: list[str], buffer_updates: str, kinds: dict[str, str] | None = None) -> list[str]:
    """Refuse (ModelError naming the first slot) when ``names`` (state written from the batch: buffers, or with
    ``kinds`` saying so, parameters or attributes) is not empty, unless ``buffer_updates == "not_private"``: then
    return them, for the run to label itself not private; or ``"restore"`` and none is a parameter: then return none
    (the caller puts them back)."""
    if buffer_updates == "restore" and not any((kinds or {}).get(n) == "parameter" for n in names):
        return []
    if names and buffer_updates != "not_private":
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        kind = (kinds or {}).get(names[0], "buffer")
        why, way_out = (
            (": parameters change only in the optimizer's step (a write from the batch is released unnoised with the "
             "model, and a model that rescales its own weights when it switches between train and eval mode, as "
             "transformers' RWKV does, writes them too)",
             "make the forward pass leave its parameters alone (RWKV: config.rescale_every = 0)")
            if kind == "parameter" else
            (" (whatever it holds, a statistic or a count of private batches, it is released unnoised with the model, "
             "or read by the next steps)",
             "compute it without state, pass buffer_updates=\"restore\" to have it put back after every chunk (the "
             "model then trains as if it never wrote it: right for a cache of the last batch, such as Qwen2-VL's "
             "rope_deltas, wrong for a statistic the model means to read)")
        )
        raise ModelError(
            f"model {kind} {names[0]!r}{more} is written by a training-mode forward pass{why}; {way_out}, or pass "
            "buffer_updates=\"not_private\" (config: training.buffer_updates) to train anyway with the run labelled "
            "NOT private"
        )
    return list(names)


__all__ = [
    "BUFFER_UPDATES",
    "COMPARED_BYTES",
    "state_slots",
    "BufferWatch",
    "check_buffer_updates",
    "check_buffers",
    "same_record",
    "value_record",
    "restored",
]
