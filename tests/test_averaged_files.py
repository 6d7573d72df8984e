"""The weight average's files (training.ema; dptrain.runs.averaged): the job's own writer writes the average under the
average's names (model_ema.pt, hf_model_ema/, hf_adapter_ema/), never over a file of the last iterate, whatever
methods of the run directory the writer uses; a Hugging Face run's save_pretrained directories included."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dptrain.engine.weight_averaging import WeightAverage
from dptrain.runs.averaged import save_averaged
from dptrain.runs.rundir import RunDirectory


def _job(model, writer, decay=0.5):
    """A job whose trainer holds an average that differs from the model (two iterates, the second released last)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    average = WeightAverage(params, decay)
    average.update(1)
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    average.update(2)
    return SimpleNamespace(trainer=SimpleNamespace(weight_average=average), save_model=writer)


def _weights(path):
    return torch.load(path, weights_only=True)


def test_every_file_a_writer_names_gets_the_averages_name(tmp_path):
    """A writer that uses every way of naming a file (save_model, save_directory, a path joined with '/', the json,
    text and bytes writers): the last iterate's files keep the last iterate, the average's hold the average."""
    model = nn.Linear(3, 2)

    def writer(rd):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rd.save_model({"state_dict": state})
        rd.save_directory("hf_model", lambda d: torch.save(state, d / "w.pt"))
        torch.save(state, rd / "extra.pt")
        rd.write_json("notes.json", {"bias": model.bias.tolist()})
        rd.write_text("notes.txt", str(model.bias.tolist()))
        rd.write_bytes("notes.bin", model.bias.detach().numpy().tobytes())
        return {"test_accuracy": 0.5, "hf_model": str(rd / "hf_model"), "preprocessing": {"kind": "the same for both"}}

    rd = RunDirectory(tmp_path)
    job = _job(model, writer)
    last = {k: v.clone() for k, v in model.state_dict().items()}
    writer(rd)  # the last iterate, as the run writes it first
    entries = save_averaged(job, rd)
    average = job.trainer.weight_average.averages
    assert not torch.equal(average["weight"], last["weight"])
    assert torch.equal(_weights(tmp_path / "model.pt")["state_dict"]["weight"], last["weight"])
    assert torch.equal(_weights(tmp_path / "model_ema.pt")["state_dict"]["weight"], average["weight"])
    for name, ema in (("hf_model/w.pt", "hf_model_ema/w.pt"), ("extra.pt", "extra_ema.pt")):
        assert torch.equal(_weights(tmp_path / name)["weight"], last["weight"])
        assert torch.equal(_weights(tmp_path / ema)["weight"], average["weight"])
    for name, ema in (("notes.json", "notes_ema.json"), ("notes.txt", "notes_ema.txt"), ("notes.bin", "notes_ema.bin")):
        assert (tmp_path / name).read_bytes() != (tmp_path / ema).read_bytes()
    assert entries["hf_model_ema"] == str(tmp_path / "hf_model_ema") and entries["test_accuracy_ema"] == 0.5
    assert entries["model_ema"] == {"file": "model_ema.pt", "decay": 0.5}
    assert "preprocessing_ema" not in entries  # (what names no file of the average's and measures nothing of it)
    assert torch.equal(model.weight, last["weight"])  # (the iterate is put back)


def test_a_writer_cannot_reach_the_directory_by_another_way(tmp_path):
    job = _job(nn.Linear(3, 2), lambda rd: torch.save({}, rd.path / "model.pt"))
    with pytest.raises(AttributeError, match="weight average"):
        save_averaged(job, RunDirectory(tmp_path))
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("lora", [False, True])
def test_a_hugging_face_models_directories_keep_the_last_iterate(tmp_path, lora):
    """The run's own Hugging Face writer (runs.job._save_hf): hf_model/ (and hf_adapter/) stay the last iterate's,
    hf_model_ema/ (and hf_adapter_ema/, its base inside it) hold the average. (Before: hf_model/ was overwritten with
    the average, and a peft model's run ended in a TypeError traceback with no summary.)"""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft") if lora else None
    from dptrain.runs.job import _save_hf

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=11)
    model = transformers.GPT2LMHeadModel(config).eval()  # (no dropout: the logits are compared)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    cfg = SimpleNamespace(data=SimpleNamespace(name="npz", options={}), model=SimpleNamespace(name="hf", options={}))
    rd = RunDirectory(tmp_path)
    job = _job(model, lambda d: _save_hf(d, model, cfg))
    entries = job.save_model(rd)  # the last iterate
    entries.update(save_averaged(job, rd))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want_last = model(input_ids=ids).logits
        with job.trainer.weight_average.applied():
            want_average = model(input_ids=ids).logits
    assert not torch.allclose(want_last, want_average)
    for name, want in (("hf_model", want_last), ("hf_model_ema", want_average)):
        assert entries[name] == str(tmp_path / name)
        saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        with torch.no_grad():
            torch.testing.assert_close(saved(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    if lora:
        for name, want in (("hf_adapter", want_last), ("hf_adapter_ema", want_average)):
            adapter = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / name).eval()
            with torch.no_grad():
                torch.testing.assert_close(adapter(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
