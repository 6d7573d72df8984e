"""The layerwise backend's rules: each layer's per-example parameter gradients from its recorded input ``a`` and its
output gradient ``go`` (:mod:`dptrain.stages.per_example`, the layerwise backend): an outer product for Linear (on
[B, in] or sequences [B, T, in], kept factored where :func:`ghost_pays`), a grouped convolution backward (or a forward
convolution for few input channels) for Conv1d/Conv2d, torch's fused GroupNorm kernels on the batch seen as one example
for GroupNorm, the normalized input for LayerNorm/RMSNorm, the looked-up ids for Embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.stages.gradient_factors import _EmbeddingFactors, _LinearFactors

#: Examples per grouped convolution in :func:`_conv_weight_per_example`: one call over a whole chunk slows down with
#: its size (cnn28's conv2 at 1024 examples: 31 ms in one call, 10.6 ms in calls of 128; the same at 256 or fewer).
CONV_GROUPS_PER_CALL = 128


#: Input channels below which :func:`_conv_weight_per_example` forms the per-example weight gradients by one forward
#: convolution (:func:`_conv_weight_by_forward`) rather than a grouped convolution backward. oneDNN's grouped kernels
#: are slow for channel counts that are not multiples of 8. ``python benchmarks/micro.py conv`` on this project's CPU
#: (2026-11-25; 128 examples of 32x32, 3x3 kernels, 16 output channels): the forward form 1.8 / 3.9 / 8.4 ms for
#: 1 / 3 / 6 input channels against 4.6 / 11.0 / 14.5 ms grouped, and from 8 channels on it loses (10.6 against
#: 2.2 ms). The first layer of an image model is the case.
CONV_FORWARD_BELOW_CHANNELS = 8


def _conv_weight_by_forward(conv: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """Per-example Conv2d weight gradients (groups = 1) as one forward convolution: example b's gradient
    g_b[o, i, u, v] = sum_{y, x} go_b[o, y, x] a_b[i, s y + d u - p, s x + d v - p] is the correlation of the input
    channels (as a batch of C_in images with the B examples as channels) with each example's output gradient as a
    filter (B groups of C_out filters), the layer's stride s becoming the dilation and its dilation d the stride;
    its first k x k outputs are the gradient (Rochette, Manoel & Tramel 2019, "Efficient per-example gradient
    computations in convolutional neural networks")."""
    b, c_in, c_out = a.shape[0], a.shape[1], go.shape[1]
    kh, kw = conv.weight.shape[2:]
    out = F.conv2d(
        a.transpose(0, 1),
        go.reshape(b * c_out, 1, *go.shape[2:]),
        None,
        stride=tuple(conv.dilation),
        padding=tuple(conv.padding),
        dilation=tuple(conv.stride),
        groups=b,
    )
    return out[:, :, :kh, :kw].reshape(c_in, b, c_out, kh, kw).permute(1, 2, 0, 3, 4).contiguous()


def _conv_weight_per_example(conv: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """Per-example Conv2d weight gradients: by one forward convolution for layers with few input channels
    (CONV_FORWARD_BELOW_CHANNELS), else as grouped-convolution weight gradients (examples as groups), at most
    CONV_GROUPS_PER_CALL examples per call."""
    b = a.shape[0]
    if conv.groups == 1 and a.shape[1] < CONV_FORWARD_BELOW_CHANNELS and b:
        return _conv_weight_by_forward(conv, a, go)
    if b > CONV_GROUPS_PER_CALL:
        out = a.new_empty((b, *conv.weight.shape))
        for i in range(0, b, CONV_GROUPS_PER_CALL):
            j = min(b, i + CONV_GROUPS_PER_CALL)
            out[i:j] = _conv_weight_per_example(conv, a[i:j], go[i:j])
        return out
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


def ghost_pays(positions: int, fan_in: int, fan_out: int) -> bool:
    """Whether a layer's per-example gradient norm is cheaper from the Gram form over its T positions (about
    T^2 (in + out) per example) than from the materialized in x out gradient (T in out to form, in out to keep).
    Decided per layer from its shapes: ghost norms pay for long-vocabulary or wide layers on short sequences, not
    for convolutions over many positions (issue measurements: cnn28's conv1 would be 13x slower)."""
    return positions * positions * (fan_in + fan_out) < positions * fan_in * fan_out


def _linear(m: nn.Linear, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor | _LinearFactors]:
    if a.dim() == 2:
        out = {"weight": _LinearFactors(go, a)}
        bias = go
    else:  # [B, ..., features]: sum over the middle dimensions of each example
        a3, go3 = a.flatten(1, -2), go.flatten(1, -2)
        if ghost_pays(a3.shape[1], a3.shape[2], go3.shape[2]):
            out = {"weight": _LinearFactors(go3, a3)}
        else:
            out = {"weight": torch.einsum("bto,bti->boi", go3, a3)}
        bias = go3.sum(1)
    if m.bias is not None:
        out["bias"] = bias
    return out


def _embedding(m: nn.Embedding, ids: torch.Tensor, go: torch.Tensor) -> dict[str, _EmbeddingFactors]:
    """An Embedding's per-example weight gradients: each example's output gradients added to the rows of its ids.
    With ``scale_grad_by_freq`` torch divides each looked-up row's gradient by the number of times its id occurs in
    the batch it was called on: an example alone counts its own ids, so each position's output gradient is divided by
    its id's count in the example. ``sparse`` only changes the format of torch's batch gradient, not its value (the
    released gradient is dense anyway: the noise reaches every row)."""
    b = ids.shape[0]
    ids, go = ids.reshape(b, -1), go.reshape(b, -1, go.shape[-1])
    if m.padding_idx is not None:  # torch leaves the padding row's gradient at zero
        go = go * (ids != m.padding_idx)[..., None]
    if m.scale_grad_by_freq:
        counts = (ids[:, :, None] == ids[:, None, :]).sum(2)  # [B, T]: how often each position's id occurs in its example
        go = go / counts[..., None].to(go.dtype)
    return {"weight": _EmbeddingFactors(ids, go, m.num_embeddings)}


def _conv1d(m: nn.Conv1d, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    """Conv1d as a Conv2d of height 1 (the same grouped-convolution weight gradient)."""
    out = {"weight": _conv_weight_per_example(_Conv1dAs2d(m), a[:, :, None, :], go[:, :, None, :])[:, :, :, 0, :]}
    if m.bias is not None:
        out["bias"] = go.sum(2)
    return out


class _Conv1dAs2d:
    """The attributes of a Conv2d that _conv_weight_per_example reads, for a Conv1d."""

    def __init__(self, m: nn.Conv1d):
        self.weight = m.weight[:, :, None, :]
        self.stride, self.padding, self.dilation = (1, *m.stride), (0, *m.padding), (1, *m.dilation)
        self.groups = m.groups


def _rms_norm(m: nn.RMSNorm, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    xhat = F.rms_norm(a, m.normalized_shape, None, m.eps)
    dims = tuple(range(1, a.dim() - len(m.normalized_shape)))
    return {"weight": (go * xhat).sum(dims) if dims else go * xhat}


def _conv2d(m: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"weight": _conv_weight_per_example(m, a, go)}
    if m.bias is not None:
        out["bias"] = go.sum((2, 3))
    return out


def _group_norm(m: nn.GroupNorm, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example GroupNorm gradients: weight sum_hw go * xhat and bias sum_hw go for every (example, channel), by
    torch's own fused GroupNorm kernels applied to the batch seen as ONE example of B x C channels in B x G groups.
    GroupNorm normalizes each group of each example on its own, so that view normalizes exactly as the layer did, and
    its "batch" weight and bias gradients are the per-example ones: one fused forward (for the means and inverse
    deviations; its normalized output is dropped) and one fused backward forming both sums, instead of the normalized
    input, its product with the output gradient and two reductions. The weight gradient is formed as torch forms the
    batch gradient, rstd (sum go a - mean sum go), with the same rounding (for inputs whose mean is large against
    their spread it cancels as torch's own gradient does; ``tests/test_per_example.py`` bounds it)."""
    b, c = a.shape[:2]
    hw = a[0, 0].numel()
    groups = b * m.num_groups
    x, g = a.reshape(1, b * c, hw), go.reshape(1, b * c, hw)
    _, mean, rstd = torch.ops.aten.native_group_norm(x, None, None, 1, b * c, hw, groups, m.eps)
    # (the weight only enters the input gradient, which is not asked for; the kernel wants one of the right size)
    ones = a.new_ones(b * c)
    _, weight, bias = torch.ops.aten.native_group_norm_backward(
        g, x, mean, rstd, ones, 1, b * c, hw, groups, [False, True, True]
    )
    return {"weight": weight.reshape(b, c), "bias": bias.reshape(b, c)}


def _layer_norm(m: nn.LayerNorm, a: torch.Tensor, go: torch.Tensor) -> dict[str, torch.Tensor]:
    xhat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
    dims = tuple(range(1, a.dim() - len(m.normalized_shape)))
    out = {"weight": (go * xhat).sum(dims) if dims else go * xhat}
    if m.bias is not None:
        out["bias"] = go.sum(dims) if dims else go
    return out


def _layerwise_rule(m: nn.Module):
    """The per-example rule for a module, or None if the layerwise backend cannot handle it. A rule gives the gradients
    of the module's own ``weight`` (and ``bias``) Parameters: a module of one of these types whose weight is computed
    from other parameters (torch's ``nn.utils.weight_norm`` / ``spectral_norm`` keep ``weight_g``, ``weight_v`` or
    ``weight_orig`` and set ``weight`` in a forward pre-hook) has none (torch.func differentiates it)."""
    if not isinstance(m._parameters.get("weight"), nn.Parameter) or not set(m._parameters) <= {"weight", "bias"}:
        return None
    if type(m) is nn.Linear:
        return _linear
    if type(m) is nn.Conv2d and m.padding_mode == "zeros" and not isinstance(m.padding, str):
        return _conv2d
    if type(m) is nn.GroupNorm and m.affine:
        return _group_norm
    if type(m) is nn.LayerNorm and m.elementwise_affine:
        return _layer_norm
    if type(m) is nn.Embedding and m.max_norm is None:
        return _embedding  # (max_norm renormalizes the weight in place: a write the model checks refuse)
    if type(m) is nn.Conv1d and m.padding_mode == "zeros" and not isinstance(m.padding, str):
        return _conv1d
    if type(m) is nn.RMSNorm and m.elementwise_affine:
        return _rms_norm
    return None


def layerwise_supported(model: nn.Module) -> bool:
    """True when every trainable parameter belongs directly to a layer the layerwise backend handles."""
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if own and _layerwise_rule(m) is None:
            return False
    return True
