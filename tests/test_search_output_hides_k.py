"""Nothing a search shows or shares depends on its secret number of trials K or on the best trial's index, for any
model (each test fails on the search before it): a library's logging handler made before the search (transformers
makes one, and logs a model's load report each time a trial builds it) wrote one block per trial on the terminal;
best/ named the selected trial's directory (``private/trials/6``: K >= 7) in its summary's ``hf_model`` and
``hf_adapter`` and in the peft adapter's ``base_model_name_or_path``, which also pointed at a deleted directory."""

import json
import logging
import logging.handlers
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from dptrain.accounting.tuning import TrialCount
from dptrain.config import load_config
from dptrain.errors import DataError
from dptrain.tuning.search import run_search

ROOT = Path(__file__).resolve().parent.parent
MONTHS = ROOT / "configs" / "data"

CONFIG = """\
[data]
name = "synthetic"
options = { n = 200, dim = 4, num_classes = 2, separation = 3.0 }
[model]
name = "logistic"
[privacy]
target_epsilon = 3.0
delta = 1e-4
[training]
epochs = 1
batch_size = 50
[tune]
trials_mean = 2.0
validation_fraction = 0.2
[tune.space]
"training.learning_rate" = { log_uniform = [0.1, 1.0] }
"""


@pytest.mark.slow
def test_a_logging_handler_made_before_the_search_shows_nothing_per_trial(tmp_path, monkeypatch, capsys):
    """A handler on the terminal, made before the search, and a model that logs each time it is built: the terminal
    reads the same whether the search drew 1 trial or 4."""
    import dptrain.runs.job as job_module

    logger = logging.getLogger("a_library")
    handler = logging.StreamHandler(sys.stderr)  # (as transformers makes its own: holding the terminal's stream)
    logger.addHandler(handler)
    real = job_module.build_model

    def build_model(*args, **kwargs):
        logger.warning("a_library: load report of the model")
        return real(*args, **kwargs)

    monkeypatch.setattr(job_module, "build_model", build_model)
    (tmp_path / "t.toml").write_text(CONFIG)
    shown = {}
    try:
        for k in (1, 4):
            monkeypatch.setattr(TrialCount, "draw", lambda self, u, k=k: k)
            run_search(load_config(tmp_path / "t.toml"), tmp_path / f"k{k}", progress=False)
            shown[k] = capsys.readouterr().err
    finally:
        logger.removeHandler(handler)
    assert shown[1] == shown[4]  # (the reference trial's build, once, whatever K)
    assert shown[1].count("load report") <= 1
    assert handler.stream is sys.stderr  # given back


def test_a_path_to_the_selected_trial_is_rewritten_and_any_other_refused(tmp_path):
    from dptrain.tuning.release import moved_paths

    secret = tmp_path / "s" / "private"
    source, target = secret / "trials" / "6", tmp_path / "s" / "best"
    (target / "hf_adapter").mkdir(parents=True)
    (target / "summary.json").write_text(json.dumps({"hf_adapter": str(source / "hf_adapter")}))
    (target / "hf_adapter" / "adapter_config.json").write_text(json.dumps({"base": str(source.resolve() / "base")}))
    moved_paths(source, target, secret)
    assert json.loads((target / "summary.json").read_text()) == {"hf_adapter": str(target / "hf_adapter")}
    assert str(target.resolve() / "base") in (target / "hf_adapter" / "adapter_config.json").read_text()
    (target / "weights.bin").write_bytes(b"\xff\xfe" + str(secret.resolve() / "trials" / "3").encode())
    with pytest.raises(DataError, match="weights.bin"):
        moved_paths(source, target, secret)


@pytest.mark.slow
def test_best_of_a_peft_search_names_no_trial_and_loads(tmp_path):
    peft = pytest.importorskip("peft")
    path = tmp_path / "lm.toml"
    path.write_text(
        f'[data]\nname = "text_files"\npath = "{MONTHS / "months_train.jsonl"}"\n'
        f'options = {{ task = "causal_lm", test_path = "{MONTHS / "months_test.jsonl"}", '
        f'tokenizer = "{MONTHS / "months_tokenizer"}", max_length = 10 }}\n'
        '[model]\nname = "hf"\noptions = { task = "causal_lm", config = { model_type = "gpt2", n_layer = 1, n_embd = 16, '
        "n_head = 2, n_positions = 16, vocab_size = 17, bos_token_id = 2, eos_token_id = 2, pad_token_id = 0 }, "
        'lora = { r = 2, alpha = 4, target_modules = ["c_attn"] } }\n'
        "[privacy]\ntarget_epsilon = 8.0\ndelta = 1e-4\n[training]\nsteps = 1\nbatch_size = 16\n"
        "[tune]\ntrials_mean = 1.0\nvalidation_is_public = true\n"
        '[tune.space]\n"training.learning_rate" = { log_uniform = [0.01, 0.1] }\n'
    )
    out = tmp_path / "s"
    run_search(load_config(path), out, progress=False)
    best = json.loads((out / "best" / "summary.json").read_text())
    assert best["hf_adapter"] == str(out / "best" / "hf_adapter")
    for root, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if d != "private"]
        for name in files:
            data = (Path(root) / name).read_bytes()
            assert not re.search(rb"private/trials", data) and str(out / "private").encode() not in data, name
    model = peft.AutoPeftModelForCausalLM.from_pretrained(out / "best" / "hf_adapter")  # (its base is in best/)
    assert isinstance(model, torch.nn.Module)


class _Terminal:
    """A stream that says whether it is a terminal, and keeps what is written to it."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_the_search_clock_leaves_no_time_in_what_it_wrote(monkeypatch, tty):
    """The clock's last reading is the search's duration, which grows with K: a log of stderr (not a terminal) gets
    no clock at all (each redraw would stay in it, one a second), and a terminal's clock is erased when the search
    ends."""
    import time

    from dptrain.tuning.quiet import Elapsed

    terminal = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", terminal)
    with Elapsed("searching", interval=0.01):
        time.sleep(0.2)
    shown = terminal.text.split("\r")[-1]  # what a terminal keeps once the lines are overwritten
    assert shown == ("\x1b[Ksearching\n" if tty else "searching\n"), repr(terminal.text[-80:])
    assert tty == ("0:00:00" in terminal.text)  # (a terminal did show the clock while it ran)


def test_a_log_file_gets_nothing_of_a_trial(tmp_path):
    """A handler that writes elsewhere than the terminal (a log file, a queue) got one record per trial from a library
    logging each time a trial builds its model, so the file's length counted the trials: what a trial logs is kept
    with its messages (secret), on every handler, and the handler works as before once the trial ends."""
    from dptrain.tuning.quiet import captured

    logger = logging.getLogger("a_library_to_a_file")
    to_file = logging.FileHandler(tmp_path / "log.txt")
    other = logging.handlers.QueueHandler(queue := __import__("queue").SimpleQueue())
    logger.addHandler(to_file)
    logger.addHandler(other)
    kept: list[str] = []
    try:
        with captured(kept):
            logger.warning("load report of the model")
        logger.warning("after the trial")
    finally:
        logger.removeHandler(to_file)
        logger.removeHandler(other)
        to_file.close()
    assert (tmp_path / "log.txt").read_text() == "after the trial\n" and queue.qsize() == 1
    assert kept == ["WARNING: load report of the model"]  # (once, though two handlers saw it)
