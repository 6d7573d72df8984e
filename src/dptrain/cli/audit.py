"""``dptrain audit``: a one-run empirical privacy audit of a configuration (:func:`dptrain.auditing.runner.audit_run`).

Prints the epsilon lower bound (with its confidence) beside the certified epsilon of the same run and the audit's
ceiling (the largest lower bound it could report), and its verdict: ``violation`` (exit code 1: the lower bound
exceeds the certificate, the engine or its accounting is broken), ``no_violation_found`` or ``inconclusive`` (the
ceiling does not exceed the certificate: this audit could not have refuted it), both exit code 0. ``--inject-bug``
trains with a deliberately broken stage (:mod:`dptrain.auditing.bugs`) to check the audit's own power. Errors in
the input are one-line :class:`~dptrain.errors.ConfigError` (exit code 2 through :func:`dptrain.cli.main`).
"""

from __future__ import annotations

import argparse

from dptrain.auditing import BUGS, KINDS
from dptrain.cli import common

NAME = "audit"
HELP = "empirical privacy audit: an epsilon lower bound from canaries in one training run"
DESCRIPTION = (
    "Insert canaries (each included with probability 1/2), train once exactly as 'dptrain train' would, and "
    "turn the canaries' scores into an epsilon lower bound (Steinke, Nasr & Jagielski, 'Privacy Auditing "
    "with One (1) Training Run'), printed beside the run's certified epsilon and the audit's ceiling. Exit code 1 "
    "only for a violation (lower bound above the certificate). Writes nothing."
)

#: Exit code of a violation (the lower bound exceeds the certificate).
AUDIT_FAILED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_config(parser)
    parser.add_argument(
        "--canaries",
        type=common.positive_int,
        default=None,
        metavar="M",
        help="number of canaries m >= 2 (default 1000; scored on the last iterate: at most the trainable parameters)",
    )
    parser.add_argument(
        "--confidence",
        type=common.finite_float,
        default=0.95,
        help="confidence of the lower bound, in (0, 1) (default 0.95)",
    )
    parser.add_argument(
        "--kind",
        default="gradient",
        metavar="|".join(KINDS),
        help="gradient: white-box gradient canaries (default; on auxiliary coordinates, scored on every released "
        "update, where every iterate is released); input: random examples with random labels",
    )
    parser.add_argument(
        "--inject-bug",
        default=None,
        metavar="|".join(BUGS),
        help="train with a deliberately broken stage while the ledger records the correct run (a check of the "
        "audit's power; never used by 'dptrain train')",
    )
    common.add_json(parser, help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the audit of ``args.config`` (+ ``args.set``) and print it; 1 for a violation, else 0."""
    # torch is imported here, not at the top: building the parser must stay light.
    import sys

    from dptrain.auditing.runner import audit_run
    from dptrain.config import load_config

    common.require_config(args)
    cfg = load_config(args.config, list(args.set))
    result = audit_run(
        cfg, canaries=args.canaries, confidence=args.confidence, kind=args.kind, inject_bug=args.inject_bug
    )
    for reason in result.get("not_private_because", []):  # (as every command says it: seeded, buffers released)
        print(f"dptrain: warning: not private: {reason}", file=sys.stderr)
    if args.json:
        common.print_json(result, indent=2)
    else:
        print(format_audit(result))
    return AUDIT_FAILED if result["verdict"] == "violation" else 0


def format_audit(result: dict) -> str:
    """A short table and one line with the verdict."""
    released = "every iterate released" if result["setting"] == "dpsgd" else "last iterate only"
    bug = result.get("injected_bug")
    rows = [
        ("setting", f"{result['setting']} ({released}), {result['kind']} canaries, score {result['score']}"),
        ("canaries", f"{result['canaries']} (each included with probability 1/2)"),
        ("guesses", f"{result['correct']} of {result['guesses']} correct"),
        (
            "epsilon lower bound",
            f"{result['epsilon_lower_bound']:.4f} ({_percent(result['confidence'])} confidence, delta = {result['delta']:g})",
        ),
        ("audit ceiling", f"{result['ceiling']:.4f} (the lower bound if every guess were right)"),
        (
            "epsilon certified",
            f"{result['epsilon_certified']:.4f} ({result['accountant']}, delta = {result['delta']:g})",
        ),
    ]
    if not result.get("private", True):
        rows.append(("NOT private", "; ".join(result["not_private_because"])))
    if bug is not None:
        rows.append(("injected bug", f"{bug} (the ledger records the correct run)"))
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    return f"{table}\n{verdict(result)}"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.3g}%"


def verdict(result: dict) -> str:
    low, cert, top = result["epsilon_lower_bound"], result["epsilon_certified"], result["ceiling"]
    if result["verdict"] == "violation":
        return (
            f"FAILED: the lower bound {low:.4f} exceeds the certified epsilon {cert:.4f} (verdict: violation): the "
            "engine or its accounting is broken (or this was the "
            f"{_percent(1 - result['confidence'])} chance of a false alarm)"
        )
    if result["verdict"] == "inconclusive":
        return (
            f"inconclusive: this audit cannot report more than {top:.4f}, which does not exceed the certified epsilon "
            f"{cert:.4f}: it could not have found a violation (lower bound {low:.4f}); audit a smaller certificate "
            "or use more canaries"
        )
    return (
        f"no violation found: the lower bound {low:.4f} stays below the certified epsilon {cert:.4f} (this audit "
        f"could have reported up to {top:.4f}; an audit can refute a certificate, never prove it)"
    )
