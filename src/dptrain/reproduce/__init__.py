"""Reproductions of the seed papers' results: ``run_reproduction(name, out_dir)`` writes a markdown report (plus
JSON and plots) into ``out_dir`` and returns the report's path. The CLI calls it as
``dptrain reproduce NAME --out DIR``."""

from __future__ import annotations

import importlib
from pathlib import Path

from dptrain.errors import ConfigError

__all__ = ["REPRODUCTIONS", "run_reproduction"]

#: name -> module with ``run(out_dir, quick=False) -> Path``.
REPRODUCTIONS: dict[str, str] = {
    "proactive": "dptrain.reproduce.proactive",
    "last-iterate": "dptrain.reproduce.last_iterate",
}


def run_reproduction(name: str, out_dir: str | Path, quick: bool = False) -> Path:
    """Run the reproduction ``name`` into ``out_dir``; returns the path of the markdown report it wrote.
    ``quick`` runs a reduced version (seconds, for tests)."""
    if name not in REPRODUCTIONS:
        raise ConfigError(f"unknown reproduction {name!r}; accepted: {', '.join(sorted(REPRODUCTIONS))}")
    module = importlib.import_module(REPRODUCTIONS[name])
    return Path(module.run(out_dir, quick=quick))
