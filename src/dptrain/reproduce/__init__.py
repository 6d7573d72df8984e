"""Reproductions of the implemented papers' results: ``run_reproduction(name, out_dir)`` writes a markdown report
(plus JSON and plots) into ``out_dir`` and returns the report's path. The CLI calls it as
``dptrain reproduce NAME --out DIR``.

Each reproduction module computes plain JSON-able data, turns it into a :class:`dptrain.reproduce.report.Report`
with its ``render`` function (from the data alone, so the JSON it writes renders the same report again) and writes
it with :meth:`~dptrain.reproduce.report.Report.write`, the one writer of markdown, JSON and plots."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from pathlib import Path
from typing import Any

import numpy as np

from dptrain.errors import ConfigError

__all__ = ["REPRODUCTIONS", "fashion_mnist", "json_default", "md_table", "run_reproduction", "single_thread"]

#: name -> module with ``run(out_dir, quick=False) -> Path`` (or ``"module:function"`` naming another function).
REPRODUCTIONS: dict[str, str] = {
    "proactive": "dptrain.reproduce.proactive",
    "last-iterate": "dptrain.reproduce.last_iterate",
    "dpsgd-f-counterexample": "dptrain.reproduce.dpsgd_f_counterexample",
    "dpsgd-f": "dptrain.reproduce.dpsgd_f",
    "audit": "dptrain.reproduce.audit",
    "modelmix-accounting": "dptrain.reproduce.modelmix:run_accounting",
    "modelmix": "dptrain.reproduce.modelmix",
    "modelmix-decided": "dptrain.reproduce.modelmix_decided",
    "bandmf": "dptrain.reproduce.bandmf_decided",
    "schedules": "dptrain.reproduce.schedules",
    "tuning": "dptrain.reproduce.tuning",
    "recipes": "dptrain.reproduce.recipes",
}


def run_reproduction(name: str, out_dir: str | Path, quick: bool = False, **options: Any) -> Path:
    """Run the reproduction ``name`` into ``out_dir``; returns the path of the markdown report it wrote.
    ``quick`` runs a reduced version (seconds, for tests). ``options`` (e.g. ``seeds``, ``epsilons``) go to the
    reproductions that take them; a ConfigError names the reproduction that does not."""
    if name not in REPRODUCTIONS:
        raise ConfigError(f"unknown reproduction {name!r}; accepted: {', '.join(sorted(REPRODUCTIONS))}")
    module, _, function = REPRODUCTIONS[name].partition(":")
    fn = getattr(importlib.import_module(module), function or "run")
    accepted = set(inspect.signature(fn).parameters) - {"out_dir", "quick"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        flags = ", ".join("--" + k for k in unknown)
        raise ConfigError(
            f"reproduction {name!r} takes no {flags}"
            + (f" (it takes {', '.join('--' + k for k in sorted(accepted))})" if accepted else "")
        )
    return Path(fn(out_dir, quick=quick, **options))


def md_table(head: list[str], rows: list[list[Any]]) -> str:
    """A markdown table (the reports' one table format)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` for numpy scalars and arrays in the reports' JSON."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


@contextlib.contextmanager
def single_thread():
    """Run torch on one intra-op thread and restore the setting after. For the reproductions' tiny models
    (hundreds to thousands of parameters) extra threads only add synchronisation cost (measured: 0.4 ms/step on
    one thread vs several ms with two on a loaded 2-core machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def fashion_mnist():
    """Fashion-MNIST as ``load_dataset("fashion-mnist")`` returns it, read once per process: the reproductions only
    index it (selecting examples copies them), never change it."""
    from dptrain.data.loaders import load_dataset

    return load_dataset("fashion-mnist")
