"""Models that can be trained with per-example differential privacy, and checks for ones that cannot.

DP-SGD clips each example's gradient separately, so a model's output for one example must not depend on
the other examples in its batch. BatchNorm breaks this (it normalizes with batch statistics), so every
model built here uses only Linear, Conv2d, GroupNorm, activations, pooling and Flatten.

Models (``build_model(name, input_shape, num_classes, **options)``):

* ``logistic``: Flatten + Linear. No options. Any input shape.
* ``mlp``: Flatten + hidden Linear layers with an activation. Options ``hidden`` (list of widths,
  default ``[128]``) and ``activation`` (``"tanh"`` default, or ``"relu"``). Any input shape.
* ``cnn28``: the small CNN for 28x28 images of Tramer & Boneh 2021. Option ``activation``.
  Input shape ``(C, 28, 28)``.
* ``cnn32``: the CIFAR-10 CNN of Tramer & Boneh 2021 / Papernot et al. 2021. Option ``activation``.
  Input shape ``(C, 32, 32)``.
* ``resnet20``: the CIFAR ResNet-20 of He et al. 2016 with GroupNorm in place of BatchNorm. Option
  ``groups`` (default 16). Input shape ``(C, H, W)``.
* ``hf``: a Hugging Face transformers model (optionally with peft LoRA) from a local directory or a config table;
  options ``path``, ``config``, ``task``, ``lora`` (:mod:`dptrain.models.huggingface`, imported only when one is built).
  Input shape ``(length,)`` of token ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.errors import ModelError

__all__ = [
    "BATCH_MIXING_TYPES",
    "MODEL_NAMES",
    "build_model",
    "check_private_compatible",
    "find_self_writing_layer",
    "convert_batchnorm_to_groupnorm",
    "count_parameters",
    "find_batch_mixing_layers",
]

MODEL_NAMES = (
    "logistic",
    "mlp",
    "cnn28",
    "cnn32",
    "resnet20",
    "tiny_transformer",
    "scatternet_linear",
    "scatternet_cnn",
    "hf",
)

# Layers whose output for one example depends on the other examples of the batch (in training mode they
# normalize with batch statistics). The private base class also catches user subclasses of BatchNorm.
# InstanceNorm, LayerNorm and GroupNorm normalize each example on its own and are not listed.
BATCH_MIXING_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.SyncBatchNorm,
    nn.modules.batchnorm._BatchNorm,
)

ACTIVATIONS = ("tanh", "relu")

# Accepted options of each model and their defaults.
_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "logistic": {},
    "mlp": {"hidden": [128], "activation": "tanh"},
    "cnn28": {"activation": "tanh"},
    "cnn32": {"activation": "tanh"},
    "resnet20": {"groups": 16},
    "tiny_transformer": {"vocab": 32, "d_model": 32, "heads": 2, "layers": 2, "lora_rank": 0},
    "scatternet_linear": {},
    "scatternet_cnn": {},
    "hf": {"path": None, "config": None, "task": None, "lora": None},
}

# ResNet-20 stage widths; ``groups`` must divide each of them.
_RESNET20_WIDTHS = (16, 32, 64)


# --------------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_input_shape(name: str, input_shape: Any) -> tuple[int, ...]:
    if not isinstance(input_shape, Sequence) or isinstance(input_shape, str) or len(input_shape) == 0:
        raise ModelError(
            f"model {name!r}: input_shape must be a non-empty tuple of positive ints (one example's shape, "
            f"without the batch dimension), got {input_shape!r}"
        )
    if not all(_is_int(d) and d > 0 for d in input_shape):
        raise ModelError(
            f"model {name!r}: input_shape must hold positive ints (one example's shape, without the batch "
            f"dimension), got {tuple(input_shape)!r}"
        )
    return tuple(int(d) for d in input_shape)


def _check_num_classes(name: str, num_classes: Any) -> int:
    if not _is_int(num_classes) or num_classes < 1:
        raise ModelError(f"model {name!r}: num_classes must be a positive int, got {num_classes!r}")
    return int(num_classes)


def _resolve_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    accepted = _DEFAULT_OPTIONS[name]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        accepted_text = ", ".join(repr(k) for k in accepted) if accepted else "none"
        raise ModelError(
            f"unknown option {', '.join(repr(k) for k in unknown)} for model {name!r}; "
            f"accepted options: {accepted_text}"
        )
    resolved = dict(accepted)
    resolved.update(options)
    return resolved


def _activation(name: str, activation: Any) -> type[nn.Module]:
    if activation == "tanh":
        return nn.Tanh
    if activation == "relu":
        return nn.ReLU
    raise ModelError(
        f"model {name!r}: unknown activation {activation!r}; accepted: {', '.join(map(repr, ACTIVATIONS))}"
    )


def _check_image_shape(name: str, shape: tuple[int, ...], height: int | None, width: int | None) -> None:
    if height is None:
        expected = "(C, H, W), e.g. (3, 32, 32)"
        fits = len(shape) == 3
    else:
        expected = f"(C, {height}, {width}) ({height}x{width} images with C channels)"
        fits = len(shape) == 3 and shape[1:] == (height, width)
    if not fits:
        raise ModelError(f"model {name!r} expects input shape {expected}, got {shape!r}")


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _logistic(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))


def _mlp(shape: tuple[int, ...], num_classes: int, hidden: Any, activation: Any) -> nn.Module:
    act = _activation("mlp", activation)
    if (
        not isinstance(hidden, Sequence)
        or isinstance(hidden, str)
        or not all(_is_int(h) and h > 0 for h in hidden)
    ):
        raise ModelError(f"model 'mlp': option 'hidden' must be a list of positive ints, got {hidden!r}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), act()]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _cnn28(shape: tuple[int, ...], num_classes: int, activation: Any) -> nn.Module:
    """Tramer & Boneh 2021, CNN for MNIST-like 28x28 images.

    Spatial sizes: 28 -conv8/s2/p3-> 14 -maxpool2/s1-> 13 -conv4/s2-> 5 -maxpool2/s1-> 4.
    """
    _check_image_shape("cnn28", shape, 28, 28)
    act = _activation("cnn28", activation)
    return nn.Sequential(
        nn.Conv2d(shape[0], 16, 8, stride=2, padding=3),
        act(),
        nn.MaxPool2d(2, stride=1),
        nn.Conv2d(16, 32, 4, stride=2),
        act(),
        nn.MaxPool2d(2, stride=1),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 32),
        act(),
        nn.Linear(32, num_classes),
    )


def _cnn32(shape: tuple[int, ...], num_classes: int, activation: Any) -> nn.Module:
    """Tramer & Boneh 2021 / Papernot et al. 2021 (tempered sigmoids), CNN for CIFAR-10 32x32 images.

    Three blocks of two 3x3 convolutions and a 2x2 max pool halve the image: 32 -> 16 -> 8 -> 4.
    """
    _check_image_shape("cnn32", shape, 32, 32)
    act = _activation("cnn32", activation)
    layers: list[nn.Module] = []
    channels = shape[0]
    for width in (32, 64, 128):
        layers += [
            nn.Conv2d(channels, width, 3, padding=1),
            act(),
            nn.Conv2d(width, width, 3, padding=1),
            act(),
            nn.MaxPool2d(2, stride=2),
        ]
        channels = width
    layers += [nn.Flatten(), nn.Linear(128 * 4 * 4, 128), act(), nn.Linear(128, num_classes)]
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    """Two 3x3 conv + GroupNorm layers with an identity shortcut (He et al. 2016, option A).

    When the block halves the resolution and widens the channels, the shortcut takes every other pixel
    and appends zero channels: it has no parameters, as in the paper's CIFAR ResNets.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.relu = nn.ReLU()
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016, section 4.2) with GroupNorm instead of BatchNorm.

    A 3x3 conv to 16 channels, then three stages of three basic blocks with widths 16/32/64 (the first
    block of stages 2 and 3 has stride 2), global average pooling and a Linear layer: 19 conv layers + 1
    Linear. Shortcuts are option A (parameter-free), so with 10 classes it has 269,722 parameters.
    """

    def __init__(self, in_channels: int, num_classes: int, groups: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), nn.GroupNorm(groups, 16), nn.ReLU()
        )
        stages: list[nn.Module] = []
        channels = 16
        for i, width in enumerate(_RESNET20_WIDTHS):
            blocks = [_BasicBlock(channels, width, 1 if i == 0 else 2, groups)]
            blocks += [_BasicBlock(width, width, 1, groups) for _ in range(2)]
            stages.append(nn.Sequential(*blocks))
            channels = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(self.pool(self.stages(self.stem(x)))))


def _resnet20(shape: tuple[int, ...], num_classes: int, groups: Any) -> nn.Module:
    _check_image_shape("resnet20", shape, None, None)
    accepted = [g for g in range(1, _RESNET20_WIDTHS[0] + 1) if all(w % g == 0 for w in _RESNET20_WIDTHS)]
    if not _is_int(groups) or groups not in accepted:
        raise ModelError(
            f"model 'resnet20': option 'groups' must divide the channel counts 16, 32 and 64 "
            f"(one of {', '.join(map(str, accepted))}), got {groups!r}"
        )
    return ResNet20(shape[0], num_classes, groups=groups)


class _Attention(nn.Module):
    """Multi-head self-attention from four Linear layers (query, key, value, out): each example attends over its
    own positions only, and every parameter has a layerwise per-example rule."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        if d % heads:
            raise ModelError(f"model 'tiny_transformer': d_model {d} must be a multiple of heads {heads}")
        self.heads = heads
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))

    def forward(self, h):
        b, t, d = h.shape
        split = lambda z: z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = nn.functional.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)))
        return self.out(att.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), _Attention(d, heads)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        h = h + self.attn(self.norm1(h))
        return h + self.fc2(nn.functional.gelu(self.fc1(self.norm2(h))))


class TinyTransformer(nn.Module):
    """A small pre-norm transformer encoder for token ids [B, T]: token and position embeddings, ``layers`` blocks,
    mean pooling, a linear head. Built locally (no weights downloaded)."""

    def __init__(self, length: int, num_classes: int, vocab: int, d_model: int, heads: int, layers: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, d_model), nn.Embedding(length, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, num_classes)
        self.register_buffer("steps", torch.arange(length), persistent=False)

    def forward(self, ids):
        h = self.tokens(ids) + self.positions(self.steps[: ids.shape[1]].expand(ids.shape[0], -1))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))


def _tiny_transformer(shape, num_classes, vocab, d_model, heads, layers, lora_rank) -> nn.Module:
    if len(shape) != 1:
        raise ModelError(f"model 'tiny_transformer' takes token ids of shape (length,), got {shape}")
    for key, value, low in (("vocab", vocab, 2), ("d_model", d_model, 1), ("heads", heads, 1), ("layers", layers, 1),
                            ("lora_rank", lora_rank, 0)):
        if not _is_int(value) or value < low:
            raise ModelError(f"model 'tiny_transformer': {key} must be an integer >= {low}, got {value!r}")
    model = TinyTransformer(shape[0], num_classes, vocab, d_model, heads, layers)
    if lora_rank:  # frozen base, adapters on the query and value projections, trainable head
        from dptrain.models.lora import add_lora

        add_lora(model, lora_rank, targets=("query", "value"), train=("head",))
    return model


def _hf(shape, num_classes, **options) -> nn.Module:
    from dptrain.models.huggingface import build_hf_model  # (transformers is imported only for such a model)

    return build_hf_model(shape, num_classes, **options)


def _scattering_input(name: str, shape: tuple[int, ...], fixed: tuple[int, ...] | None = None) -> None:
    if len(shape) != 3 or shape[0] % 27 or (fixed is not None and shape != fixed):
        wanted = f"{fixed}" if fixed is not None else "(K, H, W) with K a multiple of 27"
        raise ModelError(
            f"model {name!r} takes ScatterNet features {wanted} (set data.features = \"scatternet\"), got examples "
            f"of shape {shape}"
        )


def _scatternet_linear(shape: tuple[int, ...], classes: int) -> nn.Module:
    from dptrain.models.scatternet import scatter_linear

    _scattering_input("scatternet_linear", shape)
    return scatter_linear(shape, classes)


def _scatternet_cnn(shape: tuple[int, ...], classes: int) -> nn.Module:
    from dptrain.models.scatternet import scatter_cnn_fmnist

    _scattering_input("scatternet_cnn", shape, (81, 7, 7))
    return scatter_cnn_fmnist(classes)


_BUILDERS = {
    "logistic": _logistic,
    "mlp": _mlp,
    "cnn28": _cnn28,
    "cnn32": _cnn32,
    "resnet20": _resnet20,
    "tiny_transformer": _tiny_transformer,
    "scatternet_linear": _scatternet_linear,
    "scatternet_cnn": _scatternet_cnn,
    "hf": _hf,
}


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options: Any) -> nn.Module:
    """Build the model ``name`` (one of ``MODEL_NAMES``) for examples of shape ``input_shape``.

    ``input_shape`` excludes the batch dimension (e.g. ``(1, 28, 28)``); the model maps a batch of shape
    ``(B, *input_shape)`` to logits of shape ``(B, num_classes)``. Raises ``ModelError`` for an unknown
    name or option, a bad option value, or an input shape the model cannot take.
    """
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ModelError(f"unknown model {name!r}; accepted: {', '.join(MODEL_NAMES)}")
    shape = _check_input_shape(name, input_shape)
    classes = _check_num_classes(name, num_classes)
    resolved = _resolve_options(name, options)
    return _BUILDERS[name](shape, classes, **resolved)


# --------------------------------------------------------------------------------------------------
# Privacy compatibility checks
# --------------------------------------------------------------------------------------------------


def find_batch_mixing_layers(model: nn.Module) -> list[str]:
    """Qualified names (as in ``model.named_modules()``) of the submodules that mix examples in a batch.

    The model itself, if it is such a layer, is reported as ``""``.
    """
    return [name for name, module in model.named_modules() if isinstance(module, BATCH_MIXING_TYPES)]


#: The way out for a layer whose spectral norm keeps power-iteration state: the same normalization without state.
_STATELESS_SPECTRAL = (
    "normalize by the exact norm instead, without state (a parametrization of your own returning "
    "W / torch.linalg.matrix_norm(W.flatten(1), 2), registered with torch.nn.utils.parametrize."
    "register_parametrization: differentiated exactly per example)"
)


def find_self_writing_layer(model: nn.Module) -> str | None:
    """The refusal of the first stock layer whose training-mode forward writes the model's state by design, naming it
    and the way out, or None. The model checks refuse any such write when they see one (a release: it is saved with
    the model unnoised); these are refused by kind before any example is read, whatever the values (a write that
    happens to put back what was there passes a probe, and the next step's does not):

    - ``Embedding`` / ``EmbeddingBag`` with ``max_norm``: renormalizes, in place, the rows of its weight that the
      batch looks up (which rows, and by how much, are the batch's ids);
    - ``torch.nn.utils.parametrizations.spectral_norm`` in training mode: one power iteration per forward pass
      written to its ``_u``/``_v`` buffers (as many as the step's chunks, whose number follows the secret batch size);
    - torch's deprecated hooks ``torch.nn.utils.weight_norm`` / ``spectral_norm``: set ``weight`` as a plain
      attribute on every call (and spectral_norm its ``weight_u``)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for name, m in model.named_modules():
        where = _describe(model, name)
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.max_norm is not None:
            return (
                f"model layer {where} has max_norm={m.max_norm:g}: its forward renormalizes, in place, the rows of its "
                "weight that the batch looks up (which rows is the batch's ids, released unnoised with the weight); "
                "pass max_norm=None (to bound the rows, renormalize every row after each optimizer step: "
                "post-processing of the private update)"
            )
        if type(m).__name__ == "_SpectralNorm" and m.training:
            return (
                f"model layer {name!r} (torch.nn.utils.parametrizations.spectral_norm) writes its power-iteration "
                "buffers _u and _v on every training-mode forward pass, as many times as a step has chunks (a count "
                f"that follows the secret batch size), released unnoised with the model; {_STATELESS_SPECTRAL}, or "
                "use torch.nn.utils.parametrizations.weight_norm"
            )
        hooks = list(m._forward_pre_hooks.values())
        if any(isinstance(h, WeightNorm) for h in hooks):
            return (
                f"model layer {where} uses the deprecated torch.nn.utils.weight_norm, whose forward pre-hook sets its "
                "weight as a new plain attribute on every call (state the model checks cannot tell from a release); "
                "use torch.nn.utils.parametrizations.weight_norm (the same function, differentiated exactly per example)"
            )
        if any(isinstance(h, SpectralNorm) for h in hooks):
            return (
                f"model layer {where} uses the deprecated torch.nn.utils.spectral_norm, whose forward pre-hook sets its "
                "weight as a plain attribute and writes its power-iteration buffer weight_u on every training-mode call "
                f"(as many as a step has chunks: a count that follows the secret batch size); {_STATELESS_SPECTRAL}"
            )
    return None


def _describe(model: nn.Module, name: str) -> str:
    kind = type(model.get_submodule(name)).__name__
    return f"'{name}' ({kind})" if name else f"the model itself ({kind})"


def check_private_compatible(model: nn.Module) -> None:
    """Raise ``ModelError`` if ``model`` cannot be trained with per-example privacy.

    Rejected: TorchScript modules (their forward passes cannot be recorded or differentiated per example), BatchNorm-family
    layers (they mix examples across a batch), and normalization layers that
    track running statistics of the data (e.g. ``InstanceNorm2d(track_running_stats=True)``): those
    buffers are computed from the private data without noise and would be released with the model.
    """
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):  # (frozen too: the checks hook every module's forward)
            where = f"model layer {name!r}" if name else "the model"
            raise ModelError(
                f"{where} is a TorchScript module ({type(module).__name__}, from torch.jit.script or torch.jit.trace): "
                "per-example gradients read the eager modules' forward passes (hooks and torch.func), which TorchScript "
                "hides; pass the module before scripting it (script or trace the trained model afterwards)"
            )
    writer = find_self_writing_layer(model)
    if writer is not None:
        raise ModelError(writer)
    names = find_batch_mixing_layers(model)
    if names:
        shown = ", ".join(_describe(model, n) for n in names[:3])
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        if len(names) == 1:
            subject, verb = f"model layer {shown}", "mixes"
        else:
            subject, verb = f"model layers {shown}{more}", "mix"
        raise ModelError(
            f"{subject} {verb} examples across a batch, which breaks per-example privacy; use GroupNorm "
            f"instead (dptrain.models.builders.convert_batchnorm_to_groupnorm(model) converts it)"
        )
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            raise ModelError(
                f"model layer {_describe(model, name)} tracks running statistics of the training data, "
                f"which are released without noise; use track_running_stats=False or GroupNorm instead"
            )


def _group_norm_like(bn: nn.modules.batchnorm._BatchNorm, num_groups: int) -> nn.GroupNorm:
    if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
        raise ModelError(
            f"cannot convert {type(bn).__name__} before its number of features is known; "
            f"run one forward pass first or use BatchNorm with num_features"
        )
    channels = bn.num_features
    reference = bn.weight if bn.affine else bn.running_mean
    factory = {} if reference is None else {"device": reference.device, "dtype": reference.dtype}
    gn = nn.GroupNorm(math.gcd(num_groups, channels), channels, eps=bn.eps, affine=bn.affine, **factory)
    if bn.affine:
        with torch.no_grad():
            gn.weight.copy_(bn.weight)
            gn.bias.copy_(bn.bias)
        gn.weight.requires_grad_(bn.weight.requires_grad)
        gn.bias.requires_grad_(bn.bias.requires_grad)
    gn.train(bn.training)
    return gn


def convert_batchnorm_to_groupnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm-family layer of ``model`` by a GroupNorm, in place, and return the model.

    Each ``BatchNorm*(C)`` becomes ``GroupNorm(gcd(num_groups, C), C, affine=...)`` (so the group count
    always divides C) with the same eps, affine weight and bias. Running statistics are dropped: GroupNorm
    normalizes each example on its own, in training and evaluation alike. If ``model`` is itself a
    BatchNorm layer, the new GroupNorm is returned (it cannot be replaced in place).
    """
    if not _is_int(num_groups) or num_groups < 1:
        raise ModelError(f"num_groups must be a positive int, got {num_groups!r}")
    replaced: dict[int, nn.Module] = {}  # a layer shared by several parents becomes one shared GroupNorm

    def convert(module: nn.Module) -> nn.Module:
        if isinstance(module, BATCH_MIXING_TYPES):
            if id(module) not in replaced:
                replaced[id(module)] = _group_norm_like(module, num_groups)
            return replaced[id(module)]
        # Not named_children(): it skips a child already seen, which would leave a shared layer's second
        # occurrence unconverted.
        for child_name, child in list(module._modules.items()):
            if child is None:
                continue
            new = convert(child)
            if new is not child:
                setattr(module, child_name, new)
        return module

    return convert(model)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of scalar parameters of ``model`` (each shared parameter counted once)."""
    total = 0
    for name, p in model.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ModelError(
                f"cannot count parameters: '{name}' is not initialized yet (lazy layer); "
                f"run one forward pass first"
            )
        if p.requires_grad or not trainable_only:
            total += p.numel()
    return total
