"""Low-rank adapters (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") in plain torch.

``add_lora(model, rank, targets)`` replaces every ``nn.Linear`` whose attribute name is in ``targets`` by a
:class:`LoRALinear`: the original layer, frozen, plus ``scale * B(A(x))`` with A (in -> rank) and B (rank -> out)
trainable ``nn.Linear`` layers, B starting at zero (the model's function is unchanged at the start). Every other
parameter is frozen except those whose name starts with one of ``train`` (e.g. the classification head).

Because A and B are ordinary Linear layers, dptrain's layerwise per-example gradients apply to them (no torch.func
fallback), and frozen weights take no part in clipping or noise: the engine clips and noises only trainable
parameters, and the optimizer never sees the frozen ones. (The silent corruption reported against Opacus with PEFT,
frozen weights moving under DP training, is what tests/test_transformer.py checks does not happen here.)
"""

from __future__ import annotations

from torch import nn

from dptrain.errors import ModelError


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None):
        super().__init__()
        if not (isinstance(rank, int) and rank >= 1):
            raise ModelError(f"LoRA rank must be an integer >= 1, got {rank!r}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, dtype=dtype, device=device)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, dtype=dtype, device=device)
        nn.init.zeros_(self.lora_b.weight)
        self.scale = (alpha if alpha is not None else 2 * rank) / rank

    def forward(self, x):
        return self.base(x) + self.scale * self.lora_b(self.lora_a(x))


def add_lora(
    model: nn.Module, rank: int, targets: tuple[str, ...] = ("query", "value"), train: tuple[str, ...] = ("head",)
) -> list[str]:
    """Freeze ``model`` except the parameters under ``train``, and put adapters on the Linear layers named in
    ``targets``; returns the names of the adapted layers (a ModelError when none matches)."""
    for name, p in model.named_parameters():
        p.requires_grad_(any(name == t or name.startswith(t + ".") for t in train))
    adapted = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if child_name in targets and type(child) is nn.Linear:
                setattr(parent, child_name, LoRALinear(child, rank))
                adapted.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    if not adapted:
        raise ModelError(f"no nn.Linear named {', '.join(targets)} to adapt with LoRA")
    return adapted


__all__ = ["LoRALinear", "add_lora"]
