"""ScatterNet features (Tramer & Boneh, "Differentially Private Learning Needs Better Features (or Much More Data)")
and their CNN: the transform's shape and its algebra (order 0 is a linear low-pass, orders 1 and 2 are moduli, so
positively homogeneous and even), the cache, and the model's per-example gradients against single-example
backward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.errors import DataError
from dptrain.models import scatternet
from dptrain.models.builders import check_private_compatible
from dptrain.models.scatternet import (
    cache_file,
    cached_features,
    scatter_cnn_fmnist,
    scatter_features,
    scattering_channels,
)
from dptrain.stages.per_example import cross_entropy_per_example, make_grad_sampler


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))


def test_shape_dtype_and_orders(images):
    f = scatter_features(images, batch_size=3)  # two batches: 3 + 1
    assert f.shape == (4, 81, 7, 7) and f.dtype == torch.float32
    assert scattering_channels(2) == 81
    assert bool(torch.isfinite(f).all())
    # Orders 1 and 2 are low-passed moduli: non-negative, and not all zero for a random image.
    assert float(f[:, 1:].min()) >= 0 and float(f[:, 1:].amax(dim=(2, 3)).min()) > 1e-4
    # Batching does not change the features.
    torch.testing.assert_close(f, scatter_features(images, batch_size=4), rtol=0, atol=1e-6)


def test_homogeneity_and_sign(images):
    """S(2x) = 2 S(x) in every channel; S(-x) = -S(x) in channel 0 (a linear low-pass) and S(-x) = S(x) in the
    others (moduli). A linear map fails the second, a non-homogeneous one the first."""
    f = scatter_features(images)
    torch.testing.assert_close(scatter_features(2 * images), 2 * f, rtol=1e-5, atol=1e-6)
    g = scatter_features(-images)
    torch.testing.assert_close(g[:, 0], -f[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g[:, 1:], f[:, 1:], rtol=1e-5, atol=1e-6)


def test_constant_image_is_its_low_pass():
    """A constant image c: its order-0 channel (a normalized low-pass average) is c everywhere, its wavelet channels
    (zero-mean filters) vanish."""
    c = torch.full((2, 1, 28, 28), 0.7)
    c[1] = 0.25
    f = scatter_features(c)
    torch.testing.assert_close(f[0, 0], torch.full((7, 7), 0.7), rtol=1e-4, atol=1e-6)  # float32 FFTs
    torch.testing.assert_close(f[1, 0], torch.full((7, 7), 0.25), rtol=1e-4, atol=1e-6)
    assert float(f[:, 1:].abs().max()) < 1e-4


def test_bad_input_is_a_data_error():
    with pytest.raises(DataError, match=r"\(N, 1, H, W\)"):
        scatter_features(torch.rand(4, 28, 28))
    with pytest.raises(DataError, match="multiples"):
        scatter_features(torch.rand(1, 1, 30, 30))


def test_cache_round_trip(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(1)
    x_train, x_test = torch.rand(5, 1, 28, 28, generator=g), torch.rand(3, 1, 28, 28, generator=g)
    y_train, y_test = torch.tensor([0, 1, 2, 3, 4]), torch.tensor([9, 8, 7])
    path = cache_file(tmp_path / "cache", "fake", J=2)
    first = cached_features(path, x_train, y_train, x_test, y_test, J=2)
    assert path.is_file()
    # the training examples' features are as sensitive as the examples: the owner's alone
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o077 == 0
    with np.load(path) as archive:
        assert archive["x_train"].dtype == np.float32 and archive["x_train"].shape == (5, 81, 7, 7)
        assert archive["x_test"].shape == (3, 81, 7, 7) and int(archive["J"]) == 2
    torch.testing.assert_close(first[0], scatter_features(x_train), rtol=0, atol=0)
    torch.testing.assert_close(first[2], scatter_features(x_test), rtol=0, atol=0)

    calls = []
    real = scatternet.scatter_features
    monkeypatch.setattr(scatternet, "scatter_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = cached_features(path, x_train, y_train, x_test, y_test, J=2)
    assert calls == []  # read back, not recomputed
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert again[1].dtype == torch.int64 and again[1].tolist() == [0, 1, 2, 3, 4]

    # Other images under the same name: the cache is recomputed, not served stale.
    changed = cached_features(path, x_train.flip(3), y_train, x_test, y_test, J=2)
    assert calls == [1, 1]
    assert not torch.equal(changed[0], first[0])
    # Keyed by J: another file with other shapes.
    assert cache_file(tmp_path, "fake", J=1) != path
    j1 = cached_features(cache_file(tmp_path, "fake", J=1), x_train, y_train, x_test, y_test, J=1)
    assert j1[0].shape == (5, scattering_channels(1), 14, 14)


def test_model_shape_and_per_example_gradients():
    torch.manual_seed(0)
    model = scatter_cnn_fmnist()
    check_private_compatible(model)
    assert sum(p.numel() for p in model.parameters()) == 33_066
    assert model(torch.randn(2, 81, 7, 7)).shape == (2, 10)

    x, y = 3 * torch.randn(5, 81, 7, 7) + 1, torch.tensor([0, 3, 9, 3, 5])
    sampler = make_grad_sampler(model, cross_entropy_per_example, "auto")
    assert sampler.name == "layerwise"
    grads, losses = sampler(x, y)
    per_example = grads.materialize()
    sampler.close()
    for i in range(len(x)):
        model.zero_grad()
        loss = cross_entropy_per_example(model(x[i : i + 1]), y[i : i + 1]).sum()
        loss.backward()
        assert abs(float(losses[i]) - loss.item()) < 1e-5
        for name, p in model.named_parameters():
            torch.testing.assert_close(per_example[name][i], p.grad, rtol=0, atol=1e-5)
