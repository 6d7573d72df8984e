"""A search's directory is the search's alone, and frozen as a whole (each test fails on the search before it):
a trial's own files under private/trials are held to what the search gives it (an edit refuses the resume, exit 2,
instead of failing the trial silently), nothing of a search's config may change on resume (a key allowed to change
half-way would show in best/ whether the best trial ran before or after the resume), a run is never trained into a
search's directory nor a trial continued by ``dptrain train``, a trial is scored on its examples as its model sees
them, best/ holds no hidden file of the selected trial, a started trial deleted is never run again; and the data under a frozen run: the fingerprint sees every
tensor a data set holds (text inputs live in a dict), data.classes on memory-mapped arrays is one line."""

import json
import shutil
import sys

import pytest
import torch

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.data.datasets import DataSplit, fingerprint
from dptrain.data.text_files import TextDataset
from dptrain.engine.trainer import PrivateTrainer
from dptrain.errors import DataError
from dptrain.tuning.search import run_search

CONFIG = """\
[data]
name = "synthetic"
options = { n = 400, dim = 5, num_classes = 2, separation = 3.0 }
[model]
name = "logistic"
[privacy]
target_epsilon = 2.0
delta = 1e-5
[training]
epochs = 1
batch_size = 40
learning_rate = 0.5
[tune]
trials_mean = 2.0
validation_fraction = 0.2
[tune.space]
"training.learning_rate" = { log_uniform = [0.1, 2.0] }
"""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A search stopped by Ctrl-C at the third training step of its first trial (copied by each test)."""
    base = tmp_path_factory.mktemp("search")
    (base / "t.toml").write_text(CONFIG)
    real_step, calls = PrivateTrainer.step, {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PrivateTrainer, "step", step)
        with pytest.raises(KeyboardInterrupt):
            run_search(load_config(base / "t.toml"), base / "cut", progress=False)
    return base / "cut"


def _copy(interrupted, tmp_path):
    out = tmp_path / "s"
    shutil.copytree(interrupted, out)
    return out


def _cli(capsys, *args):
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "name,old,new,words",
    [
        ("config.toml", "learning_rate = ", "learning_rate = 1.5 #", "training.learning_rate"),
        ("config.toml", "epochs = 1.0", "epochs = 3.0", "training.epochs"),
        ("config.toml", "[training]", "[training]\neval_every = 1", "training.eval_every"),
        ("ledger.json", '"noise_multiplier": ', '"noise_multiplier": 0.01, "x": ', "ledger.json"),
    ],
)
def test_an_edited_trial_refuses_the_resume_instead_of_failing(interrupted, tmp_path, capsys, name, old, new, words):
    out = _copy(interrupted, tmp_path)
    path = out / "private" / "trials" / "0" / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err
    assert "trials/<a trial>" in err and "trials/0" not in err  # (an index on stderr would bound the number of trials)
    assert not (out / "summary.json").exists()  # nothing released, and the trial is not recorded as failed:
    path.write_text(text)  # restored, the same search goes on, every trial scored
    code, _, _ = _cli(capsys, "tune", "--resume", str(out), "--no-progress", "--keep-trials", "--json")
    assert code == 0 and json.loads((out / "summary.json").read_text())["best"] is not None


def test_a_started_trial_deleted_is_never_run_again(interrupted, tmp_path, capsys):
    """Deleting a started trial's directory made the resume run it again with fresh randomness: a user who disliked
    what the trial's private files showed could draw it again, the search then selecting among more trials than its
    certificate counts. Refused in one line; restored, the search goes on."""
    out = _copy(interrupted, tmp_path)
    trial = out / "private" / "trials" / "0"
    kept = tmp_path / "kept"
    shutil.move(trial, kept)
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "started trial's directory is missing" in err, err
    assert not (out / "summary.json").exists() and not trial.exists()
    shutil.move(kept, trial)
    code, _, _ = _cli(capsys, "tune", "--resume", str(out), "--no-progress", "--json")
    assert code == 0 and json.loads((out / "summary.json").read_text())["best"] is not None


def test_another_searchs_trial_put_in_private_is_refused(interrupted, tmp_path, capsys):
    out = _copy(interrupted, tmp_path)
    trial = out / "private" / "trials" / "0"
    text = (trial / "config.toml").read_text()
    mark = "learning_rate = "
    value = text.split(mark)[1].split("\n")[0]
    # the checkpoint's own copy of the config (hashed) says another learning rate: as another search's trial would
    state = torch.load(trial / "private" / "checkpoint.pt", weights_only=True)
    from dptrain.runs.resume import config_hash

    state["config"] = state["config"].replace(mark + value, mark + "1.25")
    state["config_sha256"] = config_hash(state["config"])
    torch.save(state, trial / "private" / "checkpoint.pt")
    (trial / "config.toml").write_text(state["config"])
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "training.learning_rate" in err


def test_no_key_of_a_searchs_config_may_change_on_resume(interrupted, tmp_path, capsys):
    for key, line in (("training.eval_every", "eval_every = 1"), ("training.max_physical_batch_size",
                                                                  "max_physical_batch_size = 7")):
        out = _copy(interrupted, tmp_path / key)
        text = (out / "config.toml").read_text()
        (out / "config.toml").write_text(text.replace("[training]", f"[training]\n{line}"))
        code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
        assert code == 2 and key in err and len(err.strip().splitlines()) == 1


def test_a_search_directory_is_continued_by_its_search_only(interrupted, tmp_path, capsys):
    out = _copy(interrupted, tmp_path)
    before = sorted(p.name for p in out.iterdir())
    code, _, err = _cli(capsys, "train", "--resume", str(out), "--no-progress")
    assert code == 2 and "dptrain tune --resume" in err and len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "train", "--config", str(out / "config.toml"), "--out", str(out), "--no-progress")
    assert code == 2 and "hyperparameter search" in err
    assert sorted(p.name for p in out.iterdir()) == before  # no model, summary or ledger of a run beside the search's
    code, _, err = _cli(capsys, "train", "--resume", str(out / "private" / "trials" / "0"), "--no-progress")
    assert code == 2 and "trial of a hyperparameter search" in err
    assert not (out / "private" / "trials" / "0" / "model.pt").exists()


def _text_split(ids: torch.Tensor) -> DataSplit:
    labels = torch.tensor([0, 1])
    data = TextDataset(ids, torch.ones_like(ids), labels, 2, "text_files", vocab_size=10, pad_token_id=0)
    return DataSplit(data, data, "text")


def test_the_fingerprint_sees_inputs_held_in_a_dict():
    """A classifier's text inputs live in a dict of tensors; the labels alone do not change when a word does."""
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    b = a.clone()
    b[1, 2] = 7
    assert fingerprint(_text_split(a)) != fingerprint(_text_split(b))
    assert fingerprint(_text_split(a)) == fingerprint(_text_split(a.clone()))


def test_a_trial_is_scored_on_its_examples_as_its_model_sees_them(tmp_path):
    """A preprocessing stage (a private mean) transforms the examples a trial trains on: its score reads the same
    rows through the trainer's source of the job's data, not the raw ones (here the transform negates the inputs, and the model classifies
    the transformed examples perfectly: on the raw ones it would be always wrong)."""
    from types import SimpleNamespace

    from dptrain.data.batches import as_source
    from dptrain.data.datasets import ArrayDataset
    from dptrain.tuning.search import Search, Trial

    path = tmp_path / "t.toml"
    path.write_text(CONFIG.replace("validation_fraction = 0.2", "validation_fraction = 0.5\nscore_noise = 1e-6"))
    search = Search(load_config(path))
    raw = search.data.train
    model = torch.nn.Linear(5, 2)
    w = torch.linalg.lstsq(-raw.x, torch.nn.functional.one_hot(raw.y).float() * 2 - 1).solution  # fits -x
    with torch.no_grad():
        model.weight.copy_(w.T)
        model.bias.zero_()
    seen = ArrayDataset(-raw.x, raw.y, raw.num_classes, raw.name)
    job = SimpleNamespace(trainer=SimpleNamespace(model=model, device=torch.device("cpu"), data=as_source(seen),
                                                  loss_fn=None),
                          data=DataSplit(seen, search.data.test, "negated"))
    trial = Trial(0, {}, [1, 2, 3, 4])
    held = int(search.held_out(trial).sum())
    score = search.score(trial, job)
    correct = (model(-raw.x[search.held_out(trial)]).argmax(-1) == raw.y[search.held_out(trial)]).float().mean()
    assert correct > 0.9 and score == pytest.approx(held * float(correct) / (0.5 * len(raw)), abs=1e-3)


def test_best_holds_no_hidden_file_of_the_selected_trial(tmp_path):
    """A crash leaves a temporary file in the trial that was running: copied into best/, it would say that the
    selected trial was that one. best/ holds the trial's released files only, and the search's own leftovers go."""
    from dptrain.runs.rundir import RunDirectory
    from dptrain.tuning import search as search_module
    from dptrain.tuning.release import publish

    path = tmp_path / "t.toml"
    path.write_text(CONFIG)
    out = tmp_path / "s"
    run_search(load_config(path), out, progress=False, keep_trials=True)
    saved = RunDirectory(out).load_private(search_module.STATE)
    state = search_module.SearchState.from_dict(saved)
    trial = out / "private" / "trials" / str(state.extra["best_index"])
    (trial / ".model.pt.abc123.tmp").write_bytes(b"half a file")
    (out / ".summary.json.abc123.tmp").write_text("{")
    ran = (trial / "config.toml").read_text()
    (trial / "config.toml").write_text(ran.replace("learning_rate = ", "learning_rate = 0.001 #", 1))
    publish(state, RunDirectory(out), keep_trials=True)
    assert not [p.name for p in (out / "best").iterdir() if p.name.startswith(".")]
    assert not (out / ".summary.json.abc123.tmp").exists()
    # best/ is held to the trial's checkpoint: the config it ran with (an edited copy misstated the selected
    # hyperparameters), and only the metrics rows it released
    assert (out / "best" / "config.toml").read_text() == ran
    rows = (trial / "metrics.jsonl").read_text()
    (trial / "metrics.jsonl").write_text(rows.replace('"step": ', '"step": 1', 1))
    with pytest.raises(DataError, match="does not hold the evaluations"):
        publish(state, RunDirectory(out), keep_trials=True)


def test_data_classes_on_memory_mapped_arrays_is_one_line(tmp_path, capsys):
    """data.classes on data it cannot filter in memory (a memory-mapped npz) is refused in one line naming the rule,
    not a traceback."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((60, 3)).astype(np.float32)
    y = np.arange(60) % 3
    np.savez(tmp_path / "m.npz", x=x, y=y, x_test=x[:9], y_test=y[:9])
    config = tmp_path / "c.toml"
    config.write_text(
        f'[data]\nname = "npz"\npath = "{tmp_path / "m.npz"}"\noptions = {{ num_classes = 3, mmap = true }}\n'
        'classes = [0, 2]\n[model]\nname = "logistic"\n[privacy]\nnoise_multiplier = 1.0\ndelta = 0.01\n'
        "[training]\nsteps = 2\nbatch_size = 2\n"
    )
    code, _, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "r"), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "data.classes" in err and "memory-mapped" in err


def test_a_value_changed_in_type_only_refuses_the_resume(tmp_path, monkeypatch, capsys):
    """``hidden = [8]`` edited to ``[8.0]`` compared equal (8 == 8.0), so the freeze let it through and the search went
    on with the edited file: here the model's own check refused it, naming no change; an option read without a check
    would have trained the remaining trials with it. A value of another type is a change (listed, exit 2), and the
    search goes on with the config it started with."""
    from dptrain.accounting.tuning import TrialCount
    from dptrain.runs.rundir import RunDirectory
    from dptrain.tuning import search as search_module

    (tmp_path / "t.toml").write_text(CONFIG.replace('name = "logistic"', 'name = "mlp"\noptions = { hidden = [8] }'))
    monkeypatch.setattr(TrialCount, "draw", lambda self, u: 3)
    real, calls = search_module.Search.noise_for, {"n": 0}

    def noise_for(self, values, reference):  # (stopped as the second trial starts: the first one done)
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, values, reference)

    out = tmp_path / "s"
    with monkeypatch.context() as m:
        m.setattr(search_module.Search, "noise_for", noise_for)
        with pytest.raises(KeyboardInterrupt):
            run_search(load_config(tmp_path / "t.toml"), out, progress=False)
    text = (out / "config.toml").read_text()
    assert "hidden = [8]" in text or "hidden = [ 8 ]" in text
    (out / "config.toml").write_text(text.replace("[8]", "[8.0]").replace("[ 8 ]", "[ 8.0 ]"))
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model.options.hidden" in err
    assert not (out / "summary.json").exists()
    (out / "config.toml").write_text(text)
    code, _, _ = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    trials = RunDirectory(out).load_private(search_module.STATE)["trials"]
    assert code == 0 and [t["status"] for t in trials] == ["done"] * 3


def _edit_state(out, edit):
    state = torch.load(out / "private" / "search.pt", weights_only=True)
    edit(state)
    torch.save(state, out / "private" / "search.pt")


def _raise_reference(state):
    state["reference_noise"] *= 3  # (trial 0 started at the true one: the search's certificate would be 0.83, not 2)


def _fake_done(state):
    state["trials"][0].update(status="done", score=99.0)  # (interrupted at its third step: its run has not finished)


@pytest.mark.parametrize(
    "edit,words",
    [
        (_raise_reference, "reference noise multiplier"),  # (each message names no trial's index)
        (lambda s: s["trials"].append(dict(s["trials"][-1], index=len(s["trials"]))), "other trials than its origin"),
        (lambda s: s["trials"][0]["values"].update({"training.learning_rate": 1.99}), "other trials than its origin"),
        (lambda s: s["trials"][0].update(noise_multiplier=0.05), "noise multiplier 0.05"),
        (_fake_done, "marks a trial done whose run has not finished"),
    ],
)
def test_an_edited_search_state_refuses_the_resume(interrupted, tmp_path, capsys, edit, words):
    """private/search.pt was trusted: a reference noise raised after a trial had run certified epsilon 0.83 for a search
    whose trial alone spent more; a trial added, dropped or redrawn, or one marked done with a score it never earned,
    was selected among. A resume recomputes what the search can (the draws from their origin, the noise from the frozen
    config, the trials' directories) and refuses a state that disagrees."""
    out = _copy(interrupted, tmp_path)
    _edit_state(out, edit)
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "summary.json").exists()


def test_another_searchs_trial_with_the_same_config_is_refused(interrupted, tmp_path, capsys):
    """A finished trial of another search with the same config (a space of one choice) was taken for this search's
    trial and scored on this search's split: the search's mark on its trial (a hash of the trial's secret key, in the
    trial's checkpoint) is required."""
    out = _copy(interrupted, tmp_path)
    checkpoint = out / "private" / "trials" / "0" / "private" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert state["owner"].startswith("search:")
    state["owner"] = "search:" + "0" * 64
    torch.save(state, checkpoint)
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and "is not this search's" in err and len(err.strip().splitlines()) == 1, err
    assert "trials/0" not in err


def test_a_resume_says_nothing_per_started_trial(interrupted, tmp_path, capsys, monkeypatch):
    """A resume checks every started trial's noise by planning its job, and what building a job says (a stage's
    warning) was printed once per started trial (the modelmix warning 4 times for 3 started trials): a count of
    trials on stderr. It is said once, for the reference trial."""
    from dptrain.runs import job as job_module

    real = job_module.build_job

    def build_job(*args, **kwargs):
        print("dptrain: warning: a stage's notice", file=sys.stderr)
        return real(*args, **kwargs)

    monkeypatch.setattr(job_module, "build_job", build_job)
    out = _copy(interrupted, tmp_path)
    shutil.rmtree(out / "private" / "trials" / "0")  # (refused after the check, before any trial runs)
    code, _, err = _cli(capsys, "tune", "--resume", str(out), "--no-progress")
    assert code == 2 and "started trial's directory is missing" in err
    assert err.count("a stage's notice") == 1, err


def test_a_trial_that_records_more_than_its_plan_is_not_covered(interrupted):
    """The search's certificate is built from each trial's plan; a release a trial's run recorded beyond it (here a
    Gaussian a stage would spend at run time) was taken as covered. Every trial's ledger is held to its plan before
    it is scored (NotCovered refuses the search, in one line; it is not a failed trial)."""
    import dp_accounting as dpa

    from dptrain.tuning.search import NotCovered, Search, Trial

    search = Search(load_config(interrupted / "config.toml"))
    trial = Trial(0, {"training.learning_rate": 0.7}, [1, 2, 3, 4], noise_multiplier=1.3)
    planner = search._planner(trial.values)
    steps = planner(1.3).copy()
    steps.entries.pop()  # (the plan ends with the score's release, which the trial's run does not record)
    search.check_covered(trial, steps)  # the run's ledger, as planned
    steps.record(dpa.GaussianDpEvent(5.0), {"mechanism": "extra"})
    with pytest.raises(NotCovered, match="other releases than the search planned"):
        search.check_covered(trial, steps)


def test_a_trial_that_failed_before_it_started_passes_the_resume_check(interrupted):
    """A trial whose draw no noise multiplier makes as private as the reference trial (noise.bands = 4 against a
    reference of 2) fails before it starts, with no noise: the resume's check of the state took it for an edit."""
    from dptrain.runs.job import run_randomness
    from dptrain.runs.rundir import RunDirectory
    from dptrain.tuning.search import Search, SearchState
    from dptrain.tuning.state import check_resumed

    state = SearchState.from_dict(RunDirectory(interrupted).load_private("search.pt"))
    cfg = load_config(interrupted / "config.toml")
    search = Search(cfg)
    state.trials[0].noise_multiplier, state.trials[0].status, state.trials[0].score = None, "failed", float("-inf")
    check_resumed(search, state, interrupted, run_randomness(cfg).stream("tuning"))
    state.trials[0].status = "done"
    with pytest.raises(Exception, match="marks a trial done that never started"):
        check_resumed(search, state, interrupted, run_randomness(cfg).stream("tuning"))
