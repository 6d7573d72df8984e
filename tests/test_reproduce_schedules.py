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
from dptrain.engine import make_private
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
