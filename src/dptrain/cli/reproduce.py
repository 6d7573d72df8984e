"""``dptrain reproduce NAME``: regenerate a paper's tables and plots (markdown, JSON, PNG) into a directory."""

from __future__ import annotations

import argparse

from dptrain.cli import common

# numpy only: run_reproduction imports the reproduction (and torch) when it runs
from dptrain.reproduce import REPRODUCTIONS, run_reproduction

NAME = "reproduce"
HELP = "regenerate a paper's tables and plots into a directory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(REPRODUCTIONS))
    parser.add_argument("--out", default=None, help="output directory (default runs/reproduce-NAME)")
    parser.add_argument("--quick", action="store_true", help="a small version that runs in about a minute")
    parser.add_argument(
        "--seeds", type=common.positive_int, default=None, metavar="N", help="training reproductions: seeds 0..N-1 (modelmix, modelmix-decided, bandmf: 3)"
    )
    parser.add_argument(
        "--power",
        action="store_true",
        help="audit: measure the audit's power instead (how often dptrain audit flags an injected bug, audit_power.md)",
    )
    parser.add_argument(
        "--epsilons",
        default=None,
        metavar="E1,E2,...",
        help="training reproductions: the target epsilons (modelmix: 0.2,0.6,1.0; modelmix-decided, bandmf: 1,3,8)",
    )
    parser.add_argument(
        "--models",
        default=None,
        metavar="M1,M2",
        help="modelmix-decided, bandmf: the models to run (default scatternet_cnn,cnn28)",
    )


def run(args: argparse.Namespace) -> int:
    from dptrain.runs.cpu_memory import keep_freed_memory

    keep_freed_memory()  # this process is ours: keep freed memory for the next step (dptrain.runs.cpu_memory)
    out = args.out or f"runs/reproduce-{args.name}"
    options = {}
    if args.seeds is not None:
        options["seeds"] = args.seeds
    if args.epsilons is not None:
        options["epsilons"] = args.epsilons
    if args.power:
        options["power"] = True
    if args.models is not None:
        options["models"] = args.models
    report = run_reproduction(args.name, out, quick=args.quick, **options)
    print(f"wrote {report} (tables, JSON and plots in {out})")
    return 0
