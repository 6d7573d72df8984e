"""Lazy package exports: a package whose names live in a torch-heavy submodule can still hold a light submodule
(its config section) that the edges import without torch."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, module: str):
    """``(__getattr__, __dir__)`` for ``package``: any name not yet defined is read from ``package.module``,
    imported on first use."""

    def _module():
        return importlib.import_module(f"{package}.{module}")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(_module(), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__():
        return sorted(set(dir(_module())))

    return __getattr__, __dir__
