"""`dptrain reproduce schedules` (App. D of "On Dynamic Noise Influence in Differential Private Learning"): its
vectorised private gradient descent is the engine's full-batch step, its noise follows the paper's convention (the
retraining estimate of a quadratic loss matches the analytic influence), and every schedule it compares spends the
same budget."""

import functools
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.engine.api import make_private
from dptrain.reproduce import schedules as rs
from dptrain.reproduce.report import to_json
from dptrain.schedules.influence import estimate_influence, quadratic_influence

warnings.filterwarnings("ignore", message="not private")


def test_the_vectorised_private_gd_is_the_engines_full_batch_step():
    x, y = rs.synthetic(60, 5)
    x = rs.app_d_scaled(x, 20.0)  # large enough that many gradients are clipped
    for loss in ("logistic", "squared"):
        model = nn.Linear(5, 1, bias=False, dtype=torch.float64)
        nn.init.zeros_(model.weight)

        def per_example(out, target, loss=loss):
            z = out[:, 0]
            return 0.5 * (z - target) ** 2 if loss == "squared" else nn.functional.softplus(-target * z)

        trainer = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            (torch.tensor(x), torch.tensor(y)),
            noise_multiplier=0.0,
            non_private=True,  # the same clipping and averaging, without noise
            max_grad_norm=4.0,
            sampling="full",
            batch_size=60,
            loss_fn=per_example,
            check_independence=False,
        )
        trainer.train(steps=15)
        z = x @ model.weight.detach().numpy()[0]
        engine_loss = float(rs._loss(z, y, loss).mean())
        ours, clipped = rs.private_gd(x, y, loss, np.zeros(15), [0], lr=0.1, clip=4.0)
        assert ours[0] == pytest.approx(engine_loss, rel=1e-10) and clipped[0] > 0.05


def test_its_noise_follows_the_papers_convention():
    """Squared loss, no clipping: the retraining estimate of q_t is the analytic influence of eta G sigma_t nu / N."""
    x, y = rs.synthetic(100, 4)
    x = rs.app_d_scaled(x, 1.0)
    _, clipped = rs.private_gd(x, y, "squared", np.full(10, 20.0), [0], lr=0.1, clip=4.0)
    assert clipped[0] == 0
    run = functools.partial(rs._final_losses, x, y, "squared", 0.1, 4.0)
    est = estimate_influence(run, np.full(10, 10.0), steps=[1, 10], grid=[20.0, 60.0, 100.0], repeats=2000, batched=True)
    q = quadratic_influence(np.linalg.eigvalsh(x.T @ x / len(x)), 10, 0.1, 4.0, len(x))
    assert est.q[0] == pytest.approx(q[0], rel=0.15) and est.q[9] == pytest.approx(q[9], rel=0.15)


def test_quick_reproduction_compares_schedules_at_one_budget(tmp_path):
    path = rs.run(tmp_path, quick=True)
    data = json.loads((tmp_path / "schedules.json").read_text())
    for row in data["rows"]:
        T = data["config"]["T"]
        for name, sig in row["schedules"]["zcdp"].items():
            assert len(sig) == T and math.fsum(s**-2 for s in sig) == pytest.approx(rs.R_BUDGET, rel=1e-9), name
        for sig in row["schedules"]["exact"].values():
            mu = math.sqrt(math.fsum(s**-2 for s in sig))
            assert gdp_epsilon(mu, rs.DELTA) == pytest.approx(rs.EPSILON, rel=1e-9) and gdp_epsilon(mu, rs.DELTA) <= 4
        exp = np.asarray(row["schedules"]["zcdp"]["exp"])
        assert np.allclose(exp[1:] / exp[:-1], exp[1] / exp[0], rtol=1e-9)  # one exponential
        assert row["final_loss"]["zcdp"]["uni"]["relative"] == 0
        # exact accounting of the same budget: less noise at every step
        assert all(a < b for a, b in zip(row["schedules"]["exact"]["uni"], row["schedules"]["zcdp"]["uni"], strict=True))
    assert "Uniform vs dynamic" in path.read_text()
    assert rs.render(json.loads(to_json(data))).markdown() == path.read_text()
    assert (tmp_path / "influence.png").stat().st_size > 0


def test_the_momentum_networks_clipped_sums_are_per_example_autograd():
    from dptrain.reproduce import schedules_momentum as sm

    g = torch.Generator().manual_seed(0)
    X = torch.randn(7, 4, generator=g) * 3  # noqa: N806
    Y = torch.tensor([0, 1, 2, 0, 1, 2, 1])  # noqa: N806
    params = [torch.randn(2, sm.HIDDEN, 4, generator=g), torch.randn(2, sm.HIDDEN, generator=g),
              torch.randn(2, 3, sm.HIDDEN, generator=g) * 0.3, torch.randn(2, 3, generator=g)]
    fast = sm.clipped_sums(X, nn.functional.one_hot(Y, 3).float(), params, clip=1.5)
    for r in range(2):
        want = [torch.zeros_like(p[r]) for p in params]
        for i in range(7):
            ps = [p[r].clone().requires_grad_(True) for p in params]
            h = torch.relu(X[i] @ ps[0].T + ps[1])
            loss = nn.functional.cross_entropy((h @ ps[2].T + ps[3])[None], Y[i : i + 1])
            grads = torch.autograd.grad(loss, ps)
            norm = torch.sqrt(sum((gr * gr).sum() for gr in grads))
            for w, gr in zip(want, grads, strict=True):
                w += gr * min(1.0, 1.5 / float(norm))
        for got, w in zip(fast, want, strict=True):
            assert torch.allclose(got[r], w, atol=1e-5)


def test_every_momentum_schedule_spends_R_and_the_quick_run_reports_them(tmp_path):
    from dptrain.reproduce import schedules_momentum as sm

    for s in sm.shapes(30).values():
        assert math.fsum(v**-2 for v in sm.sigmas_for(s["q"], rs.R_BUDGET)) == pytest.approx(rs.R_BUDGET, rel=1e-9)
    rs.run(tmp_path, quick=True)
    data = json.loads((tmp_path / "schedules.json").read_text())
    (row,) = data["momentum"]
    assert set(row["results"]) == {"uni", "expinfl", "momexpinfl"} and row["results"]["uni"]["relative"] == 0
    assert min(v for k, v in row["tuning_loss"].items() if k.startswith("expinfl")) == pytest.approx(
        row["tuning_loss"][row["results"]["expinfl"]["schedule"]]
    )
