"""A step is atomic with respect to interrupts and errors: a signal at any point of a step lets the step finish, and
an error before the release rolls the random streams back, so the run continues exactly as an uninterrupted one.

The runs here use an explicit seed (the reproducibility option): only a reproducible run can be compared with
another one draw for draw.
"""

import os
import signal

import pytest
import torch

from dptrain.data.loaders import make_gaussian_mixture
from dptrain.engine import trainer as engine_module
from dptrain.engine.api import make_private
from dptrain.models.builders import build_model

STEPS, CUT = 8, 5  # the interrupt or error strikes during step CUT (1-based)
STAGES = ("sample", "per_example", "clip", "noise", "record", "optimizer")


def _trainer(seed=11):
    torch.manual_seed(0)
    split = make_gaussian_mixture(n=300, dim=6, num_classes=3, separation=3.0, seed=0)
    model = build_model("mlp", (6,), 3, hidden=[8])
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return make_private(
        model, opt, split.train, noise_multiplier=1.0, batch_size=30, seed=seed, accountant="rdp"
    )


pytestmark = pytest.mark.usefixtures("sigint_raises")  # tests/conftest.py


def _reference():
    t = _trainer()
    t.train(steps=STEPS)
    return t


class _Proxy:
    """Wraps a stage object, calling ``hook`` before its ``method``."""

    def __init__(self, inner, method, hook):
        self._inner, self._method, self._hook = inner, method, hook

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def wrapped(*args, **kwargs):
            self._hook()
            return attr(*args, **kwargs)

        return wrapped


def _install(trainer, stage, hook, monkeypatch):
    """Call ``hook`` at ``stage`` of every step of ``trainer``."""
    if stage == "sample":
        trainer.sampler = _Proxy(trainer.sampler, "sample", hook)
    elif stage == "per_example":
        inner = trainer.per_example

        def per_example(idx):
            hook()
            return inner(idx)

        trainer.per_example = per_example
    elif stage == "clip":
        trainer.clipping = _Proxy(trainer.clipping, "clip_and_sum", hook)
    elif stage == "noise":
        real = engine_module.add_gaussian_noise

        def noise(*args):
            hook()
            return real(*args)

        monkeypatch.setattr(engine_module, "add_gaussian_noise", noise)
    elif stage == "record":
        ledger, real_record = trainer.ledger, trainer.ledger.record

        def record(*args, **kwargs):
            hook()
            return real_record(*args, **kwargs)

        ledger.record = record
    elif stage == "optimizer":
        real_step = trainer.optimizer.step

        def opt_step(*args, **kwargs):
            hook()
            return real_step(*args, **kwargs)

        trainer.optimizer.step = opt_step


def _same_run(a, b):
    assert a.steps == b.steps == STEPS
    assert a.ledger.to_dict() == b.ledger.to_dict()
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("stage", STAGES)
def test_a_signal_at_any_stage_of_a_step_lets_it_finish_and_resume_equals_uninterrupted(stage, monkeypatch):
    reference = _reference()
    cut = _trainer()
    calls = []

    def hook():  # every stage runs once per step here (one physical chunk)
        calls.append(1)
        if len(calls) == CUT:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, in the middle of step CUT

    _install(cut, stage, hook, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        cut.train(steps=STEPS)
    assert cut.steps == CUT  # the interrupted step completed before the interrupt took effect
    state = cut.state_dict()
    monkeypatch.undo()
    resumed = _trainer(seed=999)  # the checkpoint carries the streams: the new trainer's seed does not matter
    resumed.load_state_dict(state)
    resumed.train(steps=STEPS - CUT)
    _same_run(reference, resumed)


@pytest.mark.parametrize("stage", STAGES[:4])
def test_an_error_before_the_release_rolls_back_and_a_retry_is_the_same_step(stage, monkeypatch):
    reference = _reference()
    cut = _trainer()
    fired = []

    def hook():
        fired.append(1)
        if len(fired) == CUT:
            raise RuntimeError("transient failure (say, out of memory)")

    _install(cut, stage, hook, monkeypatch)
    cut.train(steps=CUT - 1)
    ledger_before = cut.ledger.to_dict()
    with pytest.raises(RuntimeError, match="transient"):
        cut.step()
    assert cut.steps == CUT - 1 and cut.ledger.to_dict() == ledger_before  # nothing released
    assert all(p.grad is None for p in cut.model.parameters())
    cut.train(steps=STEPS - cut.steps)  # the retried step draws the same batch and noise
    _same_run(reference, cut)


def test_sigterm_is_deferred_to_the_end_of_the_step(monkeypatch):
    from dptrain.engine.interrupts import Terminated, terminate_as_exception

    cut = _trainer()

    calls = []

    def hook():
        calls.append(1)
        if len(calls) == CUT:
            os.kill(os.getpid(), signal.SIGTERM)

    _install(cut, "noise", hook, monkeypatch)
    with terminate_as_exception(), pytest.raises(Terminated):
        cut.train(steps=STEPS)
    assert cut.steps == CUT and cut.ledger.releases == CUT
