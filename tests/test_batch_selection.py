"""Poisson sampling drawn as its size, then its examples (batch_selection.poisson_indices): the distribution must be
exactly that of independent coin flips at rate q' = floor(q 2^53) 2^-53."""

from collections import Counter
from fractions import Fraction
from math import comb

import numpy as np
import pytest
import torch
from scipy import stats

from dptrain.randomness.generators import Randomness
from dptrain.stages.batch_selection import binomial_below, distinct_in_order, poisson_indices, uniform_subset

STREAM_KINDS = [False, True]  # TorchStream, SecureStream


def _stream(secure: bool, seed: int = 0):
    with pytest.warns(UserWarning):
        return Randomness(seed, secure=secure).stream("sampling")


def _exact_distribution(n: int, k: int, bits: int) -> dict[int, Fraction]:
    """The exact output distribution of binomial_below, by following every answer its coin counts can give (m fair
    flips show j ones with probability C(m, j) / 2^m)."""
    out: dict[int, Fraction] = {}

    def explore(answers: list[int], prob: Fraction) -> None:
        asked: list[int] = []

        class NeedMore(Exception):
            pass

        def heads(m: int) -> int:
            if len(asked) == len(answers):
                asked.append(m)
                raise NeedMore
            asked.append(m)
            return answers[len(asked) - 1]

        try:
            value = binomial_below(heads, n, k, bits)
        except NeedMore:
            m = asked[-1]
            for j in range(m + 1):
                explore([*answers, j], prob * Fraction(comb(m, j), 2**m))
            return
        out[value] = out.get(value, Fraction(0)) + prob

    explore([], Fraction(1))
    return out


@pytest.mark.parametrize("n,bits", [(1, 3), (3, 3), (4, 4), (2, 5)])
def test_batch_size_is_exactly_binomial(n, bits):
    for k in range(2**bits + 1):
        p = Fraction(k, 2**bits)
        expected = {j: comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(n + 1)}
        got = _exact_distribution(n, k, bits)
        assert {j: got.get(j, Fraction(0)) for j in range(n + 1)} == expected, (n, bits, k)


@pytest.mark.parametrize("secure", STREAM_KINDS)
def test_stream_words_have_uniform_bits(secure):
    words = _stream(secure).words(4000)
    assert words.dtype == np.uint64
    ones = np.unpackbits(words.view(np.uint8)).reshape(-1, 64).mean(0)  # every bit position, the top one included
    assert np.all(np.abs(ones - 0.5) < 0.04), ones


@pytest.mark.parametrize("secure", STREAM_KINDS)
@pytest.mark.parametrize("n,size", [(5, 2), (5, 4), (8, 3), (6, 0), (6, 6)])
def test_uniform_subset_is_uniform(secure, n, size):
    stream, draws = _stream(secure), 6000
    counts = Counter(tuple(uniform_subset(stream, n, size).tolist()) for _ in range(draws))
    assert all(len(s) == size and list(s) == sorted(set(s)) and all(0 <= i < n for i in s) for s in counts)
    if comb(n, size) > 1:
        assert len(counts) == comb(n, size)
        assert stats.chisquare(list(counts.values())).pvalue > 1e-3


@pytest.mark.parametrize("secure", STREAM_KINDS)
def test_poisson_batches_are_independent_coin_flips(secure):
    stream, n, q, draws = _stream(secure), 40, 0.15, 6000
    masks = np.zeros((draws, n), dtype=bool)
    for t in range(draws):
        idx = poisson_indices(stream, n, q)
        assert idx.dtype == torch.int64 and bool((idx[1:] > idx[:-1]).all())
        masks[t, idx.numpy()] = True
    sizes = masks.sum(1)
    # sizes: Binomial(n, q) (chi-square over the bins with enough mass, the tails pooled)
    observed = np.bincount(sizes, minlength=n + 1)
    pmf = stats.binom.pmf(np.arange(n + 1), n, q)
    lo, hi = 2, 11
    obs = [observed[:lo].sum(), *observed[lo:hi], observed[hi:].sum()]
    exp = draws * np.array([pmf[:lo].sum(), *pmf[lo:hi], pmf[hi:].sum()])
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # every example at rate q, and two examples independently (joint rate q^2)
    rate_sd = np.sqrt(q * (1 - q) / draws)
    assert np.all(np.abs(masks.mean(0) - q) < 5 * rate_sd)
    joint = (masks[:, 0] & masks[:, n - 1]).mean()
    assert abs(joint - q * q) < 5 * np.sqrt(q * q / draws)


def test_poisson_edge_rates():
    stream = _stream(False)
    assert poisson_indices(stream, 7, 1.0).tolist() == list(range(7))
    assert len(poisson_indices(stream, 10**6, 2.0**-60)) == 0  # q' = floor(q 2^53) 2^-53 = 0: never more than q


def test_distinct_in_order_gives_the_first_distinct_values_of_the_sequence():
    """uniform_subset keeps the first ``size`` distinct values of its draws: distinct_in_order must split the
    sequence's distinct values, ordered by first appearance, into those of the first ``size`` draws (sorted) and the
    rest in order (checked against np.unique's first indices on short sequences with many repeats)."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        draws = rng.integers(0, int(rng.integers(1, 30)), int(rng.integers(0, 50))).astype(np.uint64)
        size = int(rng.integers(1, 51))
        values, first = np.unique(draws, return_index=True)
        in_order = values[np.argsort(first)]
        head, later = distinct_in_order(draws, size)
        k = len(head)
        assert np.array_equal(head, np.sort(in_order[:k])) and np.array_equal(later, in_order[k:]), (draws, size)
        assert k == len(np.unique(draws[:size]))
