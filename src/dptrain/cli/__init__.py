"""The ``dptrain`` command: a thin layer over the Python API.

One module per command (:data:`COMMANDS`), each with the same small interface:

- ``NAME``: the command's name; ``HELP``: its one line in ``dptrain --help``; optionally ``DESCRIPTION``;
- ``add_arguments(parser)``: its flags (those several commands share come from :mod:`dptrain.cli.common`);
- ``run(args) -> int``: the command itself, returning the exit code;
- optionally ``READS_DATA = False``: a calculator, computing from the numbers given only (no data, no secret draw).

Building the parser imports no torch, dp_accounting or scipy: a command that needs them imports them inside ``run``.

Every user error (bad config, impossible parameter, corrupt file, unsupported model) is printed as one
line on stderr and exits with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from dptrain.cli import account, audit, calibrate, plan, reproduce, schedule, train, tune, utility_graph
from dptrain.engine.interrupts import Terminated
from dptrain.errors import ConfigError, DPTrainError

#: The commands, in the order ``dptrain --help`` lists them.
COMMANDS: tuple[ModuleType, ...] = (
    train,
    tune,
    account,
    calibrate,
    schedule,
    plan,
    audit,
    reproduce,
    utility_graph,
)


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line :class:`ConfigError` (exit code 2 through :func:`main`);
    argparse would print the usage block too."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see '{self.prog} --help')")


def add_command(subparsers, command: ModuleType) -> argparse.ArgumentParser:
    """Add ``command`` (a module of :data:`COMMANDS`) to ``subparsers`` (an ``add_subparsers()`` result)."""
    parser = subparsers.add_parser(
        command.NAME, help=command.HELP, description=getattr(command, "DESCRIPTION", None)
    )
    command.add_arguments(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="dptrain", description="Differentially private training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    for command in COMMANDS:
        add_command(sub, command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``dptrain ARGV``: 0 on success, 2 on a user error (one line on stderr), 130 on Ctrl-C, 143 on SIGTERM,
    141 when stdout's reader closed the pipe, 1 when an audit's lower bound exceeds the certificate."""
    try:
        args = build_parser().parse_args(argv)
        command = {c.NAME: c for c in COMMANDS}[args.command]
        _one_process_unless_train(command)
        return command.run(args)
    except DPTrainError as e:
        print(f"dptrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return Terminated.exit_code
    except (MemoryError, RuntimeError) as e:  # (torch's allocators raise RuntimeError subclasses)
        if not _out_of_memory(e):
            raise
        print(f"dptrain: error: {OUT_OF_MEMORY}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`dptrain ... | head`): stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would hit the closed pipe again
        return 141  # 128 + SIGPIPE, the shell's code for a command stopped by a closed pipe


def _one_process_unless_train(command: ModuleType) -> None:
    """Only ``dptrain train`` runs data parallel, and a calculator (``READS_DATA = False``) may run on every rank; any
    other command is refused under torchrun (:func:`dptrain.engine.distributed.one_process`: torch is imported only
    there)."""
    if (command.NAME != "train" and getattr(command, "READS_DATA", True)
            and (os.environ.get("WORLD_SIZE", "1").strip() or "1") != "1"):
        from dptrain.engine.distributed import one_process

        one_process(f"dptrain {command.NAME}")


#: The one line for a command that asked for more memory than the machine has (a model, a chunk, a step).
OUT_OF_MEMORY = (
    "out of memory: the model, or a chunk of examples, needs more than this machine has; use a smaller model, or lower "
    "training.max_physical_batch_size (with training.augment, a chunk holds all K = multiplicity views of an example: "
    "lower K too)"
)


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: Python's MemoryError, torch's OutOfMemoryError (CUDA) or its CPU
    allocator's RuntimeError (told by its message: torch is not imported here for a type)."""
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in str(e) or "out of memory" in str(e).lower())


def entry() -> None:
    """The process's entry (the ``dptrain`` command, ``python -m dptrain``, also under torchrun): exits with
    :func:`main`'s status. A data-parallel rank that stops with an error (a peer lost, an interrupt) leaves at once,
    its output flushed (``os._exit``): the interpreter's exit would run the destructors of a process group whose peer
    is gone, and gloo's threads then abort the process now and then (SIGABRT instead of the status, after the one-line
    message)."""
    code = main()
    if code and _in_process_group():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # (never imports torch: a command that did not has no group)
    return dist is not None and dist.is_available() and dist.is_initialized()


__all__ = ["COMMANDS", "OneLineErrorParser", "add_command", "build_parser", "entry", "main"]
