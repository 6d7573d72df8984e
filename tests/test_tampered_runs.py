"""What a resume reads back is held to what the run can check: a label "not private" is never lifted by an edited
checkpoint (its seed is the frozen config's; a label a metrics row records stays), and a checkpoint older than the
run's records (restored from a backup) is refused, never resumed into releasing its steps again unaccounted."""

import json
import shutil

import pytest
import torch

from dptrain.cli import main
from dptrain.runs.rundir import LEDGER, METRICS

TOML = """\
{seed}
[data]
name = "synthetic"
options = {{ n = 300, dim = 4, num_classes = 2 }}
[model]
name = "logistic"
[privacy]
noise_multiplier = 1.0
accountant = "rdp"
[training]
steps = 8
batch_size = 30
eval_every = 1
"""


def _stopped(tmp_path, capsys, seed: str = "") -> tuple:
    cfg = tmp_path / "c.toml"
    cfg.write_text(TOML.format(seed=seed))
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--stop-after", "2"]) == 0
    capsys.readouterr()
    return out, out / "private" / "checkpoint.pt"


def _resume(out, capsys, *more) -> tuple[int, str]:
    code = main(["train", "--resume", str(out), "--no-progress", *more])
    return code, capsys.readouterr().err


def test_an_edited_checkpoint_does_not_lift_a_seeded_runs_label(tmp_path, capsys):
    out, checkpoint = _stopped(tmp_path, capsys, seed="seed = 5")
    state = torch.load(checkpoint, weights_only=True)
    state["randomness"]["seeded"], state["ledger"]["private"] = False, True  # (the label, removed)
    torch.save(state, checkpoint)
    ledger = json.loads((out / LEDGER).read_text())
    (out / LEDGER).write_text(json.dumps({**ledger, "private": True}))
    assert _resume(out, capsys)[0] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["private"] is False and summary["certified"] is False  # (before: true, "operating-system entropy")


@pytest.mark.parametrize("record", [METRICS, "summary.json"])
def test_a_label_a_record_holds_is_never_lifted_by_the_checkpoint(record, tmp_path, capsys):
    """(The run was labelled at step 1, or by the end of its first invocation, and its checkpoint's label removed.)"""
    out, _ = _stopped(tmp_path, capsys)
    if record == METRICS:
        rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
        rows[0]["private"] = False
        (out / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        summary = json.loads((out / record).read_text())
        (out / record).write_text(json.dumps({**summary, "private": False}))
    code, err = _resume(out, capsys)
    step = 1 if record == METRICS else 2
    assert code == 2 and f"{record} records this run not private at step {step}, but its checkpoint says private" in err


def test_a_checkpoint_older_than_the_run_is_refused_even_without_its_ledger_copy(tmp_path, capsys):
    out, checkpoint = _stopped(tmp_path, capsys)
    shutil.copy(checkpoint, tmp_path / "backup.pt")
    assert _resume(out, capsys, "--stop-after", "3")[0] == 0
    shutil.copy(tmp_path / "backup.pt", checkpoint)  # (a backup restored: steps 3 to 5 would be released again)
    code, err = _resume(out, capsys)
    assert code == 2 and "records 5 releases, the run's checkpoint 2: the checkpoint is older than the run" in err
    assert "delete" not in err  # (before: "restore or delete ledger.json to resume", and deleting it resumed)
    (out / LEDGER).unlink()
    code, err = _resume(out, capsys)
    assert code == 2 and "records step 5, beyond the checkpoint's step 2 by more than one evaluation" in err
    assert torch.load(checkpoint, weights_only=True)["steps"] == 2  # (nothing written)


EDITS = {  # (an edit of the checkpoint's first ledger entry, what the refusal names)
    "noise raised": (lambda e: e["event"]["event"].update(noise_multiplier=5.0), "noise multiplier 5.0, this run has 1.0"),
    "rate lowered": (lambda e: (e["event"].update(sampling_probability=0.01), e["facts"].update(sampling_rate=0.01)),
                     "sampling_rate 0.01, this run has 0.125"),
    "n changed": (lambda e: e["facts"].update(dataset_size=10**4), "dataset_size 10000, this run has 240"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_checkpoints_ledger_is_every_step_this_run_records(edit, tmp_path, capsys):
    """Before, a ledger edited in the checkpoint and its copy alike was resumed and certified: noise 1 -> 5 took
    epsilon 6.35 to 0.62, a rate 0.2 -> 0.01 to 5.48 (a resumed run read its sigma from that ledger)."""
    out, checkpoint = _stopped(tmp_path, capsys)
    state = torch.load(checkpoint, weights_only=True)
    change, said = EDITS[edit]
    change(state["ledger"]["entries"][0])
    torch.save(state, checkpoint)
    (out / LEDGER).write_text(json.dumps(state["ledger"]))
    code, err = _resume(out, capsys)
    assert code == 2 and f"checkpoint's ledger records at step 1 {said} (edited" in err


def test_metrics_that_are_not_the_checkpoints_releases_are_refused(tmp_path, capsys):
    """Run B's checkpoint put in run A's directory (the same config: the ledgers agree step for step) was resumed:
    A's directory then released A's evaluations and B's trajectory after them, two trajectories accounted as one; an
    edited row was resumed past as well. A checkpoint keeps a SHA-256 of the metrics rows released when it was written,
    and metrics.jsonl must begin with them (here A's row is changed as B's would differ: another test accuracy)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(TOML.format(seed="").replace("[model]", "test_is_public = true\n[model]"))
    out = tmp_path / "a"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--stop-after", "2"]) == 0
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    rows[0]["test_accuracy"] = (rows[0]["test_accuracy"] + 0.5) % 1.0  # (always another number: 1 - 0.5 was not)
    (out / METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = (out / "model.pt").read_bytes()
    code, err = _resume(out, capsys)
    assert code == 2 and "does not hold the evaluations the run's checkpoint released" in err, err
    assert len(err.strip().splitlines()) == 1 and (out / "model.pt").read_bytes() == model
