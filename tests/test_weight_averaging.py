"""Weight averaging (training.ema; dptrain.engine.weight_averaging): the bias-corrected EMA of the released iterates,
post-processing only (the ledger, the certificate and the trajectory are those of the run without it), evaluated and
saved beside the last iterate, checkpointed and resumed bit for bit, refused where the iterates are not releases."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from dptrain import make_private
from dptrain.config import load_config
from dptrain.errors import ConfigError, DataError
from dptrain.runs.report import format_report
from dptrain.runs.run import run_training


def _trainer(ema, seed=3, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    return make_private(model, opt, (x, y), noise_multiplier=1.1, batch_size=20, seed=seed, ema=ema, **options)


def test_the_ema_is_the_bias_corrected_average_of_the_released_iterates():
    beta, steps = 0.8, 7
    trainer = _trainer(beta)
    iterates = []
    trainer.train(steps=steps, callback=lambda r: iterates.append(
        {n: p.detach().double().clone() for n, p in trainer.params.items()}))
    for n in trainer.params:
        expected = sum(beta ** (steps - s) * iterates[s - 1][n] for s in range(1, steps + 1)) * (1 - beta) / (
            1 - beta**steps)
        torch.testing.assert_close(trainer.weight_average.averages[n].double(), expected, rtol=1e-5, atol=1e-7)
    # after one step it is that step's iterate exactly (the initialization has no weight)
    one = _trainer(0.999)
    one.step()
    assert all(torch.equal(one.weight_average.averages[n], p) for n, p in one.params.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_average_of_a_low_precision_model_moves(dtype):
    """Iterates theta_t = 1 + t / 1000 in bfloat16 or float16, decay 0.99: the average keeps up with the float64 EMA of
    the same iterates. Before, it was kept in the parameters' dtype and each step's move (about 1e-3) rounded away: it
    stayed at theta_1 for ever, and the released average was the first iterate."""
    from dptrain.engine.weight_averaging import WeightAverage

    param = torch.zeros(3, dtype=dtype)
    average = WeightAverage({"w": param}, 0.99)
    num = den = 0.0
    for t in range(1, 301):
        param.fill_(1 + t / 1000)
        average.update(t)
        value = float(param[0])  # (the iterate as the model holds it)
        num, den = 0.99 * num + 0.01 * value, 0.99 * den + 0.01
    assert abs(float(average.averages["w"][0]) - num / den) < 1e-5 and num / den > 1.2
    with average.applied():  # applied: rounded to the model's dtype once
        assert param.dtype == dtype and torch.equal(param, average.averages["w"].to(dtype))


def test_the_ema_is_post_processing_the_ledger_and_the_trajectory_are_unchanged():
    plain, averaged = _trainer(None), _trainer(0.9)
    plain.train(steps=5)
    averaged.train(steps=5)
    assert plain.ledger.to_dict() == averaged.ledger.to_dict()
    assert plain.epsilon().epsilon == averaged.epsilon().epsilon
    assert all(torch.equal(p, averaged.params[n]) for n, p in plain.params.items())
    # applied() evaluates the average and puts the iterate back bit for bit
    before = {n: p.detach().clone() for n, p in averaged.params.items()}
    with averaged.weight_average.applied():
        assert all(torch.equal(p, averaged.weight_average.averages[n]) for n, p in averaged.params.items())
    assert all(torch.equal(before[n], p) for n, p in averaged.params.items())


def test_ema_is_refused_where_the_iterates_are_not_releases():
    with pytest.raises(ConfigError, match="releases only its last iterate"):
        _trainer(0.9, release="last_iterate")
    for bad in (0, 1, 1.5, -0.1, True):
        with pytest.raises(ConfigError, match="training.ema must be a decay in"):
            _trainer(bad)


def test_a_checkpoint_without_an_average_is_refused_by_a_run_with_one():
    plain = _trainer(None)
    plain.step()
    with pytest.raises(DataError, match="no weight average"):
        _trainer(0.9).load_state_dict(plain.state_dict())


def _images(tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 1, 8, 8)).astype(np.float32)
    y = (x[:, 0, 2:6, 2:6].mean((1, 2)) > 0).astype(np.int64)
    np.savez(tmp_path / "d.npz", x=x[:240], y=y[:240], x_test=x[240:], y_test=y[240:])
    return tmp_path / "d.npz"


def _cfg(path, *extra):
    return load_config(None, [
        'data.name="npz"', f'data.path="{path}"', "data.options.num_classes=2", 'model.name="mlp"',
        "privacy.noise_multiplier=1.0", "training.steps=8", "training.batch_size=40", "training.eval_every=4",
        "seed=1", "training.ema=0.9", *extra,
    ])


@pytest.mark.slow
def test_a_run_reports_and_saves_both_models_and_resumes_bit_identically(tmp_path, monkeypatch):
    from conftest import run_interrupted

    path = _images(tmp_path)
    augment = "training.augment={ multiplicity = 2, crop_padding = 1, flip = true }"  # (resumed with the EMA: same views)
    summary = run_training(_cfg(path, augment), tmp_path / "whole", progress=False)
    assert summary["test_accuracy"] is not None and summary["test_accuracy_ema"] is not None
    assert summary["model_ema"]["decay"] == 0.9
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert all("test_accuracy_ema" in r for r in rows) and len(rows) == 2
    last = torch.load(tmp_path / "whole" / "model.pt")["state_dict"]
    ema = torch.load(tmp_path / "whole" / "model_ema.pt")["state_dict"]
    assert set(last) == set(ema) and any(not torch.equal(last[k], ema[k]) for k in last)
    assert "test accuracy (EMA)" in format_report(summary)
    # the EMA model's accuracy is what model_ema.pt scores
    from dptrain.data.loaders import load_npz
    from dptrain.models.builders import build_model

    data = load_npz(path, num_classes=2)
    model = build_model("mlp", data.train.input_shape, 2)
    model.load_state_dict(ema)
    with torch.no_grad():
        acc = float((model(data.test.x).argmax(1) == data.test.y).float().mean())
    assert acc == pytest.approx(summary["test_accuracy_ema"])
    # interrupted after 3 steps and resumed: the same two models, bit for bit
    run_interrupted(_cfg(path, augment), tmp_path / "cut", 3, monkeypatch)
    resumed = run_training(None, tmp_path / "cut", resume=True, progress=False)
    for name in ("model.pt", "model_ema.pt"):
        a = torch.load(tmp_path / "whole" / name)["state_dict"]
        b = torch.load(tmp_path / "cut" / name)["state_dict"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["test_accuracy_ema"] == summary["test_accuracy_ema"]


def test_a_private_test_split_keeps_the_ema_accuracy_out_unless_asked(tmp_path):
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "s.npz", x=x, y=(x.mean((1, 2, 3)) > 0).astype(np.int64))
    summary = run_training(_cfg(tmp_path / "s.npz"), tmp_path / "a", progress=False)
    assert "test_accuracy_ema" not in summary and summary["test_accuracy"] is None
    assert all("test_accuracy_ema" not in json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines())
    logged = run_training(_cfg(tmp_path / "s.npz", "training.log_not_private=true"), tmp_path / "b", progress=False)
    assert logged["not_private"]["test_accuracy_ema"] is not None
    assert "NOT private" in format_report(logged).split("test accuracy (EMA)")[1].splitlines()[0]
