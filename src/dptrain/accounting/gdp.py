"""Gaussian differential privacy (f-DP) accountant of Dong, Roth & Su (2022, JRSS-B).

Used by van Dijk et al., "Proactive DP: A Multiple Target Optimization Framework for DP-SGD" (App. C,
Tables 9-11) to compare its closed form with a tight accountant. For a Gaussian release with noise multiplier
sigma (no sampling) the guarantee is exact: it is (1/sigma)-GDP, and GDP composes exactly: mu = sqrt(sum_i mu_i^2) (Dong-Roth-Su Cor. 3.3).
For subsampled releases only the central limit theorem is available, which is an *approximation*,
not an upper bound, so reports on such ledgers carry ``certified=False``:

- Poisson sampling with rate q, T steps (Bu, Dong, Long & Su 2020, Thm 5):
  mu = q * sqrt(T * (exp(1/sigma^2) - 1)).
- Fixed-size sampling without replacement, p = b/n (Dong-Roth-Su Cor. 5.4; Proactive DP eq. (65)):
  mu = p * sqrt(T) * sqrt(2) * sqrt(exp(1/sigma^2) * Phi(1.5/sigma) + 3 * Phi(-0.5/sigma) - 2).

mu-GDP is converted to (epsilon, delta) with Dong-Roth-Su Cor. 2.13 (Proactive DP eq. (64)):
  delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2).
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
from scipy import optimize, special

from dptrain.accounting.base import PrivacyReport, register_accountant
from dptrain.accounting.ledger import Ledger
from dptrain.accounting.standard import EPSILON_MAX, check_noise, finite_epsilon, refuse_search
from dptrain.errors import AccountingError


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta(eps) of a mu-GDP mechanism, Dong-Roth-Su Cor. 2.13 (Proactive DP eq. (64)), computed in log space."""
    if mu <= 0:
        return 0.0
    a = special.log_ndtr(-epsilon / mu + mu / 2)
    b = epsilon + special.log_ndtr(-epsilon / mu - mu / 2)
    return float(np.exp(a) * -np.expm1(b - a)) if b < a else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon with delta(eps) <= delta for a mu-GDP mechanism (inverse of eq. (64)); math.inf when it is
    above EPSILON_MAX (about mu > 1400 at delta = 1e-5) or mu is not finite."""
    if not math.isfinite(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu)
    while gdp_delta(hi, mu) > delta:
        hi *= 2
        if hi > 2 * EPSILON_MAX:
            return math.inf
    eps = float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))
    return eps if eps <= EPSILON_MAX else math.inf


def mu_poisson_clt(sigma: float, q: float, steps: int) -> float:
    """CLT mu of Poisson-subsampled Gaussian DP-SGD (Bu, Dong, Long, Su 2020, Thm 5); math.inf when
    exp(1/sigma^2) overflows (sigma below about 0.0376)."""
    with np.errstate(over="ignore"):
        return float(q * np.sqrt(steps * np.expm1(np.float64(sigma) ** -2)))


def mu_uniform_clt(sigma: float, p: float, steps: int) -> float:
    """CLT mu with uniform subsampling without replacement (Dong-Roth-Su Cor. 5.4; van Dijk et al., "Proactive
    DP", eq. (65)); math.inf when exp(1/sigma^2) overflows."""
    phi = special.ndtr
    with np.errstate(over="ignore"):
        inner = np.exp(np.float64(sigma) ** -2) * phi(1.5 / sigma) + 3 * phi(-0.5 / sigma) - 2
        return float(p * np.sqrt(steps) * np.sqrt(2.0) * np.sqrt(inner))


def _entry_mu(event: dpa.DpEvent, count: int, neighboring: str) -> tuple[float, bool]:
    """(mu, exact) for ``count`` repetitions of one release."""
    if isinstance(event, dpa.GaussianDpEvent):
        if event.noise_multiplier == 0:
            raise AccountingError("the gdp accountant cannot certify a release without noise")
        return math.sqrt(count) / event.noise_multiplier, True
    if isinstance(event, dpa.PoissonSampledDpEvent) and isinstance(event.event, dpa.GaussianDpEvent):
        if neighboring != "add_or_remove_one":
            raise AccountingError(
                "the gdp accountant covers Poisson sampling only under add/remove adjacency"
            )
        return mu_poisson_clt(event.event.noise_multiplier, event.sampling_probability, count), False
    if isinstance(event, dpa.SampledWithoutReplacementDpEvent) and isinstance(
        event.event, dpa.GaussianDpEvent
    ):
        p = event.sample_size / event.source_dataset_size
        return mu_uniform_clt(event.event.noise_multiplier, p, count), False
    raise AccountingError(
        f"the gdp accountant cannot interpret {type(event).__name__}; it covers Gaussian releases, "
        "Poisson-sampled and uniformly sampled Gaussian releases"
    )


class GdpAccountant:
    name = "gdp"
    facts_used = ()  # events and adjacency only
    description = "Gaussian DP (Dong-Roth-Su); CLT approximation for subsampled steps"

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        refuse_search(ledger, self.name)
        check_noise(ledger, self.name)
        mus, exact = [], True
        for entry in ledger.entries:
            mu, entry_exact = _entry_mu(entry.event, entry.count, ledger.neighboring)
            mus.append(mu)
            exact &= entry_exact
        mu = math.sqrt(sum(m * m for m in mus))  # GDP composition, Dong-Roth-Su Cor. 3.3
        details = {"mu": mu}
        if not exact:
            details["note"] = "central limit approximation for subsampled steps, not a proven upper bound"
        return PrivacyReport(
            finite_epsilon(gdp_epsilon(mu, delta), self.name), delta, self.name, exact, details
        )


register_accountant(GdpAccountant())
