"""How a banded matrix factorization (BandMF) run is recorded in the ledger, and which accountants read it.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix Factorization: A unified
approach to private training" (NeurIPS 2023), Theorem 4: BandMF with b bands and cyclic Poisson sampling (every
example in one of b secret groups; step t Poisson-samples group t mod b at rate min(1, b q)) is, for the example
being protected, the composition of one Poisson-sampled Gaussian per participation of its group, at noise
multiplier sigma / sens (:mod:`dptrain.accounting.bandmf_sensitivity`). The most frequent group takes part
ceil(T / b) times, so the run is dominated by DP-SGD's

    SelfComposed(PoissonSampled(min(1, b q), Gaussian(sigma / sens)), ceil(T / b)),

and not by the composition of all T steps (b times too many compositions).

The record. Every step of the run is recorded like a DP-SGD step, by :func:`bandmf_step`: the event is one
participation, ``PoissonSampledDpEvent(min(1, b q), GaussianDpEvent(sigma))`` (``GaussianDpEvent(sigma)`` when
b q >= 1), and the facts are ``mechanism = "bandmf"``, ``sampling = "cyclic_poisson"``, ``bands = b``,
``sampling_rate = q`` and ``coefficients = [c_0, ..., c_{b-1}]`` (plus any the caller adds: clip norm, data set
size). Consecutive identical steps merge, so a run of 10^5 steps is one entry whose ``count`` is its steps; the
entry composes its event ceil(count / b) times (:attr:`dptrain.accounting.ledger.LedgerEntry.compositions`), which
is what ``Ledger.dp_event()`` and therefore every dp_accounting-based accountant sees. One entry is one BandMF run:

- the step index within the run is the entry's count before the step (:func:`bandmf_step_index`); the step's group
  is that index mod b. A run stopped and resumed from its ledger goes on with the same entry, the same group cycle
  and (from the checkpoint) the same b - 1 noise vectors; b not dividing T is the ceil.
- a step that does not merge (other releases in between, other sigma, rate or coefficients) starts a new entry: a
  new BandMF run, with the group cycle restarted at group 0 and no noise history. Each run is then accounted on its
  own and the runs compose, which is valid whatever their order or what lies between them.
- sigma is the event's noise multiplier because c has unit norm: the coefficients are refused otherwise, so the
  sensitivity is ||c|| = 1 for any number of steps. (A run shorter than b steps has shorter columns, sens < 1; the
  ledger does not claim that, since it is extended step by step and cannot know the run ends early.)

Who certifies it. ``pld`` and ``rdp`` (they compose ``Ledger.dp_event()`` / :attr:`LedgerEntry.compositions`) and
``composition`` (its training phase goes to pld) declare ``covers_bandmf = True``. Every other accountant, including
any registered later, is refused by :func:`check_bandmf` in one line before it reads the ledger: the others read
``count`` as independent releases (gdp, proactive, filter: they would price all T steps, or treat the correlated
noise as independent) or analyse a different mechanism (last_iterate, modelmix). numpy/dp_accounting only.
"""

from __future__ import annotations

import math
from typing import Any

import dp_accounting as dpa
import numpy as np

from dptrain.accounting.bandmf_strategy import check_coefficients
from dptrain.accounting.checks import check_noise_multiplier
from dptrain.accounting.ledger import BANDMF_MECHANISM, Ledger, LedgerEntry, gaussian_step_event
from dptrain.errors import AccountingError

#: facts["sampling"] of a BandMF step: every example's group is drawn once, independently and uniformly, from the
#: secret sampling stream; step t Poisson-samples group t mod b.
CYCLIC_POISSON = "cyclic_poisson"
#: How far ||c|| may be from 1: normalization in double precision lands within a few 1e-16; the sensitivity (and the
#: epsilon) is then exact to this relative precision, far below pld's pessimistic discretization.
UNIT_NORM_TOLERANCE = 1e-12


def check_unit_coefficients(coefficients) -> np.ndarray:
    """The coefficients of a recorded run: finite, c_0 > 0, and ||c|| = 1 (so the noise multiplier sigma is the
    multiplier of each participation's Gaussian); a one-line refusal otherwise."""
    c = check_coefficients(coefficients)
    norm = float(np.linalg.norm(c))
    if abs(norm - 1.0) > UNIT_NORM_TOLERANCE:
        raise AccountingError(
            f"BandMF coefficients must have unit L2 norm (divide them by their norm, {norm:.6g}), so that sigma is "
            "the noise multiplier of each participation"
        )
    return c


def group_sampling_rate(sampling_rate: float, bands: int) -> float:
    """min(1, b q): the Poisson rate within the sampled group (the overall rate q times the b groups); at b q >= 1
    every member of the group is taken (expected batch n / b instead of q n)."""
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, int | float) or not 0 < sampling_rate <= 1:
        raise AccountingError(f"the sampling rate must be a number in (0, 1], got {sampling_rate!r}")
    return min(1.0, bands * float(sampling_rate))


def bandmf_step(
    noise_multiplier: float, sampling_rate: float, coefficients, **facts: Any
) -> tuple[dpa.DpEvent, dict[str, Any]]:
    """(event, facts) of one BandMF step, for ``ledger.record(event, facts)``: b = len(coefficients) groups at
    overall rate q (group rate min(1, b q)), noise sigma * clip * (C^{-1} z)_t. ``facts``: extra public facts
    (clip_norm, dataset_size)."""
    check_noise_multiplier(noise_multiplier)
    c = check_unit_coefficients(coefficients)
    bands = len(c)
    # sens = ||c|| = 1 for every participation of a run of >= b steps (bandmf_sensitivity): the multiplier is sigma
    event = gaussian_step_event(noise_multiplier, "poisson", sampling_rate=group_sampling_rate(sampling_rate, bands))
    recorded: dict[str, Any] = {
        "mechanism": BANDMF_MECHANISM,
        "sampling": CYCLIC_POISSON,
        "bands": bands,
        "sampling_rate": float(sampling_rate),
        "coefficients": [float(x) for x in c],
    }
    for key, value in facts.items():
        if key in recorded:
            raise AccountingError(f"the fact {key!r} of a BandMF step is set from its arguments; do not pass it")
        if value is not None:
            recorded[key] = value
    return event, recorded


def bandmf_ledger(noise_multiplier: float, sampling_rate: float, steps: int, coefficients, **facts: Any) -> Ledger:
    """A ledger of ``steps`` steps of one BandMF run (what ``calibrate`` and ``account`` reason about, like
    :func:`dptrain.accounting.ledger.dpsgd_ledger`); the same ledger a run records step by step."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise AccountingError(f"steps must be an integer >= 0, got {steps!r}")
    event, recorded = bandmf_step(noise_multiplier, sampling_rate, coefficients, **facts)
    ledger = Ledger()
    if steps:
        ledger.record(event, recorded, steps)
    return ledger


def bandmf_step_index(ledger: Ledger, event: dpa.DpEvent, facts: dict[str, Any]) -> int:
    """The index t, within its BandMF run, of the next step recorded as (``event``, ``facts``): the last entry's
    count if the step merges into it, else 0 (a new run). Its group is t mod bands; at t = 0 the noise history is
    empty. The engine takes both from here, so its groups and noise state always match what the ledger certifies."""
    last = ledger.entries[-1] if ledger.entries else None
    return last.count if last is not None and last.event == event and last.facts == facts else 0


# --- the accountants' side ----------------------------------------------------------------------------------------


def is_bandmf(entry: LedgerEntry) -> bool:
    return entry.facts.get("mechanism") == BANDMF_MECHANISM


def check_bandmf_entry(entry: LedgerEntry, neighboring: str) -> None:
    """A BandMF entry as :func:`bandmf_step` writes it: add/remove adjacency, b = len(coefficients) bands, unit
    coefficients, and an event that is one participation at the group rate min(1, b q). A ledger edited to record the
    overall rate q instead (b times too little sampling) is refused, not certified."""
    if neighboring != "add_or_remove_one":
        raise AccountingError(
            f"BandMF is certified under add/remove-one adjacency (independent secret groups), not {neighboring}"
        )
    f = entry.facts
    bands, coefficients = f.get("bands"), f.get("coefficients")
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise AccountingError(f"a bandmf ledger entry must state its bands, an integer >= 1; got {bands!r}")
    c = check_unit_coefficients(coefficients)
    if len(c) != bands or f.get("sampling") != CYCLIC_POISSON:  # more coefficients than groups: overlapping blocks
        raise AccountingError(
            f"a bandmf ledger entry must have as many coefficients as groups ({bands}) and cyclic_poisson sampling, "
            f"got {len(c)} and {f.get('sampling')!r}"
        )
    rate = group_sampling_rate(f.get("sampling_rate"), bands)
    ev = entry.event
    inner = ev.event if isinstance(ev, dpa.PoissonSampledDpEvent) else ev
    recorded = ev.sampling_probability if isinstance(ev, dpa.PoissonSampledDpEvent) else 1.0
    if not isinstance(inner, dpa.GaussianDpEvent) or not math.isclose(recorded, rate, rel_tol=1e-12):
        raise AccountingError(
            f"a bandmf ledger entry's event must be one participation, a Gaussian Poisson-sampled at the group rate "
            f"min(1, bands x sampling_rate) = {rate:g}; it records {type(inner).__name__} at rate {recorded:g}"
        )


def check_bandmf(ledger: Ledger, accountant: str, covers: bool) -> None:
    """Called by :func:`dptrain.accounting.base.epsilon` before any accountant reads a ledger: a ledger holding a
    BandMF run is refused in one line by an accountant that does not declare ``covers_bandmf``, and checked
    (:func:`check_bandmf_entry`) for one that does."""
    entries = [e for e in ledger.entries if is_bandmf(e)]
    if not entries:
        return
    if not covers:
        raise AccountingError(
            f"the {accountant} accountant cannot certify banded matrix factorization (noise correlated across steps, "
            "cyclic Poisson groups); pld and rdp certify it as ceil(T/b) DP-SGD steps (Choquette-Choo et al., Thm 4)"
        )
    for entry in entries:
        check_bandmf_entry(entry, ledger.neighboring)
