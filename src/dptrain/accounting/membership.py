"""What a privacy budget means to a membership-inference attacker.

An attacker sees what a run released and guesses whether one example was in its training set. Whatever it does, it
is a test between the run's outputs on two neighbouring data sets, and differential privacy bounds every such test:

- Kairouz, Oh & Viswanath, "The Composition Theorem for Differential Privacy" (ICML 2015), Theorem 2.1 (after
  Wasserman & Zhou 2010): a mechanism is (eps, delta)-DP iff every test between its outputs on neighbouring data sets
  D0, D1, for both orderings of the pair, has P_FA + e^eps P_MD >= 1 - delta and e^eps P_FA + P_MD >= 1 - delta.
  With FPR = P_FA and TPR = 1 - P_MD:

      TPR <= min(e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR)),

  the same statement as Dong, Roth & Su, "Gaussian Differential Privacy" (JRSS-B 2022), Prop. 2.5: (eps, delta)-DP
  is f_{eps,delta}-DP with f_{eps,delta}(a) = max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a)).
- A run's ledger certifies (eps, delta(eps))-DP for every eps >= 0 at once (its privacy profile), so the minimum of
  those bounds over any set of eps >= 0 is a bound; over all eps it is the trade-off curve the profile determines
  (Dong, Roth & Su, Prop. 2.12, the primal-dual view). Minimizing over a finite grid can only make it larger (valid,
  a little looser): the grid's step is the pld accountant's discretization interval, or the smallest multiple of it
  that keeps the grid within EPSILON_GRID_POINTS points (6e-4 for the default run: 17,211 points from 0 to 10.3).
- delta(eps) is the profile the ``pld`` accountant certifies: dp_accounting's PLD of the ledger, composed by the
  accountant's own code (:meth:`dptrain.accounting.standard.PldAccountant.composed`, pessimistic discretization), the
  maximum over the add and the remove ordering (``PrivacyLossDistribution.get_delta_for_epsilon`` on the whole grid;
  :func:`profile_deltas` computes the same numbers with numpy, 100 times faster). The bound therefore holds for both
  directions of the attack, "member" as the alternative or as the null hypothesis. A profile of both orderings at
  once determines the lower convex envelope of the two directions' trade-off curves, so at middle FPRs, where that
  envelope bridges them, the bound can lie above the best attack of either direction alone (tests/test_membership.py).
- A ledger of Gaussian releases without subsampling is mu-GDP with mu = sqrt(sum_i count_i / sigma_i^2) (Dong, Roth &
  Su, Cor. 3.3; the ``gdp`` accountant), whose trade-off curve is exactly G_mu(a) = Phi(Phi^-1(1 - a) - mu) (Sec.
  2.3): TPR <= 1 - G_mu(FPR) = Phi(Phi^-1(FPR) + mu). That is the tightest bound for those runs and the one reported.
  Poisson-subsampled runs get no mu: the gdp accountant's central-limit mu (Bu, Dong, Long & Su) is an approximation,
  not a bound, and the mu that is one (sqrt(T)/sigma, ignoring the subsampling) is far looser than the profile.
- Accountants that certify one (eps, delta) at a time and no profile of both orderings (last_iterate, composition,
  proactive, modelmix, filter, a hyperparameter search by rdp) give no bound here: the answer is ``None`` with the pld
  accountant's refusal as the reason, never a number that is not a bound. Where the pld profile does apply to the same
  ledger but another accountant certifies a smaller epsilon (a last-iterate run: the profile is that of releasing
  every iterate, the last_iterate accountant's epsilon that of the last one), that (eps, delta) pair is one more bound:
  the TPRs are the lower of the two (``tightened_by``), so the attacker row never says more than the certificate.

This module imports numpy/scipy/dp_accounting only, like the rest of dptrain.accounting. The picture is drawn by
``dptrain account ... --attacker-plot PATH`` (:mod:`dptrain.cli.account`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import special

from dptrain.accounting.base import AUTO, epsilon, get_accountant
from dptrain.accounting.checks import check_delta
from dptrain.accounting.ledger import Ledger
from dptrain.errors import AccountingError, NoFiniteEpsilon

#: The false-positive rates reported (key -> FPR).
FPRS = {"tpr_at_fpr_1pct": 0.01, "tpr_at_fpr_10pct": 0.10}
#: At most this many eps >= 0 on the grid the profile is evaluated at.
EPSILON_GRID_POINTS = 20_000
#: The smallest positive FPR the eps grid serves (the curve's): eps above log(1/FPR_MIN) only help smaller FPRs.
FPR_MIN = 1e-5
#: The FPRs of the curve (``curve=True``): a linear grid and a logarithmic one down to FPR_MIN.
CURVE_FPRS = np.unique(np.concatenate([np.linspace(0.0, 1.0, 201), np.geomspace(FPR_MIN, 1e-1, 81)]))
#: Rows of FPR evaluated at once against the whole eps grid (bounds the memory of the curve to a few MB).
_CHUNK = 16



def tpr_bound(fpr, epsilons, deltas) -> np.ndarray:
    """The highest TPR at each ``fpr`` of any test against a mechanism that is (eps_i, delta_i)-DP for every i (both
    orderings): min over i of min(1, e^eps_i FPR + delta_i, 1 - e^-eps_i (1 - delta_i - FPR)) (Kairouz, Oh &
    Viswanath, Thm 2.1; Dong, Roth & Su, Prop. 2.5). ``epsilons`` >= 0."""
    fpr = np.atleast_1d(np.asarray(fpr, dtype=float))
    eps = np.asarray(epsilons, dtype=float)[None, :]
    delta = np.asarray(deltas, dtype=float)[None, :]
    with np.errstate(over="ignore"):  # e^eps beyond the float range: that term bounds nothing (inf), the other does
        grow = np.exp(eps)
    shrink = np.exp(-eps)
    out = np.empty_like(fpr)
    for start in range(0, len(fpr), _CHUNK):
        a = fpr[start : start + _CHUNK, None]
        first = np.multiply(grow, a, out=np.zeros(np.broadcast_shapes(grow.shape, a.shape)), where=a > 0) + delta
        bound = np.minimum(first, 1.0 - shrink * (1.0 - delta - a))  # at FPR 0 the first term is delta, not inf * 0
        out[start : start + _CHUNK] = bound.min(axis=1)
    return np.clip(out, 0.0, 1.0)


def gdp_tpr(fpr, mu: float) -> np.ndarray:
    """TPR of the most powerful test against a mu-GDP mechanism: 1 - G_mu(FPR) = Phi(Phi^-1(FPR) + mu) (Dong, Roth &
    Su, Sec. 2.3: G_mu(a) = Phi(Phi^-1(1 - a) - mu) is the trade-off of N(0, 1) against N(mu, 1))."""
    return special.ndtr(special.ndtri(np.atleast_1d(np.asarray(fpr, dtype=float))) + mu)


def profile_tpr(pld, interval: float, fpr) -> tuple[np.ndarray, dict[str, Any]]:
    """:func:`tpr_bound` at ``fpr`` from the whole privacy profile of ``pld`` (a dp_accounting
    PrivacyLossDistribution composed at ``interval``): delta(eps) = max over its two orderings
    (:func:`profile_deltas`), on a grid of eps from 0 in steps of a multiple of ``interval``. Also the grid it used."""
    fpr = np.atleast_1d(np.asarray(fpr, dtype=float))
    top = max(float(_losses_probs(pmf)[0][-1]) for pmf in _pmfs(pld))
    smallest = fpr[fpr > 0].min(initial=FPR_MIN)
    # Beyond the largest finite loss delta(eps) is constant and both terms only grow; beyond log(1/FPR) the first
    # term is above 1. The same grid for every FPR from FPR_MIN up, so that the curve and the two numbers agree.
    high = max(0.0, min(top, math.log(1.0 / min(smallest, FPR_MIN))))
    stride = max(1, math.ceil(high / interval / EPSILON_GRID_POINTS))
    epsilons = np.arange(0, math.floor(high / interval / stride) + 1) * (interval * stride)
    grid = {"points": int(len(epsilons)), "step": float(interval * stride), "max": float(epsilons[-1])}
    return tpr_bound(fpr, epsilons, profile_deltas(pld, epsilons)), grid


def profile_deltas(pld, epsilons) -> np.ndarray:
    """``pld.get_delta_for_epsilon(epsilons)`` (dp_accounting's vectorized hockey-stick divergence, the maximum over
    the remove and the add ordering), computed with numpy: dp_accounting walks every point of each PMF in a Python
    loop (0.33 s for the default run's 110,000 points of positive loss, 17,000 eps), this takes 4 ms. The same
    formula and the same sums in the same order (its docstring's delta(eps) = inf_mass + sum_{loss > eps} prob -
    e^eps sum_{loss > eps} prob e^-loss, accumulated from the largest loss down): tests/test_membership.py checks
    that the two agree to 1e-15 (bit for bit here). ``epsilons`` ascending, finite."""
    epsilons = np.asarray(epsilons, dtype=float)
    deltas = [_hockey_stick(pmf, epsilons) for pmf in _pmfs(pld)]
    return deltas[0] if len(deltas) == 1 else np.maximum(deltas[0], deltas[1])


def _pmfs(pld) -> list:
    # dp_accounting 0.6.0 (pinned) keeps a PLD's two PMFs in _pmf_remove / _pmf_add (one object when symmetric).
    remove, add = pld._pmf_remove, pld._pmf_add  # noqa: SLF001
    return [remove] if add is remove else [remove, add]


def _losses_probs(pmf) -> tuple[np.ndarray, np.ndarray]:
    """The losses (ascending) and probabilities of a dp_accounting PMF, as its get_delta_for_epsilon reads them."""
    if hasattr(pmf, "_probs"):  # DensePLDPmf
        losses = (np.arange(pmf.size) + pmf._lower_loss) * pmf._discretization  # noqa: SLF001
        return losses, np.asarray(pmf._probs, dtype=float)  # noqa: SLF001
    losses, probs = pmf._get_losses_probs()  # noqa: SLF001 (SparsePLDPmf)
    return np.asarray(losses, dtype=float), np.asarray(probs, dtype=float)


def _hockey_stick(pmf, epsilons: np.ndarray) -> np.ndarray:
    """dp_accounting's ``_get_delta_for_epsilon_vectorized`` for one PMF: suffix sums over the losses above each eps."""
    losses, probs = _losses_probs(pmf)
    upper = np.cumsum(np.concatenate([[pmf._infinity_mass], probs[::-1]]))  # noqa: SLF001
    # prob e^-loss only for the losses above the smallest eps: no other enters a sum read below (epsilons ascending),
    # and for a very negative loss (tiny noise) e^-loss overflows
    weighted = np.zeros_like(probs)
    read = losses > epsilons[0]
    weighted[read] = probs[read] * np.exp(-losses[read])
    lower = np.cumsum(np.concatenate([[0.0], weighted[::-1]]))
    above = len(losses) - np.searchsorted(losses, epsilons, side="right")  # how many losses are > eps
    return upper[above] - np.exp(epsilons) * lower[above]


def _gdp_mu(ledger: Ledger, delta: float) -> tuple[float | None, str | None, float | None]:
    """(mu, None, epsilon) when the ``gdp`` accountant certifies the ledger exactly (Gaussian releases without
    subsampling), else (None, why, None)."""
    try:
        report = epsilon(ledger, delta, "gdp")
    except AccountingError as e:
        return None, f"no mu-GDP bound: {e}", None
    if not report.certified:
        return None, f"no mu-GDP bound: {report.details.get('note', 'the gdp accountant gives an approximation')}", None
    return float(report.details["mu"]), None, report.epsilon


def _tightest_certificate(ledger: Ledger, delta: float) -> tuple[str, float] | None:
    """(accountant, epsilon) of the tightest accountant that certifies the mechanism ``ledger`` records (its randomness
    taken secret, as for the profile: a seeded run gets what it would have unseeded), or None."""
    secret = dataclasses.replace(ledger, private=True)
    try:
        report = epsilon(secret, delta, AUTO)
    except AccountingError:
        return None
    return report.accountant, float(report.epsilon)


def membership_inference(ledger: Ledger, delta: float, *, curve: bool = False) -> dict[str, Any]:
    """The bound on any membership-inference attacker against the run that ``ledger`` records, as JSON-able data.

    - ``tpr_at_fpr_1pct``, ``tpr_at_fpr_10pct``: the highest true-positive rate any attacker reaches at a
      false-positive rate of 1% and 10% (both directions of the attack), or None where no profile applies;
    - ``accountant``: ``gdp`` (the exact mu-GDP curve, Gaussian releases without subsampling), ``pld`` (the pld
      accountant's privacy profile) or None;
    - ``mu_gdp``: mu where the run is mu-GDP exactly, else None and ``mu_gdp_reason``;
    - ``no_profile``: why there is no bound (only when the TPRs are None);
    - ``tightened_by``: {accountant, epsilon} when an accountant without a profile (last_iterate, composition, ...)
      certifies a smaller epsilon than the profile's at ``delta`` and its one pair is lower at 1% or 10%: the TPRs
      are then the lower of the two bounds (both hold), never above what the run's certificate alone says;
    - ``epsilon``, ``delta``: the smallest certified epsilon at the run's delta, and ``epsilon_delta_reading``: the
      TPRs from that one (epsilon, delta) pair alone, the looser reading of a budget. The bound itself does not
      depend on ``delta`` (it reads the whole profile): at a delta below the pld profile's pessimistic tail mass
      (1e-15 for 100 steps at sigma 1) pld has no finite epsilon there, the TPRs are the same, and ``epsilon`` is
      another accountant's (rdp), or None (the reading then 1: one pair says nothing);
    - ``pld``: the profile's own TPRs, its discretization and the eps grid (or ``refused``);
    - ``certified``: False when the ledger's run is not private (seeded randomness): the bound is then what the same
      run would have with secret randomness;
    - ``curve`` (with ``curve=True``): ``fpr``, ``tpr`` (the bound) and ``tpr_epsilon_delta`` (the one-pair reading).
    """
    delta = check_delta(delta)
    mu, mu_reason, mu_epsilon = _gdp_mu(ledger, delta)
    fprs = np.asarray(list(FPRS.values()) + (list(CURVE_FPRS) if curve else []))
    pld_part: dict[str, Any]
    pld_epsilon = None  # pld's epsilon at ``delta``; None where its profile's tail (pessimistic mass) exceeds delta
    try:
        try:
            pld_epsilon = epsilon(ledger, delta, "pld").epsilon  # every refusal of the pld accountant (searches, ...)
        except NoFiniteEpsilon:
            pass  # the profile may still exist: the bound reads all of it, whatever delta is (composed() refuses if not)
        composed, interval = get_accountant("pld").composed(ledger)
        pld_tpr, grid = profile_tpr(composed, interval, fprs)
        pld_part = {**_at(pld_tpr), "discretization": interval, "epsilon_grid": grid}
    except AccountingError as e:
        pld_tpr, pld_part = None, {"refused": str(e)}
    out: dict[str, Any]
    if mu is not None:
        tpr, eps, used = gdp_tpr(fprs, mu), mu_epsilon, "gdp"
    elif pld_tpr is not None:
        tpr, eps, used = pld_tpr, pld_epsilon, "pld"
    else:
        out = no_profile(pld_part["refused"], delta)
        out.update(mu_gdp_reason=mu_reason, certified=ledger.private)
        return out
    tightened = None
    certificate = _tightest_certificate(ledger, delta)
    if certificate is not None and (eps is None or certificate[1] < eps):
        # another accountant certifies a smaller epsilon (the last iterate's, or a composition's): its one pair bounds
        # the attacker too, and where it is lower than the profile's curve the bound is the lower of the two
        eps, pair = certificate[1], tpr_bound(fprs, [certificate[1]], [delta])
        if np.any(pair < tpr):
            tpr, tightened = np.minimum(tpr, pair), {"accountant": certificate[0], "epsilon": certificate[1]}
    reading = tpr_bound(fprs, [eps], [delta]) if eps is not None else np.ones_like(fprs)  # no pair: says nothing
    out = {
        **_at(tpr),
        "accountant": used,
        **({"tightened_by": tightened} if tightened else {}),
        "mu_gdp": mu,
        **({"mu_gdp_reason": mu_reason} if mu is None else {}),
        "epsilon": eps,
        "delta": delta,
        "epsilon_delta_reading": _at(reading),
        "pld": pld_part,
        "certified": ledger.private,
    }
    if not ledger.private:
        out["note"] = (
            "this run is not private (seeded randomness, or something released outside its ledger): the bound is "
            "what the mechanism its ledger records would give with secret randomness, not a bound on this run"
        )
    if curve:
        n = len(FPRS)
        out["curve"] = {
            "fpr": fprs[n:].tolist(),
            "tpr": tpr[n:].tolist(),
            "tpr_epsilon_delta": reading[n:].tolist(),
        }
    return out


def no_profile(reason: str, delta: float | None = None) -> dict[str, Any]:
    """The answer where no privacy profile bounds the attacker (``reason`` says why): no number (the keys of every
    answer, null)."""
    return {
        **dict.fromkeys(FPRS),
        "accountant": None,
        "mu_gdp": None,
        "no_profile": reason,
        **({} if delta is None else {"delta": delta}),
    }


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """The short form of ``result`` (:func:`membership_inference`) that ``dptrain account --json`` and a run's
    ``summary.json`` print: the two rates, the accountant and mu_gdp, ``no_profile`` where there is no bound, and
    ``certified`` (false) with its ``note`` where the ledger's run is not private: the rates are then what the run
    would have with secret randomness, not a bound on what it released."""
    keys = (*FPRS, "accountant", "mu_gdp", "tightened_by", "no_profile")
    out = {k: result[k] for k in keys if k in result and (k != "no_profile" or result[k])}
    if result.get("certified") is False and out[next(iter(FPRS))] is not None:  # (no number: nothing to label)
        out.update(certified=False, note=result["note"])
    return out


def _at(tpr: np.ndarray) -> dict[str, float]:
    return {key: float(tpr[i]) for i, key in enumerate(FPRS)}


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def summary_line(result: dict[str, Any]) -> str:
    """``result`` (:func:`membership_inference`) in one line."""
    if result.get("tpr_at_fpr_1pct") is None:
        return f"a membership-inference attacker: no bound (no privacy profile: {result.get('no_profile')})"
    how = f"exact, mu-GDP with mu = {result['mu_gdp']:.4g}" if result["accountant"] == "gdp" else "pld profile"
    if result.get("tightened_by"):
        how += f", or {result['tightened_by']['accountant']}'s epsilon where lower"
    naive = result["epsilon_delta_reading"]
    if result["epsilon"] is None:
        alone = f"no accountant certifies a finite epsilon at delta {result['delta']:g}"
    else:
        alone = (
            f"epsilon {result['epsilon']:.4g} at delta {result['delta']:g} alone says <= "
            f"{_pct(naive['tpr_at_fpr_1pct'])} and <= {_pct(naive['tpr_at_fpr_10pct'])}"
        )
    return (
        f"a membership-inference attacker: TPR <= {_pct(result['tpr_at_fpr_1pct'])} at FPR 1%, <= "
        f"{_pct(result['tpr_at_fpr_10pct'])} at FPR 10% ({how}, both orderings; {alone})"
        + ("; NOT private: " + result["note"] if result.get("certified") is False else "")
    )
