"""``dptrain account``: epsilon spent by DP-SGD with given parameters (any accountant, or all side by side), or by
projected noisy SGD with the last-iterate accountant of Altschuler & Talwar, "Privacy of Noisy Stochastic Gradient
Descent" (its own flags), or by a random search releasing the best of a random number of such DP-SGD runs
(``--tuning-mean``; Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy")."""

from __future__ import annotations

import argparse

from dptrain.cli import bands as bandmf
from dptrain.cli import common
from dptrain.cli.common import check, finite_float, positive_int
from dptrain.errors import ConfigError

# dp_accounting and scipy (dptrain.accounting) are imported when the command runs: building the parser stays light.

NAME = "account"
#: A calculator: it reads no data and draws no secret (its JSON is private; torchrun may run it on every rank).
READS_DATA = False
#: Why ``--accountant last_iterate`` gives no membership-inference bound.
LAST_ITERATE_NO_PROFILE = (
    "the last_iterate accountant certifies epsilon at one delta for the last iterate; the pld accountant's privacy "
    "profile of both orderings, which this bound reads, is not computed from these flags"
)
HELP = "epsilon spent by DP-SGD (or projected noisy SGD) with given parameters"


#: The last_iterate group's flags and their defaults (the parser's): given on DP-SGD's path, each is refused (it was
#: ignored).
LAST_ITERATE_FLAGS = {
    "lipschitz": None, "diameter": None, "smoothness": None, "learning_rate": None, "dataset_size": None,
    "noise_std": None, "strong_convexity": 0.0, "batching": "random", "adjacency": "replace", "lr_power": 0.0,
    "rdp_order": None,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_noise_multiplier(parser)
    common.add_sampling_rate(parser)
    common.add_steps(parser)
    common.add_delta(parser)
    common.add_sampling(parser)
    common.add_accountant(parser)
    li = parser.add_argument_group("last_iterate (projected noisy SGD on a convex loss; Altschuler & Talwar)")
    li.add_argument("--lipschitz", type=finite_float, metavar="L")
    li.add_argument("--diameter", type=finite_float, metavar="D")
    li.add_argument("--smoothness", type=finite_float, metavar="M")
    li.add_argument("--learning-rate", type=finite_float, metavar="ETA")
    li.add_argument("--dataset-size", type=positive_int, metavar="n")
    li.add_argument("--batch-size", type=positive_int, metavar="b", help="batch size (ModelMix: the expected B)")
    li.add_argument(
        "--noise-std", type=finite_float, metavar="SIGMA", help="std of the Gaussian on the averaged gradient"
    )
    li.add_argument("--strong-convexity", type=finite_float, default=LAST_ITERATE_FLAGS["strong_convexity"], metavar="m")
    li.add_argument("--batching", default=LAST_ITERATE_FLAGS["batching"], choices=["random", "cyclic", "full"])
    li.add_argument("--adjacency", default=LAST_ITERATE_FLAGS["adjacency"], choices=["replace", "remove"])
    li.add_argument(
        "--lr-power", type=finite_float, default=LAST_ITERATE_FLAGS["lr_power"], help="eta_t = ETA (t+1)^-p, p in [0, 1)"
    )
    li.add_argument(
        "--rdp-order", type=finite_float, metavar="A", help="also print the RDP bound at this order"
    )
    common.add_modelmix(parser)
    bandmf.add_bands(parser, auto=True)
    common.add_tuning(parser)
    parser.add_argument(
        "--attacker-plot",
        metavar="PATH",
        help="also draw the membership-inference attacker's bound (TPR against FPR) to this PNG",
    )
    common.add_json(parser)


def _refuse_last_iterate_flags(args: argparse.Namespace) -> None:
    given = [f for f, default in LAST_ITERATE_FLAGS.items() if getattr(args, f) != default]
    modelmix = args.accountant == "modelmix" or any(getattr(args, f, None) is not None for f in common.MODELMIX_FLAGS)
    if args.batch_size is not None and not modelmix:  # (else ModelMix's expected batch size)
        given.append("batch_size")
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} goes with --accountant last_iterate (projected noisy SGD), not with "
            f"--accountant {args.accountant}, which would ignore it"
        )


def run(args: argparse.Namespace) -> int:
    from dptrain.accounting import accountant_names, all_reports, check_noise_multiplier, epsilon, tightest

    trials = common.tuning_trials(args)
    if args.accountant == "last_iterate":
        if trials is not None:
            raise ConfigError(
                "--tuning-mean certifies a search of DP-SGD runs with the rdp accountant (--accountant auto, rdp or "
                "all), not last_iterate"
            )
        bandmf.check_accountant(args)
        return _last_iterate(args)
    common.full_batch_rate(args)
    _refuse_last_iterate_flags(args)
    for flag in ("noise_multiplier", "sampling_rate"):
        if getattr(args, flag) is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required with --accountant {args.accountant}")
    common.check_rate_and_delta(args)
    check_noise_multiplier(args.noise_multiplier, "--noise-multiplier")
    numbers = common.run_numbers(args)
    bands = bandmf.requested(args, numbers)
    modelmix = common.modelmix_ledgers(args, numbers)
    ledger = bandmf.ledgers(bands, numbers.ledger if modelmix is None else modelmix)(args.noise_multiplier)
    if trials is not None:
        return _search(args, common.trial_ledgers(args, lambda _: ledger)(args.noise_multiplier), trials, bands)
    if args.accountant == "all":
        found, refusals = all_reports(ledger, args.delta)
        names, reports = list(accountant_names()), list(found.values())
    else:
        names, reports, refusals = [args.accountant], [epsilon(ledger, args.delta, args.accountant)], {}
    best = tightest({r.accountant: r for r in reports})
    attacker = _attacker(args, ledger)
    extra = {} if bands is None or best is None else bands.json(best.epsilon, args.delta)
    if args.json:
        if len(names) == 1:
            common.print_json({**reports[0].to_dict(), **extra, "membership_inference": _attacker_json(attacker)}, reads_data=READS_DATA)
        else:
            common.print_json(
                {
                    "epsilon": best.epsilon if best else None,
                    "delta": args.delta,
                    "accountant": best.accountant if best else None,
                    "all": [r.to_dict() for r in reports],
                    "refused": refusals,
                    **extra,
                    "membership_inference": _attacker_json(attacker),
                },
                reads_data=READS_DATA,
            )
        return 0
    for r in reports:
        mark = "" if r.certified else f"   NOT CERTIFIED: {r.details.get('note', 'not a proven bound')}"
        if len(names) > 1 and r is best:
            mark = "   <- tightest certified"
        print(f"{r.accountant:>4}: epsilon = {r.epsilon:.6g} at delta = {r.delta:g}{mark}")
        if r.accountant == "modelmix":
            d = r.details
            print(
                f"      certified: the larger ordering ({d['binding_direction']}, order {d['optimal_order']:g}; "
                f"forward {d['epsilon_forward_certified']:.6g} at integer orders, reverse "
                f"{d['epsilon_reverse_certified']:.6g}). Not certified: the paper's direction at fractional orders "
                f"{d['epsilon_paper_direction']:.6g}, the paper's method (with its Thm 2.2) "
                f"{d['epsilon_paper_method']:.6g}. Plain DP-SGD (rdp): {d['epsilon_dpsgd']:.6g}"
            )
    for name, why in refusals.items():
        print(f"{name:>4}: refused: {why}")
    if extra:
        print(bandmf.line(extra))
    print(_attacker_line(attacker))
    return 0


def _attacker(args: argparse.Namespace, ledger, reason: str | None = None) -> dict:
    """The bound on a membership-inference attacker (:func:`dptrain.accounting.membership.membership_inference`; no
    number where ``reason`` says there is no profile), drawn to ``--attacker-plot`` when given."""
    from dptrain.accounting.membership import membership_inference, no_profile

    plot = getattr(args, "attacker_plot", None)
    result = no_profile(reason, args.delta) if reason else membership_inference(ledger, args.delta, curve=bool(plot))
    if plot:
        if result["tpr_at_fpr_1pct"] is None:
            raise ConfigError(f"--attacker-plot: there is no bound to draw ({result['no_profile']})")
        draw_attacker_curve(result, plot, _settings(args))
    return result


def _attacker_json(result: dict) -> dict:
    from dptrain.accounting.membership import compact

    return compact(result)


def _attacker_line(result: dict) -> str:
    from dptrain.accounting.membership import summary_line

    return summary_line(result)


def _settings(args: argparse.Namespace) -> str:
    steps = f"{args.steps} steps" if getattr(args, "steps", None) is not None else ""
    if getattr(args, "noise_multiplier", None) is None:
        return steps
    return (
        f"noise multiplier {args.noise_multiplier:g}, {args.sampling} sampling at rate {args.sampling_rate:.4g}, "
        f"{steps}, delta {args.delta:g}"
    )


def draw_attacker_curve(result: dict, path: str, settings: str = "") -> None:
    """Draw ``result`` (:func:`~dptrain.accounting.membership.membership_inference` with ``curve=True``) to a PNG at
    ``path``: the best attacker's TPR against its FPR (the tight bound from the privacy profile), the reading of the
    one (epsilon, delta) pair alone and the diagonal (guessing), on linear axes and on log-log axes (small FPRs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["curve"]
    fpr, tight, pair = curve["fpr"], curve["tpr"], curve["tpr_epsilon_delta"]
    how = f"mu-GDP, mu = {result['mu_gdp']:.3g}" if result["accountant"] == "gdp" else "pld privacy profile"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, log in zip(axes, (False, True), strict=True):
        pair_label = f"(epsilon, delta) = ({result['epsilon']:.3g}, {result['delta']:g}) alone"
        ax.plot(fpr, pair, color="tab:orange", label=pair_label)
        ax.plot(fpr, tight, color="tab:blue", label=f"tight bound ({how})")
        ax.plot([1e-5, 1], [1e-5, 1], color="gray", linestyle=":", label="guessing (TPR = FPR)")
        for key, a in (("tpr_at_fpr_1pct", 0.01), ("tpr_at_fpr_10pct", 0.10)):
            ax.plot([a], [result[key]], "o", color="tab:blue")
            if log:
                label = f"TPR {100 * result[key]:.3g}% at FPR {a:.0%}"
                ax.annotate(label, (a, result[key]), textcoords="offset points", xytext=(6, -12))
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(1e-5, 1)
            ax.set_ylim(1e-5, 1.05)
        else:
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1.02)
        ax.set_xlabel("false-positive rate (FPR)")
        ax.set_ylabel("true-positive rate (TPR)")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"The best membership-inference attacker: TPR at each FPR\n{settings}", fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ConfigError(f"--attacker-plot: cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


def _search(args: argparse.Namespace, trial, trials, bands=None) -> int:
    """A search of ``trials`` trials, each releasing ``trial`` (a ledger): the search's epsilon (rdp; with ``all``
    every accountant's answer or refusal) beside one trial's alone (the tightest certified with auto or all); with
    ``bands`` (``--bands``), BandMF's bands and RMSE ratio at one trial's epsilon."""
    from dptrain.accounting import AUTO, all_reports, epsilon, search_ledger, tightest
    from dptrain.errors import AccountingError

    search = search_ledger(trial, trials)
    refusals = {}
    if args.accountant == "all":
        found, refusals = all_reports(search, args.delta)
        best = tightest(found)
        if best is None:
            why = "; ".join(f"{k}: {v}" for k, v in refusals.items())
            raise AccountingError(f"no accountant certifies this search ({why})")
    else:
        best = epsilon(search, args.delta, args.accountant)
    single = epsilon(trial, args.delta, AUTO if args.accountant == "all" else args.accountant)
    out = {
        **best.to_dict(),
        "epsilon_single_run": single.epsilon,
        "single_run_accountant": single.accountant,
        **trials.to_dict(),
        "trial_releases": trial.releases,
    }
    extra = {} if bands is None else bands.json(single.epsilon, args.delta)
    out.update(extra)
    if args.accountant == "all":
        out["refused"] = refusals
    attacker = _attacker(args, search)
    if args.json:
        common.print_json({**out, "membership_inference": _attacker_json(attacker)}, reads_data=READS_DATA)
        return 0
    print(
        f"{'search':>12}: epsilon = {best.epsilon:.6g} at delta = {args.delta:g}  ({best.accountant}; the best of a "
        f"{trials.name} number of trials, mean {trials.mean:g}; Papernot & Steinke)"
    )
    print(f"{'single run':>12}: epsilon = {single.epsilon:.6g}  ({single.accountant}; one trial alone)")
    for name, why in refusals.items():
        print(f"{name:>12}: refused: {why}")
    if extra:
        print(bandmf.line(extra, "one trial's epsilon"))
    print(_attacker_line(attacker))
    return 0


def _last_iterate(args: argparse.Namespace) -> int:
    from dptrain.accounting.last_iterate import (
        NOT_CERTIFIED,
        Setting,
        certifiable,
        last_iterate_report,
        rdp_bound,
    )

    needed = ("lipschitz", "diameter", "smoothness", "learning_rate", "dataset_size", "noise_std")
    missing = [f"--{k.replace('_', '-')}" for k in needed if getattr(args, k) is None]
    if missing:
        raise ConfigError(f"--accountant last_iterate needs {', '.join(missing)}")
    common.check_delta(args)
    b = (
        args.batch_size
        if args.batch_size is not None
        else (args.dataset_size if args.batching == "full" else None)
    )
    if b is None:
        raise ConfigError("--accountant last_iterate needs --batch-size (or --batching full)")
    st = Setting(
        n=args.dataset_size,
        b=b,
        noise_std=args.noise_std,
        lipschitz=args.lipschitz,
        diameter=args.diameter,
        learning_rate=args.learning_rate,
        steps=args.steps,
        batching=args.batching,
        adjacency=args.adjacency,
        strong_convexity=args.strong_convexity,
        smoothness=args.smoothness,
        lr_power=args.lr_power,
    )
    r = last_iterate_report(st, args.delta)
    certified = certifiable(st)
    out = {
        "epsilon": r["epsilon"],
        "epsilon_composition": r["epsilon_composition"],
        "delta": args.delta,
        "accountant": "last_iterate",
        "certified": certified,
        **({} if certified else {"note": NOT_CERTIFIED}),
        "burn_in_steps": r["burn_in_steps"],
        "order": r["order"],
        "bound": r["bound"],
        "window": r["window"],
    }
    if args.rdp_order is not None:
        check(args.rdp_order > 1, "--rdp-order", "a number > 1", args.rdp_order)
        at = rdp_bound(st, args.rdp_order)
        out.update(rdp_order=args.rdp_order, rdp=at.rdp, rdp_composition=at.composition)
    attacker = _attacker(args, None, LAST_ITERATE_NO_PROFILE)
    if args.json:
        common.print_json({**out, "membership_inference": _attacker_json(attacker)}, reads_data=READS_DATA)
        return 0
    burn = (
        "none (decaying steps keep growing)"
        if out["burn_in_steps"] is None
        else f"{out['burn_in_steps']} steps"
    )
    print(
        f"last_iterate: epsilon = {out['epsilon']:.6g} at delta = {args.delta:g}  (bound {out['bound']}, order "
        f"{out['order']:g}; only the last iterate released)"
    )
    print(f" composition: epsilon = {out['epsilon_composition']:.6g}  (every step charged)")
    print("   certified: yes (deterministic batches)" if certified else f"  NOT CERTIFIED: {NOT_CERTIFIED}")
    print(f"     burn-in: {burn}")
    if args.rdp_order is not None:
        print(
            f"   RDP at order {args.rdp_order:g}: {out['rdp']:.6g} (composition {out['rdp_composition']:.6g})"
        )
    print(_attacker_line(attacker))
    return 0
