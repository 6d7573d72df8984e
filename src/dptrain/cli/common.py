"""What several commands share, defined once: the argument types, the flags more than one command takes, and the
range checks of those flags.

Imports nothing heavy (no torch, no dp_accounting, no scipy), so that building the parser stays fast: what needs
:mod:`dptrain.accounting` imports it when a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING

from dptrain.errors import ConfigError
from dptrain.numbers import number_problem

if TYPE_CHECKING:  # annotations only
    from collections.abc import Callable

    from dptrain.accounting import Ledger, RunNumbers, TrialCount

#: ``--accountant auto``: every accountant that certifies the run is asked, the tightest answers
#: (:data:`dptrain.accounting.AUTO`).
AUTO = "auto"
#: The accountants ``--accountant`` offers: the registry of :mod:`dptrain.accounting` (tests/test_cli.py checks that
#: they are the same), named here so that building the parser does not import dp_accounting and scipy.
ACCOUNTANTS = ("rdp", "pld", "gdp", "proactive", "last_iterate", "composition", "modelmix", "filter")

# --- argument types (argparse turns their ArgumentTypeError into "argument --flag: ...") -----------------------


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1 or number_problem(v) is not None:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 that fits in 64 bits, got {v}")
    return v


def finite_float(text: str) -> float:
    """A finite number (no nan, no inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    problem = number_problem(v)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected {problem}, got {text!r}")
    return v


def float_list(text: str) -> list[float]:
    """Comma-separated finite numbers, e.g. ``0.5,1,2``."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    problem = next((p for p in map(number_problem, values) if p is not None), None)
    if not values or problem is not None:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, each {number_problem(math.inf)}, got {text!r}")
    return values


def check(ok: bool, flag: str, accepted: str, value) -> None:
    """A range check of a flag's value: a one-line :class:`ConfigError` ``FLAG must be ACCEPTED, got VALUE``."""
    if not ok:
        raise ConfigError(f"{flag} must be {accepted}, got {value}")


# --- a run's configuration: train, audit, utility-graph ----------------------------------------------------------

CONFIG_HELP = "TOML config file (see configs/)"


def add_config(
    parser: argparse.ArgumentParser,
    *,
    required: bool = False,
    help: str = CONFIG_HELP,
    overrides: bool = True,
) -> None:
    """``--config FILE.toml`` and, with ``overrides``, the repeatable ``--set KEY=VALUE``."""
    parser.add_argument("--config", required=required, help=help)
    if overrides:
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set privacy.target_epsilon=2 (repeatable)",
        )


def require_config(args: argparse.Namespace) -> None:
    """A run needs a config file or overrides (``--set`` alone builds one on the defaults)."""
    if not args.config and not args.set:
        raise ConfigError("give --config FILE.toml (see configs/) or --set KEY=VALUE overrides")


def add_json(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--json", action="store_true", help=help)


def print_json(result: dict, *, reads_data: bool = True, indent: int | None = None) -> None:
    """Print a command's ``--json`` object: every command prints it here, and every one says ``private``
    (tests/test_cli_json.py runs each command of the parser). A command that reads a data set passes its result's own
    ``private`` (false when seeded, trained with an injected bug or without noise: its ``not_private_because`` says
    why); one that reads none (``reads_data=False``: account, calibrate, plan, schedule compute from the numbers
    given) prints ``private: true``, since nothing it prints is computed from private data."""
    if not reads_data:
        result = {**result, "private": True}
    elif not isinstance(result.get("private"), bool):  # (a bug of dptrain's, never of the user's input)
        raise TypeError(f"a command's JSON must say whether it is private, got keys {sorted(result)}")
    print(json.dumps(result, indent=indent))


# --- the privacy flags: account, calibrate (and plan's --delta) --------------------------------------------------


def add_delta(parser: argparse.ArgumentParser, *, required: bool = True, help: str | None = None) -> None:
    parser.add_argument("--delta", type=finite_float, required=required, help=help)


def check_delta(args: argparse.Namespace) -> None:
    check(0 < args.delta < 1, "--delta", "in (0, 1)", args.delta)


def add_accountant(parser: argparse.ArgumentParser, *, allow_all: bool = True) -> None:
    """``--accountant``: ``auto`` (the default), any registered accountant, and with ``allow_all`` also ``all``."""
    choices = [AUTO, *ACCOUNTANTS] + (["all"] if allow_all else [])
    parser.add_argument(
        "--accountant",
        default=AUTO,
        choices=choices,
        help="which accountant certifies epsilon (auto: the tightest certified one"
        + ("; all: every one side by side)" if allow_all else ")"),
    )


# --- a DP-SGD run's numbers: account, calibrate ------------------------------------------------------------------


def add_noise_multiplier(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise-multiplier", type=finite_float)


def add_sampling_rate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sampling-rate", type=finite_float)


def add_steps(parser: argparse.ArgumentParser, *, or_epochs: bool = False) -> None:
    """``--steps T`` (required), or with ``or_epochs`` one of ``--steps T`` / ``--epochs K`` (checked in run)."""
    if not or_epochs:
        parser.add_argument("--steps", type=positive_int, required=True)
        return
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--steps", type=positive_int)
    group.add_argument("--epochs", type=finite_float)


def add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sampling", default="poisson", choices=["poisson", "full"])


def full_batch_rate(args: argparse.Namespace) -> None:
    """``--sampling full`` uses every example at every step: its rate is 1 without ``--sampling-rate``, and any other
    rate given with it is refused (it used to be required, then ignored)."""
    if args.sampling != "full":
        return
    check(args.sampling_rate in (None, 1.0), "--sampling-rate", "1 or left out with --sampling full (every example at "
          "every step)", args.sampling_rate)
    args.sampling_rate = 1.0


def check_rate_and_delta(args: argparse.Namespace) -> None:
    """The range checks of ``--sampling-rate`` (given) and ``--delta``, in this order."""
    check(0 < args.sampling_rate <= 1, "--sampling-rate", "in (0, 1]", args.sampling_rate)
    check_delta(args)


def run_numbers(args: argparse.Namespace) -> RunNumbers:
    """The run's numbers from ``--sampling``, ``--sampling-rate`` and ``--steps`` or ``--epochs`` (after
    :func:`check_rate_and_delta`): epochs become steps in :meth:`RunNumbers.planned`, nowhere else."""
    from dptrain.accounting import RunNumbers

    epochs = getattr(args, "epochs", None)
    if epochs is not None:
        check(epochs > 0, "--epochs", "a number > 0", epochs)
        return RunNumbers.planned(args.sampling, sampling_rate=args.sampling_rate, epochs=epochs)
    return RunNumbers.planned(args.sampling, sampling_rate=args.sampling_rate, steps=args.steps)


# --- ModelMix's flags: account, calibrate ------------------------------------------------------------------------

MODELMIX_FLAGS = ("tau_over_lr", "linf_p", "max_grad_norm")


def tau_spec(text: str):
    """``--tau-over-lr``: ``0.3`` (one value), ``0.0075,0.005,0.0025`` (equal phases) or ``0.05:0.5,0.025:0.5``
    (value:fraction of the run)."""
    try:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if parts and all(":" in p for p in parts):
            return [[float(a), float(b)] for a, b in (p.split(":", 1) for p in parts)]
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected R, R1,R2,... (equal phases) or R1:F1,R2:F2,... (fractions of the run), got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    return values[0] if len(values) == 1 else values


def add_modelmix(parser: argparse.ArgumentParser) -> None:
    """ModelMix's flags (Xiao, Wan & Devadas); ``--batch-size`` (the expected batch B) is the command's own."""
    g = parser.add_argument_group("modelmix (DP-SGD with ModelMix; Xiao, Wan & Devadas)")
    g.add_argument(
        "--tau-over-lr",
        type=tau_spec,
        metavar="R",
        help="tau as a multiple of the learning rate: R, equal phases R1,R2,... or phases R1:F1,R2:F2,...",
    )
    g.add_argument("--max-grad-norm", type=finite_float, metavar="C", help="the L2 clip norm C")
    g.add_argument("--linf-p", type=positive_int, default=None, metavar="P", help="l-infinity bound C/sqrt(P)")


def modelmix_ledgers(args: argparse.Namespace, numbers: RunNumbers):
    """sigma -> the ModelMix ledger of ``numbers`` when ``--tau-over-lr`` is given, else None. ModelMix's flags are
    refused with an accountant that cannot read them (one line, naming the flag)."""
    from dptrain.accounting.modelmix import modelmix_ledger

    given = [f for f in MODELMIX_FLAGS if getattr(args, f, None) is not None]
    if args.accountant == "modelmix" and "tau_over_lr" not in given:
        raise ConfigError("--accountant modelmix needs --tau-over-lr, --batch-size and --max-grad-norm")
    if not given:
        return None
    if args.accountant not in ("modelmix", "all", AUTO):
        raise ConfigError(
            f"--{given[0].replace('_', '-')} is a ModelMix flag: use it with --accountant modelmix (or all, auto), "
            f"not {args.accountant}"
        )
    missing = [f for f in ("tau_over_lr", "batch_size", "max_grad_norm") if getattr(args, f, None) is None]
    if missing:
        raise ConfigError(f"ModelMix accounting needs --{missing[0].replace('_', '-')}")
    check(args.max_grad_norm > 0, "--max-grad-norm", "a number > 0", args.max_grad_norm)
    check(numbers.sampling == "poisson", "--sampling", "poisson with ModelMix", numbers.sampling)

    def ledger(sigma: float) -> Ledger:
        return modelmix_ledger(
            sigma,
            numbers.sampling_rate,
            numbers.steps,
            tau=args.tau_over_lr,
            batch_size=float(args.batch_size),
            clip_norm=args.max_grad_norm,
            linf_p=args.linf_p or 1,
        )

    ledger(1.0)  # one-line errors for a bad tau now, not inside a search
    return ledger


# --- a hyperparameter search's flags: account, calibrate (Papernot & Steinke) -------------------------------------

#: :data:`dptrain.accounting.tuning.DEFAULT_DISTRIBUTION`, named here so that building the parser imports no
#: dp_accounting (tests/test_tuning_accounting.py checks that they are the same).
TUNING_DEFAULT = "geometric"
TUNING_FLAGS = ("tuning_distribution", "tuning_shape", "tuning_score_noise")


def shape_float(text: str) -> float:
    """A number or ``inf`` (no nan): the numeric shape of a distribution of the number of trials."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if math.isnan(v) or (v != math.inf and number_problem(v) is not None):
        raise argparse.ArgumentTypeError(f"expected a number or inf ({number_problem(math.inf)}, or inf), got {text!r}")
    return v


def add_tuning(parser: argparse.ArgumentParser) -> None:
    """The flags that turn one run into a random search releasing its best trial (Papernot & Steinke, "Hyperparameter
    Tuning with Renyi Differential Privacy"): the run the other flags describe is one trial."""
    g = parser.add_argument_group(
        "hyperparameter search (the best of a random number of trials, each the run above; Papernot & Steinke)"
    )
    g.add_argument(
        "--tuning-mean",
        type=finite_float,
        metavar="K",
        help="certify a random search instead of one run: K trials on average (their number drawn at random and kept "
        "secret), only the best trial (its model and its score) released",
    )
    d = g.add_mutually_exclusive_group()
    d.add_argument(
        "--tuning-distribution",
        metavar="NAME",
        help="the number of trials' distribution: geometric, logarithmic (the least epsilon for a mean, heavy-tailed), "
        "poisson (close to its mean, costly unless one trial's epsilon is small) or tnb:SHAPE (truncated negative "
        f"binomial, SHAPE >= 0); default {TUNING_DEFAULT}",
    )
    d.add_argument(
        "--tuning-shape",
        type=shape_float,
        metavar="S",
        help="the distribution as dp_accounting's number: inf poisson, 1 geometric, 0 logarithmic, else tnb:S",
    )
    g.add_argument(
        "--tuning-score-noise",
        type=finite_float,
        metavar="Z",
        help="each trial also releases its score through a Gaussian of noise multiplier Z (std over the score's "
        "sensitivity); without it the score must be computed on public data",
    )


def tuning_trials(args: argparse.Namespace) -> TrialCount | None:
    """The distribution of the number of trials from ``--tuning-mean`` and ``--tuning-distribution`` (or
    ``--tuning-shape``), None without ``--tuning-mean``; one-line errors naming the flag."""
    given = [f for f in TUNING_FLAGS if getattr(args, f, None) is not None]
    if getattr(args, "tuning_mean", None) is None:
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --tuning-mean")
        return None
    from dptrain.accounting import TrialCount

    if args.tuning_score_noise is not None:
        check(
            args.tuning_score_noise > 0, "--tuning-score-noise", "a finite number > 0", args.tuning_score_noise
        )
    if args.tuning_shape is not None:
        return TrialCount.checked(
            args.tuning_mean, args.tuning_shape, mean_key="--tuning-mean", shape_key="--tuning-shape"
        )
    return TrialCount.named(
        args.tuning_mean,
        args.tuning_distribution or TUNING_DEFAULT,
        mean_key="--tuning-mean",
        distribution_key="--tuning-distribution",
    )


def trial_ledgers(args: argparse.Namespace, run: Callable[[float], Ledger]) -> Callable[[float], Ledger]:
    """sigma -> one trial's ledger: the run's, followed by its score's release with ``--tuning-score-noise``."""
    if args.tuning_score_noise is None:
        return run
    from dptrain.accounting.tuning import with_score_release

    return lambda sigma: with_score_release(run(sigma), args.tuning_score_noise)
