"""Banded matrix factorization in the engine (dptrain.engine.bandmf, stages/correlated_noise.py, stages/cyclic_poisson.py):
b = 1 is DP-SGD bit for bit with the same streams; the engine's streamed noise is C^{-1} Z computed densely; the
ledger's account is the equivalent DP-SGD event's; each step samples its group t mod b; the groups are drawn
independently per example; a failed step leaves the noise history and the streams as they were; a checkpoint resumes
into the run an uninterrupted one takes (ledger, weights, noise history); a user's loop takes the trainer's steps."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.accounting import dpsgd_ledger, epsilon
from dptrain.accounting.bandmf_noise import dense_noise
from dptrain.engine.api import make_private, make_private_with_epsilon
from dptrain.engine.private_loop import make_private_loop
from dptrain.randomness.generators import TorchStream
from dptrain.stages.correlated_noise import BandedNoise
from dptrain.stages.cyclic_poisson import CyclicPoissonSampling, uniform_groups

N, D = 240, 5
G = torch.Generator().manual_seed(0)
X = torch.randn(N, D, generator=G)
Y = (X[:, 0] + 0.3 * X[:, 1] > 0).long()
C4 = [0.6, 0.5, 0.5, math.sqrt(1 - 0.36 - 0.25 - 0.25)]  # unit norm


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 2))


def _trainer(seed=7, momentum=0.0, **options):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=momentum)
    options = {"noise_multiplier": 1.0, "batch_size": 24, "seed": seed, "max_physical_batch_size": 16, **options}
    return make_private(model, opt, (X, Y), **options)


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def _equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("secure", [False, True])
def test_one_band_is_dpsgd_bit_for_bit_with_the_same_streams(secure):
    """The same batches (no group is drawn for one group), the same draws z, the same floating-point operations: the
    weights are equal, not merely close, and so is the epsilon (the same event)."""
    dpsgd = _trainer(secure_noise=secure)
    dpsgd.train(steps=12)
    banded = _trainer(secure_noise=secure, noise="bandmf", bands=1, planned_steps=12)
    banded.train(steps=12)
    assert banded.sampler.scheme == "cyclic_poisson" and dpsgd.sampler.scheme == "poisson"
    assert _equal(_params(banded), _params(dpsgd))
    assert banded.epsilon(accountant="pld").epsilon == dpsgd.epsilon(accountant="pld").epsilon
    assert banded.epsilon(accountant="rdp").epsilon == dpsgd.epsilon(accountant="rdp").epsilon


class KnownDraws:
    """A noise stream whose draws are given rows z_0, z_1, ... (float64), one row per call."""

    kind = "known"

    def __init__(self, z: np.ndarray):
        self.z, self.t = torch.from_numpy(z), 0

    def gaussian(self, like):
        row = self.z[self.t].reshape(like.shape).to(like.dtype)
        self.t += 1
        return row.clone()


@pytest.mark.parametrize("steps", [7, 9])  # b = 4 dividing T or not
def test_the_stage_streams_c_inverse_z_as_the_dense_solve(steps):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((steps, 6))
    count = {"t": 0}
    stage = BandedNoise(C4, lambda: count["t"])
    stream = KnownDraws(z)
    summed = {"a": torch.zeros(2, 2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}  # one group of 6
    out = []
    for t in range(steps):
        count["t"] = t
        noisy = stage(summed, 2.5, stream)
        stage.commit()
        out.append(torch.cat([noisy["a"].reshape(-1), noisy["b"]]).numpy())
    np.testing.assert_allclose(np.array(out), 2.5 * dense_noise(C4, z), rtol=1e-12, atol=1e-12)
    assert stage.history_bytes == 3 * 6 * 8  # b - 1 vectors of the noised size


def test_the_trainers_released_noise_is_c_inverse_z(monkeypatch):
    """Through the engine (ledger-indexed steps, commit with the release): with zero gradient sums and known draws, the
    gradient each step hands the optimizer is sigma C w_t / B, w = C^{-1} z."""
    steps = 9
    trainer = _trainer(noise="bandmf", bands=4, planned_steps=steps, max_grad_norm=0.7)
    c = np.array(trainer.bandmf.coefficients)
    numel = sum(p.numel() for p in trainer.params.values())
    z = np.random.default_rng(1).standard_normal((steps, numel))
    known = KnownDraws(z)
    streams = trainer.randomness._streams
    real = trainer.randomness.stream("noise")
    monkeypatch.setattr(real, "gaussian", known.gaussian)
    zero = {n: torch.zeros_like(p) for n, p in trainer.params.items()}
    monkeypatch.setattr(trainer, "_clipped_sum", lambda idx: (dict(zero), type("S", (), {"non_finite": 0})(), 0.0))
    released = []
    handle = trainer.optimizer.register_step_pre_hook(
        lambda opt, a, k: released.append(torch.cat([p.grad.reshape(-1) for p in trainer.params.values()]))
    )
    trainer.train(steps=steps)
    handle.remove()
    assert streams["noise"] is real
    scale = 1.0 * 0.7 / trainer.sampler.expected_batch_size
    expected = scale * dense_noise(c, z)
    np.testing.assert_allclose(torch.stack(released).double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_the_ledger_accounts_the_equivalent_dpsgd_event():
    """T = 10 steps over b = 4 groups at overall rate q: ceil(10/4) = 3 participations at rate 4q, for pld and rdp."""
    trainer = _trainer(noise="bandmf", bands=4, planned_steps=10)
    trainer.train(steps=10)
    q = trainer.sampling_rate
    equivalent = dpsgd_ledger(1.0, 4 * q, 3)
    for accountant in ("pld", "rdp"):
        assert trainer.epsilon(accountant=accountant).epsilon == epsilon(equivalent, 1e-5, accountant).epsilon
    assert trainer.ledger.entries[0].count == 10 and trainer.ledger.entries[0].facts["bands"] == 4


def test_step_t_samples_only_group_t_mod_b():
    trainer = _trainer(noise="bandmf", bands=4, planned_steps=12)
    groups = trainer.sampler.get_state()["groups"]
    seen = []
    real = trainer.sampler.sample

    def sample(stream, step):
        idx = real(stream, step)
        seen.append((step, idx))
        return idx

    trainer.sampler.sample = sample
    trainer.train(steps=12)
    assert [s for s, _ in seen] == list(range(12))
    assert all(bool((groups[idx] == s % 4).all()) for s, idx in seen)
    assert sum(len(idx) for _, idx in seen) > 0
    assert trainer.sampler.expected_batch_size == pytest.approx(24.0)  # q n, as with Poisson sampling
    # the group is sampled at b q, the rate its ledger event records (at q the batches would be b times too small)
    s, stream = CyclicPoissonSampling(8000, 0.05, 8), TorchStream(1)
    s.draw_groups(stream)
    sizes = [len(s.sample(stream, t)) for t in range(8)]
    assert s.group_rate == 0.4 and abs(sum(sizes) / 8 - 400) < 30  # sd of the mean about 7; at rate q: 50


def test_groups_are_drawn_independently_per_example():
    """Uniform over b (no modulo bias: b = 7), sizes multinomial (not an equal split), and adding an example moves
    nobody else: the first n groups are the same draws whatever comes after."""
    n, b = 70_000, 7
    groups = uniform_groups(TorchStream(3), n, b).long()
    counts = torch.bincount(groups, minlength=b).double()
    chi2 = float(((counts - n / b) ** 2 / (n / b)).sum())
    assert chi2 < 25  # chi-square, 6 degrees of freedom: P(> 25) < 4e-4
    same_as_next = float((groups[1:] == groups[:-1]).double().mean())
    assert abs(same_as_next - 1 / b) < 0.01  # neighbours independent
    small = uniform_groups(TorchStream(5), 700, b)
    assert len(set(torch.bincount(small.long(), minlength=b).tolist())) > 1  # not 100 each
    assert torch.equal(uniform_groups(TorchStream(5), 701, b)[:700], small)
    assert not uniform_groups(TorchStream(5), 10, 1).any()  # one group: nothing drawn


def test_a_group_draw_is_once_and_a_sampler_refuses_before_it():
    s = CyclicPoissonSampling(50, 0.1, 4)
    with pytest.raises(Exception, match="not been drawn"):
        s.sample(TorchStream(0), 0)
    s.draw_groups(TorchStream(0))
    with pytest.raises(Exception, match="drawn once"):
        s.draw_groups(TorchStream(0))


def test_a_failed_step_leaves_the_history_and_the_streams_as_they_were():
    reference = _trainer(noise="bandmf", bands=4, planned_steps=8)
    reference.train(steps=8)
    trainer = _trainer(noise="bandmf", bands=4, planned_steps=8)
    trainer.train(steps=5)
    stage = trainer.noise_stage

    def failing(*args):
        stage(*args)  # the noise of step 6 is computed ...
        raise RuntimeError("injected")  # ... and the step fails before its release

    trainer.noise_stage = failing
    with pytest.raises(RuntimeError, match="injected"):
        trainer.step()
    assert trainer.steps == 5 and stage.count == 5
    trainer.noise_stage = stage
    trainer.train(steps=3)
    assert trainer.ledger.to_dict() == reference.ledger.to_dict()
    assert _equal(_params(trainer), _params(reference))
    assert _history_equal(trainer, reference)


def _history_equal(a, b) -> bool:
    ha, hb = a.bandmf.noise.state_dict(), b.bandmf.noise.state_dict()
    return ha["count"] == hb["count"] and all(torch.equal(ha["history"][k], hb["history"][k]) for k in ha["history"])


def test_a_checkpoint_resumes_into_the_uninterrupted_run(tmp_path):
    """Stopped after 6 steps (not a multiple of b), saved, loaded into a new trainer: the ledger, the weights and the
    noise history at the end are those of 14 steps in one go (momentum: the coefficients' workload too; and the weight
    average, kept beside the noise history in the checkpoint)."""
    reference = _trainer(momentum=0.5, noise="bandmf", bands=4, planned_steps=14, ema=0.9)
    reference.train(steps=14)
    first = _trainer(momentum=0.5, noise="bandmf", bands=4, planned_steps=14, ema=0.9)
    first.train(steps=6)
    torch.save(first.state_dict(), tmp_path / "ck.pt")
    second = _trainer(seed=99, momentum=0.5, noise="bandmf", bands=4, planned_steps=14, ema=0.9)
    second.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True))
    second.train(steps=8)
    assert second.ledger.to_dict() == reference.ledger.to_dict()
    assert _equal(_params(second), _params(reference))
    assert _history_equal(second, reference)
    assert reference.bandmf.workload.kind == "momentum"
    assert all(torch.equal(second.weight_average.averages[n], a) for n, a in reference.weight_average.averages.items())


def test_a_checkpoint_of_other_coefficients_or_of_no_bandmf_run_is_refused(tmp_path):
    first = _trainer(noise="bandmf", bands=4, planned_steps=14)
    first.train(steps=3)
    state = first.state_dict()
    other = _trainer(noise="bandmf", bands=4, planned_steps=20)  # other T: other coefficients
    with pytest.raises(Exception, match="coefficients"):
        other.load_state_dict(state)
    with pytest.raises(Exception, match="BandMF run"):
        _trainer().load_state_dict(state)
    fresh = _trainer(noise="bandmf", bands=4, planned_steps=14, ledger=first.ledger.copy())
    with pytest.raises(Exception, match="its own checkpoint|own run"):
        fresh.step()  # a ledger's run without its noise history and groups


def test_a_users_loop_takes_the_trainers_bandmf_steps_bit_for_bit():
    trainer = _trainer(noise="bandmf", bands=3, planned_steps=6)
    trainer.train(steps=6)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loop = make_private_loop(
        model, opt, (X, Y), noise_multiplier=1.0, batch_size=24, seed=7, max_physical_batch_size=16, noise="bandmf",
        bands=3, planned_steps=6,
    )
    for x, y in loop.batches(steps=6):
        loop.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
        opt.zero_grad()
    assert loop.ledger.to_dict() == trainer.ledger.to_dict()
    assert _equal([p.detach() for p in model.parameters()], _params(trainer))


@pytest.mark.slow
def test_a_budget_calibrates_the_noise_for_the_bands_it_chose():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = make_private_with_epsilon(
        model, opt, (X, Y), target_epsilon=4.0, target_delta=1e-5, steps=16, batch_size=24, seed=1, noise="bandmf"
    )
    choice = trainer.bandmf.choice
    assert sorted(choice.candidates) == [1, 2, 4, 8]  # b <= 1/q = 10
    assert trainer.bandmf.bands == choice.bands == min(choice.candidates, key=choice.candidates.get)
    trainer.train(steps=16)
    assert trainer.steps == 16 and trainer.epsilon().epsilon <= 4.0
    assert trainer.epsilon().epsilon > 3.9  # the noise is the least that fits the budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_on_cuda_one_band_is_dpsgd_and_a_checkpoint_continues_exactly(tmp_path):
    dpsgd = _trainer(device="cuda")
    dpsgd.train(steps=6)
    one = _trainer(device="cuda", noise="bandmf", bands=1, planned_steps=6)
    one.train(steps=6)
    assert _equal(_params(one), _params(dpsgd))
    reference = _trainer(device="cuda", noise="bandmf", bands=3, planned_steps=10)
    reference.train(steps=10)
    first = _trainer(device="cuda", noise="bandmf", bands=3, planned_steps=10)
    first.train(steps=4)
    assert all(r.device.type == "cuda" for r in first.bandmf.noise._history.values())
    torch.save(first.state_dict(), tmp_path / "ck.pt")
    second = _trainer(seed=3, device="cuda", noise="bandmf", bands=3, planned_steps=10)
    second.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True))
    second.train(steps=6)
    assert second.ledger.to_dict() == reference.ledger.to_dict()
    assert _equal(_params(second), _params(reference)) and _history_equal(second, reference)


@pytest.mark.parametrize("stop", [1, 4, 8, 13])
def test_a_checkpoint_at_a_band_boundary_or_either_end_resumes_into_the_uninterrupted_run(tmp_path, stop):
    """b = 4, T = 14: stopped after the first step, exactly at band boundaries (4, 8: the next step samples group 0
    and its noise reaches back across the boundary) and one step before the end; the rest taken by a trainer with
    other streams loaded from the checkpoint gives the uninterrupted run's ledger, weights and noise history."""
    reference = _trainer(noise="bandmf", bands=4, planned_steps=14)
    reference.train(steps=14)
    first = _trainer(noise="bandmf", bands=4, planned_steps=14)
    first.train(steps=stop)
    torch.save(first.state_dict(), tmp_path / "ck.pt")
    second = _trainer(seed=99, noise="bandmf", bands=4, planned_steps=14)
    second.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True))
    second.train(steps=14 - stop)
    assert second.ledger.to_dict() == reference.ledger.to_dict()
    assert _equal(_params(second), _params(reference)) and _history_equal(second, reference)
