"""Per-example gradients of torch's recurrent layers (nn.RNN, nn.LSTM, nn.GRU) from one recorded call.

torch.func cannot differentiate these example by example (vmap has no batching rule for their fused kernels), so the
per-module fallback of :mod:`dptrain.stages.module_func` takes them by kind: the layer's recurrence is run again on the
recorded inputs in plain operations, one backward pass of sum <output, its recorded gradient> over every output (the
sequence, h_n, and c_n for an LSTM) gives the gradient of each matrix product y = W x + b of the recurrence, and each
example's gradient of W is the sum over its products of dy x^T (of b: of dy), one einsum per weight over all time
steps (the layerwise rule of a Linear, as Opacus' DPLSTM forms it from its per-step linear layers). The equations are torch's (the
classes' documentation): RNN h' = act(W_ih x + b_ih + W_hh h + b_hh); LSTM gates i, f, g, o, c' = f c + i g,
h' = o tanh(c') (projected by W_hr with proj_size); GRU r, z, n = tanh(W_in x + b_in + r (W_hn h + b_hn)),
h' = (1 - z) n + z h; bidirectional layers run the reversed sequence, stacked layers read the previous layer's
output. Inputs batch_first or not, a PackedSequence (each example's recurrence stops at its length), an initial
state or none. The recomputed outputs must equal the recorded ones (else :class:`RecurrentError`, and the caller
differentiates the model another way): a gradient is never of another function than the one the model ran.

Not taken (a RecurrentError): dropout between layers (its masks are inside the fused kernel: :func:`refusal`, decided
when the sampler is made, since the checks before training turn dropout off), unbatched inputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from dptrain.stages.precision import LOW, upcast


def refusal(m: nn.RNNBase) -> str | None:
    """Why ``m``'s calls cannot be taken, decided by its configuration when the sampler is made (the checks before
    training turn dropout off, so a call cannot tell), or None."""
    if m.dropout > 0 and m.num_layers > 1:
        return (f"{type(m).__name__}'s dropout between layers ({m.dropout:g}) draws its masks inside torch's fused "
                f"kernel; stack single-layer {type(m).__name__}s with nn.Dropout between them (the same model), or set "
                "dropout=0")
    return None


class RecurrentError(RuntimeError):
    """A recurrent layer's call this module does not take, or whose recomputation does not reproduce it."""


class _Taps:
    """The layer's matrix products y = W x + b of one recomputation, by weight: their inputs and outputs, for each
    example's gradient W: sum over its products of dy x^T (and b: sum of dy) once one backward pass has given the dy."""

    def __init__(self, w: dict):
        self.w, self.calls = w, []

    def __call__(self, x: torch.Tensor, weight: str, bias: str | None) -> torch.Tensor:
        b = self.w.get(bias) if bias is not None else None
        y = torch.nn.functional.linear(x, self.w[weight], b)
        if not y.requires_grad:  # (the first step's, from the initial state: a leaf of its own)
            y.requires_grad_()
        self.calls.append((weight, bias if b is not None else None, x, y))
        return y

    def per_example(self, total: torch.Tensor, trainable: set[str], batch: int) -> dict[str, torch.Tensor]:
        dys = torch.autograd.grad(total, [y for *_, y in self.calls], allow_unused=True)
        parts: dict[tuple, tuple[list, list]] = {}
        for (weight, bias, x, _), dy in zip(self.calls, dys, strict=True):
            if dy is not None:
                xs, ds = parts.setdefault((weight, bias), ([], []))
                xs.append(x.detach().reshape(batch, -1, x.shape[-1]))
                ds.append(dy.reshape(batch, -1, dy.shape[-1]))
        out: dict[str, torch.Tensor] = {}
        for (weight, bias), (xs, ds) in parts.items():
            x, d = torch.cat(xs, 1), torch.cat(ds, 1)
            if weight in trainable:
                g = torch.einsum("bto,bti->boi", d, x)
                out[weight] = out[weight] + g if weight in out else g
            if bias is not None and bias in trainable:
                g = d.sum(1)
                out[bias] = out[bias] + g if bias in out else g
        return out


def _direction(m: nn.RNNBase, tap: _Taps, x: torch.Tensor, lengths: torch.Tensor, h: torch.Tensor,
               c: torch.Tensor | None, suffix: str, reverse: bool):
    """One layer's one direction over x [B, T, in] (positions at or beyond an example's length leave its state as it
    is and output zeros): (outputs [B, T, H_out], h_n, c_n)."""
    bias = lambda name: f"{name}{suffix}" if m.bias else None  # noqa: E731
    xs = tap(x, f"weight_ih_l{suffix}", bias("bias_ih_l"))
    outs = [None] * x.shape[1]
    steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    for t in steps:
        valid = (t < lengths).to(x.dtype)[:, None]
        gh = tap(h, f"weight_hh_l{suffix}", bias("bias_hh_l"))
        if m.mode == "LSTM":
            i, f, g, o = (xs[:, t] + gh).chunk(4, 1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            if m.proj_size > 0:
                h_new = tap(h_new, f"weight_hr_l{suffix}", None)
            c = valid * c_new + (1 - valid) * c
        elif m.mode == "GRU":
            ir, iz, i_n = xs[:, t].chunk(3, 1)
            hr, hz, hn = gh.chunk(3, 1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            h_new = (1 - z) * torch.tanh(i_n + r * hn) + z * h
        else:
            h_new = (torch.tanh if m.mode == "RNN_TANH" else torch.relu)(xs[:, t] + gh)
        h = valid * h_new + (1 - valid) * h
        outs[t] = valid * h
    return torch.stack(outs, 1), h, c


def _run(m: nn.RNNBase, tap: _Taps, x: torch.Tensor, lengths: torch.Tensor, hx):
    """The layer's forward on x [B, T, in]: (output [B, T, dirs H_out], h_n [layers dirs, B, H_out], c_n or None)."""
    dirs = 2 if m.bidirectional else 1
    b = x.shape[0]
    h_out = m.proj_size if m.proj_size > 0 else m.hidden_size
    if hx is None:
        h0 = x.new_zeros(m.num_layers * dirs, b, h_out)
        c0 = x.new_zeros(m.num_layers * dirs, b, m.hidden_size) if m.mode == "LSTM" else None
    else:
        h0, c0 = hx if m.mode == "LSTM" else (hx, None)
    hs, cs = [], []
    for layer in range(m.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            suffix = f"{layer}_reverse" if d else f"{layer}"
            out, h, c = _direction(m, tap, x, lengths, h0[k], None if c0 is None else c0[k], suffix, bool(d))
            outs.append(out)
            hs.append(h)
            cs.append(c)
        x = torch.cat(outs, -1)
    return x, torch.stack(hs), (torch.stack(cs) if m.mode == "LSTM" else None)


def _near(a: torch.Tensor, r: torch.Tensor) -> bool:
    """A low-precision recorded output ``r`` against the float32 recomputation ``a``: each row to bfloat16's rounding
    of the row as a whole (the recurrence's rounding accumulates over the steps), as module_func checks its modules."""
    a, r = a.detach().double().flatten(1), r.detach().double().flatten(1)
    return bool(((a - r).norm(dim=1) <= 3e-2 * r.norm(dim=1) + 1e-6).all())


def recurrent_gradients(m: nn.RNNBase, args: tuple, kwargs: dict, gos: list, recorded: list, batch: int
                        ) -> dict[str, torch.Tensor]:
    """Per-example gradients [B, ...] of ``m``'s trainable parameters for its recorded call ``m(*args, **kwargs)``,
    whose output tensors (sequence or packed data, h_n, c_n) are ``recorded`` with gradients ``gos`` (None: unused)."""
    if refusal(m) is not None:
        raise RecurrentError(refusal(m))
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    packed = isinstance(x, PackedSequence)
    if packed:
        padded, lengths = pad_packed_sequence(x, batch_first=True)
    else:
        if x.dim() != 3:
            raise RecurrentError(f"{type(m).__name__} called on an unbatched input")
        padded = x if m.batch_first else x.transpose(0, 1)
        lengths = torch.full((padded.shape[0],), padded.shape[1])
    if padded.shape[0] != batch:
        raise RecurrentError(f"{type(m).__name__}'s input holds {padded.shape[0]} sequences for {batch} examples")
    lengths = lengths.to(padded.device)
    low = torch.is_autocast_enabled(padded.device.type)  # (the batch's outputs then carry its rounding)
    with torch.autocast(padded.device.type, enabled=False):  # (mixed precision: formed in float32, as a rule's are)
        return _gradients(m, padded, lengths, hx, gos, recorded, batch, packed, low)


def _gradients(m, padded, lengths, hx, gos, recorded, batch, packed, low) -> dict[str, torch.Tensor]:
    padded, gos = upcast(padded), [None if g is None else upcast(g) for g in gos]
    tap = _Taps({name: upcast(p.detach()) for name, p in m.named_parameters()})
    trainable = {name for name, p in m.named_parameters() if p.requires_grad}
    detached = None if hx is None else (tuple(upcast(t.detach()) for t in hx) if isinstance(hx, tuple)
                                        else upcast(hx.detach()))
    with torch.enable_grad():
        out, h_n, c_n = _run(m, tap, padded.detach(), lengths, detached)
        if packed:
            seq = pack_padded_sequence(out, lengths.cpu(), batch_first=True, enforce_sorted=False).data
        else:
            seq = out if m.batch_first else out.transpose(0, 1)
        mine = [seq, h_n] + ([c_n] if c_n is not None else [])
        # (a PackedSequence output's tensors are its data and its integer bookkeeping: the values are the data)
        kept = [(r, g) for r, g in zip(recorded, gos, strict=True) if r.is_floating_point()]
        recorded, gos = [r for r, _ in kept], [g for _, g in kept]
        if len(mine) != len(recorded) or not all(
            a.shape == r.shape and (_near(a, r) if low or r.dtype in LOW else
                                    torch.allclose(a, r.detach(), rtol=1e-4, atol=1e-6))
            for a, r in zip(mine, recorded, strict=True)
        ):
            raise RecurrentError(f"{type(m).__name__} recomputed does not reproduce its output")
        total = sum((a * g).sum() for a, g in zip(mine, gos, strict=True) if g is not None)
        grads = tap.per_example(total, trainable, batch) if torch.is_tensor(total) else {}
    params = dict(m.named_parameters())
    return {name: grads[name] if name in grads else params[name].new_zeros((batch, *params[name].shape))
            for name in trainable}


__all__ = ["RecurrentError", "recurrent_gradients", "refusal"]
