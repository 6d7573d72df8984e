"""``dptrain train``: run a training job from a TOML config (or continue an interrupted one), optionally exactly
as a plan from ``dptrain plan --json`` says."""

from __future__ import annotations

import argparse
import json
import os

from dptrain.cli import common
from dptrain.cli.common import positive_int
from dptrain.errors import ConfigError

NAME = "train"
HELP = "run a training job from a TOML config"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_config(parser)
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: runs/<config name>, or runs/<config name>-2, -3, ... if that holds a run)",
    )
    parser.add_argument("--resume", metavar="DIR", help="continue the interrupted run stored in DIR")
    parser.add_argument(
        "--stop-after",
        type=positive_int,
        metavar="STEPS",
        help="checkpoint and stop after this many steps (continue later with --resume)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    common.add_json(parser, help="print the summary as JSON instead of a table")
    parser.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="run exactly a plan from 'dptrain plan --json' (noise, batch size, rounds, delta)",
    )


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: building the parser must stay light.
    from pathlib import Path

    from dptrain.config import load_config
    from dptrain.runs.cpu_memory import keep_freed_memory
    from dptrain.runs.report import format_report
    from dptrain.runs.run import run_training
    from dptrain.runs.rundir import fresh_directory

    keep_freed_memory()  # this process is ours: keep freed memory for the next step (dptrain.runs.cpu_memory)
    if args.resume:
        if args.config or args.set or args.plan or args.out:
            raise ConfigError(
                "--resume continues a run with its own config, plan and directory; do not combine it with "
                "--config/--set/--plan/--out"
            )
        summary = run_training(
            None, args.resume, resume=True, progress=not args.no_progress, stop_after=args.stop_after
        )
    else:
        common.require_config(args)
        overrides = list(args.set)
        plan = None
        if args.plan:
            from dptrain.proactive.planner import plan_to_overrides

            plan = read_plan(args.plan)
            overrides = [*plan_to_overrides(plan), *overrides]
        # The plan fixes sigma, so a config's target_epsilon is dropped (the plan certifies the budget).
        cfg = load_config(args.config, overrides, unset=("privacy.target_epsilon",) if plan else ())
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and not args.out:
            raise ConfigError("a data-parallel run (torchrun) needs --out DIR: every rank must write to the same place")
        out = args.out or fresh_directory(Path("runs") / (Path(args.config).stem if args.config else "run"))
        summary = run_training(cfg, out, progress=not args.no_progress, stop_after=args.stop_after, plan=plan)
    from dptrain.engine import distributed
    group = distributed.current()
    if group is None or group.main:  # one report per run
        if args.json:
            common.print_json(summary, indent=2)
        else:
            print(format_report(summary))
    if group is not None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


def read_plan(path: str) -> dict:
    """The JSON object ``dptrain plan --json`` wrote to ``path``; a one-line ConfigError if it is not one."""
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
