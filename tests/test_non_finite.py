"""Non-finite values stop a run with a clear error on every path: whatever the clipping rule lets through, whatever part
of the training state (weights, optimizer state, weight average) overflows, and whatever a checkpoint holds."""

import json

import pytest
import torch
from torch import nn

from dptrain.cli import main
from dptrain.engine.api import make_private
from dptrain.errors import NonFiniteError
from dptrain.last_iterate.stages import LipschitzBound


def _data(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


class NaNGradientForOne(nn.Module):
    """A finite loss for every example, and a NaN gradient for the example whose first feature is ``at`` (the
    derivative of sqrt at 0, times 0): one example's per-example gradient is NaN, the others' are not."""

    def __init__(self, at: float):
        super().__init__()
        self.linear, self.at = nn.Linear(5, 3), at

    def forward(self, x):
        u = (x[:, :1] - self.at + 0 * self.linear.weight.sum()).abs()
        return self.linear(x) + 0 * u.sqrt()


def _trainer(model, optimizer, data, **options):
    return make_private(model, optimizer, data, noise_multiplier=1.0, check_independence=False, **options)


def test_a_nan_that_a_clipping_rule_lets_through_is_never_released():
    # A rule that does not screen each example (the Lipschitz bound of projected noisy SGD reads NaN norms as within
    # the bound) must not put a NaN into the release: the release itself is checked. Before, the step was recorded in
    # the ledger and its NaN gradient applied (the weights' check came after the release).
    x, y = _data()
    model = NaNGradientForOne(float(x[5, 0]))
    trainer = _trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), sampling="full")
    trainer.clipping = LipschitzBound(1e9)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match="noisy gradient of step 1 is not finite"):
        trainer.step()
    assert trainer.ledger.releases == 0 and trainer.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_nan_gradient_of_one_example_is_not_clipped_to_zero():
    x, y = _data()
    model = NaNGradientForOne(float(x[5, 0]))
    trainer = _trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), sampling="full")
    with pytest.raises(NonFiniteError, match="not finite"):
        trainer.step()
    assert trainer.ledger.releases == 0


@pytest.mark.parametrize("ema", [None, 0.9])
def test_an_optimizer_state_that_overflows_stops_the_run(ema):
    # Adam's second moment of a noisy gradient ~1e28 overflows float32 to inf: the weights stay finite (the update is
    # m / sqrt(inf) = 0) and, before, the run went on silently with a dead optimizer, checkpointing the inf state.
    x, y = _data()
    model = nn.Linear(5, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    trainer = _trainer(model, opt, (x, y), batch_size=32, max_grad_norm=1e30, ema=ema)
    with pytest.raises(NonFiniteError, match=r"step 1: the optimizer's state hold NaN or inf"):
        trainer.train(steps=3)


def test_a_checkpoint_holding_a_non_finite_state_is_not_continued():
    x, y = _data()
    model = nn.Linear(5, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    trainer = _trainer(model, opt, (x, y), batch_size=32, ema=0.9)
    trainer.train(steps=2)
    state = trainer.state_dict()
    state["weight_average"]["averages"]["bias"][0] = float("nan")
    again = nn.Linear(5, 3)
    resumed = _trainer(again, torch.optim.Adam(again.parameters(), lr=0.1), (x, y), batch_size=32, ema=0.9)
    with pytest.raises(NonFiniteError, match=r"checkpoint's weight average \(EMA\) hold NaN or inf"):
        resumed.load_state_dict(state)


def test_the_cli_stops_a_run_whose_optimizer_state_overflows_and_keeps_its_files(tmp_path, capsys):
    out = tmp_path / "r"
    args = ["train", "--out", str(out), "--no-progress"]
    for item in ['data.name="synthetic"', "data.options={n = 400, dim = 10, num_classes = 3, separation = 3.0}",
                 'model.name="logistic"', "training.epochs=1", "training.batch_size=100", 'training.optimizer="adam"',
                 "privacy.noise_multiplier=1.0", "privacy.max_grad_norm=1e30"]:
        args += ["--set", item]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "optimizer's state hold NaN or inf" in err, err
    # nothing released as a normal result; what was written before stays
    assert (out / "config.toml").exists() and not (out / "model.pt").exists() and not (out / "summary.json").exists()
    ledger = json.loads((out / "ledger.json").read_text()) if (out / "ledger.json").exists() else {}
    assert "NaN" not in json.dumps(ledger)


class NaNAfter(nn.Module):
    """Finite until ``poisoned`` is set (as if a bad example were first drawn into a batch at that step)."""

    def __init__(self):
        super().__init__()
        self.linear, self.poisoned = nn.Linear(5, 3), False

    def forward(self, x):
        out = self.linear(x)
        return out * float("nan") if self.poisoned else out


def test_a_run_stopped_by_its_data_after_a_release_is_labelled_not_private(tmp_path):
    """The step at which non-finite values from a private batch stop a run depends on the data and on the secret
    batches, and it is released (the steps recorded, the error's step): the run is labelled not private, in the API
    and in the run directory (its summary and ledger written as they stand). Stopped before any release, nothing is."""
    x, y = _data()
    model = NaNAfter()
    first = _trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=16)
    model.poisoned = True
    with pytest.raises(NonFiniteError):
        first.step()
    assert first.private and first.ledger.private  # (nothing released)

    model = NaNAfter()
    trainer = _trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=16)
    trainer.step()
    model.poisoned = True
    with pytest.raises(NonFiniteError, match="step 2"):
        trainer.step()
    assert not trainer.private and not trainer.ledger.private and not trainer.epsilon().certified
    assert "stopped at step 2" in trainer.not_private_reasons[0]

    from dptrain.config import load_config
    from dptrain.runs.run import RunHooks, run_training

    cfg = load_config(None, ['data.name="synthetic"', "data.options={n = 200, dim = 5, num_classes = 3}",
                             'model.name="logistic"', "training.steps=6", "training.batch_size=20",
                             "privacy.noise_multiplier=1.0", "privacy.delta=1e-3"])

    def poison_after_two_steps(job):
        step = job.trainer.step

        def stepped():
            if job.trainer.steps == 2:
                job.trainer.model.forward = lambda x: torch.full((len(x), 3), float("nan"))
            return step()

        job.trainer.step = stepped

    with pytest.raises(NonFiniteError):
        run_training(cfg, tmp_path / "r", progress=False, hooks=RunHooks(prepare=poison_after_two_steps))
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    ledger = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert summary["private"] is False and "stopped at step 3" in summary["not_private_because"][0]
    assert ledger["private"] is False and summary["steps"] == 2


def test_nan_in_the_data_is_refused_before_the_first_step_on_every_loader(tmp_path):
    """NaN in one example is refused when the trainer is made (and a memory-mapped npz's inputs, train and test, when
    loaded), never met at the late step that first samples it: that moment depends on the data (before, make_private
    ran 4 steps and stopped, the run labelled not private; a mapped x_test with a NaN gave a test accuracy)."""
    import numpy as np

    from dptrain.data.memmap import load_npz_mapped
    from dptrain.errors import DataError

    x, y = _data()
    x[41, 2] = float("nan")
    model = nn.Linear(5, 3)
    with pytest.raises(DataError, match="the data's inputs hold NaN .* pass a mask of them as an input"):
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=1.0, batch_size=8)
    a = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float64)
    labels = np.zeros(40, dtype=np.int64)
    for where, bad in (("x", np.inf), ("x_test", np.nan), ("x", 1e39)):  # (1e39: inf in float32, as training reads it)
        arrays = {"x": a.copy(), "y": labels, "x_test": a[:10].copy(), "y_test": labels[:10]}
        arrays[where][7, 1] = bad
        np.savez(tmp_path / "d.npz", **arrays)
        with pytest.raises(DataError, match=f"'{where}' must hold finite numbers"):
            load_npz_mapped(tmp_path / "d.npz", 2)
