"""Training with a noise schedule (the engine's noise stage with sigma_t = c s_t; the [schedule] config section).

Dynamic Noise Influence ("On Dynamic Noise Influence in Differential Private Learning", anonymous ICLR 2021
submission): a run spends exactly its budget, each step draws its noise at its own sigma_t and records it, a resumed
run equals an uninterrupted one, and bad schedules are refused in one line (exit 2) before anything is written."""

import json
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import run_interrupted
from torch import nn

from dptrain.accounting import epsilon
from dptrain.accounting.gdp import gdp_epsilon
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.engine import trainer as engine
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import BudgetExhausted, ConfigError, DataError
from dptrain.runs.run import run_training
from dptrain.schedules.bounds import R_from_eps_delta
from dptrain.schedules.kinds import calibrate_shape, quantised_shape, schedule_shape

warnings.filterwarnings("ignore", message="not private")


def _data(n=200, d=6):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, 0] > 0).long()


def _trainer(shape, steps, *, sampling="full", batch_size=200, target=2.0, **options):
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return make_private_with_epsilon(
        model,
        opt,
        _data(),
        target_epsilon=target,
        target_delta=1e-5,
        steps=steps,
        batch_size=batch_size,
        sampling=sampling,
        noise_schedule=shape,
        seed=3,
        **options,
    )


def _sigmas(ledger):
    """The noise multiplier of every step, in order, as the ledger records them."""
    out = []
    for e in ledger.entries:
        ev = e.event
        while not hasattr(ev, "noise_multiplier"):
            ev = ev.event
        out += [ev.noise_multiplier] * e.count
    return out


def test_a_full_batch_schedule_spends_exactly_its_budget_and_draws_each_step_at_its_sigma(monkeypatch):
    shape = schedule_shape("gd-optimal", 30, kappa=10)
    trainer = _trainer(shape, 30)
    assert trainer.accountant == "gdp"  # full-batch Gaussian steps: exact composition
    drawn = []
    real = engine.add_gaussian_noise
    monkeypatch.setattr(engine, "add_gaussian_noise", lambda g, std, gen: drawn.append(std) or real(g, std, gen))
    trainer.train(steps=100)  # the schedule bounds the run: 30 steps
    assert trainer.steps == 30
    with pytest.raises(BudgetExhausted):
        trainer.step()
    c = trainer.noise_multiplier
    expected = [c * s for s in shape]
    assert _sigmas(trainer.ledger) == expected  # the ledger records sigma_t = c s_t at every step ...
    assert drawn == expected  # ... and the noise of step t was drawn with std sigma_t C (C = 1)
    assert len(trainer.ledger.entries) == 30
    # exactly the budget, by the closed form: mu^2 = sum sigma_t^-2 (Dong, Roth & Su 2022, Cor. 3.3)
    mu = math.sqrt(sum(s**-2 for s in expected))
    assert gdp_epsilon(mu, 1e-5) == pytest.approx(2.0, rel=1e-9) and gdp_epsilon(mu, 1e-5) <= 2.0
    assert trainer.epsilon().epsilon == pytest.approx(2.0, rel=1e-9)
    # the decay of Thm 4.3 (eq. 7): sigma_{t+1}/sigma_t = gamma^(1/4), gamma = 1 - 1/kappa
    ratios = np.asarray(expected[1:]) / np.asarray(expected[:-1])
    assert np.allclose(ratios, 0.9**0.25, rtol=1e-12)


def test_poisson_schedules_are_certified_by_pld_on_few_levels_and_rdp_on_many():
    steps, q = 20, 0.2
    shape = quantised_shape(schedule_shape("exponential", steps), 4)
    trainer = _trainer(shape, steps, sampling="poisson", batch_size=40)
    assert trainer.accountant == "pld"
    report = epsilon(trainer.ledger_after(steps), 1e-5, "pld")
    assert 2.0 * (1 - 1e-4) <= report.epsilon <= 2.0
    assert len(trainer.ledger_after(steps).entries) == 4  # one entry per run of equal sigma
    # many levels: rdp; its fractional orders may certify a little below the integer-order calibration's target
    exact_shape = schedule_shape("exponential", steps)
    trainer = _trainer(exact_shape, steps, sampling="poisson", batch_size=40)
    assert trainer.accountant == "rdp"
    spent = epsilon(trainer.ledger_after(steps), 1e-5, "rdp").epsilon
    assert 2.0 * 0.98 <= spent <= 2.0
    direct = calibrate_shape(exact_shape, epsilon=2.0, delta=1e-5, accountant="rdp", sampling_rate=q)
    assert trainer.noise_multiplier == pytest.approx(direct.scale, rel=1e-9)


def test_the_papers_zcdp_calibration_spends_R_exactly_and_less_than_the_budget():
    shape = schedule_shape("gd-optimal", 25, kappa=5)
    paper = _trainer(shape, 25, schedule_calibration="zcdp")
    tight = _trainer(shape, 25)
    sig = np.asarray(_sigmas(paper.ledger_after(25)))
    rho = R_from_eps_delta(2.0, 1e-5) / 2  # Lemma B.3, with the root that reproduces the paper's example
    assert np.sum(0.5 / sig**2) == pytest.approx(rho, rel=1e-9)
    assert paper.epsilon(accountant="gdp").epsilon < 2.0  # the zCDP conversion is loose ...
    assert tight.noise_multiplier < paper.noise_multiplier  # ... so the exact calibration needs less noise


def _config(tmp_path, schedule, privacy="target_epsilon = 2.0", steps=8, sampling="poisson", extra=""):
    text = f"""
seed = 1
[data]
name = "synthetic"
options = {{ n = 300, dim = 8, num_classes = 2, separation = 3.0 }}
[model]
name = "logistic"
[privacy]
{privacy}
delta = 1e-5
sampling = "{sampling}"
[training]
steps = {steps}
batch_size = 60
learning_rate = 0.5
eval_every = 3
{extra}
[schedule]
{schedule}
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_run_with_a_schedule_resumes_to_the_same_ledger_and_model(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path, 'kind = "step"\noptions = { factor = 0.5, period = 3 }', sampling="full"))
    full = run_training(cfg, tmp_path / "full", progress=False)
    assert full["accountant"] == "gdp" and full["epsilon"] == pytest.approx(2.0, rel=1e-9)
    assert full["noise_schedule"]["levels"] == 3 and full["noise_schedule"]["kind"] == "step"
    run_interrupted(cfg, tmp_path / "cut", 4, monkeypatch)
    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    assert resumed["steps"] == full["steps"] == 8 and resumed["epsilon"] == full["epsilon"]
    assert (tmp_path / "cut" / "ledger.json").read_text() == (tmp_path / "full" / "ledger.json").read_text()
    a = torch.load(tmp_path / "full" / "private" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "private" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    ledger = json.loads((tmp_path / "full" / "ledger.json").read_text())
    assert [e["count"] for e in ledger["entries"]] == [3, 3, 2]  # runs of equal sigma merged


def test_resume_refuses_a_checkpoint_whose_steps_used_other_noise(tmp_path):
    schedule = 'kind = "step"\noptions = { factor = 0.5, period = 3 }'
    cfg = load_config(_config(tmp_path, schedule, privacy="noise_multiplier = 4.0", sampling="full"))
    run_training(cfg, tmp_path / "r", progress=False, stop_after=5)
    state = torch.load(tmp_path / "r" / "private" / "checkpoint.pt", weights_only=True)
    model = nn.Linear(8, 2)
    trainer = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        _data(240, 8),
        noise_multiplier=4.0,
        batch_size=240,
        sampling="full",
        noise_schedule=schedule_shape("step", 8, factor=0.5, period=2),  # another shape
    )
    with pytest.raises(DataError, match="at step 3 noise multiplier 4.0, this run has 2.0"):
        trainer.load_state_dict(state)


def test_the_train_command_runs_a_schedule_and_says_so(tmp_path, capsys):
    path = _config(tmp_path, 'kind = "gd-optimal"\noptions = { kappa = 10 }', sampling="full")
    code = main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "noise schedule  gd-optimal" in out
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    s = summary["noise_schedule"]
    assert summary["accountant"] == "gdp" and summary["epsilon"] == pytest.approx(2.0, rel=1e-9)
    assert s["levels"] == 8 and s["first"] > s["last"] and s["first"] == summary["noise_multiplier"]


BAD = {
    "unknown kind": ('kind = "cosine"', "schedule.kind must be one of none, uniform"),
    "option of another kind": ('kind = "step"\noptions = { kappa = 3 }', "schedule.options.kappa is not a parameter"),
    "options without kind": ("options = { kappa = 3 }", "[schedule] needs schedule.kind"),
    "gamma outside [0, 1)": ('kind = "gd-optimal"\noptions = { gamma = 1.0 }', "gamma"),
    "influence of the wrong length": ('kind = "influence"\noptions = { influence = [1.0, 2.0] }', "T=8"),
    "influence <= 0": ('kind = "influence"\noptions = { influence = [1, 1, 1, 1, 0, 1, 1, 1] }', "positive"),
    "influence file missing": ('kind = "influence"\noptions = { influence = "nope.txt" }', "no such file"),
    "levels < 0": ('kind = "exponential"\nlevels = -1', "schedule.levels must be an integer >= 0"),
    "zcdp without a target": ('kind = "exponential"\ncalibration = "zcdp"', "applies when privacy.target_epsilon"),
    "unknown calibration": ('kind = "exponential"\ncalibration = "best"', "schedule.calibration must be one of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_schedules_get_one_line_errors_and_exit_2(case, tmp_path, capsys):
    schedule, message = BAD[case]
    privacy = 'noise_multiplier = 2.0' if "zcdp" in case else "target_epsilon = 2.0"
    path = _config(tmp_path, schedule, privacy=privacy)
    out = tmp_path / "o"
    code = main(["train", "--config", str(path), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not out.exists()  # refused before anything was written


def test_schedules_do_not_combine_with_what_assumes_one_noise_multiplier(tmp_path, capsys):
    for extra, sampling, message in (
        ('update = "modelmix"', "poisson", "training.update = 'modelmix' is not supported"),
        ("", "fixed_size", 'needs privacy.sampling = "poisson" or "full"'),
        ("batch_growth = 1.0", "poisson", "constant expected batch size"),
    ):
        path = _config(tmp_path, 'kind = "exponential"', sampling=sampling, extra=extra)
        code = main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and message in err, err


def test_a_long_schedule_keeps_a_small_ledger(tmp_path):
    from dptrain.schedules.stage import shape_for

    full = load_config(_config(tmp_path, 'kind = "exponential"', sampling="full"))
    assert np.unique(shape_for(full, 500)).size == 500  # the exact shape
    assert np.unique(shape_for(full, 100_000)).size <= 1024  # rounded: a 10^5-step run has <= 1024 ledger entries
    poisson = load_config(_config(tmp_path, 'kind = "exponential"'))
    assert np.unique(shape_for(poisson, 100_000)).size == 16


def test_a_schedule_longer_than_its_budget_allows_is_refused():
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    with pytest.raises(ConfigError, match="the noise schedule has 30 steps but the budget"):
        make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.5),
            _data(),
            noise_multiplier=5.0,
            batch_size=200,
            sampling="full",
            noise_schedule=schedule_shape("gd-optimal", 30, kappa=10),
            budget=engine.Budget(1.0, 1e-5),
        )


def test_a_zcdp_budget_in_the_config_is_spent_exactly(tmp_path, capsys):
    """[schedule] R = 0.3927 (the paper's (4, 1e-8)): sum_t sigma_t^-2 = R exactly; the tightest accountant certifies
    less than the paper's conversion (epsilon 4 at delta 1e-8)."""
    text = _config(tmp_path, 'kind = "gd-optimal"\noptions = { kappa = 10 }\nR = 0.3927', privacy="", sampling="full")
    path = tmp_path / "r.toml"
    path.write_text(text.read_text().replace("delta = 1e-5", "delta = 1e-8"))
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    ledger = json.loads((tmp_path / "o" / "ledger.json").read_text())
    sigmas = [e["event"]["noise_multiplier"] for e in ledger["entries"] for _ in range(e["count"])]
    assert len(sigmas) == 8 and math.fsum(s**-2 for s in sigmas) == pytest.approx(0.3927, rel=1e-9)
    assert summary["noise_schedule"]["rho"] == pytest.approx(0.3927 / 2, rel=1e-9)
    assert summary["accountant"] == "gdp" and summary["epsilon"] < 4.0
    for bad, message in (
        ("R = 0.3927\nrho = 0.1", "not both"),
        ("R = -1.0", "schedule.R must be a finite number > 0"),
    ):
        p = tmp_path / "bad.toml"
        p.write_text(text.read_text().replace("R = 0.3927", bad))
        assert main(["train", "--config", str(p), "--out", str(tmp_path / "b"), "--no-progress"]) == 2
        assert message in capsys.readouterr().err
    p = tmp_path / "both.toml"
    p.write_text(_config(tmp_path, 'kind = "gd-optimal"\noptions = { kappa = 10 }\nR = 0.3927').read_text())
    assert main(["train", "--config", str(p), "--out", str(tmp_path / "c"), "--no-progress"]) == 2
    assert "sets the noise from its own budget" in capsys.readouterr().err
