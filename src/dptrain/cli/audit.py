"""``dptrain audit``: a one-run empirical privacy audit of a configuration (:func:`dptrain.auditing.runner.audit_run`).

Prints the epsilon lower bound (with its confidence) beside the certified epsilon of the same run, and exits with
1 when the lower bound exceeds the certificate (the engine or its accounting is broken), 0 otherwise. Errors in
the input are one-line :class:`~dptrain.errors.ConfigError` (exit code 2 through :func:`dptrain.cli.main`).
"""

from __future__ import annotations

import argparse
import json

from dptrain.auditing import KINDS
from dptrain.cli import common

NAME = "audit"
HELP = "empirical privacy audit: an epsilon lower bound from canaries in one training run"
DESCRIPTION = (
    "Insert canaries (each included with probability 1/2), train once exactly as 'dptrain train' would, and "
    "turn the canaries' scores into an epsilon lower bound (Steinke, Nasr & Jagielski, 'Privacy Auditing "
    "with One (1) Training Run'), printed beside the run's certified epsilon. Writes nothing."
)

#: Exit code when the lower bound exceeds the certificate.
AUDIT_FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_config(parser)
    parser.add_argument(
        "--canaries", type=int, default=1000, metavar="M", help="number of canaries m >= 2 (default 1000)"
    )
    parser.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        help="confidence of the lower bound, in (0, 1) (default 0.95)",
    )
    parser.add_argument(
        "--kind",
        default="gradient",
        metavar="|".join(KINDS),
        help="gradient: white-box Dirac gradient canaries (default); input: random examples with random labels",
    )
    common.add_json(parser, help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the audit of ``args.config`` (+ ``args.set``) and print it; 1 if the lower bound exceeds the certificate."""
    # torch is imported here, not at the top: building the parser must stay light.
    from dptrain.auditing.runner import audit_run
    from dptrain.config import load_config

    common.require_config(args)
    cfg = load_config(args.config, list(args.set))
    result = audit_run(cfg, canaries=args.canaries, confidence=args.confidence, kind=args.kind)
    print(json.dumps(result, indent=2) if args.json else format_audit(result))
    return AUDIT_FAILED if result["epsilon_lower_bound"] > result["epsilon_certified"] else 0


def format_audit(result: dict) -> str:
    """A short table and one line saying whether the lower bound stays below the certificate."""
    released = "every iterate released" if result["setting"] == "dpsgd" else "last iterate only"
    rows = [
        ("setting", f"{result['setting']} ({released}), {result['kind']} canaries"),
        ("canaries", f"{result['canaries']} (each included with probability 1/2)"),
        ("guesses", f"{result['correct']} of {result['guesses']} correct"),
        (
            "epsilon lower bound",
            f"{result['epsilon_lower_bound']:.4f} ({_percent(result['confidence'])} confidence, delta = {result['delta']:g})",
        ),
        (
            "epsilon certified",
            f"{result['epsilon_certified']:.4f} ({result['accountant']}, delta = {result['delta']:g})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    return f"{table}\n{verdict(result)}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def verdict(result: dict) -> str:
    low, cert = result["epsilon_lower_bound"], result["epsilon_certified"]
    if low > cert:
        return (
            f"FAILED: the lower bound {low:.4f} exceeds the certified epsilon {cert:.4f}: the engine or its accounting "
            f"is broken (or this was the {_percent(1 - result['confidence'])} chance of a false alarm)"
        )
    return (
        f"passed: the lower bound {low:.4f} stays below the certified epsilon {cert:.4f} (an audit can refute a "
        "certificate, never prove it; a one-run audit is loose)"
    )
