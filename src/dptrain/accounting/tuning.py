"""The privacy of a hyperparameter search that releases only its best trial.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy" (ICLR 2022). A random search runs a
private *trial* K times, K drawn at random from a distribution fixed in advance, each trial with hyperparameters
drawn at random (independently of the data) and fresh randomness, and releases only the best trial: its output and
its score. K and every other trial stay secret. A trial is everything one run releases: the DP-SGD steps and, when
the score is computed on private data, the noisy release of the score. If one trial is (lambda, eps(lambda))-RDP at
every order, the search is (lambda, eps'(lambda))-RDP with

- K truncated negative binomial D_{eta,gamma} (their Definition 1: eta in (-1, inf), gamma in (0, 1); eta = 1 is
  the geometric distribution, eta = 0 the logarithmic one), Thm 2, for every lh >= 1:
      eps'(lambda) = eps(lambda) + (1 + eta) (1 - 1/lh) eps(lh) + (1 + eta) log(1/gamma) / lh + log(E[K]) / (lambda - 1)
- K ~ Poisson(mu), Thm 6, when the trial is (eps_hat, delta_hat)-DP with eps_hat = log(1 + 1/(lambda - 1)):
      eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1).

A ledger holds a search as one entry whose event is dp_accounting's ``RepeatAndSelectDpEvent(trial, mean, shape)``
(shape inf: Poisson, 1: geometric, 0: logarithmic, else eta), the trial being the whole DpEvent of one trial's
ledger. dp_accounting's RdpAccountant computes these bounds (lh ranging over its orders; delta_hat from the trial's
RDP curve), so the ``rdp`` accountant certifies a search and every other accountant refuses it
(:func:`dptrain.accounting.standard.refuse_search`). Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, stats

from dptrain.accounting.base import AUTO, PrivacyReport, epsilon
from dptrain.accounting.calibration import Calibration, calibrate, calibrate_noise
from dptrain.accounting.checks import check_noise_multiplier
from dptrain.accounting.ledger import FILTER_FACT, Ledger
from dptrain.accounting.standard import RDP_ORDERS, check_noise, check_searches, quiet_absl, search_problem
from dptrain.errors import AccountingError, ConfigError

#: facts["mechanism"] of a search's ledger entry, and of a trial's noisy score release.
SEARCH_MECHANISM = "hyperparameter_search"
SCORE_MECHANISM = "trial_score"
#: The distributions of the number of trials, by name (``tnb:SHAPE``: truncated negative binomial of shape eta).
DISTRIBUTIONS = ("poisson", "geometric", "logarithmic", "tnb:SHAPE")
#: The geometric distribution (Liu & Talwar's; eta = 1): its standard deviation is about its mean. Poisson K stays
#: nearer its mean (standard deviation sqrt(mean)), but Thm 6 charges mean * delta_hat, delta_hat being one trial's
#: delta at eps_hat = log(1 + 1/(lambda - 1)), about 0.13 at lambda = 8: a search of 100 trials of an epsilon-2.6 run
#: costs 24 with Poisson, 6.4 geometric, 5.1 logarithmic (the least epsilon for a mean, with the heaviest tail).
DEFAULT_DISTRIBUTION = "geometric"
_SHAPES = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}


def parse_distribution(text: str, key: str = "the trial-count distribution") -> float:
    """dp_accounting's shape of a distribution named ``poisson``, ``geometric``, ``logarithmic`` or ``tnb:SHAPE``
    (SHAPE: eta >= 0, a number); a one-line ConfigError naming ``key`` otherwise."""
    text = str(text).strip().lower()
    if text in _SHAPES:
        return _SHAPES[text]
    if text.startswith("tnb:"):
        try:
            shape = float(text[4:])
        except ValueError:
            shape = None
        if shape is not None and not math.isnan(shape) and shape != math.inf:
            return shape
    raise ConfigError(
        f"{key} must be one of poisson, geometric, logarithmic or tnb:SHAPE (a truncated negative binomial of shape "
        f"eta >= 0, e.g. tnb:0.5), got {text!r}"
    )


def _distribution_name(shape: float) -> str:
    names = {v: k for k, v in _SHAPES.items()}
    short = f"{shape:g}"
    return names.get(shape, f"tnb:{short if float(short) == shape else repr(shape)}")  # parse_distribution's inverse


def tnb_mean(gamma: float, eta: float) -> float:
    """E[K] for K ~ D_{eta,gamma}, the truncated negative binomial of Papernot & Steinke's Definition 1:
    eta (1 - gamma) / (gamma (1 - gamma^eta)) for eta != 0, (1/gamma - 1) / log(1/gamma) for eta = 0 (the
    logarithmic distribution), 1/gamma for eta = 1 (geometric); 1 at gamma = 1 (K = 1)."""
    if gamma == 1:
        return 1.0
    x = math.log(gamma)
    if eta == 0:
        return -math.expm1(x) / (gamma * -x)
    return eta * -math.expm1(x) / (gamma * -math.expm1(eta * x))


@dataclass(frozen=True)
class TrialCount:
    """The distribution of a search's number of trials K: its mean E[K] and dp_accounting's ``shape`` (inf: Poisson,
    1: geometric, 0: logarithmic, else eta of the truncated negative binomial). Checked on construction
    (:func:`dptrain.accounting.standard.search_problem`: mean >= 1, shape inf or >= 0)."""

    mean: float
    shape: float = 1.0  # DEFAULT_DISTRIBUTION

    def __post_init__(self) -> None:
        problem = search_problem(self.mean, self.shape)
        if problem:
            raise ConfigError(problem)
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "shape", float(self.shape))

    @classmethod
    def named(
        cls, mean: float, distribution: str = DEFAULT_DISTRIBUTION, *, mean_key: str | None = None,
        distribution_key: str = "the trial-count distribution",
    ) -> TrialCount:
        """The distribution named ``distribution`` (:func:`parse_distribution`) with mean ``mean``; errors name
        ``mean_key`` / ``distribution_key`` (e.g. the command line's flags)."""
        shape = parse_distribution(distribution, distribution_key)
        return cls.checked(mean, shape, mean_key=mean_key, shape_key=distribution_key)

    @classmethod
    def checked(
        cls, mean: float, shape: float, *, mean_key: str | None = None, shape_key: str | None = None
    ) -> TrialCount:
        """``TrialCount(mean, shape)`` whose one-line error names the offending key first."""
        problem = search_problem(mean, shape)
        if problem:
            key = mean_key if problem.startswith("the mean") else shape_key
            raise ConfigError(f"{key}: {problem}" if key else problem)
        return cls(mean, shape)

    @property
    def name(self) -> str:
        """``poisson``, ``geometric``, ``logarithmic`` or ``tnb:SHAPE``."""
        return _distribution_name(self.shape)

    @property
    def gamma(self) -> float | None:
        """The truncated negative binomial's gamma whose E[K] (:func:`tnb_mean`) is the mean; None for Poisson.
        Solved in log gamma to 1e-14 (the accountant solves its own: this one draws K)."""
        if self.shape == math.inf:
            return None
        if self.mean == 1:
            return 1.0
        if self.shape == 1:
            return 1.0 / self.mean
        # x = log gamma: E[K] decreases from infinity (x -> -inf) to 1 (x -> 0)
        gap = lambda x: math.log(tnb_mean(math.exp(x), self.shape)) - math.log(self.mean)  # noqa: E731
        lo, hi = -1.0, -1e-12
        while gap(lo) < 0:
            if lo < -512:
                raise ConfigError(f"a mean of {self.mean:g} trials is too large to draw the number of trials")
            lo *= 2
        if gap(hi) >= 0:  # the mean is within ~1e-12 of 1
            return math.exp(hi)
        return math.exp(optimize.brentq(gap, lo, hi, xtol=1e-15, rtol=1e-14))

    def draw(self, uniform: float) -> int:
        """One draw of K: the inverse of K's distribution function at ``uniform``, a number in (0, 1). K is secret and
        privacy-critical: ``uniform`` must come from the run's secret streams (the "tuning" stream, AES-256-CTR with
        ``secure_noise``). A Poisson K may be 0: the search then runs no trial and releases nothing."""
        if not 0.0 < uniform < 1.0:
            raise ValueError(f"uniform must be in (0, 1), got {uniform!r}")
        if self.shape == math.inf:
            return int(stats.poisson.ppf(uniform, self.mean))
        gamma = self.gamma
        if gamma >= 1:
            return 1
        if self.shape == 1:
            return int(stats.geom.ppf(uniform, gamma))
        if self.shape == 0:  # P[K = k] = (1 - gamma)^k / (k log(1/gamma)), Definition 1
            return int(stats.logser.ppf(uniform, 1 - gamma))
        # D_{eta,gamma} is the negative binomial NB(eta, gamma) conditioned on K >= 1 (Definition 1): invert its
        # distribution function above P[NB = 0] = gamma^eta
        below = gamma**self.shape
        return max(1, int(stats.nbinom.ppf(below + uniform * (1 - below), self.shape, gamma)))

    def event(self, trial: dp_event.DpEvent) -> dp_event.RepeatAndSelectDpEvent:
        """The search's DpEvent: ``trial`` (one whole trial) repeated K times, the best released."""
        return dp_event.RepeatAndSelectDpEvent(trial, self.mean, self.shape)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (an infinite shape is the name ``poisson``)."""
        return {"tuning_distribution": self.name, "tuning_mean": self.mean}


def search_ledger(trial: Ledger, trials: TrialCount, **facts: Any) -> Ledger:
    """The ledger of a search: one entry whose event is ``RepeatAndSelectDpEvent(trial.dp_event(), mean, shape)``,
    with the trial ledger's adjacency and private flag; ``facts`` are recorded beside it. Refuses a trial that
    releases nothing, and one whose noise was chosen adaptively (a privacy filter: its DpEvent is not fixed in
    advance, which the theorems assume of every trial)."""
    if not isinstance(trials, TrialCount):
        raise AccountingError(f"trials must be a TrialCount, got {trials!r}")
    if not trial.entries:
        raise AccountingError("a search needs a trial that releases something; the trial's ledger records nothing")
    if any(e.facts.get(FILTER_FACT) for e in trial.entries):
        raise AccountingError(
            "a search's trials must have their noise fixed in advance; this trial chose its noise adaptively, under a "
            "privacy filter, which only the filter accountant reads"
        )
    ledger = Ledger(neighboring=trial.neighboring, private=trial.private)
    ledger.record(
        trials.event(trial.dp_event()),
        {"mechanism": SEARCH_MECHANISM, **trials.to_dict(), "trial_releases": trial.releases, **facts},
    )
    return ledger


def with_score_release(trial: Ledger, noise_multiplier: float) -> Ledger:
    """``trial`` followed by the release of its score through a Gaussian of noise multiplier ``noise_multiplier``
    (std over the score's sensitivity under the ledger's adjacency): the whole trial when the score is computed on
    private data (Papernot & Steinke's trial outputs its score too; a score on public data releases nothing)."""
    check_noise_multiplier(noise_multiplier, "the score's noise multiplier")
    return trial.extended(dpa.GaussianDpEvent(noise_multiplier), {"mechanism": SCORE_MECHANISM})


def search_rdp(ledger: Ledger, orders=RDP_ORDERS) -> np.ndarray:
    """The RDP of ``ledger`` (a search, or anything dp_accounting's RdpAccountant composes) at ``orders``: what the
    rdp accountant converts to epsilon (Papernot & Steinke, Thm 2 / Thm 6 for a search)."""
    check_searches(ledger, "rdp")
    check_noise(ledger, "rdp")
    acc = rdp_privacy_accountant.RdpAccountant(list(orders), neighboring_relation=ledger.neighboring_relation)
    event = ledger.dp_event()
    if not acc.supports(event):
        raise AccountingError("dp_accounting's RDP accountant cannot compose this ledger's events")
    with quiet_absl():
        acc.compose(event)
    return acc.rdp


@dataclass(frozen=True)
class SearchReport:
    """A search's epsilon beside the epsilon of one of its trials alone."""

    search: PrivacyReport
    single_run: PrivacyReport
    trials: TrialCount

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.search.to_dict(),
            "epsilon_single_run": self.single_run.epsilon,
            "single_run_accountant": self.single_run.accountant,
            **self.trials.to_dict(),
        }


def search_report(trial: Ledger, trials: TrialCount, delta: float, accountant: str = AUTO) -> SearchReport:
    """Epsilon of the search of ``trials`` trials like ``trial`` (``accountant``: auto finds rdp, the one that
    certifies searches) and of one trial alone (the same accountant, auto: the tightest for a single run)."""
    return SearchReport(
        epsilon(search_ledger(trial, trials), delta, accountant), epsilon(trial, delta, accountant), trials
    )


def trial_noise_for_search(
    target_epsilon: float,
    delta: float,
    trial_for_sigma,
    trials: TrialCount,
    accountant: str = AUTO,
    rtol: float = 1e-9,
) -> Calibration:
    """The smallest per-trial noise multiplier sigma with which the whole search meets (target_epsilon, delta):
    calibration's Brent search (:func:`dptrain.accounting.calibration.calibrate`, every accountant with ``auto``) on
    sigma -> the search ledger of ``trial_for_sigma(sigma)``, refined to ``rtol`` with the accountant that won, so
    that the search's epsilon is within about ``rtol`` below its target."""
    ledger_for_sigma = lambda s: search_ledger(trial_for_sigma(s), trials)  # noqa: E731
    cal = calibrate(target_epsilon, delta, ledger_for_sigma, accountant)
    sigma = calibrate_noise(
        target_epsilon, delta, ledger_for_sigma, cal.accountant, rtol=rtol, start=cal.noise_multiplier
    )
    return replace(cal, noise_multiplier=sigma)
