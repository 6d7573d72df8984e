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
The parts' sizes are those of independent coins (about ``test_fraction`` of the examples, not exactly).

Copies of one example (a file of categorical rows, repeated short texts) each have their own coin: copy k (k = 0, 1,
..., in file order) is decided by the hash of the content with k (the first copy by the content's hash alone). One
coin for all the copies sent whole groups to one part (a file of a few distinct rows had a test part of none, half or
all of its rows, and was refused). It keeps the neighbouring property: copies are interchangeable, so the parts are
fixed by how many copies of each content go to each, and adding (removing) a copy of a content adds (removes) its
last k, moving nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np


def _hash(key: bytes, content: bytes) -> bytes:
    return hashlib.blake2b(content, key=key, person=b"dptrain-split").digest()


def split_key(seed: int) -> bytes:
    return int(seed).to_bytes(16, "big", signed=True)


def example_split(contents: Iterable[bytes], test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test), each sorted: example i (``contents[i]``, its bytes) goes to the test part when its keyed
    hash, read in [0, 1), is below ``test_fraction``; the k-th earlier copy of the same content is hashed with k."""
    key = split_key(seed)
    copies: dict[bytes, int] = {}  # (by 128 bits of the content's keyed hash: the number of copies seen so far)
    test = []
    for c in contents:
        h = _hash(key, c)
        k = copies.get(h[:16], 0)
        copies[h[:16]] = k + 1
        if k:
            h = _hash(key, h + k.to_bytes(8, "big"))
        test.append(int.from_bytes(h[:8], "big") / 2.0**64 < test_fraction)
    test = np.array(test, dtype=bool)
    return np.flatnonzero(~test), np.flatnonzero(test)


def array_contents(*arrays: np.ndarray) -> Iterable[bytes]:
    """Each example's bytes from arrays of one row per example (inputs, labels, ...), with their dtypes and shapes: the
    same example gives the same bytes in any file."""
    rows = [np.ascontiguousarray(a) for a in arrays]
    header = repr([(a.dtype.str, a.shape[1:]) for a in rows]).encode()
    for i in range(len(rows[0])):
        yield header + b"".join(a[i].tobytes() for a in rows)


__all__ = ["array_contents", "example_split"]
