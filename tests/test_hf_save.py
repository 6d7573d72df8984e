"""A run with ``model.name = "hf"`` writes ``save_pretrained`` directories (dptrain.models.hf_save) beside model.pt:
``hf_model/`` (the adapters merged) and, for peft, ``hf_adapter/``, each with the run's tokenizer, loadable with
transformers / peft alone and equal to the trained model; only released quantities in them; named in the summary and
the printed report."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_cli import GPT2, WORDS, small_shipped_config, tokenizer_dir, write_jsonl  # noqa: E402

from dptrain.cli import main  # noqa: E402
from dptrain.models.builders import build_model  # noqa: E402
from dptrain.runs.report import format_report  # noqa: E402

#: what a save_pretrained directory may hold: the weights, the model's config, the tokenizer, peft's model card
ALLOWED = {"config.json", "generation_config.json", "model.safetensors", "adapter_config.json",
           "adapter_model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "vocab.json", "merges.txt"}


def trained_model(run):
    """The trained model as dptrain built it, from model.pt (what the directories must equal)."""
    saved = torch.load(run / "model.pt", weights_only=False)
    model = build_model("hf", tuple(saved["input_shape"]), saved["num_classes"], **saved["options"])
    model.load_state_dict(saved["state_dict"])
    return model.eval()


def only_released(directory):
    names = {p.name for p in directory.rglob("*") if p.is_file()}
    assert names <= ALLOWED, names - ALLOWED


def test_a_lora_language_model_run_writes_directories_loadable_alone(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", "--no-progress", "--json", "--config", small_shipped_config(tmp_path), "--out", str(run)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["hf_model"] == str(run / "hf_model") and summary["hf_adapter"] == str(run / "hf_adapter")
    assert "hugging face" in format_report(summary) and str(run / "hf_adapter") in format_report(summary)
    for d in ("hf_model", "hf_adapter"):
        only_released(run / d)
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "hf_model")
    ids = tokenizer(["up nov dec jan", "down mar feb"], padding=True, return_tensors="pt")["input_ids"]
    assert (ids != tokenizer.unk_token_id).all()  # (the run's own word-level tokenizer, not a default one)
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "hf_model").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters()) and merged.config.use_cache
    adapter = peft.AutoPeftModelForCausalLM.from_pretrained(run / "hf_adapter").eval()
    assert transformers.AutoTokenizer.from_pretrained(run / "hf_adapter").get_vocab() == tokenizer.get_vocab()
    with torch.no_grad():
        want = trained_model(run)(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapter(input_ids=ids).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("lora", [None, {"r": 2, "target_modules": ["c_attn"]}])
def test_a_classifier_from_a_local_directory(tmp_path, capsys, lora):
    """A base read from a directory: the adapter names it (no copy of the base); the classification head peft trains
    (modules_to_save) is merged too. Full fine-tuning writes hf_model only."""
    config = transformers.GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"}, num_labels=2,
                                     pad_token_id=0)
    transformers.GPT2ForSequenceClassification(config).save_pretrained(tmp_path / "base")
    tokenizer_dir(tmp_path / "base")
    words = WORDS[3:-1]
    write_jsonl(tmp_path / "train.jsonl",
                [{"text": " ".join(words[(i + k) % len(words)] for k in range(3)), "label": i % 2} for i in range(32)])
    write_jsonl(tmp_path / "test.jsonl", [{"text": " ".join(words[:3]), "label": 1}])
    options = f'path = "{tmp_path / "base"}", task = "sequence_classification"'
    options += "" if lora is None else ', lora = { r = 2, target_modules = ["c_attn"] }'
    (tmp_path / "c.toml").write_text(
        f'[data]\nname = "text_files"\npath = "{tmp_path / "train.jsonl"}"\n'
        f'options = {{ task = "sequence_classification", num_classes = 2, max_length = 6, test_path = '
        f'"{tmp_path / "test.jsonl"}" }}\n[model]\nname = "hf"\noptions = {{ {options} }}\n'
        '[privacy]\nnoise_multiplier = 1.0\naccountant = "rdp"\n[training]\nsteps = 2\nbatch_size = 8\n'
        'learning_rate = 0.5\n'
    )
    run = tmp_path / "run"
    code = main(["train", "--no-progress", "--json", "--config", str(tmp_path / "c.toml"), "--out", str(run)])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert ("hf_adapter" in summary) == (lora is not None) and (run / "hf_adapter").exists() == (lora is not None)
    only_released(run / "hf_model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(run / "hf_model")
    batch = tokenizer(["red cat sees", "a dog"], padding="max_length", max_length=6, return_tensors="pt")
    want = trained_model(run)(**batch).logits.detach()
    merged = transformers.AutoModelForSequenceClassification.from_pretrained(run / "hf_model").eval()
    torch.testing.assert_close(merged(**batch).logits.detach(), want, rtol=1e-5, atol=1e-5)
    if lora is not None:
        only_released(run / "hf_adapter")
        adapter_config = json.loads((run / "hf_adapter" / "adapter_config.json").read_text())
        assert adapter_config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
        assert not (run / "hf_adapter" / "base").exists()
        adapter = peft.AutoPeftModelForSequenceClassification.from_pretrained(run / "hf_adapter").eval()
        torch.testing.assert_close(adapter(**batch).logits.detach(), want, rtol=0, atol=0)
        base = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base").eval()
        assert not torch.allclose(base(**batch).logits, want)  # (the head and the adapters were trained)


@pytest.mark.parametrize("targets", [["c_attn", "wte"], ["c_attn", "lm_head"], ["q_proj", "embed_tokens"]])
def test_an_adapter_on_a_tied_weight_merges_into_the_model_it_trained(tmp_path, targets):
    """GPT-2's token embedding is its output layer's weight (tied), as BART's encoder and decoder embeddings are its
    ``shared`` one. peft's merge writes an adapter's delta into the base weight in place, so a LoRA on the embedding
    (or on the output layer) moved both uses: ``hf_model/`` reloaded with from_pretrained alone computed logits 23
    (5.8) away from the trained model's, silently. Each use now gets its own copy of a tied weight an adapter wraps
    before merging (the config no longer ties them), and the directory computes what was trained."""
    from hf_zoo import MORE, batch, gpt2, moved

    from dptrain.models.hf_save import save_model_directory

    torch.manual_seed(0)
    bart = targets[0] == "q_proj"
    task = "SEQ_2_SEQ_LM" if bart else "CAUSAL_LM"
    fan = {} if bart else {"fan_in_fan_out": True}
    model = peft.get_peft_model(MORE["bart"][0]() if bart else gpt2(),
                                peft.LoraConfig(r=2, target_modules=targets, task_type=task, **fan))
    model = moved(model).eval()
    x, _, _ = batch("t5" if bart else "gpt2", dtype=torch.float32)
    save_model_directory(model, tmp_path / "hf_model")
    auto = transformers.AutoModelForSeq2SeqLM if bart else transformers.AutoModelForCausalLM
    reloaded = auto.from_pretrained(tmp_path / "hf_model").eval()
    with torch.no_grad():
        trained, merged = model(**x).logits, reloaded(**x).logits
    assert float((trained - merged).abs().max()) <= 1e-5 * float(trained.abs().max())
