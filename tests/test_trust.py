"""What a run releases is what its certificate covers: secret randomness, nothing unaccounted in the outputs, one run
per directory, clean errors. Each test reproduces a finding of the attacker's review of the project."""

import ast
import json
import math
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch import nn

from dptrain.cli import main
from dptrain.config import load_config
from dptrain.data.loaders import make_gaussian_mixture
from dptrain.dpsgd_f import normalize_features
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import AccountingError, ConfigError, DataError, ModelError
from dptrain.models.builders import build_model
from dptrain.randomness.generators import NotPrivateWarning, Randomness
from dptrain.runs.run import run_training

ROOT = Path(__file__).resolve().parents[1]

SYNTHETIC = [
    'data.name="synthetic"',
    "data.options={n = 2000, dim = 10, num_classes = 3, separation = 3.0}",
    'model.name="logistic"',
    "training.epochs=1",
    "training.batch_size=200",
    "training.learning_rate=2.0",
]


def _cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


# --- 1. the noise cannot be recomputed from what a run shares -----------------------------------------------


def _private_mean_run(tmp_path, name, *extra):
    cfg = load_config(
        None,
        [
            *SYNTHETIC,
            "privacy.target_epsilon=2.0",
            'privacy.accountant="rdp"',
            'preprocessing.kind="private_mean"',
            "preprocessing.feature_norm=1.0",
            "preprocessing.eps_f=0.1",
            *extra,
        ],
    )
    out = tmp_path / name
    run_training(cfg, out, progress=False)
    return cfg, out


def _observed_noise(cfg, out) -> torch.Tensor:
    """The attacker's view: the released mean minus the true mean (which an attacker holding all but one record, or
    the data owner in this test, knows) times n is exactly the noise vector that was drawn."""
    data = make_gaussian_mixture(n=2000, dim=10, num_classes=3, separation=3.0, seed=cfg.data.seed).train
    z = normalize_features(data.x, 1.0).double()
    released = torch.tensor(json.loads((out / "preprocessing.json").read_text())["mean"], dtype=torch.float64)
    return (released - z.mean(0)) * len(z)


def _attack(cfg, out, noise: torch.Tensor) -> bool:
    """Rebuild every generator the shareable outputs could seed (any integer in config.toml, summary.json or
    metrics.jsonl, and small seeds) the ways dptrain ever derived the preprocessing noise; True if one of them
    reproduces the observed noise."""
    text = "".join((out / f).read_text() for f in ("config.toml", "summary.json", "metrics.jsonl"))
    numbers = {int(tok) for tok in text.replace(",", " ").replace("=", " ").split() if tok.isdigit()}
    sigma = json.loads((out / "preprocessing.json").read_text())["noise_multiplier"]
    for s in sorted(numbers | set(range(20))):
        candidates = [
            torch.randn(
                len(noise), generator=torch.Generator().manual_seed(10_007 * s + 1), dtype=torch.float64
            ),
            Randomness(s, warn=False).stream("preprocessing").normal((len(noise),), torch.float64),
        ]
        for c in candidates:
            if torch.allclose(c * sigma, noise, atol=1e-3 * sigma):
                return True
    return False


def test_the_private_mean_noise_cannot_be_rebuilt_from_the_shareable_outputs(tmp_path):
    cfg, out = _private_mean_run(tmp_path, "secret")
    assert "seed" not in (out / "config.toml").read_text().split("[data]")[0]  # no top-level seed written
    assert not _attack(cfg, out, _observed_noise(cfg, out))
    # The same attack does recover the noise when the user opts into a seed (the warned, non-private option):
    seeded_cfg, seeded = _private_mean_run(tmp_path, "seeded", "seed=3")
    assert _attack(seeded_cfg, seeded, _observed_noise(seeded_cfg, seeded))
    summary = json.loads((seeded / "summary.json").read_text())
    assert (
        "not private" in summary["randomness"]
        and "not private" not in json.loads((out / "summary.json").read_text())["randomness"]
    )


def test_secret_runs_differ_and_a_seed_warns():
    draws = [Randomness().stream("noise").normal((5,)) for _ in range(2)]
    assert not torch.equal(*draws)
    with pytest.warns(NotPrivateWarning, match="not private"):
        Randomness(4)
    a, b = Randomness(4, warn=False), Randomness(4, warn=False)
    assert torch.equal(a.stream("noise").normal((5,)), b.stream("noise").normal((5,)))
    # One stream per purpose: drawing more batches never shifts the noise.
    a.stream("sampling").uniform((1000,))
    assert torch.equal(a.stream("noise").normal((5,)), b.stream("noise").normal((5,)))


# --- 2. a model that mixes the examples of a batch is refused ------------------------------------------------


class _Centering(nn.Module):
    """Subtracts the batch mean of a hidden layer: each example's output depends on the others."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0))


def _data(n=50, d=5):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_a_model_mixing_examples_is_refused_by_the_independence_check():
    model = _Centering()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for backend in ("auto", "func"):
        with pytest.raises(ModelError, match="per-example independence check"):
            make_private(model, opt, _data(), noise_multiplier=1.0, batch_size=10, grad_sampler=backend)
    # The documented opt-out for a model the user vouches for:
    trainer = make_private(model, opt, _data(), noise_multiplier=1.0, batch_size=10, check_independence=False)
    assert not trainer.independence_checked


def test_independent_models_pass_the_check_even_with_dropout():
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), noise_multiplier=1.0, batch_size=10
    )
    cnn = build_model("cnn28", (1, 28, 28), 10)
    x = torch.zeros(20, 1, 28, 28)
    make_private(
        cnn,
        torch.optim.SGD(cnn.parameters(), lr=0.1),
        (x, torch.zeros(20, dtype=torch.long)),
        noise_multiplier=1.0,
        batch_size=10,
    )


# --- 3. nothing computed from private data leaves a run unaccounted -------------------------------------------


def test_training_loss_is_written_only_on_request_and_labelled(tmp_path):
    cfg = load_config(None, [*SYNTHETIC, "privacy.noise_multiplier=1.0", "training.eval_every=3"])
    run_training(cfg, tmp_path / "default", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    # (synthetic data: its test split is cut from the private examples, so no test accuracy is written either)
    assert rows and all(set(r) == {"step", "epoch", "epsilon", "delta", "private"} for r in rows)
    asked = load_config(
        None,
        [
            *SYNTHETIC,
            "privacy.noise_multiplier=1.0",
            "training.eval_every=3",
            "training.log_not_private=true",
        ],
    )
    run_training(asked, tmp_path / "asked", progress=False)
    rows = [json.loads(line) for line in (tmp_path / "asked" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["not_private"]["train_loss"]) for r in rows[:-1])
    assert all(0 <= r["not_private"]["test_accuracy"] <= 1 and "test_accuracy" not in r for r in rows)


# --- 4. the number of steps for a number of epochs is computed once -----------------------------------------


def test_train_and_calibrate_agree_on_the_steps_of_an_epoch_count(capsys):
    # n = 50,000, expected batch 300, 10 epochs: 1667 steps everywhere (train used to run 1670).
    n = 50_000
    model = nn.Linear(1, 2)
    trainer = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (torch.zeros(n, 1), torch.zeros(n, dtype=torch.long)),
        noise_multiplier=1.0,
        batch_size=300,
        accountant="rdp",
        check_independence=False,
    )
    code, out, _ = _cli(
        [
            "calibrate",
            "--epsilon",
            "3",
            "--delta",
            "1e-5",
            "--sampling-rate",
            "0.006",
            "--epochs",
            "10",
            "--accountant",
            "rdp",
            "--json",
        ],
        capsys,
    )
    assert code == 0 and trainer.steps_for(epochs=10) == json.loads(out)["steps"] == 1667


# --- 5., 11. one rule for sigma, and bad input refused where it enters --------------------------------------


def test_the_api_refuses_bad_input_when_the_trainer_is_made():
    model = build_model("logistic", (5,), 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    with pytest.raises(AccountingError, match="noise_multiplier must be a finite number > 0"):
        make_private(model, opt, data, noise_multiplier=0.0, batch_size=10)
    with pytest.raises(AccountingError, match="delta must be in"):
        make_private(model, opt, data, noise_multiplier=1.0, batch_size=10, delta=2)
    with pytest.raises(ConfigError, match="accountant must be one of"):
        make_private(model, opt, data, noise_multiplier=1.0, batch_size=10, accountant="renyi")
    with pytest.raises(ConfigError, match="epochs must be a finite number > 0"):
        make_private_with_epsilon(
            model, opt, data, target_epsilon=1.0, target_delta=1e-5, epochs=-1, batch_size=10
        )
    with pytest.raises(DataError, match="one label per example"):
        make_private(model, opt, (data[0], data[1][:-1]), noise_multiplier=1.0, batch_size=10)
    with pytest.raises(DataError, match=r"labels must be class indices in \[0, 3\)"):
        make_private(model, opt, (data[0], data[1] + 5), noise_multiplier=1.0, batch_size=10)


def test_the_noise_multiplier_cannot_change_after_calibration():
    model = build_model("logistic", (5,), 3)
    trainer = make_private_with_epsilon(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _data(),
        target_epsilon=1.0,
        target_delta=1e-5,
        steps=20,
        batch_size=10,
        accountant="rdp",
    )
    with pytest.raises(ConfigError, match="fixed when the trainer is made"):
        trainer.noise_multiplier = 0.1
    trainer.train(steps=100)
    assert trainer.steps == 20 and trainer.epsilon().epsilon <= 1.0


@pytest.mark.parametrize(
    "override,message",
    [
        ("training.learning_rate=1e39", "training diverged at step 1"),
        ("privacy.max_grad_norm=1e39", "noisy gradient of step 1 is not finite"),
        ("training.weight_decay=inf", "training.weight_decay must be a finite number"),
    ],
)
def test_numbers_that_would_give_a_nan_model_stop_the_run_with_one_line(tmp_path, capsys, override, message):
    args = ["train", "--out", str(tmp_path / "r"), "--no-progress", "--set", "privacy.noise_multiplier=1.0"]
    for item in [*SYNTHETIC, override]:
        args += ["--set", item]
    code, _, err = _cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_non_finite_loss_stops_the_step_before_anything_is_released():
    from dptrain.errors import NonFiniteError

    x, y = _data()
    x[7] = float("inf")  # (NaN in the data is refused when the trainer is made)
    model = build_model("logistic", (5,), 3)
    trainer = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=1.0,
        sampling="full",
        check_independence=False,
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match="not finite"):
        trainer.step()
    assert trainer.ledger.releases == 0 and all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )


@pytest.mark.parametrize("target", ["dir", "file", "unwritable"])
def test_bad_paths_are_one_line_errors(tmp_path, capsys, target):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[data]\nname = 'digits'\n[model]\nname = 'logistic'\n[privacy]\nnoise_multiplier = 1.0\n")
    if target == "dir":
        args = ["train", "--config", str(tmp_path), "--out", str(tmp_path / "r")]
        expected = "is a directory"
    elif target == "file":
        (tmp_path / "taken").write_text("x")
        args = ["train", "--config", str(cfg), "--out", str(tmp_path / "taken")]
        expected = "exists and is not a directory"
    else:
        args = ["train", "--config", str(cfg), "--out", "/sys/dptrain-cannot-write-here"]
        expected = "cannot create the output directory"
    code, _, err = _cli([*args, "--no-progress"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


# --- 7. every third-party module dptrain imports is a declared dependency -----------------------------------


def _imported_modules(nodes) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"dptrain"}


#: Modules of dptrain that exist for an optional extra and are imported only when the user asks for them (their
#: package's names are lazy): what they import at module level may come from that extra. tests/test_hf_trainer.py
#: checks that importing their package imports none of it.
EXTRA_ONLY_MODULES = ("huggingface/trainer.py",)


def test_every_imported_distribution_is_declared():
    """A module imported when dptrain is imported is a required dependency; one imported only inside a function
    (used only when the user asks for it, e.g. Hugging Face models), or by a module that exists for an extra
    (EXTRA_ONLY_MODULES), may come from an optional extra other than the benchmarks' and the developers' (Opacus is
    never used by dptrain itself)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {d.split("==")[0].split("[")[0].lower().replace("_", "-") for d in requirements}

    required = names(project["dependencies"])
    extras = names(d for k, v in project["optional-dependencies"].items() if k not in ("bench", "dev") for d in v)
    providers = metadata.packages_distributions()

    def undeclared(modules, declared):
        return {
            m: providers.get(m)
            for m in modules
            if not any(p.lower().replace("_", "-") in declared for p in providers.get(m, [m]))
        }

    eager, lazy = set(), set()
    for path in (ROOT / "src" / "dptrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inside = {id(m) for f in functions for m in ast.walk(f) if m is not f}
        nodes = list(ast.walk(tree))
        if path.relative_to(ROOT / "src" / "dptrain").as_posix() in EXTRA_ONLY_MODULES:
            inside = {id(n) for n in nodes}
        eager |= _imported_modules(n for n in nodes if id(n) not in inside)
        lazy |= _imported_modules(n for n in nodes if id(n) in inside)
    assert not undeclared(eager, required), f"imported at module level but not a dependency: {undeclared(eager, required)}"
    missing = undeclared(lazy - eager, required | extras)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


# --- 8., 10. one run per directory; SIGTERM checkpoints; the ledger copy is checked ---------------------------

LONG = """seed = 5
[data]
name = "synthetic"
options = { n = 500, dim = 4, num_classes = 2, separation = 3.0 }
[model]
name = "logistic"
[privacy]
noise_multiplier = 1.0
accountant = "rdp"
[training]
steps = 20000
batch_size = 25
eval_every = 10000
"""


def _dptrain(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "dptrain.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def _wait_for(path: Path, timeout=60.0):
    end = time.time() + timeout
    while not path.exists():
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_one_run_per_directory_sigterm_checkpoints_and_resume_checks_the_ledger(tmp_path, capsys):
    cfg, out = tmp_path / "long.toml", tmp_path / "run"
    cfg.write_text(LONG)
    first = _dptrain("train", "--config", str(cfg), "--out", str(out), "--no-progress")
    _wait_for(out / "config.toml")
    # A second run into the same directory while the first trains: refused at once, the first is untouched.
    code, _, err = _cli(["train", "--config", str(cfg), "--out", str(out), "--no-progress"], capsys)
    assert code == 2 and ("in use by another dptrain run" in err or "already holds a run" in err)
    time.sleep(1.0)
    first.send_signal(signal.SIGTERM)  # what a scheduler or a container sends
    _, err = first.communicate(timeout=60)
    assert first.returncode == 143 and "continue with: dptrain train --resume" in err
    state = torch.load(out / "private" / "checkpoint.pt", weights_only=True)
    ledger = json.loads((out / "ledger.json").read_text())
    assert 0 < state["steps"] < 20000 and ledger["releases"] == state["steps"]  # checkpoint and copy agree
    # Resume a few steps: the wall time of the first segment is kept.
    code, stdout, _ = _cli(
        ["train", "--resume", str(out), "--stop-after", "5", "--no-progress", "--json"], capsys
    )
    summary = json.loads(stdout)
    assert code == 0 and summary["steps"] == state["steps"] + 5
    resumed = torch.load(out / "private" / "checkpoint.pt", weights_only=True)
    assert resumed["elapsed_s"] >= state["elapsed_s"] > 0 and "wall_time_s" not in summary
    # An edited ledger.json is noticed: the checkpoint's ledger is authoritative.
    edited = json.loads((out / "ledger.json").read_text())
    edited["entries"][0]["count"] -= 100
    edited["entries"][0]["facts"]["noise_multiplier"] = 5.0
    (out / "ledger.json").write_text(json.dumps(edited))
    code, _, err = _cli(["train", "--resume", str(out), "--stop-after", "1", "--no-progress"], capsys)
    assert code == 2 and "ledger.json does not match the run's checkpoint" in err


def test_a_ledger_copy_one_step_behind_is_accepted_on_resume(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        LONG.replace("steps = 20000", "steps = 12").replace("eval_every = 10000", "eval_every = 4")
    )
    out = tmp_path / "run"
    assert (
        _cli(
            ["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--stop-after", "6"], capsys
        )[0]
        == 0
    )
    behind = json.loads((out / "ledger.json").read_text())
    behind["entries"][0]["count"] -= 1  # a crash between the checkpoint and its copy
    behind["releases"] -= 1
    (out / "ledger.json").write_text(json.dumps(behind))
    code, _, _ = _cli(["train", "--resume", str(out), "--no-progress"], capsys)
    assert code == 0 and json.loads((out / "ledger.json").read_text())["releases"] == 12


# --- 13. papercuts --------------------------------------------------------------------------------------------


def test_default_output_directories_never_collide_and_finished_runs_are_not_resumed(
    tmp_path, capsys, monkeypatch
):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(LONG.replace("steps = 20000", "steps = 6").replace("eval_every = 10000", "eval_every = 3"))
    monkeypatch.chdir(tmp_path)
    outs = []
    for _ in range(2):  # `make run` twice
        code, stdout, _ = _cli(["train", "--config", str(cfg), "--no-progress", "--json"], capsys)
        assert code == 0
        outs.append(json.loads(stdout)["out"])
    assert outs == [str(Path("runs") / "tiny"), str(Path("runs") / "tiny-2")]
    metrics = (tmp_path / outs[0] / "metrics.jsonl").read_text()
    code, _, err = _cli(["train", "--resume", outs[0], "--no-progress"], capsys)
    assert code == 0 and "has finished" in err
    assert (tmp_path / outs[0] / "metrics.jsonl").read_text() == metrics  # no duplicate rows


def test_the_lock_refuses_a_second_writer_in_the_same_process(tmp_path):
    from dptrain.errors import RunDirectoryError
    from dptrain.runs.rundir import RunDirectory

    with RunDirectory(tmp_path / "r").locked(create=True):
        cfg = load_config(None, [*SYNTHETIC, "privacy.noise_multiplier=1.0"])
        with pytest.raises(RunDirectoryError, match="in use by another dptrain run"):
            run_training(cfg, tmp_path / "r", progress=False)
    assert not (tmp_path / "r" / "config.toml").exists()


def test_the_run_numbers_give_the_trainers_own_planned_ledger():
    """The numbers built at the edge (steps from epochs, rate, schedule) and the engine agree: the planned ledger
    RunNumbers gives calibrate/account/plan is the one the trainer itself will record."""
    from dptrain.accounting import RunNumbers

    x, y = _data(n=400)
    for growth in (0.0, 1.0):
        numbers = RunNumbers.planned(
            "poisson", dataset_size=400, batch_size=40, epochs=2.5, batch_growth=growth, clip_norm=0.7
        )
        model = build_model("logistic", (5,), 3)
        trainer = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            (x, y),
            noise_multiplier=1.3,
            max_grad_norm=0.7,
            batch_size=40,
            sample_sizes=numbers.sample_sizes,
            accountant="rdp",
        )
        assert numbers.steps == trainer.steps_for(epochs=2.5) == 25
        assert numbers.ledger(1.3).to_dict() == trainer.ledger_after(numbers.steps).to_dict()
