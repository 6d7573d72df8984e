"""Privacy budgets of a noise schedule: zCDP ``rho``, the paper's ``R`` (= 2 rho) or ``(epsilon, delta)``.

"On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021 submission, "Dynamic Noise
Influence") charges a step 1/sigma^2 against its budget R (Thm 3.1), so R = 2 rho. ``(epsilon, delta)`` is converted
by Lemma B.3 with the root that reproduces the paper's own example ((4, 1e-8) -> rho = 0.1963, R = 0.3927;
:func:`dptrain.schedules.bounds.R_from_eps_delta` and :func:`~dptrain.schedules.bounds.eps_from_R`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dptrain.accounting.checks import check_delta
from dptrain.errors import AccountingError
from dptrain.schedules.bounds_constants import R_from_eps_delta, R_from_rho, eps_from_R, rho_from_R


def _positive(key: str, value: Any) -> float:
    """A budget number (rho, R, epsilon): a finite number > 0, else AccountingError."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise AccountingError(f"{key} must be a finite number > 0, got {value!r}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise AccountingError(f"{key} must be a finite number > 0, got {value!r}")
    return v


def _epsilon_of(rho: float, delta: float) -> float:
    """Epsilon at delta of a rho-zCDP run (Dynamic Noise Influence, Lemma B.3, via the paper's R = 2 rho)."""
    return eps_from_R(R_from_rho(rho), delta)


def _rho_of(epsilon: float, delta: float) -> float:
    """The largest rho whose Lemma B.3 conversion gives (epsilon, delta) (via the paper's R = 2 rho)."""
    return rho_from_R(R_from_eps_delta(epsilon, delta))


@dataclass(frozen=True)
class Budget:
    """A privacy budget: zCDP ``rho`` (the paper's R = 2 rho), or ``(epsilon, delta)``. ``delta`` may come with a
    zCDP budget too: the target stays rho, and spent epsilons are reported at that delta."""

    rho: float | None = None
    epsilon: float | None = None
    delta: float | None = None

    @property
    def R(self) -> float | None:  # noqa: N802  (the paper's name)
        return None if self.rho is None else R_from_rho(self.rho)

    def to_json(self) -> dict[str, Any]:
        return {"rho": self.rho, "R": self.R, "epsilon": self.epsilon, "delta": self.delta}


def make_budget(
    *,
    rho: float | None = None,
    R: float | None = None,  # noqa: N803  (the paper's name)
    epsilon: float | None = None,
    delta: float | None = None,
) -> Budget:
    """A :class:`Budget` from exactly one of ``rho`` (zCDP), ``R`` (= 2 rho, Dynamic Noise Influence, Thm 3.1) or
    ``epsilon`` (with ``delta``)."""
    given = [k for k, v in (("rho", rho), ("R", R), ("epsilon", epsilon)) if v is not None]
    if len(given) != 1:
        got = ", ".join(
            f"{k}={v!r}" for k, v in (("rho", rho), ("R", R), ("epsilon", epsilon)) if v is not None
        )
        raise AccountingError(
            f"budget: give exactly one of rho (zCDP), R (= 2 rho) or epsilon (with delta), got {got or 'none'}"
        )
    d = None if delta is None else check_delta(delta)
    if epsilon is not None:
        if d is None:
            raise AccountingError(f"budget: epsilon={epsilon!r} needs a delta in (0, 1), got delta=None")
        return Budget(epsilon=_positive("epsilon", epsilon), delta=d)
    r = _positive("rho", rho) if rho is not None else rho_from_R(_positive("R", R))
    return Budget(rho=r, delta=d)
