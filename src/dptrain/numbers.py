"""The one rule every number a user gives passes before any range check of its own (config keys, command-line flags):
finite, and of a size the arithmetic behind it can hold.

A float must be finite and at most :data:`MAX_FLOAT` in magnitude: no quantity dptrain reads (a noise multiplier, a
learning rate, a clip norm, a budget, an epoch count) means anything beyond, while 1e308 overflows the first square
taken of it (e.g. sigma^2 in the proactive closed form), far from where the value was given. 1e50 keeps fourth powers
finite and lies above float32's 3.4e38, so a value that overflows a model's float32 weights still reaches training,
which stops it as not finite. An integer must fit in 64 bits (TOML's own integer range; torch and numpy sizes and
seeds): 10**30 would overflow the first tensor or array built from it. The key's own range check (> 0, in (0, 1),
...) comes after this one.

What this cannot see: a number inside the bounds that is still too large for the resources of the machine (10**9
steps of a schedule allocate arrays of that length); those are the key's own checks.
"""

from __future__ import annotations

import math

#: The largest magnitude of a float a user may give.
MAX_FLOAT = 1e50
#: The integers a user may give: TOML's 64-bit range.
MIN_INT, MAX_INT = -(2**63), 2**63 - 1


def number_problem(value: int | float) -> str | None:
    """Why ``value`` (an int or a float, not a bool) is not a number dptrain takes, or None when it is: the text
    completes "must be ...", e.g. "a finite number of magnitude at most 1e+50"."""
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            return f"a finite number of magnitude at most {MAX_FLOAT:g}"
    elif not MIN_INT <= value <= MAX_INT:
        return "an integer that fits in 64 bits"
    return None
