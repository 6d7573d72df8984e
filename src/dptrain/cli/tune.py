"""``dptrain tune``: a private random search over a config's ``[tune.space]``, certified as a whole
(:mod:`dptrain.tuning.search`; docs/tuning.md)."""

from __future__ import annotations

import argparse

from dptrain.cli import common
from dptrain.errors import ConfigError
from dptrain.runs.report import attacker_text

NAME = "tune"
HELP = "private hyperparameter search: the whole search certified (Papernot & Steinke 2022)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_config(parser)
    parser.add_argument("--out", default=None, help="search directory (default: runs/<config name>-tune, -2, ...)")
    parser.add_argument("--resume", metavar="DIR", help="continue the interrupted search stored in DIR")
    parser.add_argument("--trials-mean", type=common.finite_float, metavar="K", help="mean number of trials (tune.trials_mean)")
    parser.add_argument(
        "--distribution",
        metavar="geometric|logarithmic|poisson|tnb:SHAPE",
        help="the law of the secret number of trials (tune.distribution; default geometric)",
    )
    parser.add_argument("--keep-trials", action="store_true",
                        help="keep every trial's directory in private/ and list them (and how many ran) in the output, "
                        "labelled not private: secret, revealing them voids the certificate")
    parser.add_argument("--no-progress", action="store_true",
                        help="no clock on stderr (a search shows its elapsed time only, never a count of trials)")
    common.add_json(parser, help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dptrain.config import load_config
    from dptrain.runs.cpu_memory import keep_freed_memory
    from dptrain.runs.rundir import fresh_directory
    from dptrain.tuning.search import run_search

    keep_freed_memory()
    if args.resume:
        if args.config or args.set or args.trials_mean is not None or args.distribution or args.out:
            raise ConfigError("--resume continues a search with its own config; do not combine it with other options")
        summary = run_search(None, args.resume, resume=True, progress=not args.no_progress,
                             keep_trials=args.keep_trials)
    else:
        common.require_config(args)
        overrides = list(args.set)
        if args.trials_mean is not None:
            overrides.append(f"tune.trials_mean={args.trials_mean!r}")
        if args.distribution:
            overrides.append(f'tune.distribution="{args.distribution}"')
        cfg = load_config(args.config, overrides)
        out = args.out or fresh_directory(Path("runs") / f"{Path(args.config).stem}-tune")
        summary = run_search(cfg, out, progress=not args.no_progress, keep_trials=args.keep_trials)
    if args.json:
        common.print_json(summary, indent=2)
    else:
        print(format_search(summary))
    return 0


def format_search(s: dict) -> str:
    best = "none (no trial completed)" if s["best"] is None else ", ".join(f"{k} = {v:.4g}" if isinstance(v, float)
                                                                         else f"{k} = {v}" for k, v in s["best"].items())
    cert = "" if s["certified"] else "  (NOT certified: " + ("not private)" if not s["private"] else "approx.)")
    rows = [
        ("search", f"epsilon = {s['epsilon']:.4f} at delta = {s['delta']:g} ({s['accountant']}){cert}"),
        *([("attacker", attacker_text(s["membership_inference"]))] if "membership_inference" in s else []),
        *([("NOT private", "; ".join(s["not_private_because"]))] if not s["private"] else []),
        ("one trial alone", f"epsilon = {s['epsilon_single_run']:.4f} ({s['single_run_accountant']})"),
        ("trials", f"{s['tuning_distribution']}, mean {s['tuning_mean']:g} (how many ran is secret)"),
        ("best", best),
        ("best score", "-" if s["best_score"] is None else f"{s['best_score']:.4f} ({s['score']})"),
        ("noise multiplier", "-" if s["best_noise_multiplier"] is None else f"{s['best_noise_multiplier']:.4f}"),
        ("selected run", s["out"] or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
