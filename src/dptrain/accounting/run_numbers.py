"""The numbers of a run that every part of dptrain must agree on, computed in one place.

A number of epochs is converted to a number of steps here and nowhere else, so that ``dptrain train``,
``dptrain calibrate``, ``dptrain plan``, ``dptrain utility-graph``, projected runs and the reproductions all
train and certify the same number of steps.
"""

from __future__ import annotations

import math

from dptrain.errors import ConfigError


def steps_for_epochs(epochs: float, sampling_rate: float) -> int:
    """Steps whose expected number of passes over the data is ``epochs``: max(1, round(epochs / q)).

    ``sampling_rate`` q is the expected fraction of the training set one step uses (Poisson rate, b/n for
    batches of b out of n, 1 for full batches): T steps make T q expected passes. Example: n = 50,000,
    expected batch 300 (q = 0.006), 10 epochs -> round(1666.7) = 1667 steps."""
    if not (isinstance(epochs, int | float) and not isinstance(epochs, bool) and math.isfinite(epochs)):
        raise ConfigError(f"epochs must be a finite number > 0, got {epochs!r}")
    if epochs <= 0:
        raise ConfigError(f"epochs must be a finite number > 0, got {epochs!r}")
    if not (isinstance(sampling_rate, int | float) and 0 < sampling_rate <= 1):
        raise ConfigError(f"the sampling rate must be in (0, 1], got {sampling_rate!r}")
    return max(1, round(epochs / sampling_rate))
