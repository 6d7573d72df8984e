"""Utility graph of van Dijk et al., "Proactive DP: A Multiple Target Optimization Framework for DP-SGD", Sec. 3.3, on a tiny synthetic problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dptrain.data.loaders import make_gaussian_mixture
from dptrain.errors import ConfigError
from dptrain.models.builders import build_model
from dptrain.proactive.utility_graph import (
    UtilityGraph,
    accuracy_evaluator,
    noise_free_trainer,
    utility_graph,
)

SIGMAS = [0.0, 1.0, 10.0, 100.0]


@pytest.fixture(scope="module")
def problem():
    split = make_gaussian_mixture(n=400, dim=10, num_classes=2, separation=4.0)
    train = noise_free_trainer(
        lambda: build_model("logistic", (10,), 2), split, steps=60, batch_size=32, lr=0.5, seed=0
    )
    return split, train, accuracy_evaluator(split.test.x, split.test.y)


@pytest.fixture(scope="module")
def graph(problem):
    _, train, evaluate = problem
    return utility_graph(train, evaluate, clips=[0.5, 2.0], sigmas=SIGMAS, draws=5, seed=0)


def test_shapes_and_base_accuracy(graph):
    assert graph.fractions.shape == (2, len(SIGMAS), 5)
    assert graph.mean_fraction().shape == (2, len(SIGMAS))
    # the separable mixture is learned well without noise, so the fraction is meaningful
    assert all(acc > 0.9 for acc in graph.base_accuracy.values())


def test_fraction_is_exactly_one_without_noise(graph):
    assert np.array_equal(graph.fractions[:, 0, :], np.ones((2, 5)))


def test_fraction_decreases_with_sigma(graph):
    mean = graph.mean_fraction()
    for row in mean:
        assert row[0] >= row[1] >= row[2] - 0.02  # allow a little noise between neighbouring sigmas
        assert row[-1] < row[0] - 0.1  # sigma = 100 destroys the model
        assert row[-1] < 0.8


def test_largest_sigma_respects_threshold(graph):
    mean = graph.mean_fraction()
    for i, clip in enumerate(graph.clips):
        for threshold in (0.5, 0.9, 0.99):
            best = graph.largest_sigma(clip, threshold)
            ok = [s for s, f in zip(graph.sigmas, mean[i], strict=True) if f >= threshold]
            assert best == max(ok)  # sigma = 0 always qualifies (fraction 1)
            assert mean[i][graph.sigmas.index(best)] >= threshold
            assert all(f < threshold for s, f in zip(graph.sigmas, mean[i], strict=True) if s > best)
    assert graph.largest_sigma(0.5, threshold=1.01) is None
    with pytest.raises(ConfigError):
        graph.largest_sigma(0.3)


def test_table_and_plot(graph, tmp_path):
    table = graph.table()
    assert table.count("\n") == 1 + len(graph.clips)
    assert "sigma=100" in table and "| 0.5 |" in table
    path = graph.plot(tmp_path / "ug.png")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_deterministic_given_seed(problem, graph):
    _, train, evaluate = problem
    again = utility_graph(train, evaluate, clips=[0.5, 2.0], sigmas=SIGMAS, draws=5, seed=0)
    assert np.array_equal(again.fractions, graph.fractions)
    assert again.base_accuracy == graph.base_accuracy
    other = utility_graph(train, evaluate, clips=[0.5, 2.0], sigmas=SIGMAS, draws=5, seed=1)
    assert not np.array_equal(other.fractions[:, 1:], graph.fractions[:, 1:])


def test_noise_has_the_paper_scale():
    """Each parameter receives N(0, C^2 sigma^2) (Sec. 3.3): measured on a model whose 'accuracy' reports the
    weights' standard deviation."""
    model = torch.nn.Linear(200, 50, bias=False)
    torch.nn.init.zeros_(model.weight)
    stds = []

    def evaluate(m):
        stds.append(float(m.weight.detach().std()))
        return 1.0

    utility_graph(lambda c: model, evaluate, clips=[0.5], sigmas=[3.0], draws=1)
    assert stds[0] == 0.0
    assert abs(stds[1] - 1.5) < 0.05
    assert float(model.weight.detach().abs().max()) == 0.0  # w* itself is not modified


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clips": [], "sigmas": [1.0]},
        {"clips": [0.0], "sigmas": [1.0]},
        {"clips": [1.0], "sigmas": [-1.0]},
        {"clips": [1.0], "sigmas": [float("nan")]},
        {"clips": [1.0], "sigmas": [1.0], "draws": 0},
    ],
)
def test_bad_parameters(kwargs):
    with pytest.raises(ConfigError):
        utility_graph(lambda c: torch.nn.Linear(2, 2), lambda m: 1.0, **kwargs)


def test_zero_base_accuracy_is_refused():
    with pytest.raises(ConfigError, match="accuracy fraction is undefined"):
        utility_graph(lambda c: torch.nn.Linear(2, 2), lambda m: 0.0, clips=[1.0], sigmas=[1.0])


def test_unknown_clip_in_table_object():
    g = UtilityGraph([1.0], [0.0, 1.0], {1.0: 0.5}, np.ones((1, 2, 1)))
    assert g.largest_sigma(1.0) == 1.0
    with pytest.raises(ConfigError):
        g.largest_sigma(2.0)
