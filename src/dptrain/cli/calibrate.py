"""``dptrain calibrate``: the smallest noise multiplier meeting an (epsilon, delta) budget, for T (sub)sampled
DP-SGD steps (Brent's method on an accountant), for each trial of a random search releasing the best of a random
number of such runs (``--tuning-mean``; Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential
Privacy"), or for ONE Gaussian release (the analytic Gaussian mechanism of Balle & Wang 2018)."""

from __future__ import annotations

import argparse
import math

from dptrain.cli import bands as bandmf
from dptrain.cli import common
from dptrain.cli.common import check, finite_float, positive_int
from dptrain.errors import ConfigError

# dp_accounting and scipy (dptrain.accounting) are imported when the command runs: building the parser stays light.

NAME = "calibrate"
#: A calculator: it reads no data and draws no secret (its JSON is private; torchrun may run it on every rank).
READS_DATA = False
HELP = "smallest noise multiplier meeting an (epsilon, delta) budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mechanism",
        default="dpsgd",
        choices=["dpsgd", "gaussian"],
        help="dpsgd: T (sub)sampled steps (default); gaussian: ONE Gaussian release of L2 sensitivity 1, analytic "
        "calibration (Balle & Wang 2018), e.g. a private mean",
    )
    parser.add_argument("--epsilon", type=finite_float, required=True)
    common.add_delta(parser)
    common.add_sampling_rate(parser)
    common.add_steps(parser, or_epochs=True)
    common.add_sampling(parser)
    common.add_accountant(parser, allow_all=False)
    parser.add_argument("--batch-size", type=positive_int, metavar="B", help="expected batch size (ModelMix)")
    common.add_modelmix(parser)
    bandmf.add_bands(parser, auto=True)
    common.add_tuning(parser)
    common.add_json(parser)


def run(args: argparse.Namespace) -> int:
    from dptrain.accounting import calibrate, epsilon

    trials = common.tuning_trials(args)
    if args.mechanism == "gaussian":
        if trials is not None:
            raise ConfigError("--tuning-mean calibrates the trials of a search of DP-SGD runs: use --mechanism dpsgd")
        return _gaussian(args)
    common.full_batch_rate(args)
    if args.sampling_rate is None or (args.steps is None and args.epochs is None):
        raise ConfigError("calibrate --mechanism dpsgd needs --sampling-rate and one of --steps / --epochs")
    common.check_rate_and_delta(args)
    check(args.epsilon > 0, "--epsilon", "a number > 0", args.epsilon)
    numbers = common.run_numbers(args)
    bands = bandmf.requested(args, numbers, target=args.epsilon)
    ledger = bandmf.ledgers(bands, common.modelmix_ledgers(args, numbers) or numbers.ledger)
    if trials is not None:
        return _search(args, numbers, common.trial_ledgers(args, ledger), trials, bands)
    cal = calibrate(args.epsilon, args.delta, ledger, args.accountant)
    sigma = cal.noise_multiplier
    spent = epsilon(ledger(sigma), args.delta, cal.accountant)
    extra = {} if bands is None else bands.json(args.epsilon, args.delta)
    if args.json:
        common.print_json({**_result(args, numbers, cal, spent), **extra}, reads_data=READS_DATA)
    else:
        print(
            f"noise multiplier = {sigma:.6f}  ({numbers.steps} steps at sampling rate {numbers.sampling_rate:g}: "
            f"epsilon = {spent.epsilon:.6g} <= {args.epsilon:g} at delta = {args.delta:g}, {cal.accountant})"
        )
        if extra:
            print(bandmf.line(extra, "this epsilon") + (" (bands: auto)" if args.bands == "auto" else ""))
    return 0


def _result(args: argparse.Namespace, numbers, cal, spent) -> dict:
    """What ``calibrate --json`` prints of a DP-SGD calibration (one run or a search's trials)."""
    return {
        "noise_multiplier": cal.noise_multiplier,
        "epsilon": spent.epsilon,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "steps": numbers.steps,
        "sampling_rate": numbers.sampling_rate,
        "accountant": cal.accountant,
        "certified": spent.certified,
        "others": cal.others,
    }


def _search(args: argparse.Namespace, numbers, trial, trials, bands=None) -> int:
    """The per-trial noise multiplier with which the whole search (``trials`` trials, ``trial(sigma)`` each) meets
    the budget, with the search's epsilon and one trial's alone (the same accountant; auto: the tightest); with
    ``bands`` (``--bands B``), BandMF's bands and RMSE ratio at one trial's epsilon."""
    from dptrain.accounting import epsilon, search_ledger, trial_noise_for_search

    cal = trial_noise_for_search(args.epsilon, args.delta, trial, trials, args.accountant)
    sigma = cal.noise_multiplier
    spent = epsilon(search_ledger(trial(sigma), trials), args.delta, cal.accountant)
    single = epsilon(trial(sigma), args.delta, args.accountant)
    out = {
        **_result(args, numbers, cal, spent),
        "epsilon_single_run": single.epsilon,
        "single_run_accountant": single.accountant,
        **trials.to_dict(),
    }
    extra = {} if bands is None else bands.json(single.epsilon, args.delta)
    out.update(extra)
    if args.json:
        common.print_json(out, reads_data=READS_DATA)
        return 0
    print(
        f"noise multiplier = {sigma:.6f} per trial  (a search of a {trials.name} number of trials, mean "
        f"{trials.mean:g}, each {numbers.steps} steps at sampling rate {numbers.sampling_rate:g}: epsilon = "
        f"{spent.epsilon:.6g} <= {args.epsilon:g} at delta = {args.delta:g}, {cal.accountant}; one trial alone: "
        f"epsilon = {single.epsilon:.6g}, {single.accountant})"
    )
    if extra:
        print(bandmf.line(extra, "one trial's epsilon"))
    return 0


def _gaussian(args: argparse.Namespace) -> int:
    from dptrain.accounting import gaussian_mechanism_epsilon, gaussian_mechanism_noise
    from dptrain.accounting.calibration import gaussian_mechanism_delta

    given = [
        f
        for f, v in (
            ("--sampling-rate", args.sampling_rate),
            ("--steps", args.steps),
            ("--epochs", args.epochs),
        )
        if v is not None
    ]
    if given:
        raise ConfigError(f"calibrate --mechanism gaussian takes --epsilon and --delta only, not {given[0]}")
    check(args.epsilon > 0, "--epsilon", "a number > 0", args.epsilon)
    common.check_delta(args)
    sigma = gaussian_mechanism_noise(args.epsilon, args.delta)
    spent = gaussian_mechanism_epsilon(sigma, args.delta)
    if (
        gaussian_mechanism_delta(sigma, args.epsilon) <= args.delta
    ):  # both certified; drop float noise above target
        spent = min(spent, args.epsilon)
    classical = math.sqrt(2 * math.log(1.25 / args.delta)) / args.epsilon
    out = {
        "mechanism": "gaussian",
        "noise_multiplier": sigma,
        "epsilon": spent,
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "classical_noise_multiplier": classical if args.epsilon < 1 else None,
        "calibration": "analytic Gaussian mechanism (Balle & Wang 2018, Thm 8)",
    }
    if args.json:
        common.print_json(out, reads_data=READS_DATA)
    else:
        extra = (
            f"; the classical sqrt(2 ln(1.25/delta))/eps gives {classical:.4f}" if args.epsilon < 1 else ""
        )
        print(
            f"noise multiplier = {sigma:.6f}  (one Gaussian release of L2 sensitivity 1 is ({out['epsilon']:.6g}, "
            f"{args.delta:g})-DP, analytic calibration{extra})"
        )
    return 0
