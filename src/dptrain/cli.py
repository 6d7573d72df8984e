"""The ``dptrain`` command: a thin layer over the Python API.

Every user error (bad config, impossible parameter, corrupt file, unsupported model) is printed as one
line on stderr and exits with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from dptrain.errors import ConfigError, DPTrainError
from dptrain.interrupts import Terminated


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse would print the usage block too)
        raise ConfigError(f"{message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _check(ok: bool, flag: str, accepted: str, value) -> None:
    if not ok:
        raise ConfigError(f"{flag} must be {accepted}, got {value}")


def _add_accountant(p: argparse.ArgumentParser, allow_all: bool = True) -> None:
    from dptrain.accounting import AUTO, accountant_names

    choices = [AUTO, *accountant_names()] + (["all"] if allow_all else [])
    p.add_argument(
        "--accountant",
        default=AUTO,
        choices=choices,
        help="which accountant certifies epsilon (auto: the tightest certified one; all: every one side by side)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dptrain", description="Differentially private training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="run a training job from a TOML config")
    t.add_argument("--config", help="TOML config file (see configs/)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set privacy.target_epsilon=2 (repeatable)",
    )
    t.add_argument(
        "--out",
        default=None,
        help="output directory (default: runs/<config name>, or runs/<config name>-2, -3, ... if that holds a run)",
    )
    t.add_argument("--resume", metavar="DIR", help="continue the interrupted run stored in DIR")
    t.add_argument(
        "--stop-after",
        type=_positive_int,
        metavar="STEPS",
        help="checkpoint and stop after this many steps (continue later with --resume)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    t.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="run exactly a plan from 'dptrain plan --json' (noise, batch size, rounds, delta)",
    )

    a = sub.add_parser(
        "account", help="epsilon spent by DP-SGD (or projected noisy SGD) with given parameters"
    )
    a.add_argument("--noise-multiplier", type=_float)
    a.add_argument("--sampling-rate", type=_float)
    a.add_argument("--steps", type=_positive_int, required=True)
    a.add_argument("--delta", type=_float, required=True)
    a.add_argument("--sampling", default="poisson", choices=["poisson", "full"])
    _add_accountant(a)
    li = a.add_argument_group("last_iterate (projected noisy SGD on a convex loss; Altschuler & Talwar)")
    li.add_argument("--lipschitz", type=_float, metavar="L")
    li.add_argument("--diameter", type=_float, metavar="D")
    li.add_argument("--smoothness", type=_float, metavar="M")
    li.add_argument("--learning-rate", type=_float, metavar="ETA")
    li.add_argument("--dataset-size", type=_positive_int, metavar="n")
    li.add_argument("--batch-size", type=_positive_int, metavar="b")
    li.add_argument(
        "--noise-std", type=_float, metavar="SIGMA", help="std of the Gaussian on the averaged gradient"
    )
    li.add_argument("--strong-convexity", type=_float, default=0.0, metavar="m")
    li.add_argument("--batching", default="random", choices=["random", "cyclic", "full"])
    li.add_argument("--adjacency", default="replace", choices=["replace", "remove"])
    li.add_argument("--lr-power", type=_float, default=0.0, help="eta_t = ETA (t+1)^-p, p in [0, 1)")
    li.add_argument("--rdp-order", type=_float, metavar="A", help="also print the RDP bound at this order")
    a.add_argument("--json", action="store_true")

    c = sub.add_parser("calibrate", help="smallest noise multiplier meeting an (epsilon, delta) budget")
    c.add_argument(
        "--mechanism",
        default="dpsgd",
        choices=["dpsgd", "gaussian"],
        help="dpsgd: T (sub)sampled steps (default); gaussian: ONE Gaussian release of L2 sensitivity 1, analytic "
        "calibration (Balle & Wang 2018), e.g. a private mean",
    )
    c.add_argument("--epsilon", type=_float, required=True)
    c.add_argument("--delta", type=_float, required=True)
    c.add_argument("--sampling-rate", type=_float)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--steps", type=_positive_int)
    g.add_argument("--epochs", type=_float)
    c.add_argument("--sampling", default="poisson", choices=["poisson", "full"])
    _add_accountant(c, allow_all=False)
    c.add_argument("--json", action="store_true")
    pl = sub.add_parser("plan", help="choose noise, batch size and rounds before training (Proactive DP)")
    pl.add_argument("--epsilon", type=_float, help="target epsilon (budget mode)")
    pl.add_argument("--delta", type=_float, help="target delta (budget mode; --from-sigma uses 1/N)")
    pl.add_argument(
        "--from-sigma", type=_float, metavar="S", help="run the App. D.4 calculator for this sigma"
    )
    pl.add_argument("--dataset-size", type=_positive_int, required=True, metavar="N")
    pl.add_argument("--epochs", type=_float, required=True, metavar="K", help="gradient computations K = kN")
    pl.add_argument("--theta", type=_float, default=1.0, help="s_max / s_bar of the batch-size sequence")
    pl.add_argument("--accountant", default="proactive", choices=["proactive", "rdp", "pld", "gdp", "all"])
    pl.add_argument(
        "--gamma",
        default="fixed-point",
        choices=["fixed-point", "paper"],
        help="with --from-sigma: tightest fixed point, or the paper's iteration (Tables 9-11)",
    )
    pl.add_argument("--json", action="store_true")

    from dptrain.auditing.cli import add_parser as add_audit_parser

    add_audit_parser(sub)

    from dptrain.reproduce import REPRODUCTIONS

    r = sub.add_parser("reproduce", help="regenerate a paper's tables and plots into a directory")
    r.add_argument("name", choices=sorted(REPRODUCTIONS))
    r.add_argument("--out", default=None, help="output directory (default runs/reproduce-NAME)")
    r.add_argument("--quick", action="store_true", help="a small version that runs in about a minute")

    u = sub.add_parser(
        "utility-graph",
        help="accuracy of w* + N(0, C^2 sigma^2 I) over a (C, sigma) grid "
        "(seed 002 Sec. 3.3; trains without noise: NOT private)",
    )
    u.add_argument(
        "--config", required=True, help="TOML config: data, model, training (steps/epochs, lr, batch)"
    )
    u.add_argument("--clips", type=_float_list, required=True, metavar="C1,C2,...")
    u.add_argument("--sigmas", type=_float_list, required=True, metavar="S1,S2,...")
    u.add_argument("--draws", type=_positive_int, default=5, help="noise draws per (C, sigma)")
    u.add_argument("--threshold", type=_float, default=0.9, help="accuracy fraction to keep (paper: 0.9)")
    u.add_argument("--out", default=None, help="output directory (default runs/utility-graph)")
    u.add_argument("--json", action="store_true")
    return parser


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers, got {text!r}")
    return values


def _check_common(args) -> None:
    _check(0 < args.sampling_rate <= 1, "--sampling-rate", "in (0, 1]", args.sampling_rate)
    _check(0 < args.delta < 1, "--delta", "in (0, 1)", args.delta)


def cmd_account(args) -> int:
    from dptrain.accounting import (
        accountant_names,
        all_reports,
        check_noise_multiplier,
        dpsgd_ledger,
        epsilon,
        tightest,
    )

    if args.accountant == "last_iterate":
        return _account_last_iterate(args)
    for flag in ("noise_multiplier", "sampling_rate"):
        if getattr(args, flag) is None:
            raise ConfigError(f"--{flag.replace('_', '-')} is required with --accountant {args.accountant}")
    _check_common(args)
    check_noise_multiplier(args.noise_multiplier, "--noise-multiplier")
    ledger = dpsgd_ledger(args.noise_multiplier, args.sampling_rate, args.steps, args.sampling)
    if args.accountant == "all":
        found, refusals = all_reports(ledger, args.delta)
        names, reports = list(accountant_names()), list(found.values())
    else:
        names, reports, refusals = [args.accountant], [epsilon(ledger, args.delta, args.accountant)], {}
    best = tightest({r.accountant: r for r in reports})
    if args.json:
        if len(names) == 1:
            print(json.dumps(reports[0].to_dict()))
        else:
            print(
                json.dumps(
                    {
                        "epsilon": best.epsilon if best else None,
                        "delta": args.delta,
                        "accountant": best.accountant if best else None,
                        "all": [r.to_dict() for r in reports],
                        "refused": refusals,
                    }
                )
            )
        return 0
    for r in reports:
        mark = "" if r.certified else "   approximation, not a proven bound"
        if len(names) > 1 and r is best:
            mark = "   <- tightest certified"
        print(f"{r.accountant:>4}: epsilon = {r.epsilon:.6g} at delta = {r.delta:g}{mark}")
    for name, why in refusals.items():
        print(f"{name:>4}: refused: {why}")
    return 0


def _account_last_iterate(args) -> int:
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
    _check(0 < args.delta < 1, "--delta", "in (0, 1)", args.delta)
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
        _check(args.rdp_order > 1, "--rdp-order", "a number > 1", args.rdp_order)
        at = rdp_bound(st, args.rdp_order)
        out.update(rdp_order=args.rdp_order, rdp=at.rdp, rdp_composition=at.composition)
    if args.json:
        print(json.dumps(out))
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
    return 0


def cmd_calibrate(args) -> int:
    from dptrain.accounting import calibrate, dpsgd_ledger, epsilon, steps_for_epochs

    if args.mechanism == "gaussian":
        return _calibrate_gaussian(args)
    if args.sampling_rate is None or (args.steps is None and args.epochs is None):
        raise ConfigError("calibrate --mechanism dpsgd needs --sampling-rate and one of --steps / --epochs")
    _check_common(args)
    _check(args.epsilon > 0, "--epsilon", "a number > 0", args.epsilon)
    if args.epochs is not None:
        _check(args.epochs > 0, "--epochs", "a number > 0", args.epochs)
        steps = steps_for_epochs(args.epochs, args.sampling_rate)
    else:
        steps = args.steps
    ledger_for = lambda s: dpsgd_ledger(s, args.sampling_rate, steps, args.sampling)  # noqa: E731
    cal = calibrate(args.epsilon, args.delta, ledger_for, args.accountant)
    sigma = cal.noise_multiplier
    spent = epsilon(ledger_for(sigma), args.delta, cal.accountant)
    if args.json:
        print(
            json.dumps(
                {
                    "noise_multiplier": sigma,
                    "epsilon": spent.epsilon,
                    "target_epsilon": args.epsilon,
                    "delta": args.delta,
                    "steps": steps,
                    "sampling_rate": args.sampling_rate,
                    "accountant": cal.accountant,
                    "others": cal.others,
                }
            )
        )
    else:
        print(
            f"noise multiplier = {sigma:.6f}  ({steps} steps at sampling rate {args.sampling_rate:g}: "
            f"epsilon = {spent.epsilon:.6g} <= {args.epsilon:g} at delta = {args.delta:g}, {cal.accountant})"
        )
    return 0


def _calibrate_gaussian(args) -> int:
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
    _check(args.epsilon > 0, "--epsilon", "a number > 0", args.epsilon)
    _check(0 < args.delta < 1, "--delta", "in (0, 1)", args.delta)
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
        print(json.dumps(out))
    else:
        extra = (
            f"; the classical sqrt(2 ln(1.25/delta))/eps gives {classical:.4f}" if args.epsilon < 1 else ""
        )
        print(
            f"noise multiplier = {sigma:.6f}  (one Gaussian release of L2 sensitivity 1 is ({out['epsilon']:.6g}, "
            f"{args.delta:g})-DP, analytic calibration{extra})"
        )
    return 0


def cmd_train(args) -> int:
    from pathlib import Path

    from dptrain.config import load_config
    from dptrain.run import format_report, run_training
    from dptrain.rundir import fresh_directory

    if args.resume:
        if args.config or args.set:
            raise ConfigError(
                "--resume continues a run with its own config; do not combine it with --config/--set"
            )
        out = args.resume
        summary = run_training(
            None, out, resume=True, progress=not args.no_progress, stop_after=args.stop_after
        )
    else:
        if not args.config and not args.set:
            raise ConfigError("give --config FILE.toml (see configs/) or --set KEY=VALUE overrides")
        overrides = list(args.set)
        plan = None
        if args.plan:
            from dptrain.planner import plan_to_overrides

            plan = _read_json(args.plan)
            overrides = [*plan_to_overrides(plan), *overrides]
        # The plan fixes sigma, so a config's target_epsilon is dropped (the plan certifies the budget).
        cfg = load_config(args.config, overrides, unset=("privacy.target_epsilon",) if plan else ())
        out = args.out or fresh_directory(Path("runs") / (Path(args.config).stem if args.config else "run"))
        summary = run_training(cfg, out, progress=not args.no_progress, stop_after=args.stop_after, plan=plan)
    print(json.dumps(summary, indent=2) if args.json else format_report(summary))
    return 0


def cmd_plan(args) -> int:
    from dptrain.planner import PLAN_ACCOUNTANTS, plan_budget, plan_from_sigma

    if args.from_sigma is not None:
        if args.epsilon is not None or args.delta is not None:
            raise ConfigError(
                "--from-sigma plans for delta = 1/N from sigma; do not combine it with --epsilon/--delta"
            )
        r = plan_from_sigma(
            args.from_sigma, args.dataset_size, args.epochs, args.theta, args.gamma.replace("-", "_")
        )
        if args.json:
            print(json.dumps({**r, "accountant": "proactive"}))
        else:

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
            print(json.dumps(result["plans"][0]))
        else:
            best = next((p for p in result["plans"] if p["accountant"] == result["tightest"]), {})
            print(
                json.dumps(
                    {
                        **best,
                        "tightest": result["tightest"],
                        "plans": result["plans"],
                        "refused": result["refused"],
                    }
                )
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


def cmd_reproduce(args) -> int:
    from dptrain.reproduce import run_reproduction

    out = args.out or f"runs/reproduce-{args.name}"
    report = run_reproduction(args.name, out, quick=args.quick)
    print(f"wrote {report} (tables, JSON and plots in {out})")
    return 0


def cmd_utility_graph(args) -> int:
    from pathlib import Path

    from dptrain.accounting import steps_for_epochs
    from dptrain.config import load_config
    from dptrain.data import load_dataset
    from dptrain.models import build_model
    from dptrain.utility_graph import accuracy_evaluator, noise_free_trainer, utility_graph

    _check(0 < args.threshold <= 1, "--threshold", "in (0, 1]", args.threshold)
    # The graph trains without noise; the privacy section is not used (any valid sigma satisfies the validator).
    cfg = load_config(args.config, ["privacy.noise_multiplier=1.0"], unset=("privacy.target_epsilon",))
    data = load_dataset(cfg.data.name, cfg.data.path, seed=cfg.data.seed, **cfg.data.options)
    t = cfg.training
    steps = t.steps if t.steps is not None else steps_for_epochs(t.epochs, t.batch_size / len(data.train))
    train = noise_free_trainer(
        lambda: build_model(
            cfg.model.name, data.train.input_shape, data.train.num_classes, **cfg.model.options
        ),
        data,
        steps,
        t.batch_size,
        t.learning_rate,
        cfg.data.seed,
    )
    graph = utility_graph(
        train, accuracy_evaluator(data.test.x, data.test.y), args.clips, args.sigmas, args.draws, cfg.data.seed
    )
    out = Path(args.out or "runs/utility-graph")
    out.mkdir(parents=True, exist_ok=True)
    png = graph.plot(out / "utility_graph.png", args.threshold)
    choice = {c: graph.largest_sigma(c, args.threshold) for c in graph.clips}
    (out / "utility_graph.json").write_text(
        json.dumps({**graph.to_dict(), "largest_sigma": choice}, indent=2)
    )
    if args.json:
        print(json.dumps({**graph.to_dict(), "largest_sigma": choice}))
    else:
        print(graph.table(args.threshold))
        print(f"plot: {png}  (w* trained on the data without noise: this exploration is NOT private)")
    return 0


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"plan file {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"plan file {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan file {path} must hold one JSON object (dptrain plan --json)")
    return data


def cmd_audit(args) -> int:
    from dptrain.auditing.cli import cmd_audit as audit

    return audit(args)


COMMANDS = {
    "train": cmd_train,
    "audit": cmd_audit,
    "account": cmd_account,
    "calibrate": cmd_calibrate,
    "plan": cmd_plan,
    "reproduce": cmd_reproduce,
    "utility-graph": cmd_utility_graph,
}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except DPTrainError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return Terminated.exit_code


if __name__ == "__main__":
    sys.exit(main())
