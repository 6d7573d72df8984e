"""``dptrain schedule``: a noise schedule sigma_1..sigma_T of "On Dynamic Noise Influence in Differential
Private Learning" (anonymous ICLR 2021 submission), scaled to spend exactly a privacy budget
(:func:`dptrain.schedules.calibration.calibrate_schedule`); or, with ``--bound``, the paper's optimal step counts
and utility bounds for given kappa and alpha (:func:`dptrain.schedules.bounds_gd.bound_summary`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dptrain.cli import common
from dptrain.cli.common import finite_float, positive_int
from dptrain.errors import ConfigError
from dptrain.schedules.names import ACCOUNTANTS, KIND_PARAMS, KINDS

# numpy, scipy and dp_accounting (dptrain.schedules.calibration, .shapes, .bounds) are imported in the functions that run the
# command: building the parser stays light.

NAME = "schedule"
#: A calculator: it reads no data and draws no secret (its JSON is private; torchrun may run it on every rank).
READS_DATA = False
HELP = "noise schedule sigma_1..sigma_T calibrated to a budget, or the optimal T (Dynamic Noise Influence)"
DESCRIPTION = (
    "Print a noise schedule sigma_t = c * s_t, t = 1..T, of one kind (its shape s_t), with the one scale c "
    'that makes the run spend exactly the budget under the accountant ("On Dynamic Noise Influence in '
    "Differential Private Learning\", anonymous ICLR 2021 submission). With --bound: the paper's optimal "
    "step counts and expected-risk upper bounds (ERUB) of gradient descent for given kappa and alpha (Eq. 2)."
)

#: The kind parameters, each the flag --NAME: its type, metavar and help (the kinds taking it: KIND_PARAMS).
PARAM_HELP = {
    "kappa": (finite_float, "K", "condition number M/mu >= 1 (gd-optimal, momentum; also --bound)"),
    "gamma": (finite_float, "G", "contraction in [0, 1) instead of --kappa (gd-optimal, momentum)"),
    "eta": (finite_float, "ETA", "step size times M, with --kappa (gd-optimal; default 1)"),
    "beta": (finite_float, "B", "momentum in [0, 1) (momentum)"),
    "eta0": (finite_float, "ETA0", "step size eta0 with --kappa: gamma = 1 - eta0/kappa (momentum)"),
    "form": (str, "reindexed|two-exponential", "momentum influence (momentum; default reindexed)"),
    "c1": (finite_float, "C1", "Thm 4.6 constant (momentum --form two-exponential)"),
    "c2": (finite_float, "C2", "Thm 4.6 constant (momentum --form two-exponential)"),
    "influence": (
        str,
        "FILE",
        "T positive influences q_t: a text/CSV file (numbers separated by commas, spaces or lines) "
        "or a .npy file (influence)",
    ),
    "rate": (finite_float, "RATE", "decay rate (exponential, time; default: a tenfold decay over the run)"),
    "factor": (finite_float, "F", "factor per period (step; default 0.5)"),
    "period": (positive_int, "STEPS", "steps per period (step: default ceil(T/4); polynomial: default T-1)"),
    "power": (finite_float, "P", "exponent (polynomial; default 1)"),
    "final": (finite_float, "RATIO", "sigma_end / sigma_start (polynomial; default 0.1)"),
}
assert set(PARAM_HELP) == {p for params in KIND_PARAMS.values() for p in params}

#: The flags of a schedule (refused with --bound), as (dest, flag); the kind parameters come on top.
SCHEDULE_FLAGS = (
    ("kind", "--kind"),
    ("steps", "--steps"),
    ("epsilon", "--epsilon"),
    ("delta", "--delta"),
    ("rho", "--rho"),
    ("R", "--R"),
    ("sampling_rate", "--sampling-rate"),
    ("accountant", "--accountant"),
    ("levels", "--levels"),
    ("plot", "--plot"),
)

ACCOUNTANT_HELP = (
    "what spending the budget means: zcdp (the paper's: sum_t 1/(2 sigma_t^2) = rho, no amplification by "
    "sampling), exact (full batch only: the steps compose into one Gaussian, exact (epsilon, delta)), rdp "
    "(Poisson-subsampled, certified, fast for any shape), pld (Poisson-subsampled, a few %% less noise than "
    "rdp, seconds per level, at most 16 distinct levels: see --levels). Default: zcdp for a --rho/--R "
    "budget; for (epsilon, delta): exact at sampling rate 1, rdp below 1"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", metavar="KIND", help=f"the schedule's shape: {', '.join(KINDS)}")
    parser.add_argument("--steps", type=positive_int, metavar="T", help="number of steps T")
    budget = parser.add_argument_group("budget (one of --epsilon with --delta, --rho, --R)")
    budget.add_argument("--epsilon", type=finite_float, metavar="E")
    common.add_delta(
        budget, required=False, help="delta of the budget (with --rho/--R: epsilon is reported at it)"
    )
    budget.add_argument("--rho", type=finite_float, help="zCDP budget rho")
    budget.add_argument("--R", type=finite_float, help="the paper's budget R = 2 rho (sum_t sigma_t^-2 = R)")
    parser.add_argument(
        "--sampling-rate",
        type=finite_float,
        metavar="Q",
        help="Poisson sampling rate in (0, 1] (default 1: full batch)",
    )
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default=None, help=ACCOUNTANT_HELP)
    parser.add_argument(
        "--levels",
        type=positive_int,
        metavar="N",
        help="round the shape (in log space) to N geometric levels first (pld needs <= 16)",
    )
    kind = parser.add_argument_group(
        "kind parameters",
        "Each kind takes its own flags; a flag the kind does not take is an error. "
        + "; ".join(f"{k}: {', '.join('--' + p for p in ps) or 'none'}" for k, ps in KIND_PARAMS.items())
        + ".",
    )
    for name, (type_, metavar, help_) in PARAM_HELP.items():
        kind.add_argument(f"--{name}", type=type_, metavar=metavar, help=help_)
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw sigma_t vs t into this PNG (with the zcdp schedule dashed)",
    )
    bound = parser.add_argument_group(
        "--bound (the paper's optimal T and ERUB; takes --kappa, --alpha, --json)"
    )
    bound.add_argument(
        "--bound", action="store_true", help="print bound_summary(kappa, alpha) instead of a schedule"
    )
    bound.add_argument("--alpha", type=finite_float, metavar="A", help="the paper's alpha > 0 (Eq. 2)")
    common.add_json(
        parser, help="one JSON object: the schedule (Schedule.to_json(), plus 'plot') or the bound summary"
    )


def run(args: argparse.Namespace) -> int:
    from dptrain.schedules.calibration import calibrate_schedule
    from dptrain.schedules.params import check_kind

    if args.bound:
        return _bound(args)
    if args.alpha is not None:
        raise ConfigError("--alpha is used only with --bound (the paper's optimal T and ERUB)")
    if args.kind is None:
        raise ConfigError("schedule needs --kind KIND and --steps T (or --bound --kappa K --alpha A)")
    kind = check_kind(args.kind)
    if args.steps is None:
        raise ConfigError(f"schedule --kind {kind} needs --steps T")
    params = _kind_params(args, kind)
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG: give a FILE.png, got {args.plot!r}")
    q = 1.0 if args.sampling_rate is None else args.sampling_rate
    accountant = args.accountant or _default_accountant(args, q)
    budget = {"rho": args.rho, "R": args.R, "epsilon": args.epsilon, "delta": args.delta}
    options = {**budget, "sampling_rate": q, "levels": args.levels, **params}
    schedule = calibrate_schedule(kind, args.steps, accountant=accountant, **options)
    plot = None
    if args.plot is not None:
        zcdp = None
        if accountant != "zcdp":
            zcdp = calibrate_schedule(kind, args.steps, accountant="zcdp", **options)
        plot = _plot(Path(args.plot), schedule, zcdp)
    if args.json:
        common.print_json({**schedule.to_json(), **({"plot": str(plot)} if plot else {})}, reads_data=READS_DATA)
        return 0
    print(_summary(schedule, args))
    if plot is not None:
        dashed = "; the zcdp schedule of the same budget dashed" if accountant != "zcdp" else ""
        print(f"plot      wrote {plot} (sigma_t vs t{dashed})")
    return 0


def _default_accountant(args: argparse.Namespace, q: float) -> str:
    """zcdp for a zCDP budget; exact (tight, closed form) for full batches; rdp (certified, milliseconds, any
    number of noise levels) for Poisson sampling. pld is a few % tighter there but takes seconds per noise
    level and at most 16 of them, so it is asked for by name."""
    if args.epsilon is None:
        return "zcdp"
    return "exact" if q == 1.0 else "rdp"


def _kind_params(args: argparse.Namespace, kind: str) -> dict:
    """The kind parameters given, as calibrate_schedule's keywords (a flag the kind does not take: error)."""
    from dptrain.schedules.shapes import read_influence

    given = {name: getattr(args, name) for name in PARAM_HELP if getattr(args, name) is not None}
    takes = KIND_PARAMS[kind]
    for name in given:
        if name not in takes:
            accepted = f"its flags are {', '.join('--' + p for p in takes)}" if takes else "it takes no flags"
            raise ConfigError(f"--{name} is not a parameter of schedule kind {kind!r}; {accepted}")
    if "influence" in given:
        given["influence"] = read_influence(given["influence"], "--influence")
    return given


def _summary(schedule, args: argparse.Namespace) -> str:
    import numpy as np

    s = schedule
    T, sig = s.T, s.sigmas
    shown = ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.params.items() if k != "influence"
    )
    if "influence" in s.params:
        shown = ", ".join(filter(None, [f"influence from {args.influence}", shown]))
    batch = "full batch" if s.sampling_rate == 1.0 else f"Poisson sampling rate {s.sampling_rate:g}"
    levels = f", {s.details['levels']} levels" if "levels" in s.details else ""
    b = s.budget
    target = f"epsilon {b.epsilon:g}" if b.epsilon is not None else f"rho {b.rho:g}, R {b.R:g}"
    if s.epsilon is not None:
        spent = f"epsilon = {s.epsilon:.6g} at delta = {s.delta:g}"
    else:
        spent = f"rho = {s.rho:.6g}"
        target += "; give --delta for epsilon"
    order = f" (order {s.details['optimal_order']})" if "optimal_order" in s.details else ""
    mid = (T + 1) // 2
    lo, hi = int(np.argmin(sig)), int(np.argmax(sig))
    amplification = "" if s.sampling_rate == 1.0 else "; no amplification by sampling"
    lines = [
        f"schedule  {s.kind}{f' ({shown})' if shown else ''}, T = {T} steps, {batch}{levels}",
        f"spent     {spent} under {s.accountant}{order}  (budget: {target})",
        f"zCDP      rho = {s.rho:.6g}, R = {s.R:.6g}  (R = sum_t sigma_t^-2 = 2 rho{amplification})",
        f"sigma_t   first {sig[0]:.6g} (t = 1), middle {sig[mid - 1]:.6g} (t = {mid}), "
        f"last {sig[-1]:.6g} (t = {T})",
        f"          min {sig[lo]:.6g} (t = {lo + 1}), max {sig[hi]:.6g} (t = {hi + 1}), "
        f"max/min {sig[hi] / sig[lo]:.6g}",
    ]
    return "\n".join(lines)


def _plot(path: Path, schedule, zcdp) -> Path:
    """sigma_t vs t as a PNG at ``path`` (folder created), the zcdp-calibrated schedule dashed beside it."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(1, schedule.T + 1)
    marker = "." if schedule.T <= 60 else None
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        b = schedule.budget
        budget = f"epsilon {b.epsilon:g}, delta {b.delta:g}" if b.epsilon is not None else f"rho {b.rho:g}"
        label = f"{schedule.accountant} ({budget})"
        ax.plot(t, schedule.sigmas, marker=marker, label=label)
        if zcdp is not None:
            ax.plot(t, zcdp.sigmas, linestyle="--", marker=marker, label="zcdp (same budget)")
        top = max(schedule.sigmas.max(), zcdp.sigmas.max() if zcdp is not None else 0.0)
        bottom = min(schedule.sigmas.min(), zcdp.sigmas.min() if zcdp is not None else np.inf)
        if top / bottom > 20:
            ax.set_yscale("log")
        ax.set_xlabel("step t")
        ax.set_ylabel("noise multiplier sigma_t")
        ax.set_title(f"{schedule.kind} schedule, T = {schedule.T} (Dynamic Noise Influence)")
        ax.legend()
        fig.tight_layout()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=100, format="png")
        except OSError as e:
            raise ConfigError(f"--plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path


def _bound(args: argparse.Namespace) -> int:
    from dptrain.schedules.bounds_gd import bound_summary, erub_dynamic

    extra = [
        f
        for dest, f in (*SCHEDULE_FLAGS, *((p, "--" + p) for p in PARAM_HELP if p != "kappa"))
        if getattr(args, dest) is not None
    ]
    if extra:
        raise ConfigError(f"--bound takes --kappa, --alpha and --json only, got {extra[0]} (a schedule flag)")
    missing = [f for f, v in (("--kappa", args.kappa), ("--alpha", args.alpha)) if v is None]
    if missing:
        raise ConfigError(f"--bound needs --kappa K and --alpha A, got no {missing[0]}")
    summary = bound_summary(args.kappa, args.alpha)
    if args.json:
        common.print_json(summary, reads_data=READS_DATA)
        return 0
    s = summary
    print(
        f"PGD (eta = 1/M) at kappa = {args.kappa:g}, alpha = {args.alpha:g}: optimal T and ERUB "
        "(bound / initial gap)"
    )
    print(f"{'schedule':<34}{'T':>10}{'ERUB':>12}")
    rows = [
        ("uniform, integer argmin (eq. 21)", f"{s['T_uniform']}", s["erub_uniform"]),
        ("uniform, paper's form (eqs. 23-24)", f"{s['T_uniform_paper']:.4f}", s["erub_uniform_paper"]),
        ("dynamic, continuous (eq. 26)", f"{s['T_dynamic_continuous']:.4f}", s["erub_dynamic"]),
        (
            "dynamic, integer argmin (Thm 4.3)",
            f"{s['T_dynamic']}",
            erub_dynamic(s["T_dynamic"], args.kappa, args.alpha),
        ),
    ]
    for label, T, erub in rows:
        print(f"{label:<34}{T:>10}{erub:>12.6g}")
    return 0
