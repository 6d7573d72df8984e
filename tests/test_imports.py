"""dptrain's modules import each other without a cycle.

The graph has one node per module of src/dptrain and an edge a -> b when a imports b anywhere: at the top of the
module or inside a function (a function-level import is still a dependency; placing it in a function only hides a
cycle until the function runs). Imports under ``if TYPE_CHECKING:`` never run and are left out. ``from p import y``
is an edge to the submodule ``p.y`` when ``y`` is one, else to ``p``; ``import dptrain.x.y`` is an edge to
``dptrain.x.y``. A package's own ``__init__`` running before its submodules is how Python imports, not an edge.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "dptrain"


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, calls: bool = True):
    """Every Import / ImportFrom node of ``tree``, except those under ``if TYPE_CHECKING:``; a call
    ``importlib.import_module("a.b")`` (or ``import_module``, ``__import__``) of a written-out name counts as
    ``import a.b`` (``calls=False``: the source has no such call, none looked for)."""
    children = tree.orelse if isinstance(tree, ast.If) and _is_type_checking(tree) else ast.iter_child_nodes(tree)
    for node in children:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif (
            calls
            and isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield ast.Import(names=[ast.alias(name=node.args[0].value)])
            yield from _imports(node, calls)
        else:
            yield from _imports(node, calls)


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
        names = submodules + ([target] if len(submodules) < len(node.names) else [])
    out = set()
    for name in names:
        if name != "dptrain" and not name.startswith("dptrain."):
            continue
        while name not in modules and "." in name:  # an attribute path: its innermost module
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the dptrain modules it imports (a fresh copy: callers may add edges to test the rules)."""
    return {module: set(targets) for module, targets in _parsed_graph().items()}


@functools.cache
def _parsed_graph() -> dict[str, set[str]]:  # the sources do not change during a test session
    modules = _modules()
    graph = {}
    for module, (path, is_package) in modules.items():
        text = path.read_text()
        calls = "import_module" in text or "__import__" in text
        tree = ast.parse(text, str(path))
        graph[module] = set().union(*(_targets(module, is_package, n, modules) for n in _imports(tree, calls)))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "dptrain.errors" in graph["dptrain.data.loaders"]  # a top-level import
    assert "dptrain.config" in graph["dptrain.cli.train"]  # an import inside a function
    assert "dptrain.cli.common" in graph["dptrain.cli.train"]  # from a package import a submodule
    assert "dptrain.cli" not in graph["dptrain.cli.train"]
    source = "if TYPE_CHECKING:\n    import a\nelse:\n    import b\ndef f():\n    import c\n"
    assert [n.names[0].name for n in _imports(ast.parse(source))] == ["b", "c"]
    source = "import importlib\ndef f(name):\n    importlib.import_module('d.e')\n    importlib.import_module(name)\n"
    assert [n.names[0].name for n in _imports(ast.parse(source))] == ["importlib", "d.e"]


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_dptrain_modules_import_each_other_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
