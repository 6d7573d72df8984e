"""The one-run privacy audit (``dptrain audit``): canaries inserted as specified, lower bounds below the certificate
on the real engine and above it on a deliberately broken one, and one-line errors for bad input.

Every audit uses an explicit ``seed`` (a reproducible experiment), so each outcome below is deterministic."""

from __future__ import annotations

import argparse
import json
import math
import warnings

import pytest
import torch

from dptrain import engine
from dptrain.auditing import runner as runner_module
from dptrain.auditing.canaries import (
    ReleasedCoordinates,
    dirac_coordinates,
    dirac_gradients,
    draw_inclusion,
    with_canaries,
)
from dptrain.auditing.runner import audit_run
from dptrain.cli import add_command
from dptrain.cli import audit as audit_command
from dptrain.cli.audit import run as cmd_audit
from dptrain.clipping import FlatClipping
from dptrain.config import config_from_dict
from dptrain.errors import ConfigError
from dptrain.last_iterate import ConvexGLM
from dptrain.per_example import PerExampleGrads, trainable_parameters
from dptrain.randomness import Randomness
from dptrain.reproduce import single_thread

SEED = 0
M = 1000  # canaries in the privacy tests


@pytest.fixture(autouse=True)
def _quiet_and_single_threaded():
    with warnings.catch_warnings(), single_thread():
        warnings.simplefilter("ignore")
        yield


def dpsgd_config(epsilon: float = 1.0, **training) -> dict:
    """Logistic regression on 1000 synthetic 500-dimensional examples, 10 classes (5010 parameters, room for 1000
    distinct Dirac coordinates); Poisson batches of expected size 200, 20 epochs."""
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


def noise_divided_by(monkeypatch, module, factor: float) -> None:
    """The injected bug: the engine's noise stage adds 1/factor of the noise its ledger records."""
    original = module.add_gaussian_noise
    monkeypatch.setattr(
        module, "add_gaussian_noise", lambda s, std, stream: original(s, std / factor, stream)
    )


def clipping_off(monkeypatch) -> None:
    """The injected bug: flat clipping sums the raw per-example gradients (its sensitivity, hence the noise and
    the ledger, unchanged)."""
    original = FlatClipping.clip_and_sum

    def unclipped(self, grads):
        _, stats = original(self, grads)
        return grads.weighted_sum(torch.ones(stats.examples)), stats

    monkeypatch.setattr(FlatClipping, "clip_and_sum", unclipped)


# --- the privacy tests -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dpsgd_audit_below_certificate_and_catches_broken_engine(monkeypatch):
    results = {eps: audit_run(cfg(dpsgd_config(eps)), canaries=M) for eps in (1, 2, 4, 8)}
    for eps, r in results.items():
        assert r["setting"] == "dpsgd" and r["kind"] == "gradient" and r["accountant"] == "pld"
        assert r["epsilon_certified"] == pytest.approx(eps, rel=1e-3)
        assert 0 <= r["epsilon_lower_bound"] <= r["epsilon_certified"], r
    # the canaries are really there: at epsilon 8 the audit finds a clearly positive lower bound
    assert results[8]["epsilon_lower_bound"] > 0.5
    # the same audit of the same configuration, with the engine adding a tenth of its recorded noise
    noise_divided_by(monkeypatch, engine, 10)
    broken = audit_run(cfg(dpsgd_config(1)), canaries=M)
    assert broken["epsilon_certified"] == pytest.approx(1, rel=1e-3)  # the ledger cannot see the bug
    assert broken["epsilon_lower_bound"] > broken["epsilon_certified"], broken


def test_input_canaries_catch_clipping_off(monkeypatch):
    config = cfg(dpsgd_config(1))
    honest = audit_run(config, canaries=M, kind="input")
    assert honest["kind"] == "input"
    assert honest["epsilon_lower_bound"] <= honest["epsilon_certified"], honest
    clipping_off(monkeypatch)
    broken = audit_run(config, canaries=M, kind="input")
    assert broken["epsilon_lower_bound"] > broken["epsilon_certified"], broken


@pytest.mark.slow
def test_projected_audit_below_last_iterate_certificate(monkeypatch):
    config = cfg(projected_config(2.0))
    r = audit_run(config, canaries=M)
    assert r["setting"] == "projected" and r["accountant"] == "last_iterate"
    assert r["epsilon_certified"] == pytest.approx(2.0, rel=1e-3)
    assert r["epsilon_lower_bound"] <= r["epsilon_certified"], r
    # Scored on w_T alone, a 10x noise bug stays inside the last-iterate bound's slack for this audit; a 100x one
    # does not: the canaries do reach the last iterate.
    noise_divided_by(monkeypatch, engine, 100)
    broken = audit_run(config, canaries=M)
    assert broken["epsilon_lower_bound"] > broken["epsilon_certified"], broken


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
    original = runner_module.dirac_gradients

    def spy(coordinates, params, norm):
        sampled.append(coordinates.clone())
        return original(coordinates, params, norm)

    monkeypatch.setattr(runner_module, "dirac_gradients", spy)
    audit_run(cfg(raw), canaries=M)
    included = draw_inclusion(M, Randomness(SEED, warn=False).stream("canaries"))
    coords = dirac_coordinates(M, 5010)
    counts = torch.bincount(torch.cat(sampled), minlength=5010)[coords]
    assert int(counts[~included].sum()) == 0  # an excluded canary never reaches the gradient
    k, steps = int(included.sum()), len(sampled)
    q = 200 / (1000 + M)  # one row per canary, included or not: q does not depend on the secrets
    rate = float(counts[included].sum()) / (k * steps)
    assert abs(rate - q) < 4 * math.sqrt(q * (1 - q) / (k * steps))
    assert int((counts[included] == 0).sum()) < 0.2 * k  # every included one is sampled, at rate q each


def test_scored_gradient_is_the_released_update():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    data = (torch.randn(50, 4), torch.randint(0, 2, (50,)))
    trainer = engine.make_private(model, opt, data, noise_multiplier=1.0, batch_size=10, seed=1)
    coords = torch.arange(10)
    released = ReleasedCoordinates(opt, trainer.params, coords)
    before = torch.cat([p.detach().reshape(-1).clone() for p in trainer.params.values()])
    trainer.train(steps=3)
    after = torch.cat([p.detach().reshape(-1) for p in trainer.params.values()])
    assert released.steps == 3
    # plain SGD: w_T = w_0 - lr * sum_t g_t, so the captured sum is exactly what moved the released model
    torch.testing.assert_close(released.total.float(), (before - after) / 0.3, rtol=1e-4, atol=1e-5)


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
        ({"canaries": 6000}, "at most the number of trainable parameters (5010)"),
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
    raw["training"]["steps"] = 200
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
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=20)))
    args = _parser().parse_args(["audit", "--config", path, "--canaries", "50", "--json"])
    assert cmd_audit(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "epsilon_lower_bound",
        "epsilon_certified",
        "confidence",
        "canaries",
        "guesses",
        "correct",
        "kind",
        "accountant",
        "delta",
        "setting",
    }
    assert out["canaries"] == 50 and out["confidence"] == 0.95 and out["delta"] == 1e-5
    args = _parser().parse_args(["audit", "--config", path, "--canaries", "50", "--kind", "input"])
    assert cmd_audit(args) == 0
    text = capsys.readouterr().out
    assert "epsilon lower bound" in text and "epsilon certified" in text
    assert "stays below the certified epsilon" in text
    assert not (tmp_path / "runs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["audit.toml"]


def test_cli_reports_failure(tmp_path, capsys, monkeypatch):
    noise_divided_by(monkeypatch, engine, 10)
    path = _config_file(tmp_path, dpsgd_config(1))
    args = _parser().parse_args(["audit", "--config", path])
    assert cmd_audit(args) == 1
    assert "FAILED: the lower bound" in capsys.readouterr().out


def test_reproduction_writes_report_json_and_plot(tmp_path, monkeypatch):
    from dptrain.reproduce import audit as reproduction
    from dptrain.reproduce import run_reproduction

    # the report's plumbing on two tiny audits (the experiment itself: dptrain reproduce audit)
    monkeypatch.setattr(reproduction, "CANARIES", 40)
    monkeypatch.setattr(
        reproduction,
        "plan",
        lambda quick: [("dpsgd", "input", "clipping off", 1.0), ("projected", "gradient", "real", 2.0)],
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
    assert "| input | clipping off |" in text and "| gradient | real |" in text
    assert "m = 40 canaries" in text
    data = json.loads((tmp_path / "audit.json").read_text())
    assert [a["setting"] for a in data["audits"]] == ["dpsgd", "projected"]
    assert data["ceiling"] == pytest.approx(reproduction.ceiling(40))
    assert (tmp_path / "audit_lower_bounds.png").stat().st_size > 1000
    assert reproduction.render(data).markdown() == text  # the JSON holds everything the report shows


def test_cli_bad_input(tmp_path):
    path = _config_file(tmp_path, with_sigma(dpsgd_config(steps=1)))
    for argv, words in [
        (["audit", "--config", path, "--confidence", "1.5"], "confidence"),
        (["audit", "--config", path, "--kind", "nope"], "kind"),
        (["audit", "--config", path, "--canaries", "1"], "canaries"),
        (["audit"], "give --config"),
    ]:
        with pytest.raises(ConfigError, match=words):
            cmd_audit(_parser().parse_args(argv))
