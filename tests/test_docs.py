"""The README and the docs: the README stays a page a newcomer reads in minutes, and every relative link of the README
and of docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def broken(page: Path) -> list[str]:
    return [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert text.index("make run") < text.index("make test") < text.index("## Your own PyTorch model")


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = {str(p.relative_to(ROOT)): broken(p) for p in pages if broken(p)}
    assert not bad


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("x")
    page.write_text("[a](there.md) [b](missing.md#x) [c](https://example.org) [d](#anchor)")
    assert broken(page) == ["missing.md#x"]
