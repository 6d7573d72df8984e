"""Cyclic and shuffled batches (blocks of a secret permutation of the n examples) are certified under replace-one
adjacency, with sensitivity 2C per step, as fixed-size batches are.

Adding an example to a permutation moves every example after it to the next position, so the blocks of the other
examples change (the equal split that docs/accounting.md refuses for BandMF's groups, for the same reason): the step
sums differ by up to 2C at every step after the added example, not by C at its own steps. Recorded under add/remove
adjacency at sensitivity C, T steps were certified as T Gaussians of sensitivity C, which the run below (D = {a, b},
D' = D + {x}, batches of one example, 6 steps) exceeds by a wide margin."""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from dptrain.accounting import get_accountant
from dptrain.accounting.membership import profile_deltas
from dptrain.engine.api import make_private

STEPS, SIGMA = 6, 1.0
EPSILONS = np.array([0.0, 1.0, 2.0, 3.0, 4.0])


def _release_mixture(grads):
    """The released noisy step sums of cyclic batches of one example: a mixture, over the secret permutation, of
    Gaussians of std SIGMA (clip norm 1) centred on the permuted gradients repeated for STEPS steps."""
    means = [[grads[perm[t % len(grads)]] for t in range(STEPS)] for perm in itertools.permutations(range(len(grads)))]
    return np.full(len(means), 1.0 / len(means)), np.array(means, dtype=float)


def _log_density(y, weights, means):
    d = -((y[:, None, :] - means[None]) ** 2).sum(-1) / (2 * SIGMA**2)
    top = d.max(1, keepdims=True)
    return np.log((weights[None] * np.exp(d - top)).sum(1)) + top[:, 0]


def _hockey_stick(p, q, rng, n=100_000):
    """H_{e^eps}(P || Q) at EPSILONS, by Monte Carlo under P (each a mixture of Gaussians); standard error < 2e-3."""
    k = rng.choice(len(p[0]), size=n, p=p[0])
    y = p[1][k] + SIGMA * rng.standard_normal((n, STEPS))
    loss = _log_density(y, *p) - _log_density(y, *q)
    return np.maximum(0.0, 1.0 - np.exp(EPSILONS[None] - loss[:, None])).mean(0)


@pytest.mark.parametrize("sampling", ["cyclic", "shuffled"])
def test_permutation_batches_are_charged_2c_per_step_and_that_bounds_adding_an_example(sampling):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=SIGMA,
                           batch_size=1, sampling=sampling, seed=0)
    ledger = trainer.ledger_after(STEPS)
    trainer.close()

    # D = {a, b} against D' = D + {x}: the others' blocks move after x's position
    rng = np.random.default_rng(1)
    with_x, without = _release_mixture([1.0, -1.0, 1.0]), _release_mixture([1.0, -1.0])
    remove, add = _hockey_stick(with_x, without, rng), _hockey_stick(without, with_x, rng)
    mu = np.sqrt(STEPS) / SIGMA  # the add/remove reading at sensitivity C: STEPS Gaussians, mu-GDP
    old = stats.norm.cdf(-EPSILONS / mu + mu / 2) - np.exp(EPSILONS) * stats.norm.cdf(-EPSILONS / mu - mu / 2)
    assert remove[3] > old[3] + 0.05 and add[3] > old[3] + 0.05  # 0.45 and 0.48 against 0.356 at eps = 3
    pld, _ = get_accountant("pld").composed(ledger)  # the profile the run's ledger certifies
    assert np.all(np.maximum(remove, add) <= profile_deltas(pld, EPSILONS))
    assert ledger.neighboring == "replace_one"  # the same n, one example replaced: its block moves by up to 2C
    assert ledger.entries[0].event.noise_multiplier == pytest.approx(SIGMA / 2)


@pytest.mark.parametrize("sampling", ["cyclic", "shuffled", "fixed_size"])
def test_a_ledger_under_add_remove_adjacency_is_refused_for_replace_one_batches(sampling):
    """A given ledger (a resumed run's, a preprocessing prefix, the user's own) sets the adjacency its steps are
    recorded under: for these schemes add/remove would record sensitivity C, which the run does not meet."""
    from dptrain.accounting import Ledger
    from dptrain.errors import ConfigError

    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ConfigError, match="certified under replace-one adjacency") as e:
        make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=SIGMA,
                     batch_size=2, sampling=sampling, seed=0, ledger=Ledger())
    assert "\n" not in str(e.value)
    trainer = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), noise_multiplier=SIGMA,
                           batch_size=2, sampling=sampling, seed=0, ledger=Ledger(neighboring="replace_one"))
    event = trainer.release_event()[0]
    assert getattr(event, "event", event).noise_multiplier == pytest.approx(SIGMA / 2)  # std over 2C
    trainer.close()


def test_last_iterate_cyclic_batches_are_certified_under_replace_adjacency_only(capsys):
    from dptrain.accounting.last_iterate import Setting, last_iterate_report
    from dptrain.cli import main
    from dptrain.errors import AccountingError

    common = dict(n=100, b=10, noise_std=0.5, lipschitz=1.0, diameter=10.0, learning_rate=1.0, steps=100,
                  smoothness=1.0, batching="cyclic")
    assert last_iterate_report(Setting(**common, adjacency="replace"), 1e-5)["epsilon"] > 0
    with pytest.raises(AccountingError, match="replace adjacency only"):
        last_iterate_report(Setting(**common, adjacency="remove"), 1e-5)
    flags = ("account --accountant last_iterate --lipschitz 1 --diameter 10 --smoothness 1 --learning-rate 1 "
             "--dataset-size 100 --batch-size 10 --noise-std 0.5 --steps 100 --delta 1e-5 --batching cyclic "
             "--adjacency remove").split()
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "replace adjacency only" in err and len(err.strip().splitlines()) == 1
