"""Issue 30's matrix: stock Hugging Face models (GPT-2, OPT, Llama, Mistral, Qwen2, BERT, RoBERTa, DistilBERT, T5,
ViT, and two that stress other layers: ConvNeXt's depthwise convolutions and own LayerNorm, Swin's windows flattened
into rows and its learned relative-position bias) x full fine-tuning and peft adapters (LoRA, DoRA, IA3, LoHa, VeRA,
prefix and prompt tuning) x gradient checkpointing (off, non-reentrant, reentrant). Each cell is built as a user
builds it and made private with ``make_private``; the per-example gradients of the backend it settles on must match,
parameter by parameter, a backward pass on each example alone and unpadded, computed here (float64, where float32
rounding would blur tiny gradients such as attention keys'), to 1e-4 of that parameter's own gradient (plus 1e-9 of
the example's whole gradient, for parameters whose gradient is zero up to rounding, such as a key's bias). A cell
refused must be refused in one line (a DPTrainError) that names the way out.

Cells for which peft has no adapter (LoHa on GPT-2's Conv1D, prefix tuning of encoders and vision models, prompt
tuning of vision models) are not in the matrix: peft refuses them itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_zoo import MODELS, batch, build  # noqa: E402

from dptrain.engine.api import make_private  # noqa: E402
from dptrain.errors import DPTrainError  # noqa: E402

ADAPTERS = ("full", "lora", "dora", "ia3", "loha", "vera", "prefix", "prompt")
#: Cells whose per-example gradients need the whole model differentiated example by example (torch.func, or the loop
#: backend where transformers' masking code defeats vmap): exact, and slower. T5's and Swin's relative-position biases
#: are computed once for the whole batch, so their gradient sums every example's; so is peft's prompt, computed once
#: and repeated to the batch.
WHOLE_MODEL = {("t5", "full"), ("swin", "full")} | {(m, "prompt") for m in MODELS}


def applicable(model: str, adapter: str) -> bool:
    kind = MODELS[model][1]
    if adapter == "prefix":
        return kind in ("causal", "seq2seq")
    if adapter == "prompt":
        return kind != "image"
    return not (adapter == "loha" and model == "gpt2")


def _cells():
    cells = []
    for model in (m for m in MODELS if m != "mixtral"):
        for adapter in ADAPTERS:
            if applicable(model, adapter):
                cells.append((model, adapter, "off"))
    for model in ("gpt2", "llama", "bert"):
        for adapter in ("full", "lora"):
            cells += [(model, adapter, "non_reentrant"), (model, adapter, "reentrant")]
    return [pytest.param(*c, id="-".join(c)) for c in cells]


def per_example_loss(kind: str, virtual: int = 0):
    """The test's own loss, one per example: cross-entropy of the class, or the mean over each example's labelled
    tokens (the next token's for a causal LM, the prompt's virtual tokens labelled -100)."""

    def loss(outputs, labels):
        logits = outputs.logits
        if kind == "causal":  # (peft's convention: the last virtual token predicts the first real one)
            labels = torch.cat([labels.new_full((len(labels), virtual), -100), labels], 1)
            logits, labels = logits[:, :-1], labels[:, 1:]
        if logits.dim() == 3:
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            return per_token.sum(1) / (labels != -100).sum(1).clamp_min(1)
        return F.cross_entropy(logits, labels, reduction="none")

    return loss


def single_example_gradients(model, loss, one, params: dict, n: int) -> list[dict]:
    out = []
    for i in range(n):
        xi, yi = one(i)
        grads = torch.autograd.grad(loss(model(**xi), yi).sum(), list(params.values()), allow_unused=True)
        out.append({k: torch.zeros_like(p) if g is None else g for (k, p), g in zip(params.items(), grads, strict=True)})
    return out


def assert_exact(got: dict, expected: list[dict], rtol: float = 1e-4) -> None:
    """Each example's gradient of each parameter within rtol of that parameter's own single-example gradient (plus
    1e-9 of the example's whole gradient: rounding of a gradient that is zero in exact arithmetic)."""
    unused = [name for name in expected[0] if all(float(ref[name].abs().max()) == 0 for ref in expected)]
    assert not unused, f"parameters with no gradient to check: {unused}"
    for i, ref in enumerate(expected):
        whole = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())))
        assert whole > 0
        for name, r in ref.items():
            err = float((got[name][i].double() - r.double()).norm())
            assert err <= rtol * float(r.double().norm()) + 1e-9 * whole, (name, i, err, float(r.norm()))


def private(model, x, y, loss, chunk: int = 4):
    params = [p for p in model.parameters() if p.requires_grad]
    return make_private(model, torch.optim.SGD(params, lr=0.1), (x, y), noise_multiplier=1.0, batch_size=2,
                        max_physical_batch_size=chunk, loss_fn=loss)


@pytest.mark.parametrize("model_name,adapter,checkpointing", _cells())
def test_per_example_gradients_are_exact_or_refused_in_one_line(model_name, adapter, checkpointing):
    model = build(model_name, adapter, checkpointing)
    kind = MODELS[model_name][1]
    virtual = 2 if adapter == "prompt" and kind == "causal" else 0
    loss = per_example_loss(kind, virtual)
    x, y, one = batch(model_name)
    try:
        trainer = private(model, x, y, loss)
    except DPTrainError as e:  # a refusal: one line, naming what to do
        assert checkpointing == "reentrant" and "\n" not in str(e) and "use_reentrant=False" in str(e), str(e)
        return
    assert checkpointing != "reentrant", "reentrant checkpointing must be refused"
    model.train()
    grads, _ = trainer.grad_sampler(x, y)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one, params, len(y)))
    backend = trainer.grad_sampler.name
    if adapter in ("full", "lora", "dora", "loha", "prefix") and (model_name, adapter) not in WHOLE_MODEL:
        assert backend.startswith("layerwise"), backend  # the fast backend, not the loop


def test_a_mixture_of_experts_router_gradient_is_not_counted_twice():
    """Mixtral's router returns its logits and the top-k weights computed from them; differentiated on its own by
    torch.func, the gradient reaching the weights was also counted through the logits (twice the router's per-example
    gradient, which the model-wide gradient check did not see). In float32: transformers' fused experts run no
    float64."""
    model = build("mixtral", dtype=torch.float32)
    loss = per_example_loss("causal")
    x, y, one = batch("mixtral", dtype=torch.float32)
    trainer = private(model, x, y, loss)
    model.train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grads, _ = trainer.grad_sampler(x, y)
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one, params, len(y)), rtol=1e-4)
    assert trainer.grad_sampler.name == "layerwise+func"


def test_t5_with_the_sequence_as_long_as_the_chunk_is_exact_not_refused():
    """With T == the chunk size, T5's [T, T] relative-position buckets looked like a batch: the model was refused for
    "mixing examples" through relative_attention_bias (and with T != the chunk, a raw RuntimeError)."""
    from hf_zoo import LENGTH

    model = build("t5")
    loss = per_example_loss("seq2seq")
    x, y, one = batch("t5", n=LENGTH)
    trainer = private(model, x, y, loss, chunk=LENGTH)
    model.train()
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grads, _ = trainer.grad_sampler(x, y)
    assert_exact(grads.materialize(), single_example_gradients(model, loss, one, params, len(y)))
