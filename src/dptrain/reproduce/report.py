"""The one writer of the reproductions' outputs: a :class:`Report` (title, sections of markdown blocks, JSON files,
plots) built from a reproduction's data and written into its output directory.

A reproduction computes plain JSON-able data (dicts, lists, numbers, strings), builds a :class:`Report` from that
data alone (its ``render`` function) and calls :meth:`Report.write`. Rendering the data read back from the JSON file
gives the same markdown, so a report can be re-rendered without re-running the experiment."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dptrain.reproduce import json_default

__all__ = ["Plot", "Report", "Section", "figure", "to_json", "write_json"]


@dataclass(frozen=True)
class Section:
    """``## heading`` (omitted when None) followed by its blocks (paragraphs, tables, lists), separated by blank
    lines; empty blocks are dropped."""

    heading: str | None
    blocks: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Plot:
    """One PNG of a report: ``write(path)`` draws it from the report's data (see :func:`figure`)."""

    file: str
    write: Callable[[Path], object]


def figure(file: str, draw: Callable[[Any, Any], object], *, dpi: int = 100, **subplots: Any) -> Plot:
    """A :class:`Plot` drawn by ``draw(fig, axes)`` on ``matplotlib.pyplot.subplots(**subplots)`` (Agg backend) and
    saved at ``dpi``; the figure is closed whatever happens."""

    def write(path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(**subplots)
        try:
            draw(fig, axes)
            fig.savefig(path, dpi=dpi)
        finally:
            plt.close(fig)

    return Plot(file, write)


def to_json(data: Any) -> str:
    """The reports' JSON text (numpy scalars and arrays as numbers and lists, see ``json_default``)."""
    return json.dumps(data, indent=1, default=json_default) + "\n"


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.write_text(to_json(data))
    return path


@dataclass(frozen=True)
class Report:
    """A reproduction's outputs: the markdown file ``file`` (``# title``, the ``intro`` blocks, then the
    sections), the JSON files ``data`` (file name -> JSON-able data) and the ``plots``."""

    file: str
    title: str
    intro: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    plots: list[Plot] = field(default_factory=list)

    def markdown(self) -> str:
        blocks = [f"# {self.title}", *self.intro]
        for s in self.sections:
            if s.heading is not None:
                blocks.append(f"## {s.heading}")
            blocks += s.blocks
        return "\n\n".join(b for b in blocks if b) + "\n"

    def write(self, out_dir: str | Path) -> Path:
        """Write the JSON files, the plots and the markdown into ``out_dir`` (created if needed); returns the
        markdown's path."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in self.data.items():
            write_json(out / name, data)
        for plot in self.plots:
            plot.write(out / plot.file)
        path = out / self.file
        path.write_text(self.markdown())
        return path
