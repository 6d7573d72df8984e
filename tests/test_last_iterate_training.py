"""Projected noisy SGD on convex GLMs (Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient Descent"): gradients, constants, projection,
ledger contract, validation, determinism, resume and utility."""

import copy
import math

import dp_accounting as dpa
import pytest
import torch

from dptrain.data.loaders import make_gaussian_mixture
from dptrain.errors import ConfigError
from dptrain.last_iterate import (
    LOSSES,
    ConvexGLM,
    ProjectedNoisySGD,
    RunNotFinished,
    accuracy,
    project_to_ball,
)
from dptrain.randomness.generators import Randomness

CASES = [(loss, bias, l2) for loss in LOSSES for bias in (True, False) for l2 in (0.0, 0.3)]


def _data(n=40, d=5, loss="logistic", seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    if loss == "squared":
        y = 3.0 * torch.randn(n, generator=g, dtype=torch.float64)  # some beyond label_bound: clipped
    else:
        y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def _reference_loss(loss, w, x_row, y_row):
    """Independent scalar reference for f_i (written from the definitions, not from the module)."""
    score = torch.dot(w, x_row)
    if loss == "squared":
        return 0.5 * (score - y_row) ** 2
    z = y_row * score
    if loss == "logistic":
        return torch.log1p(torch.exp(-z))
    if z >= 1:
        return 0.0 * z
    if z > 0:
        return 0.5 * (1 - z) ** 2
    return 0.5 - z


def _sample_in_ball(g, center, radius, k):
    """k points in the ball: directions uniform, radii in [0, radius] with some exactly on the sphere."""
    u = torch.randn(k, center.shape[0], generator=g, dtype=torch.float64)
    u /= torch.linalg.vector_norm(u, dim=1, keepdim=True)
    r = radius * torch.rand(k, 1, generator=g, dtype=torch.float64)
    r[: k // 4] = radius
    return center + r * u


@pytest.mark.parametrize("loss,fit_bias,l2", CASES)
def test_closed_form_gradients_equal_autograd_per_example(loss, fit_bias, l2):
    glm = ConvexGLM(loss, feature_norm=2.0, fit_bias=fit_bias, l2=l2, label_bound=1.5)
    x, y = _data(loss=loss)
    xt, yt = glm.prepare_features(x), glm.prepare_labels(y)
    g = torch.Generator().manual_seed(1)
    w = 1.2 * torch.randn(xt.shape[1], generator=g, dtype=torch.float64)
    if loss == "smoothed_hinge":  # all three pieces of the hinge must be exercised
        z = yt * (xt @ w)
        assert (z <= 0).any() and ((z > 0) & (z < 1)).any() and (z >= 1).any()
    closed = glm.per_example_gradients(w, xt, yt)
    for i in range(xt.shape[0]):
        wi = w.clone().requires_grad_(True)
        f = _reference_loss(loss, wi, xt[i], yt[i])
        assert float(glm.per_example_losses(w, xt[i : i + 1], yt[i : i + 1])[0]) == pytest.approx(
            float(f.detach())
        )
        (grad,) = torch.autograd.grad(f + 0.5 * l2 * wi.pow(2).sum(), wi)
        torch.testing.assert_close(closed[i] + l2 * w, grad, rtol=1e-12, atol=1e-12)
    # The batch gradient is the mean of grad F_i (regularized), also against autograd.
    wr = w.clone().requires_grad_(True)
    objective = glm.per_example_losses(wr, xt, yt).mean() + 0.5 * l2 * wr.pow(2).sum()
    (grad,) = torch.autograd.grad(objective, wr)
    torch.testing.assert_close(glm.batch_gradient(w, xt, yt), grad, rtol=1e-12, atol=1e-12)


def test_features_and_labels_are_mapped_per_example():
    glm = ConvexGLM("logistic", feature_norm=2.0, fit_bias=True)
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)
    xt = glm.prepare_features(x)
    torch.testing.assert_close(xt, torch.tensor([[1.2, 1.6, 1.0], [0.3, 0.4, 1.0]], dtype=torch.float64))
    torch.testing.assert_close(glm.prepare_labels(torch.tensor([0, 1])), torch.tensor([-1.0, 1.0]).double())
    sq = ConvexGLM("squared", feature_norm=1.0, label_bound=2.0)
    torch.testing.assert_close(
        sq.prepare_labels(torch.tensor([-5.0, 1.0, 7.0])), torch.tensor([-2.0, 1.0, 2.0]).double()
    )


@pytest.mark.parametrize("loss,fit_bias,l2", CASES)
def test_lipschitz_bound_holds_on_K(loss, fit_bias, l2):
    r, diameter = 2.0, 3.0
    glm = ConvexGLM(loss, feature_norm=r, fit_bias=fit_bias, l2=l2, label_bound=1.5)
    x, y = _data(n=200, loss=loss, scale=2.0)  # many rows have ||x|| > R: the rescaling must bound them
    xt, yt = glm.prepare_features(x), glm.prepare_labels(y)
    assert float(torch.linalg.vector_norm(xt, dim=1).max()) <= glm.augmented_feature_norm * (1 + 1e-12)
    g = torch.Generator().manual_seed(3)
    center = torch.randn(xt.shape[1], generator=g, dtype=torch.float64)
    lip = glm.lipschitz(diameter, float(torch.linalg.vector_norm(center)))
    assert lip == glm.constants(diameter, float(torch.linalg.vector_norm(center)))["L"]
    worst = 0.0
    for w in _sample_in_ball(g, center, diameter / 2, 200):
        worst = max(worst, float(torch.linalg.vector_norm(glm.per_example_gradients(w, xt, yt), dim=1).max()))
    assert worst <= lip * (1 + 1e-12)
    if loss != "squared":
        assert worst > 0.5 * lip  # the bound is not vacuous: gradients near R~ occur


def test_squared_lipschitz_bound_is_attained():
    # ||x|| = R, w on the sphere of K aligned with x~, y = -label_bound: |w.x~ - y| ||x~|| equals L exactly.
    glm = ConvexGLM("squared", feature_norm=2.0, fit_bias=True, label_bound=1.5)
    diameter = 3.0
    xt = glm.prepare_features(torch.tensor([[2.0, 0.0, 0.0]], dtype=torch.float64))
    w = (diameter / 2) * xt[0] / torch.linalg.vector_norm(xt[0])
    grad = glm.per_example_gradients(w, xt, glm.prepare_labels(torch.tensor([-1.5])))
    assert float(torch.linalg.vector_norm(grad)) == pytest.approx(glm.lipschitz(diameter), rel=1e-12)


@pytest.mark.parametrize("loss,fit_bias,l2", CASES)
def test_smoothness_and_strong_convexity_bounds(loss, fit_bias, l2):
    glm = ConvexGLM(loss, feature_norm=1.5, fit_bias=fit_bias, l2=l2)
    c = glm.constants(4.0)
    big_m, small_m = c["M"], c["m"]
    x, y = _data(n=60, loss=loss, scale=1.0)
    xt, yt = glm.prepare_features(x), glm.prepare_labels(y)
    g = torch.Generator().manual_seed(4)
    for _ in range(100):
        w, v = 2.0 * torch.randn(2, xt.shape[1], generator=g, dtype=torch.float64)
        dg = glm.per_example_gradients(w, xt, yt) - glm.per_example_gradients(v, xt, yt) + l2 * (w - v)
        dist = float(torch.linalg.vector_norm(w - v))
        assert float(torch.linalg.vector_norm(dg, dim=1).max()) <= big_m * dist * (1 + 1e-10)
        # m-strong convexity of F_i: <grad F_i(w) - grad F_i(v), w - v> >= m ||w - v||^2.
        assert float((dg @ (w - v)).min()) >= small_m * dist**2 * (1 - 1e-10) - 1e-12
    # M is attained (not loose): curvature along x~ where l'' is maximal (z = 0 logistic, z = 1/2 hinge).
    xt1 = glm.prepare_features(torch.tensor([[1.5, 0.0, 0.0]], dtype=torch.float64))
    yt1 = torch.ones(1, dtype=torch.float64)
    u = xt1[0] / torch.linalg.vector_norm(xt1[0])
    base = {"logistic": 0.0, "smoothed_hinge": 0.5, "squared": 0.0}[loss] / glm.augmented_feature_norm
    h = 1e-4
    w, v = (base + h) * u, (base - h) * u
    dg = glm.per_example_gradients(w, xt1, yt1)[0] - glm.per_example_gradients(v, xt1, yt1)[0] + l2 * (w - v)
    assert float(torch.linalg.vector_norm(dg)) / (2 * h) == pytest.approx(big_m, rel=1e-6)


def test_projection_is_the_euclidean_projection_onto_the_ball():
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    inside = c + torch.tensor([0.3, 0.2, -0.1], dtype=torch.float64)
    assert torch.equal(project_to_ball(inside, c, 1.0), inside)
    out = c + torch.tensor([3.0, -4.0, 0.0], dtype=torch.float64)
    p = project_to_ball(out, c, 1.0)
    assert float(torch.linalg.vector_norm(p - c)) == pytest.approx(1.0)
    # The closest point: every other point of the sphere (sampled) is farther from `out`.
    g = torch.Generator().manual_seed(0)
    others = _sample_in_ball(g, c, 1.0, 400)
    assert float(torch.linalg.vector_norm(others - out, dim=1).min()) >= float(
        torch.linalg.vector_norm(p - out)
    )


def _run(batching="random", **kw):
    x, y = kw.pop("data", None) or _data(n=60, d=4)
    options = dict(noise_std=0.5, learning_rate=0.5, steps=30, batch_size=10, diameter=2.0, seed=7)
    options.update(kw)
    glm = options.pop("glm", ConvexGLM("logistic", feature_norm=1.0))
    if batching == "full":
        options["batch_size"] = None
    return ProjectedNoisySGD(glm, (x, y), batching=batching, **options)


@pytest.mark.parametrize("batching", ["random", "cyclic", "full"])
def test_iterates_stay_in_K_and_projection_is_active(batching):
    center = torch.tensor([0.5, -0.3, 0.2, 0.1, 0.4], dtype=torch.float64)
    run = _run(batching, noise_std=20.0, learning_rate=1.0, steps=40, diameter=1.0, center=center)
    dists = []
    while not run.finished:
        run.step()
        dists.append(float(torch.linalg.vector_norm(run.state_dict()["iterate"] - center)))
    assert max(dists) <= 0.5 + 1e-9
    assert max(dists) >= 0.5 - 1e-9  # with this much noise the projection must have acted


def test_steps_follow_the_papers_update_rule():
    # Full batch draws no batches, so Z_t is the (t+1)-th draw of the (seeded) noise stream.
    # w_{t+1} = Proj_K[w_t - eta_t (G_t + Z_t)], eta_t = eta_0 (t + 1)^(-p), K = ball of radius D/2 around 0.
    x, y = _data(n=20, d=3)
    glm = ConvexGLM("smoothed_hinge", feature_norm=1.0, l2=0.1)
    run = ProjectedNoisySGD(
        glm,
        (x, y),
        noise_std=0.7,
        learning_rate=0.2,
        steps=3,
        batching="full",
        diameter=1.0,
        seed=5,
        lr_power=0.5,
    )
    w_final = run.train()
    xt, yt = glm.prepare_features(x), glm.prepare_labels(y)
    noise = Randomness(5, warn=False).stream("noise")  # the run's noise stream, rebuilt from its explicit seed
    w = torch.zeros(4, dtype=torch.float64)
    for t in range(3):
        z = 0.7 * noise.normal((4,), torch.float64)
        w = w - 0.2 * (t + 1) ** -0.5 * (glm.batch_gradient(w, xt, yt) + z)
        w = w * min(1.0, 0.5 / float(torch.linalg.vector_norm(w)))
    torch.testing.assert_close(w_final, w, rtol=0, atol=1e-14)


def test_batches_random_without_replacement_and_cyclic_round_robin():
    run = _run("random", batch_size=12)
    for t in range(20):
        idx = run.batch_indices(t)
        assert len(idx) == 12 and len(torch.unique(idx)) == 12 and int(idx.max()) < 60
    cyc = _run("cyclic", batch_size=12)
    epoch = torch.cat([cyc.batch_indices(t) for t in range(5)])
    assert sorted(epoch.tolist()) == list(range(60))  # every example exactly once per pass of n/b steps
    assert torch.equal(cyc.batch_indices(5), cyc.batch_indices(0)) and torch.equal(
        cyc.batch_indices(7), cyc.batch_indices(2)
    )
    assert _run("full").batch_size == 60


@pytest.mark.parametrize(
    "batching,adjacency",
    [("random", "replace"), ("random", "remove"), ("cyclic", "replace"), ("full", "replace")],
)
def test_ledger_records_one_event_per_step(batching, adjacency):
    glm = ConvexGLM("squared", feature_norm=1.0, l2=0.2, label_bound=2.0)
    run = _run(batching, glm=glm, adjacency=adjacency, learning_rate=0.3, lr_power=0.5, steps=25)
    for _ in range(7):
        run.step()
    assert run.ledger.releases == 7
    run.train()
    ledger = run.ledger
    lip = glm.lipschitz(2.0)
    assert lip == pytest.approx(((0 + 1.0) * math.sqrt(2) + 2.0) * math.sqrt(2))
    delta = (2.0 if adjacency == "replace" else 1.0) * lip
    b = 60 if batching == "full" else 10
    assert len(ledger.entries) == 1 and ledger.entries[0].count == 25 and ledger.releases == 25
    event = ledger.entries[0].event
    if batching == "random":
        assert isinstance(event, dpa.SampledWithoutReplacementDpEvent)
        assert (event.source_dataset_size, event.sample_size) == (60, 10)
        event = event.event
    assert isinstance(event, dpa.GaussianDpEvent)
    assert event.noise_multiplier == pytest.approx(b * 0.5 / delta, rel=1e-12)
    assert ledger.neighboring == {"replace": "replace_one", "remove": "add_or_remove_one"}[adjacency]
    facts = ledger.entries[0].facts
    assert facts["mechanism"] == "projected_noisy_sgd" and facts["batching"] == batching
    assert (facts["dataset_size"], facts["batch_size"]) == (60, b)
    assert facts["lipschitz"] == pytest.approx(lip) and facts["sensitivity"] == pytest.approx(delta)
    assert facts["smoothness"] == pytest.approx(2.0 + 0.2) and facts["strong_convexity"] == pytest.approx(0.2)
    assert facts["diameter"] == 2.0 and facts["learning_rate"] == 0.3 and facts["lr_power"] == 0.5
    assert facts["noise_std"] == 0.5 and facts["convex"] is True and facts["projected"] is True
    assert isinstance(ledger.dp_event(), dpa.SelfComposedDpEvent)
    assert run.learning_rate_at(3) == pytest.approx(0.3 * 4**-0.5)


def _one_line_config_error(**kw):
    with pytest.raises(ConfigError) as info:
        _run(**kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_validation_refuses_impossible_settings():
    # logistic, R = 1 with bias: M = (1 + 1)/4 = 0.5, so 2/M = 4.
    assert "learning_rate" in _one_line_config_error(learning_rate=4.01)
    _run(learning_rate=4.0)  # eta = 2/M is allowed when m = 0 (Lemma 2.1)
    strong = ConvexGLM("logistic", feature_norm=1.0, l2=0.5)  # M = 1, m = 0.5: needs eta < 2 (Lemma 5.5)
    assert "learning_rate" in _one_line_config_error(glm=strong, learning_rate=2.0)
    _run(glm=strong, learning_rate=1.99)
    assert "divide" in _one_line_config_error(batching="cyclic", batch_size=7)
    x, y = _data(n=60, d=4)
    assert "0 or 1" in _one_line_config_error(data=(x, y + 1))
    assert "0 or 1" in _one_line_config_error(data=(x, y.double() * 0.5))
    _run(glm=ConvexGLM("squared", feature_norm=1.0), data=(x, y + 5))  # any real label is fine for squared
    assert "lr_power" in _one_line_config_error(lr_power=1.0)
    assert "lr_power" in _one_line_config_error(lr_power=-0.1)
    assert "diameter" in _one_line_config_error(diameter=0.0)
    assert "noise_std" in _one_line_config_error(noise_std=0.0)
    assert "batch_size" in _one_line_config_error(batch_size=61)
    assert "batch_size" in _one_line_config_error(batch_size=0)
    assert "steps" in _one_line_config_error(steps=0)
    assert "batching" in _one_line_config_error(batching="poisson")
    assert "adjacency" in _one_line_config_error(adjacency="swap")
    assert "center" in _one_line_config_error(center=torch.zeros(3))
    with pytest.raises(ConfigError, match="batch_size must equal n"):
        ProjectedNoisySGD(
            ConvexGLM("logistic", 1.0),
            (x, y),
            noise_std=1.0,
            learning_rate=0.1,
            steps=1,
            batch_size=10,
            batching="full",
            diameter=1.0,
        )
    with pytest.raises(ConfigError, match="loss"):
        ConvexGLM("hinge", 1.0)
    with pytest.raises(ConfigError, match="feature_norm"):
        ConvexGLM("logistic", 0.0)


def test_determinism_resume_and_final_model_only_at_the_end():
    a, b, c = _run(seed=3), _run(seed=3), _run(seed=4)
    with pytest.raises(RunNotFinished):
        a.final_model()
    with pytest.raises(RunNotFinished):
        a.predict(torch.zeros(2, 4))
    wa, wb, wc = a.train(), b.train(), c.train()
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    with pytest.raises(RunNotFinished):
        a.step()
    assert a.predict(torch.zeros(3, 4)).tolist() == [int(float(wa[-1]) > 0)] * 3
    # Resuming from the (internal) state mid-run gives the same last iterate as an uninterrupted run.
    for batching in ("random", "cyclic"):
        first = _run(batching, seed=11)
        for _ in range(13):
            first.step()
        state = copy.deepcopy(first.state_dict())
        with pytest.raises(ConfigError, match="noise_std"):
            _run(batching, seed=11, noise_std=0.6).load_state_dict(state)  # state of another run is refused
        resumed = _run(batching, seed=99)  # the state carries the run's random streams, not the new run's seed
        resumed.load_state_dict(state)
        assert resumed.ledger.releases == 13
        assert torch.equal(resumed.train(), _run(batching, seed=11).train())


def test_training_separates_a_gaussian_mixture():
    split = make_gaussian_mixture(n=2000, dim=20, num_classes=2, separation=4.0, seed=0)
    for loss, lr in (("logistic", 0.1), ("smoothed_hinge", 0.02)):
        glm = ConvexGLM(loss, feature_norm=8.0, fit_bias=True)
        assert lr <= 2 / glm.constants(10.0)["M"]
        run = ProjectedNoisySGD(
            glm, split.train, noise_std=0.5, learning_rate=lr, steps=400, batch_size=50, diameter=10.0, seed=0
        )
        w = run.train()
        acc = accuracy(w, glm, split.test.x, split.test.y)
        assert acc > 0.85, (loss, acc)
    with pytest.raises(ConfigError):
        accuracy(w, ConvexGLM("squared", 8.0), split.test.x, split.test.y)


def test_cli_trains_projected_noisy_sgd_and_certifies_the_last_iterate(tmp_path, capsys):
    import json

    from dptrain.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "seed = 1\n"  # reproducible (not private): the accuracy assertion below must not depend on the draw
        '[data]\nname = "synthetic"\noptions = { n = 600, dim = 8, num_classes = 2, separation = 4.0 }\n'
        "test_is_public = true\n"  # generated data: its test split is public
        '[privacy]\ntarget_epsilon = 2.0\ndelta = 1e-5\naccountant = "rdp"\n'
        '[training]\nalgorithm = "projected_noisy_sgd"\nsteps = 300\nbatch_size = 10\nlearning_rate = 1.0\n'
        '[convex]\nloss = "logistic"\nfeature_norm = 1.0\nl2 = 0.01\ndiameter = 4.0\n'
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["accountants"]["rdp"]["certified"] and summary["accountant"] == "rdp"
    assert summary["epsilon"] <= 2.0 + 1e-9 and not summary["certified"] and not summary["private"]  # seeded
    assert summary["epsilon_last_iterate"] < summary["epsilon"]  # the paper's bound, reported, not certified
    assert summary["test_accuracy"] > 0.8 and summary["steps"] == 300
    assert (out / "model.pt").exists() and not (out / "checkpoint.pt").exists()  # only the last iterate
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2  # no overwrite
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("learning_rate = 1.0", "learning_rate = 50.0"))
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "r2"), "--no-progress"]) == 2
    assert "2/M" in capsys.readouterr().err
    uncertified = tmp_path / "li.toml"
    uncertified.write_text(cfg.read_text().replace('accountant = "rdp"', 'accountant = "last_iterate"'))
    assert main(["train", "--config", str(uncertified), "--out", str(tmp_path / "r3"), "--no-progress"]) == 2
    assert "not certified" in capsys.readouterr().err


def test_cli_full_batch_run_certified_by_the_last_iterate_bound(tmp_path, capsys):
    """With full batches the last-iterate bound certifies the run (past the burn-in D~ n / (Delta eta), about 700
    steps here, it stops growing), with composition reported beside it."""
    import json

    from dptrain.cli import main

    cfg = tmp_path / "full.toml"
    cfg.write_text(
        '[data]\nname = "synthetic"\noptions = { n = 600, dim = 8, num_classes = 2, separation = 4.0 }\n'
        "test_is_public = true\n"  # generated data: its test split is public
        '[privacy]\ndelta = 1e-5\naccountant = "last_iterate"\n'
        '[training]\nalgorithm = "projected_noisy_sgd"\nsteps = 3000\nlearning_rate = 1.0\n'
        '[convex]\nloss = "logistic"\nfeature_norm = 1.0\nl2 = 0.01\ndiameter = 4.0\nbatching = "full"\n'
        "noise_std = 0.05\n"
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["accountant"] == "last_iterate" and s["certified"] and s["last_iterate_certified"]
    assert s["epsilon"] == s["epsilon_last_iterate"] < s["epsilon_composition"] / 2
    assert s["test_accuracy"] > 0.8
