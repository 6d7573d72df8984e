"""The privacy ledger: the ordered record of every noisy release of a run.

Each entry is one kind of release (a dp_accounting ``DpEvent``) repeated ``count`` times in a row,
plus the facts an accountant may need beyond the event itself (sampling scheme, clip norm,
data set size, ...). Consecutive identical releases are merged, so a run of a million identical
DP-SGD steps is one entry. The ledger is plain JSON on disk and is saved with every checkpoint.

This module imports numpy/dp_accounting only (never torch), like the rest of dptrain.accounting.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import attr
import dp_accounting as dpa
from dp_accounting import dp_event as dp_event_module

from dptrain.accounting.checks import check_noise_multiplier
from dptrain.errors import AccountingError, DataError

LEDGER_FORMAT = "dptrain-ledger/1"

#: Neighbouring relations we record; the accountants read them from the ledger.
NEIGHBORING = {
    "add_or_remove_one": dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace_one": dpa.NeighboringRelation.REPLACE_ONE,
}

#: The fact recorded beside releases whose noise was chosen adaptively, under a privacy filter
#: (:mod:`dptrain.accounting.filters`): only the filter certifies them.
FILTER_FACT = "filter"

#: Batch selection schemes an event may come from. Which accountant applies depends on it.
SAMPLING_SCHEMES = ("poisson", "full", "fixed_size_without_replacement", "cyclic")

#: facts["mechanism"] of the steps of a banded matrix factorization run (:mod:`dptrain.accounting.bandmf_ledger`):
#: the entry's ``count`` is the run's steps, its event one participation of the most frequent of facts["bands"] groups,
#: which composes ceil(count / bands) times (:attr:`LedgerEntry.compositions`).
BANDMF_MECHANISM = "bandmf"


# --- DpEvent <-> JSON -------------------------------------------------------------------------------------


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """Serialize a dp_accounting DpEvent (recursively) to JSON-able data."""
    if not isinstance(event, dpa.DpEvent):
        raise TypeError(f"not a DpEvent: {event!r}")
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in attr.fields(type(event)):
        out[f.name] = _value_to_json(getattr(event, f.name))
    return out


#: How an infinite float of an event is written (JSON has no infinity; ``json.dump(allow_nan=False)`` refuses one): a
#: Poisson-distributed number of trials is RepeatAndSelectDpEvent(shape=inf). No DpEvent has a string field, so these
#: strings read back unambiguously.
_INFINITIES = {math.inf: "inf", -math.inf: "-inf"}


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dpa.DpEvent):
        return event_to_dict(value)
    if isinstance(value, list | tuple):
        return [_value_to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            raise AccountingError("a DpEvent field is NaN: no accountant certifies a release whose noise or rate is not a number")
        return _INFINITIES[value]
    return value


def event_from_dict(data: dict[str, Any]) -> dpa.DpEvent:
    """Inverse of :func:`event_to_dict`. Only dp_accounting's own event classes are accepted."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a serialized DpEvent: {data!r}")
    cls = getattr(dp_event_module, str(data["type"]), None)
    if not (isinstance(cls, type) and issubclass(cls, dpa.DpEvent)):
        raise ValueError(f"unknown DpEvent type {data['type']!r}")
    names = {f.name for f in attr.fields(cls)}
    kwargs = {k: _value_from_json(v) for k, v in data.items() if k != "type"}
    if set(kwargs) != names:
        raise ValueError(f"{cls.__name__} needs fields {sorted(names)}, got {sorted(kwargs)}")
    return cls(**kwargs)


def _value_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return [_value_from_json(v) for v in value]
    if isinstance(value, str) and value in _INFINITIES.values():
        return float(value)
    return value


# --- the ledger -------------------------------------------------------------------------------------------


@dataclass
class LedgerEntry:
    """``count`` consecutive releases of ``event``; ``facts`` hold what the event itself does not say."""

    event: dpa.DpEvent
    count: int
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def compositions(self) -> int:
        """How many times ``event`` composes: ``count``, except in a banded matrix factorization run, whose ``count``
        steps compose its event (one participation of the most frequent group) ceil(count / bands) times."""
        if self.facts.get("mechanism") != BANDMF_MECHANISM:
            return self.count
        bands = self.facts.get("bands")
        if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
            raise AccountingError(f"a bandmf ledger entry must state its bands, an integer >= 1; got {bands!r}")
        return -(-self.count // bands)

    def composed(self) -> dpa.DpEvent:
        n = self.compositions
        return self.event if n == 1 else dpa.SelfComposedDpEvent(self.event, n)

    def to_dict(self) -> dict[str, Any]:
        return {"event": event_to_dict(self.event), "count": self.count, "facts": self.facts}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LedgerEntry:
        count = data["count"]
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"entry count must be a positive integer, got {count!r}")
        facts = data.get("facts", {})
        if not isinstance(facts, dict):
            raise ValueError("entry facts must be an object")
        return cls(event_from_dict(data["event"]), count, facts)


@dataclass
class Ledger:
    """Ordered record of what a run released. Accountants read it; training code only appends to it."""

    entries: list[LedgerEntry] = field(default_factory=list)
    neighboring: str = "add_or_remove_one"
    #: False when the run that recorded it is not private whatever its epsilon: its randomness was seeded (the noise
    #: can be recomputed) or it released something no event covers (a buffer written from private batches). The
    #: accountants still price the events (what the run would certify with secret randomness); whoever reports the
    #: epsilon must say it is not a certificate.
    private: bool = True

    def __post_init__(self) -> None:
        if self.neighboring not in NEIGHBORING:
            raise AccountingError(
                f"unknown neighbouring relation {self.neighboring!r}; accepted: {', '.join(NEIGHBORING)}"
            )

    # -- recording --
    def record(self, event: dpa.DpEvent, facts: dict[str, Any] | None = None, count: int = 1) -> None:
        """Append ``count`` releases of ``event``; merged into the last entry when it is the same release."""
        if count < 1:
            raise ValueError("count must be >= 1")
        facts = dict(facts or {})
        last = self.entries[-1] if self.entries else None
        if last is not None and last.event == event and last.facts == facts:
            last.count += count
        else:
            json.dumps(facts)  # facts must be JSON-able: fail at record time, not at save time
            self.entries.append(LedgerEntry(event, count, facts))

    def extended(self, event: dpa.DpEvent, facts: dict[str, Any] | None = None, count: int = 1) -> Ledger:
        """A copy of this ledger with ``count`` (>= 0) more releases: what-if questions for budgets and planning."""
        new = self.copy()
        if count:
            new.record(event, facts, count)
        return new

    def is_prefix_of(self, other: Ledger) -> bool:
        """True when ``other`` is this ledger followed by zero or more further releases."""
        if (
            self.neighboring != other.neighboring
            or self.private != other.private
            or len(self.entries) > len(other.entries)
        ):
            return False
        for i, (mine, theirs) in enumerate(zip(self.entries, other.entries, strict=False)):
            if mine.event != theirs.event or mine.facts != theirs.facts:
                return False
            last = i == len(self.entries) - 1
            if mine.count > theirs.count or (not last and mine.count != theirs.count):
                return False
        return True

    def copy(self) -> Ledger:
        return Ledger(
            [LedgerEntry(e.event, e.count, dict(e.facts)) for e in self.entries], self.neighboring, self.private
        )

    # -- reading --
    @property
    def releases(self) -> int:
        """Total number of releases recorded (DP-SGD steps, private means, ...)."""
        return sum(e.count for e in self.entries)

    def dp_event(self) -> dpa.DpEvent:
        """The whole run as one DpEvent (the composition of all entries, in order)."""
        if not self.entries:
            return dpa.NoOpDpEvent()
        if len(self.entries) == 1:
            return self.entries[0].composed()
        return dpa.ComposedDpEvent([e.composed() for e in self.entries])

    @property
    def neighboring_relation(self) -> dpa.NeighboringRelation:
        return NEIGHBORING[self.neighboring]

    # -- persistence --
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "private": self.private,
            "neighboring": self.neighboring,
            "releases": self.releases,
            "entries": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ledger:
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
            raise ValueError(f"not a {LEDGER_FORMAT} ledger")
        private = data.get("private", True)
        if not isinstance(private, bool):
            raise ValueError(f"ledger's private must be true or false, got {private!r}")
        return cls(
            [LedgerEntry.from_dict(e) for e in data["entries"]], data.get("neighboring", "add_or_remove_one"), private
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write never leaves a truncated ledger behind."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Ledger:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except FileNotFoundError:
            raise DataError(f"ledger file {os.fspath(path)} does not exist") from None
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"ledger file {os.fspath(path)} is corrupt or not a dptrain ledger: {e}"
            ) from None


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --- the DP-SGD release -----------------------------------------------------------------------------------


def gaussian_step_event(
    noise_multiplier: float,
    sampling: str,
    *,
    sampling_rate: float | None = None,
    dataset_size: int | None = None,
    batch_size: int | None = None,
) -> dpa.DpEvent:
    """The DpEvent of one noisy-gradient release under a batch selection scheme.

    ``noise_multiplier`` is sigma: the Gaussian's standard deviation divided by the L2 sensitivity of the
    released sum (the clip norm under add/remove-one adjacency).
    """
    check_noise_multiplier(noise_multiplier)
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    if sampling == "poisson":
        if sampling_rate is None or not 0 < sampling_rate <= 1:
            raise AccountingError(f"Poisson sampling rate must be in (0, 1], got {sampling_rate}")
        return gaussian if sampling_rate == 1 else dpa.PoissonSampledDpEvent(sampling_rate, gaussian)
    if sampling == "full":
        return gaussian
    if sampling == "fixed_size_without_replacement":
        if not dataset_size or not batch_size or not 0 < batch_size <= dataset_size:
            raise AccountingError("fixed-size sampling needs 0 < batch_size <= dataset_size")
        return dpa.SampledWithoutReplacementDpEvent(dataset_size, batch_size, gaussian)
    if sampling == "cyclic":
        # Each example is in exactly one batch per pass and no amplification by sampling is claimed.
        return gaussian
    raise AccountingError(f"unknown sampling scheme {sampling!r}; accepted: {', '.join(SAMPLING_SCHEMES)}")


def dpsgd_ledger(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    sampling: str = "poisson",
    **facts: Any,
) -> Ledger:
    """A ledger of ``steps`` identical DP-SGD steps (what ``dptrain account`` and calibration reason about)."""
    if not isinstance(steps, int) or steps < 0:
        raise AccountingError(f"steps must be an integer >= 0, got {steps}")
    ledger = Ledger()
    if steps:
        event = gaussian_step_event(noise_multiplier, sampling, sampling_rate=sampling_rate, **facts)
        ledger.record(event, step_facts(sampling, sampling_rate, **facts), steps)
    return ledger


#: facts["mechanism"] of the releases that are training steps (what a run's step counter counts).
TRAINING_MECHANISMS = ("dpsgd", "projected_noisy_sgd", BANDMF_MECHANISM)


def training_steps(ledger: Ledger) -> int:
    """Training steps in a ledger (a ledger may also hold other releases, e.g. a private feature mean)."""
    return sum(e.count for e in ledger.entries if e.facts.get("mechanism") in TRAINING_MECHANISMS)


def step_facts(sampling: str, sampling_rate: float | None = None, **extra: Any) -> dict:
    """The facts recorded beside every DP-SGD step (one place, so identical steps merge). The noise multiplier is
    not a fact: it is in the event, the one place a release's sigma is recorded."""
    facts: dict[str, Any] = {"mechanism": "dpsgd", "sampling": sampling}
    if sampling_rate is not None:
        facts["sampling_rate"] = float(sampling_rate)
    facts.update({k: v for k, v in extra.items() if v is not None})
    return facts


#: The fact a run with a noise schedule records beside every step: the scale c of sigma_t = c s_t (the event holds
#: sigma_t itself). A resumed run reads c from it exactly (sigma_t / s_t need not round-trip to c).
NOISE_SCALE_FACT = "noise_scale"


def event_noise_multiplier(entry, neighboring: str) -> float:
    """The noise multiplier of one ledger entry's release as the trainer counts it (std over the per-example bound):
    the event's multiplier, times 2 under replace-one adjacency."""
    event = entry.event
    while not hasattr(event, "noise_multiplier"):
        event = event.event
    return event.noise_multiplier * (2.0 if neighboring == "replace_one" else 1.0)


def ledger_noise_multiplier(ledger: Ledger) -> float:
    """The run's noise multiplier from its ledger (the ledger is where a run's sigma lives; a resumed run reads it
    from there): the last training step's, or with a noise schedule the scale c recorded beside its steps."""
    entry = next(e for e in reversed(ledger.entries) if e.facts.get("mechanism") in TRAINING_MECHANISMS)
    if NOISE_SCALE_FACT in entry.facts:
        return float(entry.facts[NOISE_SCALE_FACT])
    return event_noise_multiplier(entry, ledger.neighboring)
