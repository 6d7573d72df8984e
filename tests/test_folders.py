"""The folder rule: which folder of src/dptrain may import which (docs/architecture.md, "Folders").

The layers are read from the table in docs/architecture.md, so the page and the code cannot disagree: a module may
import modules of its own folder and of lower layers only; two folders of the same layer never import each other
(the papers' packages are independent of one another). Every folder and top-level module must have a layer.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import import_graph

DOC = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def read_layers(text: str) -> dict[str, int]:
    """folder or top-level module -> layer, from the rows ``| L | `a`, `b` | ... |`` between the layer markers."""
    block = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    layers = {}
    for row in block.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+)`", cells[1]):
                layers[name.removesuffix(".py").removesuffix("/")] = int(cells[0])
    return layers


def unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: dptrain.engine.trainer -> engine; dptrain -> dptrain."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        a = unit(module)
        for target in sorted(targets):
            b = unit(target)
            if a != b and not layers[b] < layers[a]:
                out.append(f"{module} -> {target} ({a}: layer {layers[a]}, {b}: layer {layers[b]})")
    return out


def test_every_folder_and_top_level_module_has_a_layer():
    layers = read_layers(DOC.read_text())
    units = {unit(m) for m in import_graph()}
    assert units - set(layers) == set(), "give these a layer in docs/architecture.md"
    assert set(layers) - units == set(), "docs/architecture.md names folders that do not exist"


def test_no_folder_imports_one_of_its_own_layer_or_above():
    bad = violations(import_graph(), read_layers(DOC.read_text()))
    assert not bad, "imports against the folder rule:\n" + "\n".join(bad)


def test_the_rule_fails_on_a_forbidden_import():
    graph = import_graph()
    layers = read_layers(DOC.read_text())
    assert violations(graph, layers) == []
    upward = {**graph, "dptrain.stages.noise": graph["dptrain.stages.noise"] | {"dptrain.engine.trainer"}}
    assert violations(upward, layers) == [
        "dptrain.stages.noise -> dptrain.engine.trainer (stages: layer 3, engine: layer 7)"
    ]
    sideways = {**graph, "dptrain.modelmix.update": graph["dptrain.modelmix.update"] | {"dptrain.tuning.search"}}
    assert len(violations(sideways, layers)) == 1
    into_accounting = {**graph, "dptrain.accounting.ledger": {"dptrain.randomness.generators"}}
    assert len(violations(into_accounting, layers)) == 1


def drawn_tree(text: str) -> dict[str, set[str]]:
    """The ``src/dptrain/`` drawing of docs/architecture.md, "Folders": each folder (``name/``) or top-level module
    (``name.py``) it lists at the left, before a gap of 3 or more spaces -> the ``file.py`` names its lines mention (a
    folder's continuation lines, indented further, included)."""
    block = text.split("```\nsrc/dptrain/\n")[1].split("```")[0]
    tree: dict[str, set[str]] = {}
    current: list[str] = []
    for line in block.splitlines():
        heads = re.split(r"\s{3,}", line[2:])[0].split() if not line.startswith("   ") else []  # then 3+ spaces
        if heads:
            current = heads
            tree.update({name: set() for name in heads})
        for name in current:
            if name.endswith("/"):
                tree[name] |= set(re.findall(r"\b\w+\.py\b", line)) - set(heads)
    return tree


def tree_mismatches(tree: dict[str, set[str]], package: Path) -> list[str]:
    listed = {p.name + ("/" if p.is_dir() else "") for p in package.iterdir()
              if (p / "__init__.py").exists() or p.suffix == ".py"}
    out = [f"not drawn: {n}" for n in sorted(listed - set(tree))] + [f"no such: {n}" for n in sorted(set(tree) - listed)]
    return out + [f"no such: {d}{f}" for d, files in sorted(tree.items()) for f in sorted(files) if not (package / d / f).exists()]


def test_the_drawing_lists_every_folder_and_top_level_module_and_its_files_exist(tmp_path):
    package = DOC.parent.parent / "src" / "dptrain"
    assert tree_mismatches(drawn_tree(DOC.read_text()), package) == []
    for name in ("a/__init__.py", "a/x.py", "b/__init__.py", "c.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    drawing = "```\nsrc/dptrain/\n  c.py  d.py        modules\n  a/                x.py and\n                    y.py\n  z/   e.py\n```\n"
    assert tree_mismatches(drawn_tree(drawing), tmp_path) == ["not drawn: b/", "no such: d.py", "no such: z/",
                                                             "no such: a/y.py", "no such: z/e.py"]
