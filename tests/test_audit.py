"""The one-run privacy audit (``dptrain audit``): canaries inserted as specified, lower bounds below the certificate
on the real engine and above it on deliberately broken ones (:mod:`dptrain.auditing.bugs`), the audit's ceiling and
verdict, and one-line errors for bad input.

Every audit uses an explicit ``seed`` (a reproducible experiment), so each outcome below is deterministic."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from dptrain.auditing.auxiliary import AUX, GAIN, AuxiliaryCanaries, SplitClipping
from dptrain.auditing.bounds import ceiling
from dptrain.auditing.bugs import BUGS, NoiseDivided, Unclipped, inject
from dptrain.auditing.canaries import (
    dirac_gradients,
    draw_inclusion,
    with_canaries,
)
from dptrain.auditing.runner import audit_run
from dptrain.cli import add_command, main
from dptrain.cli import audit as audit_command
from dptrain.cli.audit import run as cmd_audit
from dptrain.config import config_from_dict, load_config
from dptrain.engine import trainer as engine
from dptrain.engine.api import make_private
from dptrain.errors import ConfigError
from dptrain.last_iterate import ConvexGLM
from dptrain.randomness.generators import Randomness
from dptrain.reproduce import single_thread
from dptrain.stages.clipping import FlatClipping, L2LinfClipping, PerLayerClipping, clipped_sum
from dptrain.stages.per_example import PerExampleGrads, trainable_parameters

SEED = 0
M = 1000  # canaries in the privacy tests
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded():
    with warnings.catch_warnings(), single_thread():
        warnings.simplefilter("ignore")
        yield


def dpsgd_config(epsilon: float = 1.0, **training) -> dict:
    """Logistic regression on 1000 synthetic 500-dimensional examples, 10 classes (5010 parameters); Poisson
    batches of expected size 200, 20 epochs."""
    return {
        "seed": SEED,
        "data": {
            "name": "synthetic",
            "options": {"n": 1250, "dim": 500, "num_classes": 10, "separation": 3.0},
        },
        "model": {"name": "logistic"},
        "privacy": {"target_epsilon": epsilon, "delta": 1e-5, "max_grad_norm": 1.0, "accountant": "pld"},
        "training": {"epochs": 20, "batch_size": 200, "learning_rate": 0.5, **training},
    }


def with_sigma(raw: dict, sigma: float = 1.0) -> dict:
    """``raw`` with a fixed noise multiplier instead of a target epsilon (no calibration: fast)."""
    privacy = {k: v for k, v in raw["privacy"].items() if k != "target_epsilon"}
    return {**raw, "privacy": {**privacy, "noise_multiplier": sigma}}


def projected_config(epsilon: float = 2.0) -> dict:
    """Projected noisy SGD with full batches on 560 synthetic 1000-dimensional binary examples, 300 steps;
    certified by the last-iterate accountant (Altschuler & Talwar), here far below composition."""
    return {
        "seed": SEED,
        "data": {
            "name": "synthetic",
            "options": {"n": 700, "dim": 1000, "num_classes": 2, "separation": 0.0},
        },
        "privacy": {"target_epsilon": epsilon, "delta": 1e-5, "accountant": "last_iterate"},
        "training": {"algorithm": "projected_noisy_sgd", "steps": 300, "learning_rate": 1.0},
        "convex": {"loss": "logistic", "feature_norm": 1.0, "l2": 0.1, "diameter": 1.0, "batching": "full"},
    }


def cfg(raw: dict):
    return config_from_dict(raw)


def acceptance(*overrides: str):
    """configs/audit.toml (5 epochs certified at epsilon 1), seeded."""
    return load_config(str(CONFIGS / "audit.toml"), [f"seed={SEED}", *overrides])


# --- the privacy tests -----------------------------------------------------------------------------------------


def test_acceptance_config_flags_a_tenth_of_the_noise_and_clipping_off_but_not_the_real_engine():
    """configs/audit.toml: 5 epochs certified at epsilon 1. The old canaries (on the model's own coordinates) let a
    tenth of the noise (true epsilon ~190) pass with lower bounds 0.45-0.78; gradient canaries with clipping off
    were invisible (they had norm C already)."""
    config = acceptance()
    honest = audit_run(config)
    assert honest["setting"] == "dpsgd" and honest["score"] == "llr" and honest["canaries"] == M
    assert honest["epsilon_certified"] == pytest.approx(1.0, rel=1e-3)
    assert honest["verdict"] == "no_violation_found", honest
    assert 0 <= honest["epsilon_lower_bound"] <= 1.0 < honest["ceiling"]
    for bug in ("noise/10", "clipping-off"):
        broken = audit_run(config, inject_bug=bug)
        assert broken["injected_bug"] == bug
        assert broken["epsilon_certified"] == honest["epsilon_certified"]  # the ledger cannot see the bug
        assert broken["verdict"] == "violation" and broken["epsilon_lower_bound"] > 1.5, broken


@pytest.mark.slow
def test_dpsgd_audit_below_certificate_at_every_epsilon():
    results = {eps: audit_run(cfg(dpsgd_config(eps)), canaries=M) for eps in (1, 2, 4, 8)}
    for eps, r in results.items():
        assert r["setting"] == "dpsgd" and r["kind"] == "gradient" and r["accountant"] == "pld"
        assert r["epsilon_certified"] == pytest.approx(eps, rel=1e-3)
        assert 0 <= r["epsilon_lower_bound"] <= r["epsilon_certified"], r
    # the canaries are really there: at epsilon 8 the audit finds a clearly positive lower bound
    assert results[8]["epsilon_lower_bound"] > 1.0
    # the certificate at 8 is above what 1000 canaries can report: inconclusive, not passed
    assert results[8]["verdict"] == "inconclusive" and results[8]["ceiling"] < 8
    assert results[1]["verdict"] == "no_violation_found"


def test_input_canaries_catch_clipping_off():
    config = cfg(dpsgd_config(1))
    honest = audit_run(config, canaries=M, kind="input")
    assert honest["kind"] == "input" and honest["score"] == "loss"
    assert honest["epsilon_lower_bound"] <= honest["epsilon_certified"], honest
    broken = audit_run(config, canaries=M, kind="input", inject_bug="clipping-off")
    assert broken["epsilon_lower_bound"] > broken["epsilon_certified"], broken


@pytest.mark.slow
def test_projected_audit_below_last_iterate_certificate():
    config = cfg(projected_config(2.0))
    r = audit_run(config, canaries=M)
    assert r["setting"] == "projected" and r["accountant"] == "last_iterate" and r["score"] == "final_iterate"
    assert r["epsilon_certified"] == pytest.approx(2.0, rel=1e-3)
    assert r["epsilon_lower_bound"] <= r["epsilon_certified"], r
    # Scored on w_T alone, a 10x noise bug stays inside the last-iterate bound's slack for this audit; a 100x one
    # does not: the canaries do reach the last iterate.
    broken = audit_run(config, canaries=M, inject_bug="noise/100")
    assert broken["epsilon_lower_bound"] > broken["epsilon_certified"], broken


def test_inconclusive_when_the_ceiling_is_below_the_certificate():
    """20 canaries cannot report more than about 1.4 at delta = 1e-5: a certificate of about 7 is out of reach,
    even for an engine with a tenth of the noise, and the audit says so instead of "passed"."""
    config = cfg(with_sigma(dpsgd_config(steps=10), 0.8))
    r = audit_run(config, canaries=20, inject_bug="noise/10")
    assert r["ceiling"] == pytest.approx(ceiling(20, 1e-5, 0.95))
    assert r["ceiling"] < r["epsilon_certified"] and r["verdict"] == "inconclusive", r
    assert r["epsilon_lower_bound"] <= r["ceiling"]


def test_default_canaries_adapt_to_the_model():
    """configs/synthetic.toml has 42 parameters: the old default (1000 Dirac coordinates of the model) refused it.
    The dpsgd setting needs no limit; the last-iterate one uses min(1000, trainable parameters)."""
    r = audit_run(load_config(str(CONFIGS / "synthetic.toml"), [f"seed={SEED}", "training.epochs=1"]))
    assert r["setting"] == "dpsgd" and r["canaries"] == 1000 and r["verdict"] == "no_violation_found"
    small = projected_config()
    small["data"]["options"]["dim"] = 30  # w has 31 entries (30 weights and the bias)
    small["training"]["steps"] = 20
    small["convex"]["noise_std"] = 0.05
    del small["privacy"]["target_epsilon"]
    r = audit_run(cfg(small))
    assert r["setting"] == "projected" and r["canaries"] == 31
    with pytest.raises(ConfigError, match=r"at most the number of trainable parameters \(31\)"):
        audit_run(cfg(small), canaries=32)


# --- canaries inserted as specified ------------------------------------------------------------------------------


def _linear_params():
    return trainable_parameters(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(6, 3)))


def test_dirac_canary_clipped_gradient_is_exactly_c_e_j():
    params = _linear_params()  # 18 weights then 3 biases
    for clip in (1.0, 1.5, 0.25):
        coords = torch.tensor([0, 7, 20])
        grads = dirac_gradients(coords, params, clip)
        for r, j in enumerate(coords.tolist()):
            one = PerExampleGrads({n: g[r : r + 1] for n, g in grads.materialize().items()})
            summed, stats = FlatClipping(clip).clip_and_sum(one)
            flat = torch.cat([summed[n].reshape(-1) for n in params])
            expected = torch.zeros(21)
            expected[j] = clip
            assert torch.equal(flat, expected)
            assert stats.clipped == 0


def _recording_stage(params, seen):
    def real_stage(idx):
        seen.append(idx.clone())
        yield (
            PerExampleGrads({n: torch.ones(len(idx), *p.shape) for n, p in params.items()}),
            torch.ones(len(idx)),
        )

    return real_stage


def test_canary_stage_routes_real_included_and_excluded_rows():
    params = _linear_params()
    coords = torch.tensor([4, 11, 19, 7])  # canaries 0..3 at indices 10..13; canary 1 excluded
    included = torch.tensor([True, False, True, True])
    seen = []
    dirac = lambda r: dirac_gradients(coords[r], params, 2.0)  # noqa: E731
    stage = with_canaries(_recording_stage(params, seen), 10, included, chunk=1, dirac=dirac)
    chunks = list(stage(torch.tensor([1, 3, 10, 11, 12])))
    assert torch.equal(seen[0], torch.tensor([1, 3]))  # real rows only reach the engine's stage
    assert len(chunks) == 3  # the real chunk, then one chunk per INCLUDED canary (chunk=1); canary 1 adds nothing
    for (grads, losses), j in zip(chunks[1:], (4, 19), strict=True):
        flat = torch.cat([g.reshape(1, -1) for g in grads.materialize().values()], 1)[0]
        assert flat[j] == 2.0 and int((flat != 0).sum()) == 1
        assert torch.equal(losses, torch.zeros(1))
    # input canaries: included rows go to the engine's stage like real examples, excluded ones nowhere
    seen.clear()
    list(with_canaries(_recording_stage(params, seen), 10, included, chunk=1)(torch.tensor([2, 11, 13])))
    assert torch.equal(seen[0], torch.tensor([2, 13]))


def test_included_canaries_sampled_at_rate_q_and_excluded_never(monkeypatch):
    raw = with_sigma(dpsgd_config(epochs=4))
    sampled = []
    original = AuxiliaryCanaries.gradients

    def spy(self, canaries):
        sampled.append(canaries.clone())
        return original(self, canaries)

    monkeypatch.setattr(AuxiliaryCanaries, "gradients", spy)
    audit_run(cfg(raw), canaries=M)
    included = draw_inclusion(M, Randomness(SEED, warn=False).stream("canaries"))
    counts = torch.bincount(torch.cat(sampled), minlength=M)
    assert int(counts[~included].sum()) == 0  # an excluded canary never reaches the gradient
    k, steps = int(included.sum()), 4 * (1000 + M) // 200
    q = 200 / (1000 + M)  # one row per canary, included or not: q does not depend on the secrets
    rate = float(counts[included].sum()) / (k * steps)
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (k * steps))
    assert int((counts[included] == 0).sum()) < 0.2 * k  # every included one is sampled, at rate q each


def _tiny_trainer(clipping="flat", noise_multiplier=1.0, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    data = (torch.randn(50, 4), torch.randint(0, 2, (50,)))
    return make_private(
        model, opt, data, noise_multiplier=noise_multiplier, batch_size=10, clipping=clipping, seed=1, **options
    )


@pytest.mark.parametrize(
    "rule",
    [FlatClipping(1.5), PerLayerClipping(1.5), L2LinfClipping(1.5, 1), L2LinfClipping(1.5, 4)],
    ids=["flat", "per_layer", "l2_linf_p1", "l2_linf_p4"],
)
def test_auxiliary_coordinates_get_zero_from_real_examples_and_c_from_each_canary(rule):
    trainer = _tiny_trainer(rule)
    idx = torch.arange(20)
    without, _, _ = clipped_sum(trainer.per_example(idx), trainer.clipping, trainer.params)
    model_names = list(trainer.params)
    canaries = AuxiliaryCanaries(trainer, 3)
    canaries.install()
    assert canaries.block == rule.facts["linf_p"] if hasattr(rule, "facts") else canaries.block == 1
    # real examples: the model's tensors clipped exactly as without the audit (per-layer: C split over the model's
    # 2 tensors, not 3), the auxiliary tensor exactly 0
    real, _, _ = clipped_sum(trainer.per_example(idx), trainer.clipping, trainer.params)
    assert torch.equal(real[AUX], torch.zeros(3 * canaries.block))
    for n in model_names:
        assert torch.equal(real[n], without[n])
    # canaries 0 and 2: each clipped by the same rule to norm C on its own block, the model's tensors exactly 0
    chunk = [(canaries.gradients(torch.tensor([0, 2])), torch.zeros(2))]
    fake, stats, _ = clipped_sum(iter(chunk), trainer.clipping, trainer.params)
    assert all(torch.equal(fake[n], torch.zeros_like(trainer.params[n])) for n in model_names)
    blocks = fake[AUX].reshape(3, canaries.block)
    torch.testing.assert_close(blocks.norm(dim=1), torch.tensor([1.5, 0.0, 1.5]))
    assert float(blocks.abs().max()) <= 1.5 / math.sqrt(getattr(rule, "linf_p", 1)) * (1 + 1e-6)
    assert stats.clipped == 2  # the raw canary has norm GAIN x C: the rule must clip it
    # a rule that does not clip lets the canary through at GAIN x C
    trainer.clipping = SplitClipping(Unclipped(rule), trainer.params)
    chunk = [(canaries.gradients(torch.tensor([1])), torch.zeros(1))]
    fake, _, _ = clipped_sum(iter(chunk), trainer.clipping, trainer.params)
    assert float(fake[AUX].norm()) == pytest.approx(GAIN * 1.5)
    canaries.remove()


def test_scores_read_every_released_update():
    """The statistics are computed from what each step releases: p.grad of the auxiliary tensor when the optimizer
    gets it (x_t = released x B / C), with the sigma_t and q_t of the ledger."""
    trainer = _tiny_trainer(noise_multiplier=0.7, max_grad_norm=2.0)
    canaries = AuxiliaryCanaries(trainer, 4)
    canaries.install()
    included = torch.tensor([True, True, False, True])
    trainer.per_example = with_canaries(trainer.per_example, 46, included, 8, canaries.gradients)
    seen = []
    aux = trainer.params[AUX]
    trainer.optimizer.register_step_pre_hook(lambda *a: seen.append(aux.grad.detach().double().clone()))
    before = {n: p.detach().clone() for n, p in trainer.params.items()}
    trainer.train(steps=6)
    assert canaries.scores.steps == 6 and len(seen) == 6
    x = torch.stack(seen) * 10 / 2.0  # expected batch size 10, C = 2
    q, sigma = 10 / 50, 0.7
    expected_llr = torch.log(1 - q + q * torch.exp((x - 0.5) / sigma**2)).sum(0)
    torch.testing.assert_close(canaries.scores.totals["sum"], x.sum(0))
    torch.testing.assert_close(canaries.scores.totals["llr"], expected_llr)
    assert torch.equal(trainer.params[AUX], before[AUX])  # not in the optimizer: never moved
    assert len(trainer.ledger.entries) >= 1 and trainer.steps == 6
    canaries.remove()
    assert trainer.noise_stage is None  # the scoring's wrapper is gone


def test_injected_bugs_break_the_engine_and_not_the_ledger():
    honest, broken = _tiny_trainer("l2_linf", linf_p=2), _tiny_trainer("l2_linf", linf_p=2)
    inject(broken, "clipping-off")
    assert isinstance(broken.clipping, Unclipped)
    assert broken.clipping.sensitivity == honest.clipping.sensitivity and broken.clipping.facts == {"linf_p": 2}
    honest.train(steps=3)
    broken.train(steps=3)
    assert honest.ledger.to_dict() == broken.ledger.to_dict()  # the ledger records the correct run
    assert not torch.equal(honest.params["1.weight"], broken.params["1.weight"])
    # noise/F adds N(0, (std / F)^2): measured on a zero sum
    stream = Randomness(3, warn=False).stream("noise")
    for bug, factor in (("noise/2", 2), ("noise/10", 10), ("noise/100", 100)):
        t = _tiny_trainer()
        inject(t, bug)
        assert isinstance(t.noise_stage, NoiseDivided)
        noisy = t.noise_stage({"w": torch.zeros(200_000, dtype=torch.float64)}, 3.0, stream)["w"]
        assert float(noisy.std()) == pytest.approx(3.0 / factor, rel=0.01)
    assert set(BUGS) == {"noise/2", "noise/10", "noise/100", "clipping-off"}
    t = _tiny_trainer()
    inject(t, None)
    assert t.noise_stage is None and isinstance(t.clipping, FlatClipping)


def test_projected_canaries_enter_the_full_batch_gradient_through_the_engine():
    """A gradient canary of norm L moves the projected run's averaged gradient by exactly L e_j / b (b counts one
    row per canary): the same per-example stage as DP-SGD, with the GLM's closed-form gradients for real rows."""
    from dptrain.last_iterate import ProjectedNoisySGD

    glm = ConvexGLM("logistic", 1.0, l2=0.0)
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0])
    run = ProjectedNoisySGD(
        glm, (x, y), noise_std=1.0, learning_rate=0.1, steps=1, batching="full", diameter=100.0, seed=0
    )
    trainer = run.trainer
    included = torch.tensor([True, False])  # rows 5 and 6 are canaries 0 and 1
    coords = torch.tensor([2, 0])
    trainer.per_example = with_canaries(
        trainer.per_example, 5, included, 8, lambda r: dirac_gradients(coords[r], trainer.params, run.lipschitz)
    )
    summed, stats, _ = engine.clipped_sum(trainer.per_example(torch.arange(7)), trainer.clipping, trainer.params)
    w = trainer.model.w.detach()
    xt, yt = glm.prepare_features(x), glm.prepare_labels(y)
    expected = glm.per_example_gradients(w, xt[:5], yt[:5]).sum(0)
    expected[2] += run.lipschitz  # the included canary; the excluded one adds nothing
    torch.testing.assert_close(summed["w"], expected)
    assert stats.examples == 6


def test_gradient_canaries_are_compared_with_an_accountant_that_covers_the_gradients():
    """ModelMix's accountant credits the secret mixing of the iterates: the privatized gradients, which gradient
    canaries observe in the dpsgd setting, are not released in its analysis. Such an audit is compared with the
    tightest accountant that covers them (input canaries, scored on the final model, keep the run's own)."""
    import dataclasses

    from dptrain.accounting import dpsgd_ledger, epsilon
    from dptrain.auditing.runner import _certificate

    ledger = dpsgd_ledger(1.0, 0.05, 100)

    class Run:  # what _certificate reads of a trainer
        delta = 1e-5

        def __init__(self):
            self.ledger = ledger

        def epsilon(self):
            return dataclasses.replace(epsilon(ledger, 1e-5, "pld"), accountant="modelmix", epsilon=0.1)

    eps, accountant = _certificate(Run(), "dpsgd", "gradient")
    assert accountant != "modelmix" and eps == epsilon(ledger, 1e-5, accountant).epsilon
    assert eps <= min(epsilon(ledger, 1e-5, a).epsilon for a in ("rdp", "pld"))
    assert _certificate(Run(), "dpsgd", "input") == (0.1, "modelmix")
    assert _certificate(Run(), "projected", "gradient") == (0.1, "modelmix")


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        ({"canaries": 1}, "canaries must be an integer >= 2"),
        ({"canaries": 2.5}, "canaries must be an integer >= 2"),
        ({"confidence": 1.0}, "confidence must be a number in (0, 1)"),
        ({"confidence": 0}, "confidence must be a number in (0, 1)"),
        ({"confidence": "high"}, "confidence must be a number in (0, 1)"),
        ({"kind": "membership"}, "kind must be one of gradient, input"),
        ({"inject_bug": "noise/3"}, "the injected bug (--inject-bug) must be one of noise/2, noise/10"),
    ],
)
def test_bad_input_is_one_line_error(options, words):
    with pytest.raises(ConfigError) as e:
        audit_run(cfg(with_sigma(dpsgd_config(steps=1))), **options)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_projected_random_batches_sample_the_canaries_like_examples():
    """With random batches the canaries enter through batch selection like any example (q = b / (n + m)); the
    certificate is then rdp's (the last-iterate bound is not certified for random batches) and the audit stays
    below it."""
    raw = projected_config()
    raw["convex"]["batching"] = "random"
    raw["privacy"]["accountant"] = "rdp"
    raw["training"]["batch_size"] = 100
    raw["training"]["steps"] = 100
    r = audit_run(cfg(raw), canaries=50)
    assert r["setting"] == "projected" and r["accountant"] == "rdp"
    assert r["epsilon_lower_bound"] <= r["epsilon_certified"]


# --- the command ------------------------------------------------------------------------------------------------


def _parser():
    parser = argparse.ArgumentParser(prog="dptrain")
    add_command(parser.add_subparsers(dest="command"), audit_command)
    return parser


def _config_file(tmp_path, raw: dict):
    from dptrain.config import config_to_toml

    path = tmp_path / "audit.toml"
    path.write_text(config_to_toml(cfg(raw)))
    return str(path)


def test_cli_json_and_text(tmp_path, capsys):
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=20), 3.0))
    args = _parser().parse_args(["audit", "--config", path, "--canaries", "50", "--json"])
    assert cmd_audit(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "epsilon_lower_bound",
        "epsilon_certified",
        "ceiling",
        "verdict",
        "confidence",
        "canaries",
        "guesses",
        "correct",
        "kind",
        "score",
        "accountant",
        "delta",
        "setting",
        "injected_bug",
        "private",
        "not_private_because",
    }
    assert out["private"] is False  # (dpsgd_config is seeded, for a reproducible audit)
    assert out["canaries"] == 50 and out["confidence"] == 0.95 and out["delta"] == 1e-5
    assert out["verdict"] == "no_violation_found" and out["injected_bug"] is None
    assert out["ceiling"] == pytest.approx(ceiling(50, 1e-5)) and out["ceiling"] > out["epsilon_certified"]
    args = _parser().parse_args(["audit", "--config", path, "--canaries", "50", "--kind", "input"])
    assert cmd_audit(args) == 0
    text = capsys.readouterr().out
    assert "epsilon lower bound" in text and "epsilon certified" in text and "audit ceiling" in text
    assert text.splitlines()[-1].startswith("no violation found: the lower bound")
    assert not (tmp_path / "runs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["audit.toml"]


def test_a_seeded_audit_says_not_private_like_every_command(tmp_path, capsys):
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=5), 3.0))
    assert main(["audit", "--config", path, "--set", "seed=1", "--canaries", "20", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["private"] is False and "seed" in " ".join(out["not_private_because"])
    assert "warning: not private: seeded randomness" in captured.err
    assert main(["audit", "--config", path, "--set", "seed=1", "--canaries", "20"]) == 0
    assert "NOT private" in capsys.readouterr().out


def test_cli_reports_violation_and_inconclusive(tmp_path, capsys):
    acceptance_config = str(CONFIGS / "audit.toml")
    code = main(["audit", "--config", acceptance_config, "--set", "seed=0", "--inject-bug", "noise/10"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert "injected bug" in lines[-2] and "noise/10" in lines[-2]
    assert lines[-1].startswith("FAILED: the lower bound") and "violation" in lines[-1]
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=5), 0.8))
    assert main(["audit", "--config", path, "--canaries", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "inconclusive"
    assert main(["audit", "--config", path, "--canaries", "20"]) == 0  # inconclusive is not a failure
    assert capsys.readouterr().out.splitlines()[-1].startswith("inconclusive: this audit cannot report more than")


def test_cli_rejects_an_unknown_bug_in_one_line(capsys):
    code = main(["audit", "--config", str(CONFIGS / "audit.toml"), "--inject-bug", "noise/3"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("dptrain: error: the injected bug (--inject-bug) must be one of noise/2, noise/10")


def test_reproduction_writes_report_json_and_plot(tmp_path, monkeypatch):
    from dptrain.reproduce import audit as reproduction
    from dptrain.reproduce import run_reproduction

    # the report's plumbing on two tiny audits (the experiment itself: dptrain reproduce audit)
    monkeypatch.setattr(reproduction, "CANARIES", 40)
    monkeypatch.setattr(
        reproduction,
        "plan",
        lambda quick: [("dpsgd", "input", "clipping-off", 1.0), ("projected", "gradient", "real", 2.0)],
    )
    monkeypatch.setattr(
        reproduction, "dpsgd_config", lambda eps, seed: with_sigma(dpsgd_config(steps=5), 2.0)
    )
    small = projected_config()
    small["training"]["steps"] = 20
    small["convex"]["noise_std"] = 0.05
    del small["privacy"]["target_epsilon"]
    monkeypatch.setattr(reproduction, "projected_config", lambda eps, seed: small)
    report = run_reproduction("audit", tmp_path, quick=True)  # dispatches to the patched module
    text = report.read_text()
    assert report == tmp_path / "audit.md"
    assert "| input | clipping-off |" in text and "| gradient | real |" in text
    assert "m = 40 canaries" in text
    data = json.loads((tmp_path / "audit.json").read_text())
    assert [a["setting"] for a in data["audits"]] == ["dpsgd", "projected"]
    assert [a["injected_bug"] for a in data["audits"]] == ["clipping-off", None]
    assert data["ceiling"] == pytest.approx(ceiling(40, 1e-5))
    assert (tmp_path / "audit_lower_bounds.png").stat().st_size > 1000
    assert reproduction.render(data).markdown() == text  # the JSON holds everything the report shows


def test_power_reproduction_counts_flags_per_engine(tmp_path, monkeypatch):
    from dptrain.reproduce import audit as reproduction
    from dptrain.reproduce import run_reproduction

    # configs/audit.toml is the configuration the power reproduction audits
    assert acceptance() == config_from_dict({**reproduction.POWER_CONFIG, "seed": SEED})
    # the power report's plumbing on a small version of it (2 seeds, 2 engines)
    small = {
        **reproduction.POWER_CONFIG,
        "data": {"name": "synthetic", "options": {"n": 500, "dim": 20, "num_classes": 2, "separation": 3.0}},
        "training": {"epochs": 1, "batch_size": 100, "learning_rate": 0.5},
    }
    monkeypatch.setattr(reproduction, "POWER_CONFIG", small)
    monkeypatch.setattr(reproduction, "POWER_ENGINES", (None, "noise/10"))
    report = run_reproduction("audit", tmp_path, quick=True, power=True)
    assert report == tmp_path / "audit_power.md"
    data = json.loads((tmp_path / "audit_power.json").read_text())
    rows = {(r["engine"], r["score"]): r for r in data["summary"]}
    assert set(rows) == {(e, s) for e in ("real", "noise/10") for s in ("llr", "sum")}
    for row in rows.values():
        assert row["audits"] == 2 and 0 <= row["flagged"] <= 2
        assert len(row["lower_bounds"]) == 2 and row["max_seconds"] > 0
    assert rows[("real", "llr")]["flagged"] == 0
    assert sorted(a["seed"] for a in data["audits"] if a["engine"] == "real") == [0, 1]
    assert reproduction.render_power(data).markdown() == report.read_text()
    with pytest.raises(ConfigError, match="takes no --power"):
        run_reproduction("proactive", tmp_path, quick=True, power=True)


def test_cli_bad_input(tmp_path):
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=1)))
    for argv, words in [
        (["audit", "--config", path, "--confidence", "1.5"], "confidence"),
        (["audit", "--config", path, "--kind", "nope"], "kind"),
        (["audit", "--config", path, "--canaries", "1"], "canaries"),
        (["audit", "--config", path, "--inject-bug", "clipping"], "inject-bug"),
        (["audit"], "give --config"),
    ]:
        with pytest.raises(ConfigError, match=words):
            cmd_audit(_parser().parse_args(argv))
