"""ModelMix's update rule (Xiao, Wan & Devadas, Algorithm 1) and Algorithm 2 clipping as engine stages."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dptrain.accounting import epsilon
from dptrain.accounting.modelmix import modelmix_ledger, phase_lengths
from dptrain.cli import main
from dptrain.config import load_config
from dptrain.engine.api import make_private
from dptrain.errors import ConfigError
from dptrain.modelmix import ModelMixSGD
from dptrain.randomness.generators import Randomness
from dptrain.runs.run import build_job
from dptrain.stages.clipping import FlatClipping, L2LinfClipping
from dptrain.stages.per_example import PerExampleGrads


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _data(n=300):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


def _literal_step(current, previous, grad, lr, tau, wd, draws):
    """Algorithm 1's inner loop written coordinate by coordinate (lines 5-9), with the averaged-gradient convention.
    ``draws`` yields the mixing stream's values in the order the stage draws them: the tie-breaking coins of this
    tensor's tied coordinates (flat order), then one alpha per coordinate."""
    cur, prev, g = current.flatten().tolist(), previous.flatten().tolist(), grad.flatten().tolist()
    ties = [j for j in range(len(cur)) if abs(cur[j] - prev[j]) < tau and cur[j] == prev[j]]
    coins = dict(zip(ties, draws(len(ties)), strict=True))
    alphas = draws(len(cur))
    new, pushed = [], []
    for j in range(len(cur)):
        a, b = cur[j], prev[j]
        if abs(a - b) < tau:
            s = (1.0 if a > b else -1.0) if a != b else (-1.0 if coins[j] < 0.5 else 1.0)
            a, b = a + s * tau / 2, b - s * tau / 2
        new.append(alphas[j] * a + (1 - alphas[j]) * b - lr * (g[j] + wd * cur[j]))
        pushed.append(a)
    shape = current.shape
    return torch.tensor(new, dtype=torch.float64).reshape(shape), torch.tensor(pushed, dtype=torch.float64).reshape(shape)


def test_the_update_is_algorithm_1_coordinate_by_coordinate():
    model = _model()
    params = list(model.parameters())
    opt = ModelMixSGD(params, lr=0.3, tau=0.5, weight_decay=0.01)
    opt.bind_randomness(Randomness(7, warn=False))
    replica = Randomness(7, warn=False).stream("mixing")

    def draws(n):
        return replica.uniform((n,), dtype=torch.float64).tolist() if n else []

    previous = [p.detach().clone() for p in params]  # w_{-1} = w_0
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        expected = []
        for p, prev in zip(params, previous, strict=True):
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1
            expected.append(_literal_step(p.detach(), prev, p.grad, 0.3, 0.15, 0.01, draws))
        opt.step()
        for p, (new, pushed) in zip(params, expected, strict=True):
            assert torch.allclose(p.detach(), new, rtol=0, atol=1e-12)
            assert torch.allclose(opt.state[p]["previous"], pushed, rtol=0, atol=1e-12)
        previous = [opt.state[p]["previous"].clone() for p in params]


def test_the_gap_holds_at_every_step_and_the_mix_lies_between_the_pushed_iterates():
    model = _model()
    params = list(model.parameters())
    lr, ratio = 0.2, 0.25
    opt = ModelMixSGD(params, lr=lr, tau=ratio)
    opt.bind_randomness(Randomness(2, warn=False))
    g = torch.Generator().manual_seed(4)
    tau = ratio * lr
    previous = [p.detach().clone() for p in params]
    for step in range(60):
        before = [p.detach().clone() for p in params]
        grads = []
        for p in params:
            # small gradients, some exactly zero: many coordinates fall inside the gap, some tie
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.05 * (step % 3 != 0)
            grads.append(p.grad.clone())
        opt.step()
        for p, cur, prev, grad in zip(params, before, previous, grads, strict=True):
            cur_pushed = opt.state[p]["previous"]
            push = cur_pushed - cur
            prev_pushed = prev - push
            gap = (cur_pushed - prev_pushed).abs()
            assert bool((gap >= tau * (1 - 1e-12)).all()), (step, float(gap.min()))
            mixed = p.detach() + lr * grad
            low, high = torch.minimum(cur_pushed, prev_pushed), torch.maximum(cur_pushed, prev_pushed)
            assert bool(((mixed >= low - 1e-12) & (mixed <= high + 1e-12)).all())
            # a coordinate already at least tau apart is not moved
            far = (cur - prev).abs() >= tau
            assert torch.equal(push[far], torch.zeros_like(push[far]))
        previous = [opt.state[p]["previous"].clone() for p in params]


def test_mixing_weights_are_uniform_and_secret_per_run():
    """alpha ~ U[0,1] per coordinate: over a large tensor with a zero gradient the mixed point's position within its
    segment has mean 1/2 and E(1 - alpha)^2 = 1/3 (the paper's Thm 3.1 proof facts); two unseeded runs differ."""
    p = nn.Parameter(torch.zeros(20000, dtype=torch.float64))
    opt = ModelMixSGD([p], lr=1.0, tau=1.0)
    opt.bind_randomness(Randomness(5, warn=False))
    p.grad = torch.zeros_like(p)
    opt.step()  # from w_{-1} = w_0 = 0: the segment is [-1/2, 1/2] around 0 in a random direction
    position = (p.detach() - (-0.5)).abs()  # distance from one end; uniform on [0, 1] either way
    assert abs(float(position.mean()) - 0.5) < 0.01
    assert abs(float(((1 - position) ** 2).mean()) - 1 / 3) < 0.01
    q = nn.Parameter(torch.zeros(50, dtype=torch.float64))
    r = nn.Parameter(torch.zeros(50, dtype=torch.float64))
    for param in (q, r):
        o = ModelMixSGD([param], lr=1.0, tau=1.0)
        o.bind_randomness(Randomness(None))
        param.grad = torch.zeros_like(param)
        o.step()
    assert not torch.equal(q.detach(), r.detach())


def test_l2_linf_clipping_bounds_both_norms_and_is_flat_clipping_at_p_1():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 30, generator=g, dtype=torch.float64)
    w[0] = 0.0
    w[0, 3] = 5.0  # concentrated on one coordinate: truncation bites
    w[1] *= 1e-3  # small: left unchanged
    b = torch.randn(8, 4, generator=g, dtype=torch.float64)
    b[1] *= 1e-3
    grads = PerExampleGrads({"w": w, "b": b})
    c, p = 1.0, 9
    clip = L2LinfClipping(c, p)
    for i in range(8):
        one = PerExampleGrads({"w": w[i : i + 1], "b": b[i : i + 1]})
        summed, _ = clip.clip_and_sum(one)
        flat = torch.cat([summed["w"].flatten(), summed["b"].flatten()])
        assert float(flat.norm()) <= c * (1 + 1e-12)
        assert float(flat.abs().max()) <= c / math.sqrt(p) * (1 + 1e-12)
        if i == 1:
            assert torch.allclose(summed["w"], w[1]) and torch.allclose(summed["b"], b[1])
    summed0, _ = clip.clip_and_sum(PerExampleGrads({"w": w[:1], "b": b[:1]}))
    assert float(summed0["w"][3]) == pytest.approx(c / math.sqrt(p))
    at_one, _ = L2LinfClipping(c, 1).clip_and_sum(grads)
    flat_sum, _ = FlatClipping(c).clip_and_sum(grads)
    for n in at_one:
        assert torch.allclose(at_one[n], flat_sum[n], atol=1e-12)
    assert clip.facts == {"linf_p": 9}


def _trainer(steps, seed=11):
    model = _model()
    opt = ModelMixSGD(model.parameters(), lr=0.5, tau=[[0.1, 0.5], [0.05, 0.5]], total_steps=steps)
    return make_private(
        model, opt, _data(), noise_multiplier=1.0, max_grad_norm=1.0, batch_size=30, seed=seed,
        clipping="l2_linf", linf_p=4,
    )


def test_the_ledger_records_each_phase_and_matches_the_planned_ledger():
    steps = 13
    planned = _trainer(steps).ledger_after(steps)
    trainer = _trainer(steps)
    trainer.train(steps=steps)
    assert trainer.ledger.to_dict() == planned.to_dict()
    entries = trainer.ledger.entries
    assert [e.count for e in entries] == phase_lengths([(0.1, 0.5), (0.05, 0.5)], steps)
    assert [e.facts["tau_over_lr"] for e in entries] == [0.1, 0.05]
    assert all(e.facts["linf_p"] == 4 and e.facts["batch_size"] == 30.0 for e in entries)
    # the accountant's own ledger builder (CLI, calibration) records the same steps
    same = modelmix_ledger(1.0, 0.1, steps, tau=[[0.1, 0.5], [0.05, 0.5]], batch_size=30.0, clip_norm=1.0, linf_p=4)
    assert epsilon(same, 1e-5, "modelmix").epsilon == epsilon(trainer.ledger, 1e-5, "modelmix").epsilon


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run():
    steps = 12
    straight = _trainer(steps)
    straight.train(steps=steps)
    first = _trainer(steps)
    first.train(steps=5)
    state = first.state_dict()
    assert any("previous" in s for s in state["optimizer"]["state"].values())  # both iterates are checkpointed
    resumed = _trainer(steps, seed=999)  # the streams come from the checkpoint
    resumed.load_state_dict(state)
    resumed.train(steps=steps - 5)
    assert resumed.ledger.to_dict() == straight.ledger.to_dict()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


SYNTHETIC = [
    'data.name="synthetic"',
    "data.options={n = 600, dim = 6, num_classes = 3, separation = 3.0}",
    'model.name="logistic"',
    "training.steps=6",
    "training.batch_size=60",
    "training.learning_rate=0.5",
    "privacy.noise_multiplier=1.0",
    'training.update="modelmix"',
]


def test_config_builds_a_modelmix_job():
    cfg = load_config(None, [*SYNTHETIC, "modelmix.tau=[[0.2, 0.5], [0.1, 0.5]]", 'privacy.clipping="l2_linf"',
                             "privacy.linf_p=4"])
    job = build_job(cfg, Randomness(3, warn=False))
    assert isinstance(job.trainer.optimizer, ModelMixSGD)
    assert job.trainer.optimizer.total_steps == 6
    event, facts = job.trainer.release_event(0)
    assert facts["update"] == "modelmix" and facts["tau_over_lr"] == 0.2 and facts["linf_p"] == 4
    assert job.trainer.release_event(5)[1]["tau_over_lr"] == 0.1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.momentum=0.9"], "plain SGD"),
        (['training.optimizer="adam"'], "plain SGD"),
        (["modelmix.tau=-0.1"], "tau must be >= 0"),
        (["modelmix.tau=[[0.1, 0.5], [0.05, 0.4]]"], "add up to 1"),
        (['privacy.clipping="l2_linf"', "privacy.linf_p=0"], "privacy.linf_p"),
        (["privacy.linf_p=4"], "privacy.linf_p"),
        (['training.update="mix"'], "training.update"),
        (['training.update="optimizer"', "modelmix.tau=0.1"], "[modelmix] is for"),
    ],
)
def test_bad_modelmix_configs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_config(None, [*SYNTHETIC, *overrides])
    assert "\n" not in str(e.value)


def test_the_cli_refuses_momentum_with_modelmix_exit_2(tmp_path, capsys):
    # (in this process: tests/test_cli.py's real-process test holds that the command's exit 2 comes without traceback)
    args = [arg for o in [*SYNTHETIC, "training.momentum=0.9"] for arg in ("--set", o)]
    code = main(["train", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and "plain SGD" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_modelmix_sgd_refuses_to_run_without_the_runs_streams():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3)
    with pytest.raises(ConfigError, match="secret streams"):
        ModelMixSGD([p], lr=0.1, tau=0.1).step()
    with pytest.raises(ConfigError, match="total_steps"):
        ModelMixSGD([p], lr=0.1, tau=[[0.1, 0.5], [0.05, 0.5]])
