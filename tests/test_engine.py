"""The DP-SGD engine: clipping bound, noise scale, ledger events, budget enforcement, determinism."""

import math

import pytest
import torch
from torch import nn

from dptrain.accounting import epsilon
from dptrain.data.loaders import make_gaussian_mixture
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.errors import BudgetExhausted, ConfigError, ModelError
from dptrain.models.builders import build_model
from dptrain.randomness.generators import TorchStream
from dptrain.stages.clipping import FlatClipping, PerLayerClipping, per_example_norms
from dptrain.stages.noise import add_gaussian_noise
from dptrain.stages.per_example import PerExampleGrads


def _grads(b=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return PerExampleGrads(
        {"w": 3 * scale * torch.randn(b, 5, 4, generator=g), "b": scale * torch.randn(b, 5, generator=g)}
    )


@pytest.mark.parametrize("rule", [FlatClipping(1.0), PerLayerClipping(1.0), FlatClipping(0.05)])
def test_each_clipped_example_is_within_the_bound(rule):
    grads = _grads()
    # Clip example by example (sum over a batch of one) and check the norm bound.
    for i in range(64):
        one = PerExampleGrads({n: g[i : i + 1] for n, g in grads.materialize().items()})
        clipped, stats = rule.clip_and_sum(one)
        norm = math.sqrt(sum(float(c.pow(2).sum()) for c in clipped.values()))
        assert norm <= rule.sensitivity * (1 + 1e-6)
    _, stats = rule.clip_and_sum(grads)
    assert stats.examples == 64 and stats.clipped == 64  # every norm here is far above the bound


def test_clipping_leaves_small_gradients_alone():
    grads = _grads(scale=1e-3)
    summed, stats = FlatClipping(1.0).clip_and_sum(grads)
    assert stats.clipped == 0
    for n, g in grads.materialize().items():
        torch.testing.assert_close(summed[n], g.sum(0))
    assert per_example_norms(grads).max() < 1.0


def test_noise_has_the_configured_standard_deviation():
    # 400k draws: the sample std has relative standard error 1/sqrt(2n) ~ 0.11%; we allow 1% (~9 s.e.).
    std = 2.5
    noisy = add_gaussian_noise({"a": torch.zeros(400_000)}, std, TorchStream(0))["a"]
    assert float(noisy.std()) == pytest.approx(std, rel=0.01)
    assert abs(float(noisy.mean())) < 5 * std / math.sqrt(400_000)


def test_noise_of_several_tensors_is_independent_with_the_configured_std():
    """The tensors of one dtype are noised as one vector and returned as views of it: each keeps its shape and
    values, gets noise of the configured std, and no two share a draw (a reused draw would correlate them fully)."""
    std, n = 1.5, 200_000
    summed = {"w": torch.full((400, 500), 3.0), "b": torch.full((n,), -1.0), "h": torch.zeros(7, dtype=torch.float64)}
    noisy = add_gaussian_noise(summed, std, TorchStream(0))
    assert {k: (v.shape, v.dtype) for k, v in noisy.items()} == {k: (v.shape, v.dtype) for k, v in summed.items()}
    w, b = (noisy["w"] - 3.0).reshape(-1), noisy["b"] + 1.0
    for e in (w, b):
        assert float(e.std()) == pytest.approx(std, rel=0.01)
        assert abs(float(e.mean())) < 5 * std / math.sqrt(n)
    assert abs(float(torch.corrcoef(torch.stack([w, b]))[0, 1])) < 5 / math.sqrt(n)
    assert float(summed["w"].max()) == 3.0  # the inputs are left as they were


def test_engine_gradient_is_noise_with_std_sigma_c_over_expected_batch():
    # Zero inputs and no bias: every per-example gradient is 0, so the optimizer sees pure noise with
    # std sigma * C / (q n). 100k coordinates: 1.5% tolerance is > 6 standard errors.
    n, q, sigma, clip = 1000, 0.05, 1.3, 0.7
    model = nn.Linear(1000, 100, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = (torch.zeros(n, 1000), torch.zeros(n, dtype=torch.long))
    trainer = make_private(model, opt, data, noise_multiplier=sigma, max_grad_norm=clip, batch_size=q * n)
    before = model.weight.detach().clone()
    trainer.step()
    update = before - model.weight.detach()  # lr = 1: the privatized gradient itself
    assert float(update.std()) == pytest.approx(sigma * clip / (q * n), rel=0.015)


def _synthetic(n=400, seed=0):
    return make_gaussian_mixture(n=n, dim=10, num_classes=3, separation=4.0, seed=seed)


def _trainer(seed=0, physical=256, **kw):
    torch.manual_seed(seed)
    split = _synthetic()
    model = build_model("mlp", (10,), 3, hidden=[16])
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    defaults = dict(
        noise_multiplier=1.0, max_grad_norm=1.0, batch_size=40, seed=seed, max_physical_batch_size=physical
    )
    return make_private(model, opt, split.train, **{**defaults, **kw}), split


def test_every_step_is_one_ledger_release():
    trainer, split = _trainer()
    trainer.train(steps=7)
    assert trainer.ledger.releases == 7 and len(trainer.ledger.entries) == 1
    entry = trainer.ledger.entries[0]
    assert entry.facts["sampling"] == "poisson" and entry.facts["clip_norm"] == 1.0
    assert entry.event.sampling_probability == pytest.approx(40 / len(split.train))


def test_training_learns_and_is_deterministic_given_the_seed():
    a, split = _trainer(seed=3, noise_multiplier=0.5)
    b, _ = _trainer(seed=3, noise_multiplier=0.5)
    a.train(epochs=5)
    b.train(epochs=5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.evaluate(split.test.x, split.test.y) > 0.8  # 3 well-separated classes; chance is 1/3


def test_physical_chunks_do_not_change_the_result():
    a, _ = _trainer(physical=256)
    b, _ = _trainer(physical=7)
    a.train(steps=5)
    b.train(steps=5)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_budget_is_never_exceeded():
    torch.manual_seed(0)
    split = _synthetic()
    model = build_model("logistic", (10,), 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = make_private_with_epsilon(
        model, opt, split.train, target_epsilon=1.0, target_delta=1e-5, epochs=3, batch_size=32
    )
    planned = trainer.steps_for(epochs=3)
    assert trainer.allowed_steps() == planned  # sigma was calibrated for exactly this many steps
    trainer.train(steps=planned + 50)  # asks for more than the budget allows: stops at the boundary
    assert trainer.steps == planned
    assert epsilon(trainer.ledger, 1e-5).epsilon <= 1.0
    with pytest.raises(BudgetExhausted, match="allows"):
        trainer.step()


def test_batchnorm_models_are_refused_with_groupnorm_advice():
    model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ModelError, match="GroupNorm"):
        make_private(model, opt, _synthetic().train, noise_multiplier=1.0, batch_size=10)


def test_optimizer_must_hold_the_model_parameters():
    model = build_model("logistic", (10,), 3)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="optimizer does not hold"):
        make_private(model, opt, _synthetic().train, noise_multiplier=1.0, batch_size=10)


def test_full_batch_sampling_records_gaussian_events():
    trainer, _ = _trainer(sampling="full", batch_size=None)
    trainer.train(steps=3)
    assert trainer.ledger.entries[0].facts["sampling"] == "full"
    assert epsilon(trainer.ledger, 1e-5, "gdp").certified  # full-batch Gaussian: GDP is exact


def test_an_empty_poisson_batch_still_releases_pure_noise():
    # q = 1/n on a tiny set: many batches are empty. Each such step must still add noise and be recorded.
    torch.manual_seed(0)
    n = 8
    model = nn.Linear(3, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = (torch.randn(n, 3), torch.randint(0, 2, (n,)))
    trainer = make_private(
        model,
        opt,
        data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        batch_size=0.01 * n,
        seed=1,
        report_not_private=True,
    )
    sizes, updates = [], []
    for _ in range(20):
        before = model.weight.detach().clone()
        sizes.append(trainer.step().not_private["batch_size"])
        updates.append(float((model.weight.detach() - before).abs().sum()))
    assert 0 in sizes and trainer.ledger.releases == 20
    assert all(u > 0 for u, s in zip(updates, sizes, strict=True) if s == 0)  # noise moved the model anyway


def test_steps_train_in_training_mode_after_an_evaluation():
    """evaluate() leaves the model in eval mode; the next step runs it in training mode (its dropout layer sees
    training=True). A submodule the user set to eval inside a training model stays so."""
    split = make_gaussian_mixture(n=64, dim=5, num_classes=3, seed=0)
    data = split.train
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    trainer = make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0, batch_size=16, seed=0
    )
    trainer.evaluate(split.test.x, split.test.y)
    assert not model.training
    seen = []
    model[2].register_forward_hook(lambda m, i, o: seen.append(m.training))
    trainer.step()
    assert model.training and seen and all(seen)
    model[2].eval()  # the user's choice inside a training model
    seen.clear()
    trainer.step()
    assert model.training and seen and not any(seen)
