"""A test set cut from the user's examples, example by example.

Where a data set has no test set of its own (an npz file without ``x_test``, a text file without ``test_path``,
scikit-learn's digits, the synthetic sets), dptrain holds out a fraction of the examples. Which part an example goes
to is decided by that example alone: a keyed hash (BLAKE2b, keyed by the split's public ``seed``) of its content,
its input and its label, read as a number in [0, 1) and compared with ``test_fraction``.

Why not a seeded permutation (stratified or not): the certificate is under add/remove-one adjacency, on the file the
user gives. With a permutation, adding one example to the file moves other examples between the parts (26 each way
for 600 examples of two classes, by the stratified split dptrain used before), so two files that differ in one example
gave training parts that differ in many, and the certificate covered the training part, not the file. With a
decision per example, adding or removing an example changes nothing but that example's own place: the training part
of the neighbouring file is a neighbouring training part (or the same one, when the example goes to the test part).
The split is public (whoever holds an example and the seed knows its part), as before; it is not privacy randomness.
The parts' sizes are those of independent coins (about ``test_fraction`` of the examples, not exactly); duplicates of
one example land together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np


def _unit(key: bytes, content: bytes) -> float:
    h = hashlib.blake2b(content, key=key, person=b"dptrain-split")
    return int.from_bytes(h.digest()[:8], "big") / 2.0**64


def split_key(seed: int) -> bytes:
    return int(seed).to_bytes(16, "big", signed=True)


def example_split(contents: Iterable[bytes], test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test), each sorted: example i (``contents[i]``, its bytes) goes to the test part when its keyed
    hash, read in [0, 1), is below ``test_fraction``."""
    key = split_key(seed)
    test = np.fromiter((_unit(key, c) < test_fraction for c in contents), dtype=bool)
    return np.flatnonzero(~test), np.flatnonzero(test)


def array_contents(*arrays: np.ndarray) -> Iterable[bytes]:
    """Each example's bytes from arrays of one row per example (inputs, labels, ...), with their dtypes and shapes: the
    same example gives the same bytes in any file."""
    rows = [np.ascontiguousarray(a) for a in arrays]
    header = repr([(a.dtype.str, a.shape[1:]) for a in rows]).encode()
    for i in range(len(rows[0])):
        yield header + b"".join(a[i].tobytes() for a in rows)


__all__ = ["array_contents", "example_split"]
