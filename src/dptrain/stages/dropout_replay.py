"""Dropout inside a module differentiated per example by torch.func (:mod:`dptrain.stages.module_func`), replayed.

The layerwise backend differentiates a module without a rule (nn.MultiheadAttention's packed projection, a layer of
one's own) by calling it again, example by example, under ``vmap``. A dropout inside it (MultiheadAttention's
``dropout``, which every nn.TransformerEncoderLayer passes it: 0.1 by default) drew its mask once for the batch; the
calls again must use that mask, not a new one (the gradient would be of another function than the one whose output the
model used), and ``vmap`` refuses random operations anyway. So, while the module runs on the batch, :class:`Recorder`
(a torch function mode) computes each dropout as its input times a mask (the dropout function applied to ones:
whatever it is, its own mask) and keeps the masks in order; the calls example by example run under :class:`Replayer`,
whose k-th dropout multiplies by example i's rows of the k-th mask. ``scaled_dot_product_attention`` with a dropout
probability, whose mask is inside the fused kernel, is computed in both passes as its reference form (softmax(q k^T
scale + mask) with the dropout mask, times v: PyTorch's documented equivalent) with the mask kept likewise.

Only multiplicative dropouts are replayed (:data:`DROPOUTS`; alpha dropout is not a mask) and only calls that draw
(p > 0, in training). Draws of torch's random factories (:data:`FACTORIES`: ``torch.rand(1)``, ``torch.randn(n)``,
...) are replayed too, whole (:class:`Shared`): the batch's call drew one for all its examples, so each example's call
gets that draw again, which is only possible at the same size (a draw sized by the batch's rows is not the example's:
the replay raises). peft's LyCORIS layers (LoHa, LoKr) draw ``torch.rand(1) > module_dropout`` in every training call,
even at ``module_dropout = 0``: ``vmap`` refused them, the automatic backend differentiated the whole model example by
example, and DPTrainer refused LoHa and LoKr on every model. Any other random operation in such a module still makes
``vmap`` refuse it. A replay that does not see the same draws in the same order and shapes raises, and the module's
outputs example by example are checked against the batch's (module_func): a wrong replay is never a wrong gradient.
"""

from __future__ import annotations

import functools
import math
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: The functions whose randomness is dropout (their first argument is the input).
DROPOUTS = frozenset(
    {
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
        torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
    }
)
#: The dropouts that multiply their input by a mask (:class:`Recorder` and :class:`Replayer` take them).
MASKS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.feature_dropout})
#: Random factories whose draws are replayed whole (:class:`Shared`).
FACTORIES = frozenset({torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
                       torch.randint_like})
SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_SDPA_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_F_INPLACE = 3  # (F.dropout's position of ``inplace``)


def _argument(args: tuple, kwargs: dict, position: int, name: str, default):
    return args[position] if len(args) > position else kwargs.get(name, default)


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call is a dropout that draws a mask: a multiplicative dropout (p > 0, training) or attention
    with a dropout probability."""
    if func in MASKS:
        p = _argument(args, kwargs, 1, "p", 0.5)
        train = _argument(args, kwargs, 2, "train" if func in (torch.dropout, torch.feature_dropout) else "training",
                          True)
        return bool(train) and float(p) > 0
    if func in SDPA:
        return float(_argument(args, kwargs, 4, "dropout_p", 0.0)) > 0
    return False


def _dropped(func, args: tuple, kwargs: dict, mask: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else kwargs["input"]
    inplace = func not in (torch.dropout, torch.feature_dropout) and bool(_argument(args, kwargs, _F_INPLACE,
                                                                                  "inplace", False))
    return x.mul_(mask) if inplace else x * mask


def _attention(args: tuple, kwargs: dict, mask_of) -> torch.Tensor:
    """scaled_dot_product_attention's reference form with the dropout mask ``mask_of(weights)``."""
    a = dict(zip(_SDPA_NAMES, args, strict=False)) | kwargs
    q, k, v = a["query"], a["key"], a["value"]
    if a.get("enable_gqa", False):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = a.get("scale")
    w = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
    if a.get("is_causal", False):
        w = w.masked_fill(~torch.ones(w.shape[-2:], dtype=torch.bool, device=w.device).tril(), float("-inf"))
    mask = a.get("attn_mask")
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else w + mask
    w = torch.softmax(w, -1)
    return (w * mask_of(w)) @ v


def _calls_dropout(func) -> bool:
    """A Python-level function of torch.nn.functional whose body calls dropout or attention by name
    (F.multi_head_attention_forward)."""
    return (isinstance(func, types.FunctionType) and func.__module__ == "torch.nn.functional"
            and func not in DROPOUTS and any(name in func.__code__.co_names for name in _INNER))


#: The names under which torch.nn.functional's own functions call the dropouts the replay takes.
_INNER = ("dropout", "scaled_dot_product_attention")


def _through(func, mode: TorchFunctionMode):
    """A copy of the Python-level torch function ``func`` (:func:`_calls_dropout`) whose calls of dropout and attention
    go to ``mode``'s handler. A torch function mode's handler runs with the mode popped, so the function's own calls
    would not reach it: the copy reads its globals from a dict of its own (nothing of torch is patched) where those
    names are the mode's and ``has_torch_function`` is False (it is handled already)."""
    names = dict(func.__globals__)
    for name in list(names):
        if name.startswith("has_torch_function"):
            names[name] = lambda *a, **k: False
    for name in _INNER:
        if name in names:
            names[name] = functools.partial(lambda original, *a, **k: mode.__torch_function__(original, (), a, k),
                                            names[name])
    copy = types.FunctionType(func.__code__, names, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


class Shared:
    """A random factory's draw in the batch's call (``value``), replayed whole to each example's call."""

    __slots__ = ("func", "value")

    def __init__(self, func, value: torch.Tensor):
        self.func, self.value = func, value


def _size(func, args: tuple, kwargs: dict) -> tuple | None:
    """The shape a random factory's call asks for (None where it cannot be read)."""
    if func in (torch.rand_like, torch.randn_like, torch.randint_like):
        x = args[0] if args else kwargs.get("input")
        return tuple(x.shape) if torch.is_tensor(x) else None
    if func is torch.randperm:
        n = args[0] if args else kwargs.get("n")
        return (int(n),) if isinstance(n, int) else None
    size = kwargs.get("size")
    if size is None:
        dims = [a for a in args if isinstance(a, (tuple, list, torch.Size))]
        size = dims[-1] if dims else (args if func is not torch.randint else None)
    if size is None or not all(isinstance(d, int) for d in size):
        return None
    return tuple(size)


class Recorder(TorchFunctionMode):
    """While a module runs on the batch: each dropout that draws computed as its input times a mask, the masks kept in
    order (``masks``)."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            out = func(*args, **kwargs)
            self.masks.append(Shared(func, out.detach().clone()))
            return out
        if not _draws(func, args, kwargs):
            return (_through(func, self) if _calls_dropout(func) else func)(*args, **kwargs)

        def mask_of(like: torch.Tensor, dropout=func, rest=args[1:], kw=kwargs) -> torch.Tensor:
            # (the dropout itself applied to ones, through the modes outside this one: its own mask, or ones where an
            # outer mode turns dropout off)
            kw = {n: v for n, v in kw.items() if n not in ("input", "inplace")}
            mask = dropout(torch.ones_like(like), *rest[:2], **kw).detach()
            self.masks.append(mask)
            return mask

        if func in SDPA:
            p = float(_argument(args, kwargs, 4, "dropout_p", 0.0))
            return _attention(args, kwargs, lambda w: mask_of(w, F.dropout, (p, True), {}))
        x = args[0] if args else kwargs["input"]
        return _dropped(func, args, kwargs, mask_of(x))


class ReplayError(RuntimeError):
    """The calls example by example did not draw the dropouts the batch's call drew."""


class Replayer(TorchFunctionMode):
    """While a module runs on one example (inside vmap): the k-th dropout that draws multiplies by ``masks[k]`` (that
    example's rows of the batch's k-th mask), the k-th random factory's call returns ``shared[k]``'s draw."""

    def __init__(self, masks: list[torch.Tensor], shared: list[Shared] = ()):
        super().__init__()
        self.masks, self.used = list(masks), 0
        self.shared, self.replayed = list(shared), 0

    def _draw(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        k = self.replayed
        if k >= len(self.shared) or self.shared[k].func is not func or _size(func, args, kwargs) != tuple(
            self.shared[k].value.shape
        ):
            raise ReplayError("the module's random draws example by example are not the batch's")
        self.replayed += 1
        return self.shared[k].value

    def _next(self, like: torch.Tensor) -> torch.Tensor:
        if self.used >= len(self.masks) or self.masks[self.used].shape != like.shape:
            raise ReplayError("the module's dropouts example by example are not the batch's")
        self.used += 1
        return self.masks[self.used - 1]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            return self._draw(func, args, kwargs)
        if not _draws(func, args, kwargs):
            return (_through(func, self) if _calls_dropout(func) else func)(*args, **kwargs)
        if func in SDPA:
            return _attention(args, kwargs, self._next)
        x = args[0] if args else kwargs["input"]
        return _dropped(func, args, kwargs, self._next(x))


__all__ = ["DROPOUTS", "FACTORIES", "MASKS", "SDPA", "Recorder", "ReplayError", "Replayer", "Shared"]
