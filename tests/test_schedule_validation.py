"""The validation noise schedule and privacy filters (dptrain.schedules.validation, dptrain.accounting.filters).

Its noise is chosen during the run from a validation signal, so only a privacy filter fixed before the run certifies
it. Whatever the signal (random or adversarial), a run never spends more than its budget, measured independently of
the filter's own code; the filter is not wasteful (one more step would pass the budget); other accountants refuse the
ledger; a resumed run equals an uninterrupted one."""

import json
import math
import warnings

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from conftest import run_interrupted
from dp_accounting.rdp import rdp_privacy_accountant
from torch import nn

from dptrain.accounting import Ledger, all_reports, epsilon
from dptrain.accounting.filters import make_filter
from dptrain.accounting.gdp import gdp_delta, gdp_epsilon
from dptrain.accounting.ledger import FILTER_FACT
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.engine.api import make_private
from dptrain.errors import AccountingError, BudgetExhausted, ConfigError
from dptrain.runs.run import run_training
from dptrain.schedules.validation import validation_noise

warnings.filterwarnings("ignore", message="not private")


def _sigmas(ledger):
    out = []
    for e in ledger.entries:
        ev = e.event
        while not isinstance(ev, dpa.GaussianDpEvent):
            ev = ev.event
        out += [ev.noise_multiplier] * e.count
    return out


def test_filter_budgets_are_the_largest_that_meet_the_target():
    f = make_filter("gdp", 1.5, 1e-6)
    mu = math.sqrt(f.budget)
    assert gdp_epsilon(mu, 1e-6) <= 1.5 and gdp_delta(1.5, mu * (1 + 1e-12)) > 1e-6
    f = make_filter("rdp", 1.5, 1e-6, sampling_rate=0.02, order=12)
    conv = lambda b: rdp_privacy_accountant.compute_epsilon([12], [b], 1e-6)[0]  # noqa: E731
    assert conv(f.budget) <= 1.5 < conv(f.budget * (1 + 1e-12))
    with pytest.raises(Exception, match="full-batch"):
        make_filter("gdp", 1.5, 1e-6, sampling_rate=0.5)
    with pytest.raises(Exception, match="one integer order"):
        make_filter("rdp", 1.5, 1e-6, sampling_rate=0.5)


def _run(signal, sampling_rate, seed, factor=0.5, steps=40, calibration="tightest"):
    """A run of a validation schedule fed ``signal(step, rng)`` after every step (the most adaptive case)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Linear(5, 2)
    controller = validation_noise(
        steps, 1.0, 1e-5, sampling_rate=sampling_rate, factor=factor, initial=1.3, calibration=calibration
    )
    trainer = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        (x, y),
        noise_multiplier=controller.sigma,
        batch_size=200 * sampling_rate,
        sampling="full" if sampling_rate == 1 else "poisson",
        noise_controller=controller,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    for _ in range(10 * steps):
        if not trainer.can_step():
            break
        trainer.step()
        trainer.observe_validation(signal(trainer.steps, rng))
    return trainer, controller


SIGNALS = {
    "random": lambda t, rng: rng.normal(),
    "never improves": lambda t, rng: 0.0,  # the noise falls at every step: the fastest spend
    "improves then stalls": lambda t, rng: min(t, 5) + rng.normal() * 1e-3,
    "non-finite": lambda t, rng: math.nan if t % 2 else t,
}


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_a_validation_schedule_never_overspends_whatever_the_signal(name):
    for seed in range(4):
        # full batches: the gdp filter, checked by the exact composition of the realized steps
        trainer, controller = _run(SIGNALS[name], 1.0, seed)
        sig = _sigmas(trainer.ledger)
        mu = math.sqrt(math.fsum(s**-2 for s in sig))
        assert gdp_epsilon(mu, 1e-5) <= 1.0
        # ... and not wasteful: one more step at the next sigma would pass the budget
        assert gdp_epsilon(math.sqrt(mu**2 + controller.sigma**-2), 1e-5) > 1.0
        with pytest.raises(BudgetExhausted, match="privacy filter"):
            trainer.step()
        assert trainer.epsilon().epsilon <= 1.0 and trainer.epsilon().accountant == "filter"
        # Poisson sampling: the rdp filter at its fixed order, checked with dp_accounting on the realized steps
        trainer, controller = _run(SIGNALS[name], 0.1, seed)
        acc = rdp_privacy_accountant.RdpAccountant([controller.filter.order])
        for s in _sigmas(trainer.ledger):
            acc.compose(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(s)))
        assert acc.get_epsilon(1e-5) <= 1.0
        if name == "never improves":
            assert controller.decays >= 2 and len(set(_sigmas(trainer.ledger))) >= 2


def test_the_papers_zcdp_filter_is_algorithm_1s_residual_budget():
    trainer, controller = _run(SIGNALS["never improves"], 1.0, 0, calibration="zcdp")
    rho = math.fsum(0.5 * s**-2 for s in _sigmas(trainer.ledger))
    assert controller.filter.kind == "zcdp" and rho <= controller.filter.budget
    assert rho + 0.5 * controller.sigma**-2 > controller.filter.budget


def test_only_the_filter_certifies_an_adaptive_ledger():
    trainer, _ = _run(SIGNALS["random"], 0.1, 0)
    reports, refusals = all_reports(trainer.ledger, 1e-5)
    assert set(reports) == {"filter"} and "chose its noise adaptively" in refusals["rdp"]
    assert epsilon(trainer.ledger, 1e-5, "filter").epsilon <= 1.0
    # at another delta the filter's budget is converted (a fixed number, not the realized spend)
    assert epsilon(trainer.ledger, 1e-3, "filter").epsilon < epsilon(trainer.ledger, 1e-5, "filter").epsilon


CONFIG = """
seed = 2
[data]
name = "npz"
path = "{data}"
options = {{ num_classes = 2 }}
[model]
name = "logistic"
[privacy]
{privacy}
delta = 1e-5
[training]
steps = 30
batch_size = 60
learning_rate = 0.5
eval_every = 2
[schedule]
{schedule}
"""


def _npz(tmp_path):
    """A data set with its own test set (the validation kind refuses a test set split off the training data)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    path = tmp_path / "d.npz"
    np.savez(path, x=x[:300], y=y[:300], x_test=x[300:], y_test=y[300:])
    return path


def _config(tmp_path, schedule='kind = "validation"\noptions = { factor = 0.6, initial = 1.1 }', privacy="target_epsilon = 1.0"):
    path = tmp_path / "v.toml"
    path.write_text(CONFIG.format(privacy=privacy, schedule=schedule, data=_npz(tmp_path)))
    return path


def test_a_validation_run_resumes_to_the_same_ledger_and_model(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path))
    full = run_training(cfg, tmp_path / "full", progress=False)
    assert full["accountant"] == "filter" and full["epsilon"] <= 1.0 and full["finished"]
    assert full["noise_schedule"]["decays"] >= 1 and full["steps"] < 30  # lower noise: the budget ends sooner
    run_interrupted(cfg, tmp_path / "cut", 7, monkeypatch)
    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    assert resumed["steps"] == full["steps"]
    assert (tmp_path / "cut" / "ledger.json").read_text() == (tmp_path / "full" / "ledger.json").read_text()
    a = torch.load(tmp_path / "full" / "private" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "private" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    metrics = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics]  # every 2 steps, then the final evaluation, each once
    assert steps == sorted(set(steps)) and steps[-1] == full["steps"] and all(s % 2 == 0 for s in steps[:-1])


@pytest.mark.parametrize(
    "schedule, privacy, message",
    [
        ('kind = "validation"', "noise_multiplier = 1.0", "needs privacy.target_epsilon"),
        ('kind = "validation"\noptions = { factor = 1.5 }', "target_epsilon = 1.0", "factor must be a number in (0, 1)"),
        ('kind = "validation"\noptions = { patience = 0 }', "target_epsilon = 1.0", "patience must be an integer >= 1"),
        ('kind = "validation"\noptions = { kappa = 2 }', "target_epsilon = 1.0", "not a parameter of schedule kind"),
        ('kind = "validation"\nlevels = 4', "target_epsilon = 1.0", "does not apply"),
    ],
)
def test_bad_validation_schedules_exit_2(tmp_path, capsys, schedule, privacy, message):
    """(and a test set split off the training examples is not public data)"""
    path = _config(tmp_path, schedule, privacy)
    code = main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_test_set_split_off_the_training_data_cannot_drive_the_noise(tmp_path, capsys):
    path = tmp_path / "s.toml"
    text = _config(tmp_path).read_text().replace('name = "npz"', 'name = "synthetic"').replace(
        f'path = "{tmp_path / "d.npz"}"\noptions = {{ num_classes = 2 }}', "options = { n = 300, dim = 8 }"
    )
    path.write_text(text)
    code = main(["train", "--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "splits its test set off the training examples" in err and not (tmp_path / "o").exists()


def _filtered_ledger(fact_changes=None, event=None, count=5):
    f = make_filter("rdp", 1.0, 1e-5, sampling_rate=0.01, order=16)
    fact = {**f.to_fact(), **(fact_changes or {})}
    ledger = Ledger()
    ev = event or dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(3.0))
    ledger.record(ev, {FILTER_FACT: fact}, count)
    return ledger


def test_the_filter_accountant_refuses_crafted_ledgers():
    assert epsilon(_filtered_ledger(), 1e-5, "filter").epsilon <= 1.0
    crafted = {
        "events sampled at another rate than the filter says": _filtered_ledger(
            event=dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(3.0)), count=50
        ),
        "a NaN budget": _filtered_ledger({"budget": math.nan}),
        "a NaN noise multiplier": _filtered_ledger(event=dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(math.nan))),
        "a Laplace release": _filtered_ledger(event=dpa.LaplaceDpEvent(1.0)),
        "an order that is not an integer": _filtered_ledger({"order": 2.5}),
    }
    for what, ledger in crafted.items():
        with pytest.raises(AccountingError):
            epsilon(ledger, 1e-5, "filter")
            pytest.fail(what)


def test_the_engine_ties_the_filter_to_its_sampler():
    x = torch.randn(100, 5)
    y = (x[:, 0] > 0).long()
    controller = validation_noise(40, 1.0, 1e-5, sampling_rate=0.01)
    for sampling, batch, message in (("poisson", 50, "planned for sampling rate 0.01"), ("fixed_size", 1, "Poisson or full")):
        model = nn.Linear(5, 2)
        with pytest.raises(ConfigError, match=message):
            make_private(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                (x, y),
                noise_multiplier=controller.sigma,
                batch_size=batch,
                sampling=sampling,
                noise_controller=controller,
            )
