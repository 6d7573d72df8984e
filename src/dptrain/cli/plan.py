"""``dptrain plan``: choose the noise, the batch size and the rounds before training, from a budget or from a
noise multiplier (van Dijk et al., "Proactive DP": the closed form and the App. D.4 calculator)."""

from __future__ import annotations

import argparse

from dptrain.cli import common
from dptrain.cli.common import finite_float, positive_int
from dptrain.errors import ConfigError

#: The accountants a plan can be made with: :data:`dptrain.proactive.planner.PLAN_ACCOUNTANTS` (tests/test_cli.py checks that
#: they are the same), named here so that building the parser does not import the planner's dp_accounting and scipy.
PLAN_ACCOUNTANTS = ("proactive", "rdp", "pld", "gdp")

NAME = "plan"
#: A calculator: it reads no data and draws no secret (its JSON is private; torchrun may run it on every rank).
READS_DATA = False
HELP = "choose noise, batch size and rounds before training (Proactive DP)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epsilon", type=finite_float, help="target epsilon (budget mode)")
    common.add_delta(parser, required=False, help="target delta (budget mode; --from-sigma uses 1/N)")
    parser.add_argument(
        "--from-sigma", type=finite_float, metavar="S", help="run the App. D.4 calculator for this sigma"
    )
    parser.add_argument("--dataset-size", type=positive_int, required=True, metavar="N")
    parser.add_argument(
        "--epochs", type=finite_float, required=True, metavar="K", help="gradient computations K = kN"
    )
    parser.add_argument(
        "--theta", type=finite_float, default=1.0, help="s_max / s_bar of the batch-size sequence"
    )
    # Not the shared --accountant: a plan inverts the planning accountants, and its default is the closed form.
    parser.add_argument("--accountant", default="proactive", choices=[*PLAN_ACCOUNTANTS, "all"])
    parser.add_argument(
        "--gamma",
        default="fixed-point",
        choices=["fixed-point", "paper"],
        help="with --from-sigma: tightest fixed point, or the paper's iteration (Tables 9-11)",
    )
    common.add_json(parser)


def run(args: argparse.Namespace) -> int:
    from dptrain.proactive.planner import plan_budget

    if args.from_sigma is not None:
        return _from_sigma(args)
    if args.epsilon is None or args.delta is None:
        raise ConfigError("give --epsilon and --delta (budget mode) or --from-sigma S")
    names = PLAN_ACCOUNTANTS if args.accountant == "all" else (args.accountant,)
    result = plan_budget(args.epsilon, args.delta, args.dataset_size, args.epochs, args.theta, names)
    if not result["plans"]:
        raise ConfigError(
            "no accountant can plan this budget: "
            + "; ".join(f"{k}: {v}" for k, v in result["refused"].items())
        )
    if args.json:
        if len(names) == 1:
            common.print_json(result["plans"][0], reads_data=READS_DATA)
        else:
            best = next((p for p in result["plans"] if p["accountant"] == result["tightest"]), {})
            common.print_json(
                {**best, "tightest": result["tightest"], "plans": result["plans"], "refused": result["refused"]},
                reads_data=READS_DATA,
            )
        return 0
    print(
        f"budget: epsilon = {args.epsilon:g}, delta = {args.delta:g}; N = {args.dataset_size}, "
        f"k = {args.epochs:g} epochs (K = {args.epochs * args.dataset_size:g} gradients)"
    )
    print(f"{'accountant':>10}  {'sigma':>9}  {'batch s':>8}  {'rounds T':>8}  {'gamma':>7}  {'epsilon':>9}")
    for p in result["plans"]:
        gamma = f"{p['gamma']:.4f}" if p["gamma"] else "-"
        mark = "  <- tightest (fewest rounds)" if p["accountant"] == result["tightest"] else ""
        if not p["certified"]:
            mark += "  approximation, not certified"
        if not p["valid"]:
            mark += "  INVALID: " + "; ".join(
                c["name"] for c in p["theorem_b4"]["conditions"] if not c["holds"]
            )
        print(
            f"{p['accountant']:>10}  {p['noise_multiplier']:9.4f}  {p['s_max']:8d}  {p['T_min']:8d}  "
            f"{gamma:>7}  {p['epsilon']:9.5f}{mark}"
        )
    for name, why in result["refused"].items():
        print(f"{name:>10}  refused: {why}")
    return 0


def _from_sigma(args: argparse.Namespace) -> int:
    from dptrain.proactive.planner import plan_from_sigma

    if args.epsilon is not None or args.delta is not None:
        raise ConfigError(
            "--from-sigma plans for delta = 1/N from sigma; do not combine it with --epsilon/--delta"
        )
    r = plan_from_sigma(
        args.from_sigma, args.dataset_size, args.epochs, args.theta, args.gamma.replace("-", "_")
    )
    if args.json:
        common.print_json({**r, "accountant": "proactive"}, reads_data=READS_DATA)
        return 0

    def verdict(rep):
        if rep is None:
            return "not applicable (s_max < 1)"
        return (
            "holds"
            if rep["holds"]
            else "does NOT hold: "
            + "; ".join(c["name"] + " " + c["detail"] for c in rep["conditions"] if not c["holds"])
        )

    check = verdict(r["theorem_3_1"]) + "\n  Thm B.4 " + verdict(r["theorem_b4"])
    print(
        f"sigma = {r['noise_multiplier']:g}, N = {r['dataset_size']}, k = {r['k']:g}, delta = 1/N "
        f"= {r['delta']:.4g}  (App. D.4, gamma: {args.gamma})\n"
        f"  eps        = {r['epsilon']:.4f}\n  gamma      = {r['gamma']:.4f}\n"
        f"  T_min      = {r['T_min']:.1f}   s_max      = {r['s_max']}\n"
        f"  T_min_asym = {r['T_min_asym']:.1f}   s_max_asym = {r['s_max_asym']}  (Thm 3.2: no plan below)\n"
        f"  Thm 3.1 {check}"
    )
    return 0
