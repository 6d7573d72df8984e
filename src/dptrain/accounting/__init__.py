"""Privacy accounting: the ledger, the accountants and their inverses. Imports no torch.

Accountants are looked up by name in a registry; ``rdp`` and ``pld`` delegate to dp_accounting,
``gdp`` is the Gaussian-DP accountant of Dong, Roth & Su. Later modules register their own. A hyperparameter
search (the best of a random number of trials; Papernot & Steinke) is a ledger entry of its own
(:mod:`dptrain.accounting.tuning`), which ``rdp`` certifies. Banded matrix factorization (Choquette-Choo et al.) is
recorded as one entry per run (:mod:`dptrain.accounting.bandmf_ledger`), which ``pld`` and ``rdp`` certify.
"""

from dptrain.accounting import standard as _standard  # noqa: F401, I001  (registers "rdp", "pld" first)
from dptrain.accounting import gdp as _gdp  # noqa: F401  (registers "gdp")
from dptrain.accounting import proactive as _proactive  # noqa: F401  (registers "proactive")
from dptrain.accounting import last_iterate as _last_iterate  # noqa: F401  (registers "last_iterate")
from dptrain.accounting import composition as _composition  # noqa: F401  (registers "composition")
from dptrain.accounting import modelmix as _modelmix  # noqa: F401  (registers "modelmix")
from dptrain.accounting import filters as _filters  # noqa: F401  (registers "filter")
from dptrain.accounting.base import (
    AUTO,
    Accountant,
    PrivacyReport,
    accountant_names,
    all_reports,
    certified_epsilon,
    check_accountant,
    check_noise_multiplier,
    epsilon,
    get_accountant,
    register_accountant,
    tightest,
)
from dptrain.accounting.calibration import (
    Calibration,
    calibrate,
    calibrate_dpsgd_noise,
    calibrate_noise,
    gaussian_mechanism_epsilon,
    gaussian_mechanism_noise,
    max_releases,
)
from dptrain.accounting.bandmf_bands import (
    BandsChoice,
    bandmf_noise_multiplier,
    choose_bands,
    reported_rmse_ratio,
    rmse_ratio,
)
from dptrain.accounting.bandmf_ledger import bandmf_ledger, bandmf_step, bandmf_step_index
from dptrain.accounting.bandmf_noise import noise_recurrence, streamed_noise
from dptrain.accounting.bandmf_sensitivity import bandmf_sensitivity, participation_sensitivity
from dptrain.accounting.bandmf_strategy import (
    PREFIX_SUMS,
    Workload,
    momentum_workload,
    optimal_coefficients,
    toeplitz_workload,
    workload_error,
)
from dptrain.accounting.ledger import Ledger, LedgerEntry, dpsgd_ledger, gaussian_step_event, step_facts
from dptrain.accounting.membership import membership_inference
from dptrain.accounting.run_numbers import RunNumbers, steps_for_epochs
from dptrain.accounting.tuning import TrialCount, search_ledger, search_report, trial_noise_for_search

__all__ = [
    "AUTO",
    "Accountant",
    "BandsChoice",
    "PREFIX_SUMS",
    "Workload",
    "bandmf_ledger",
    "bandmf_noise_multiplier",
    "bandmf_sensitivity",
    "bandmf_step",
    "bandmf_step_index",
    "choose_bands",
    "momentum_workload",
    "noise_recurrence",
    "optimal_coefficients",
    "participation_sensitivity",
    "reported_rmse_ratio",
    "rmse_ratio",
    "streamed_noise",
    "toeplitz_workload",
    "workload_error",
    "Calibration",
    "all_reports",
    "calibrate",
    "check_accountant",
    "check_noise_multiplier",
    "tightest",
    "Ledger",
    "LedgerEntry",
    "PrivacyReport",
    "RunNumbers",
    "TrialCount",
    "accountant_names",
    "calibrate_dpsgd_noise",
    "calibrate_noise",
    "certified_epsilon",
    "dpsgd_ledger",
    "epsilon",
    "gaussian_mechanism_epsilon",
    "gaussian_mechanism_noise",
    "gaussian_step_event",
    "get_accountant",
    "max_releases",
    "membership_inference",
    "register_accountant",
    "search_ledger",
    "search_report",
    "step_facts",
    "steps_for_epochs",
    "trial_noise_for_search",
]
