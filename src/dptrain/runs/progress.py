"""A progress bar that shows steps, never time: how long a step takes depends on its realized (secret) batch size and
on the data, so the bar has no elapsed time, rate or estimate, and is redrawn every ``total // 100`` steps, never on a
timer (the steps at which a timed bar redraws, kept in a log of stderr, would time them too)."""

from __future__ import annotations

import math

#: tqdm's line without its times: the bar, the steps and the postfix (epsilon)
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}"


def step_bar(total: int | None, initial: int = 0, enabled: bool = True, **options):
    """A tqdm bar over ``total`` steps that the clock does not reach (module docstring)."""
    from tqdm import tqdm

    every = max(1, (total or 0) // 100)
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
                bar_format=BAR_FORMAT, mininterval=0, miniters=every, maxinterval=math.inf, **options)


__all__ = ["BAR_FORMAT", "step_bar"]
