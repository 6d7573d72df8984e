"""Noise schedules sigma_t (t = 1..T) and their calibration to a privacy budget.

The paper is "On Dynamic Noise Influence in Differential Private Learning" (anonymous ICLR 2021 submission),
cited below as "Dynamic Noise Influence". Its private gradient descent adds noise ``G sigma_t nu_t / N`` at step t,
and a schedule is the sequence sigma_1..sigma_T. Every schedule here is ``sigma_t = c * s_t``: an unnormalised
positive shape s_t (the kind) times ONE common scale c, chosen so that the whole run spends exactly the budget.

The pieces, one idea a module:

- :mod:`dptrain.schedules.shapes`: the shapes s_t of each kind (the config's ``[schedule] kind``), built from the
  paper's formulas in :mod:`dptrain.schedules.bounds`;
- :mod:`dptrain.schedules.budget`: the budgets;
- :mod:`dptrain.schedules.spend`: what sigmas = c * s spend under each accountant (``zcdp``, ``exact``, ``rdp``,
  ``pld``);
- :mod:`dptrain.schedules.calibration`: the scale c that spends exactly the budget, and the calibrated schedule;
- :mod:`dptrain.schedules.params`: the parameter checks they share.


Budgets: zCDP ``rho``, the paper's ``R`` (= 2 rho: it charges a step 1/sigma^2, Thm 3.1), or ``(epsilon,
delta)``, converted by Lemma B.3 with the root that reproduces the paper's own example ((4, 1e-8) -> rho = 0.1963,
R = 0.3927; :func:`dptrain.schedules.bounds.R_from_eps_delta` and :func:`~dptrain.schedules.bounds.eps_from_R`).

This module gathers their public names (the ones users import from ``dptrain.schedules.kinds``).

Numpy, scipy, dp_accounting, dptrain.accounting and dptrain.schedules.bounds only: no torch.
"""

from __future__ import annotations

from dptrain.schedules.budget import Budget, make_budget
from dptrain.schedules.calibration import Schedule, calibrate_schedule, calibrate_shape

# (the names live in a light module: the config validator and the CLI parser read them without scipy)
from dptrain.schedules.names import ACCOUNTANTS, BASELINE_KINDS, KIND_PARAMS, KINDS, MOMENTUM_FORMS
from dptrain.schedules.params import check_accountant, check_kind
from dptrain.schedules.shapes import quantised_shape, read_influence, schedule_shape
from dptrain.schedules.spend import RDP_INTEGER_ORDERS as RDP_INTEGER_ORDERS
from dptrain.schedules.spend import spent_epsilon, spent_rho, step_allowed

__all__ = [
    "ACCOUNTANTS",
    "BASELINE_KINDS",
    "KINDS",
    "KIND_PARAMS",
    "MOMENTUM_FORMS",
    "Budget",
    "Schedule",
    "calibrate_schedule",
    "calibrate_shape",
    "check_accountant",
    "check_kind",
    "make_budget",
    "quantised_shape",
    "read_influence",
    "schedule_shape",
    "spent_epsilon",
    "spent_rho",
    "step_allowed",
]
