"""Accountant interface and registry.

An accountant reads a :class:`~dptrain.accounting.ledger.Ledger` and returns epsilon at a delta, or
raises :class:`~dptrain.errors.AccountingError` saying why it cannot certify that ledger. It never
guesses: an event it does not cover is a refusal, not a number.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from dptrain.accounting.bandmf_ledger import check_bandmf
from dptrain.accounting.checks import check_delta, check_epsilon, check_noise_multiplier  # noqa: F401
from dptrain.accounting.ledger import FILTER_FACT, Ledger
from dptrain.errors import AccountingError, ConfigError

#: The accountant name that means "every registered accountant; report the tightest certified one".
AUTO = "auto"


@dataclass(frozen=True)
class PrivacyReport:
    """What an accountant says about a ledger."""

    epsilon: float
    delta: float
    accountant: str
    #: True when epsilon is a proven upper bound; False for an approximation (e.g. a CLT limit).
    certified: bool
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "certified": self.certified,
            **self.details,
        }

    def __float__(self) -> float:
        """The epsilon, where it is a finite certified bound (``float(loop.epsilon())``); an approximation (or a run
        that is not private), or an infinite epsilon, is refused in one line rather than read as a guarantee."""
        if not self.certified:
            why = self.details.get("note") or "an approximation, not a proven bound"
            raise AccountingError(
                f"float() of a privacy report takes a certified epsilon; this one ({self.accountant}: epsilon "
                f"{self.epsilon:.6g}) is not certified ({why}): read report.epsilon to see it anyway"
            )
        if not math.isfinite(self.epsilon):
            raise AccountingError(
                f"float() of a privacy report takes a finite epsilon; the {self.accountant} accountant certifies no "
                "finite epsilon for this run"
            )
        return float(self.epsilon)

    def __format__(self, spec: str) -> str:
        """``f"{report}"`` is the report; ``f"{report:.3f}"`` its epsilon as :meth:`__float__` gives it."""
        return str(self) if not spec else format(float(self), spec)


class Accountant(Protocol):
    name: str
    description: str
    #: Optional: the ledger facts the accountant reads (None or absent: it may read any). Used to memoize reports.
    facts_used: tuple[str, ...] | None
    #: Optional: True when it certifies banded matrix factorization runs (it composes each entry's event
    #: ``entry.compositions`` times); absent or False: such ledgers are refused before it reads them.
    covers_bandmf: bool

    def report(self, ledger: Ledger, delta: float) -> PrivacyReport:
        """Epsilon at ``delta`` for ``ledger``; raises AccountingError if it cannot be certified."""
        ...


_REGISTRY: dict[str, Accountant] = {}


def register_accountant(accountant: Accountant) -> Accountant:
    """Add an accountant to the registry by its ``name`` (later issues add theirs this way)."""
    _REGISTRY[accountant.name] = accountant
    return accountant


def accountant_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def check_accountant(name: str, key: str = "accountant") -> str:
    """``name`` if it is ``auto`` or a registered accountant, else a one-line ConfigError naming ``key``."""
    if name != AUTO and name not in _REGISTRY:
        raise ConfigError(f"{key} must be one of {', '.join((AUTO, *_REGISTRY))}, got {name!r}")
    return name


def get_accountant(name: str) -> Accountant:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise AccountingError(
            f"unknown accountant {name!r}; accepted: {', '.join(accountant_names())}"
        ) from None


#: Reports by (ledger content, delta, accountant). An accountant's answer is a function of the ledger's content
#: (events and facts) only, so a grid that rebuilds identical ledgers (calibration, budget checks) reuses them.
_REPORTS: OrderedDict[tuple, PrivacyReport] = OrderedDict()
_REPORTS_MAX = 4096


def _content_key(ledger: Ledger, facts_used: tuple[str, ...] | None) -> str:
    """The ledger as the accountant sees it: events, counts, adjacency and the facts it reads (all if it does not
    declare ``facts_used``)."""
    data = ledger.to_dict()
    for entry, e in zip(ledger.entries, data["entries"], strict=True):
        e["compositions"] = entry.compositions  # facts may change it (a BandMF run's bands)
        if facts_used is not None:
            e["facts"] = {k: v for k, v in e["facts"].items() if k in facts_used}
    return json.dumps(data, sort_keys=True)


def all_reports(ledger: Ledger, delta: float) -> tuple[dict[str, PrivacyReport], dict[str, str]]:
    """Every registered accountant's report on ``ledger`` (name -> report) and its refusals (name -> why)."""
    reports, refusals = {}, {}
    for name in accountant_names():
        try:
            reports[name] = epsilon(ledger, delta, name)
        except AccountingError as e:
            refusals[name] = str(e)
    return reports, refusals


def tightest(reports: dict[str, PrivacyReport]) -> PrivacyReport | None:
    """The certified report with the smallest epsilon (None if no report is certified)."""
    certified = [r for r in reports.values() if r.certified]
    return min(certified, key=lambda r: r.epsilon) if certified else None


def epsilon(ledger: Ledger, delta: float, accountant: str = AUTO) -> PrivacyReport:
    """Epsilon spent by ``ledger`` at ``delta`` according to the named accountant (memoized by content).

    ``auto`` asks every registered accountant and returns the tightest certified answer (each one is a proven
    upper bound on the same mechanism's privacy loss, so their minimum is one too)."""
    delta = check_delta(delta)
    if accountant == AUTO:
        reports, refusals = all_reports(ledger, delta)
        best = tightest(reports)
        if best is None:
            why = "; ".join(f"{k}: {v}" for k, v in refusals.items()) or "only approximations"
            raise AccountingError(f"no accountant certifies this ledger ({why})")
        return best
    acc = get_accountant(accountant)
    if accountant != "filter" and any(e.facts.get(FILTER_FACT) for e in ledger.entries):
        raise AccountingError(
            f"the {accountant} accountant composes releases whose noise was fixed in advance; this run chose its "
            "noise adaptively (a validation noise schedule), under a privacy filter that only the filter accountant "
            "reads"
        )
    check_bandmf(ledger, accountant, getattr(acc, "covers_bandmf", False))
    key = (_content_key(ledger, getattr(acc, "facts_used", None)), delta, accountant, id(acc))
    if key in _REPORTS:
        _REPORTS.move_to_end(key)
        return _REPORTS[key]
    report = acc.report(ledger, delta)
    _REPORTS[key] = report
    if len(_REPORTS) > _REPORTS_MAX:
        _REPORTS.popitem(last=False)
    return report


def certified_epsilon(ledger: Ledger, delta: float, accountant: str = AUTO) -> PrivacyReport:
    """Like :func:`epsilon`, but refuses accountants whose answer for this ledger is not a proven bound."""
    report = epsilon(ledger, delta, accountant)
    if not report.certified:
        raise AccountingError(
            f"accountant {accountant!r} gives only an approximation for this run "
            f"({report.details.get('note', 'not a proven bound')}); use 'rdp' or 'pld' to certify a budget"
        )
    return report
