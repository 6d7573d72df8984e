"""data.features = "scatternet": every example becomes its ScatterNet features before training (a fixed transform, no
privacy cost), computed once and cached; the ScatterNet models take those features and refuse anything else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.config import load_config
from dptrain.errors import ConfigError, DataError, ModelError
from dptrain.models.builders import build_model
from dptrain.models.scatternet import scatter_features
from dptrain.runs.job import load_data
from dptrain.runs.run import run_training


def _npz(tmp_path, n=60, channels=1):
    g = np.random.default_rng(0)
    x = g.uniform(size=(n, channels, 28, 28)).astype(np.float32)
    y = (x[:, 0, 10:18, 10:18].mean((1, 2)) > 0.5).astype(np.int64)
    path = tmp_path / "d.npz"
    np.savez(path, x=x[: n - 20], y=y[: n - 20], x_test=x[n - 20 :], y_test=y[n - 20 :])
    return path, x


def _cfg(path, *extra):
    return load_config(
        None,
        ['data.name="npz"', f'data.path="{path}"', "data.options.num_classes=2", 'data.features="scatternet"',
         "privacy.noise_multiplier=1.0", *extra],
    )


def test_the_examples_become_their_features_computed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, x = _npz(tmp_path)
    split = load_data(_cfg(path))
    expected = scatter_features(torch.from_numpy(x[:40]))
    assert split.train.x.shape == (40, 81, 7, 7) and torch.equal(split.train.x, expected)
    assert torch.equal(split.test.x, scatter_features(torch.from_numpy(x[40:])))
    cached = list((tmp_path / "runs" / "cache").glob("*.npz"))
    assert len(cached) == 1
    # a second load reads the cache (the transform is not run again)
    monkeypatch.setattr("dptrain.models.scatternet.scatter_features", lambda *a, **k: pytest.fail("recomputed"))
    assert torch.equal(load_data(_cfg(path)).train.x, expected)


def test_a_run_trains_the_linear_model_on_the_features(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, _ = _npz(tmp_path)
    cfg = _cfg(path, 'model.name="scatternet_linear"', "training.steps=3",
               "training.batch_size=10", "privacy.max_grad_norm=0.1")
    summary = run_training(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 3 and "ScatterNet features" in summary["dataset"]


def test_what_the_features_cannot_take_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="data.features must be one of none, scatternet"):
        load_config(None, ['data.features="wavelets"', "privacy.noise_multiplier=1.0"])
    path, _ = _npz(tmp_path, channels=3)
    with pytest.raises(DataError, match=r"takes greyscale images \(N, 1, H, W\)"):
        load_data(_cfg(path))
    with pytest.raises(ConfigError, match='data.options.pixels must be "raw"'):
        load_data(load_config(None, ['data.features="scatternet"', 'data.options.pixels="standardized"', "privacy.noise_multiplier=1.0"]))
    for name in ("scatternet_linear", "scatternet_cnn"):
        with pytest.raises(ModelError, match='set data.features = "scatternet"'):
            build_model(name, (1, 28, 28), 10)
    assert build_model("scatternet_linear", (81, 7, 7), 10)[-1].in_features == 81 * 49
