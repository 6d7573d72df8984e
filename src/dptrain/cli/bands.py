"""``--bands B|auto`` of ``dptrain account`` and ``dptrain calibrate``: banded matrix factorization (Choquette-Choo et
al., "(Amplified) Banded Matrix Factorization", NeurIPS 2023; docs/bandmf.md) instead of DP-SGD's independent noise.
The run is ``--steps`` steps at overall rate ``--sampling-rate`` over B secret groups (cyclic Poisson), its ledger what
a BandMF run records (:func:`dptrain.accounting.bandmf_ledger`), with the coefficients optimized for the steps and the
workload (``--momentum``: SGD with momentum; prefix sums by default). ``--bands 1`` is DP-SGD exactly.

Imports nothing heavy: :mod:`dptrain.accounting` is imported when a command runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dptrain.cli.common import AUTO, check, finite_float
from dptrain.errors import ConfigError

if TYPE_CHECKING:  # annotations only
    from collections.abc import Callable

    from dptrain.accounting import Ledger, RunNumbers

AUTO_BANDS = "auto"
#: The accountants that certify a BandMF ledger (their covers_bandmf), and the choices that ask them.
CERTIFY = ("pld", "rdp", "composition", AUTO, "all")


def bands_value(text: str) -> int | str:
    """An integer >= 1, or auto."""
    if text == AUTO_BANDS:
        return text
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or auto, got {v}")
    return v


def add_bands(parser: argparse.ArgumentParser, *, auto: bool) -> None:
    g = parser.add_argument_group("banded matrix factorization (correlated noise; Choquette-Choo et al.)")
    g.add_argument(
        "--bands",
        type=bands_value,
        metavar="B|auto" if auto else "B",
        help="BandMF with B bands over B secret groups (1: DP-SGD exactly)"
        + ("; auto: the B with the least error relative to DP-SGD at this budget" if auto else ""),
    )
    g.add_argument(
        "--momentum",
        type=finite_float,
        metavar="BETA",
        help="with --bands: optimize the coefficients for SGD with momentum BETA (default: prefix sums, plain SGD)",
    )


class Bands:
    """What ``--bands`` asks for: b (after auto), the coefficients, the workload, and the ledger of a run at sigma."""

    def __init__(self, args: argparse.Namespace, numbers: RunNumbers, bands: int, choice=None):
        from dptrain.accounting import optimal_coefficients

        self.numbers, self.bands, self.choice = numbers, bands, choice
        self.workload = workload(args)
        if bands > numbers.steps:
            raise ConfigError(f"--bands must be at most --steps ({numbers.steps}), got {bands}")
        if bands * numbers.sampling_rate > 1 + 1e-12:
            raise ConfigError(
                f"--bands x --sampling-rate must be <= 1 (each of the B groups holds n/B examples on average), got "
                f"{bands} x {numbers.sampling_rate:g}"
            )
        self.coefficients = [float(x) for x in optimal_coefficients(numbers.steps, bands, self.workload)]

    def ledger(self, sigma: float) -> Ledger:
        from dptrain.accounting import bandmf_ledger

        return bandmf_ledger(sigma, self.numbers.sampling_rate, self.numbers.steps, self.coefficients)

    def json(self, epsilon: float, delta: float) -> dict:
        """``bands``, ``coefficients`` and ``rmse_ratio`` (the workload's error over DP-SGD's at ``epsilon``, both
        calibrated by pld; :func:`dptrain.accounting.rmse_ratio`), or ``rmse_ratio`` null and ``rmse_ratio_note``
        where it cannot be computed (:func:`dptrain.accounting.reported_rmse_ratio`: the epsilon is still printed)."""
        from dptrain.accounting import reported_rmse_ratio

        n = self.numbers
        ratio, why = reported_rmse_ratio(n.steps, n.sampling_rate, epsilon, delta, self.bands, self.workload)
        out = {
            "bands": self.bands,
            "coefficients": self.coefficients,
            "rmse_ratio": ratio,
            **({"rmse_ratio_note": why} if why else {}),
            "workload": "prefix sums" if self.workload.kind == "prefix" else f"momentum {self.workload.momentum:g}",
        }
        if self.choice is not None:
            out["candidates"] = {str(b): r for b, r in self.choice.candidates.items()}
        return out


def workload(args: argparse.Namespace):
    from dptrain.accounting import PREFIX_SUMS, momentum_workload

    beta = args.momentum
    if beta is None or beta == 0:
        return PREFIX_SUMS
    check(0 < beta < 1, "--momentum", "in [0, 1)", beta)
    return momentum_workload(beta)


def check_accountant(args: argparse.Namespace) -> None:
    """``--bands`` with an accountant that cannot certify BandMF: refused in one line (before that accountant's own
    flags are asked for)."""
    if getattr(args, "bands", None) is not None and args.accountant not in CERTIFY:
        raise ConfigError(
            f"--bands: the {args.accountant} accountant cannot certify banded matrix factorization; pld and rdp "
            "certify it as ceil(T/b) DP-SGD steps (use --accountant auto, pld, rdp or all)"
        )


def requested(args: argparse.Namespace, numbers: RunNumbers, target: float | None = None) -> Bands | None:
    """The BandMF run ``--bands`` asks for (None without it): ``auto`` needs the budget ``target`` (calibrate); the
    flags that cannot go with it are refused in one line."""
    if args.bands is None:
        if args.momentum is not None:
            raise ConfigError("--momentum goes with --bands (it sets BandMF's coefficients)")
        return None
    if args.bands == 1:  # DP-SGD exactly: its ledger, every accountant and sampling it takes (:func:`ledgers`)
        return Bands(args, numbers, 1)
    check(numbers.sampling == "poisson", "--sampling", "poisson with --bands (the groups are Poisson-sampled)",
          numbers.sampling)
    check_accountant(args)
    if getattr(args, "tau_over_lr", None) is not None:
        raise ConfigError("--bands is not certified with ModelMix's mixing (--tau-over-lr): use one or the other")
    if args.bands != AUTO_BANDS:
        return Bands(args, numbers, args.bands)
    if target is None:
        raise ConfigError(
            "--bands auto chooses b for a target epsilon: use dptrain calibrate --bands auto (or give --bands B)"
        )
    if getattr(args, "tuning_mean", None) is not None:  # (as dptrain tune refuses noise.bands = "auto")
        raise ConfigError(
            "--bands auto chooses b for one run's budget; with --tuning-mean a trial's noise is set by the search: "
            "give --bands B"
        )
    from dptrain.accounting import choose_bands

    choice = choose_bands(numbers.steps, numbers.sampling_rate, target, args.delta, workload(args))
    return Bands(args, numbers, choice.bands, choice)


def ledgers(bands: Bands | None, otherwise: Callable[[float], Ledger]) -> Callable[[float], Ledger]:
    """The ledger of a run at sigma: BandMF's, or ``otherwise`` (DP-SGD's, ModelMix's) without ``--bands`` and at
    ``--bands 1``, which is DP-SGD exactly (one group, the coefficient 1)."""
    return otherwise if bands is None or bands.bands == 1 else bands.ledger


def line(extra: dict, epsilon_words: str = "the same epsilon") -> str:
    """BandMF's bands and error in words (``--bands``; ``extra``: :meth:`Bands.json`)."""
    c = ", ".join(f"{x:.4f}" for x in extra["coefficients"][:4]) + (", ..." if len(extra["coefficients"]) > 4 else "")
    head = f"bandmf: {extra['bands']} bands, coefficients {c}; "
    if extra["rmse_ratio"] is None:
        return head + extra["rmse_ratio_note"]
    return head + f"RMSE of the {extra['workload']} {extra['rmse_ratio']:.4f} x DP-SGD's at {epsilon_words}"
