"""The README and the docs: the README stays a page a newcomer reads in minutes, and every relative link of the README
and of docs/ points at a file that exists and, where it names one (``page.md#anchor``, ``#anchor``), at an anchor of
that page: a heading's GitHub anchor or an explicit ``<a id="...">``."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup and punctuation other than - and _ dropped, lower case, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown page: its headings' (outside code fences; repeats get -1, -2, ...) and explicit ids."""
    out, seen, fenced = set(), {}, False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out | set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', page.read_text()))


def broken(page: Path) -> list[str]:
    out = []
    for t in [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]:
        file, _, anchor = t.partition("#")
        target = page.parent / file if file else page
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target)):
            out.append(t)
    return out


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
    assert broken(page) == ["missing.md#x", "#anchor"]


def test_a_missing_anchor_is_found(tmp_path):
    (tmp_path / "there.md").write_text(
        "# Banded matrix factorization (Choquette-Choo et al.)\n## `dptrain account`: Step 2\n## Notes\n## Notes\n"
        "```\n# not a heading\n```\n<a id=\"kept\"></a>\n"
    )
    page = tmp_path / "p.md"
    page.write_text(
        "[a](there.md#banded-matrix-factorization-choquette-choo-et-al) [b](there.md#dptrain-account-step-2) "
        "[c](there.md#notes-1) [d](there.md#kept) [e](there.md#not-a-heading) [f](there.md#notes-2) [g](#here)\n"
        "## Here\n"
    )
    assert broken(page) == ["there.md#not-a-heading", "there.md#notes-2"]


SRC = ROOT / "src"
DOTTED = re.compile(r"\bdptrain(?:\.[A-Za-z_]\w*)+")


@functools.cache
def _top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines or imports at its top level (and in __all__ / lazy export tables as string keys)."""
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            names.add(node.value)  # __all__ entries, lazy exports
    return frozenset(names)


def unresolved(dotted: str) -> bool:
    """True when ``dptrain.a.b.name`` names no module of src/ and no name its innermost module defines."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = SRC.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.exists():
            names = set(_top_level_names(module))
            for lazy in re.findall(r'lazy_exports\(__name__, "(\w+)"\)', module.read_text()):  # names of a submodule
                names |= _top_level_names(base / f"{lazy}.py")
            return i < len(parts) and parts[i] not in names
    return True


FROM_IMPORT = re.compile(r"^\s*from (dptrain(?:\.\w+)*) import ([\w, ]+)$", re.M)


def module_paths(text: str) -> list[str]:
    """The dotted paths a page names: ``dptrain.a.b`` anywhere, and ``dptrain.a.B`` for ``from dptrain.a import B``."""
    imported = [f"{m}.{n.split(' as ')[0].strip()}" for m, names in FROM_IMPORT.findall(text) for n in names.split(",")]
    return DOTTED.findall(text) + imported


def test_every_module_path_in_the_docs_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = sorted({f"{p.relative_to(ROOT)}: {d}" for p in pages for d in module_paths(p.read_text()) if unresolved(d)})
    assert not bad


def test_a_moved_module_is_found():
    assert module_paths("from dptrain.huggingface import DPTrainer, Gone as G\n`dptrain.x`") == [
        "dptrain.huggingface", "dptrain.x", "dptrain.huggingface.DPTrainer", "dptrain.huggingface.Gone"]
    assert not unresolved("dptrain.huggingface.DPTrainer") and unresolved("dptrain.huggingface.Gone")
    assert not unresolved("dptrain.modelmix.ModelMixSGD") and unresolved("dptrain.modelmix.ModelMixAdam")  # lazy
    assert not unresolved("dptrain.stages.correlated_noise.BandedNoise") and not unresolved("dptrain.accounting")
    assert unresolved("dptrain.correlated_noise") and unresolved("dptrain.stages.correlated_noise.NoSuchThing")
    assert unresolved("dptrain.engine.bandmf_stage")


FOLDERS = sorted(p.name for p in (SRC / "dptrain").iterdir() if (p / "__init__.py").exists())
FILE_PATH = re.compile(r"`((?:src/|tests/|benchmarks/|configs/|(?:" + "|".join(FOLDERS) + r")/)[\w/.*<>-]*\.(?:py|toml|json|md))`")


def missing_files(text: str) -> list[str]:
    """Backticked file paths (``src/...``, ``tests/...``, ``benchmarks/...``, ``configs/...`` from the repository root;
    ``engine/bandmf.py`` from src/dptrain) that match no file; ``*`` is a glob."""
    out = []
    for path in FILE_PATH.findall(text):
        root = ROOT if path.split("/")[0] in ("src", "tests", "benchmarks", "configs") else SRC / "dptrain"
        if "<" not in path and not list(root.glob(path)):
            out.append(path)
    return out


def test_every_file_path_in_the_docs_exists():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = {str(p.relative_to(ROOT)): missing_files(p.read_text()) for p in pages if missing_files(p.read_text())}
    assert not bad
    assert missing_files("`engine/bandmf.py` `accounting/bandmf_*.py` `tests/test_docs.py` `engine/noise.py`") == [
        "engine/noise.py"
    ]


def unreachable(start: Path, pages: list[Path]) -> list[str]:
    """The pages no chain of relative links from ``start`` reaches."""
    seen, todo = {start.resolve()}, [start]
    while todo:
        page = todo.pop()
        for t in LINK.findall(page.read_text()):
            target = (page.parent / t.split("#")[0]).resolve()
            if not re.match(r"[a-z]+:", t) and target.suffix == ".md" and target.exists() and target not in seen:
                seen.add(target)
                todo.append(target)
    return sorted(p.name for p in pages if p.resolve() not in seen)


def test_every_page_of_docs_is_reached_from_the_readme(tmp_path):
    assert unreachable(ROOT / "README.md", sorted((ROOT / "docs").glob("*.md"))) == []
    (tmp_path / "a.md").write_text("[b](b.md)")
    (tmp_path / "b.md").write_text("[a](a.md#x)")
    (tmp_path / "c.md").write_text("[a](a.md)")
    assert unreachable(tmp_path / "a.md", [tmp_path / "b.md", tmp_path / "c.md"]) == ["c.md"]


# --- the default run, as the pages describe it ---------------------------------------------------------------------


def default_run_claims() -> list[str]:
    """What each page says of the default run (configs/default.toml) that the config decides, as (page, text) checks:
    the README's printed report, docs/cli.md's "The default run" and docs/privacy.md's attacker example."""
    import tomllib

    from dptrain.accounting.run_numbers import steps_for_epochs

    cfg = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    n = 60000  # Fashion-MNIST's training set (the README's report says so too)
    q = cfg["training"]["batch_size"] / n
    model, clip = cfg["model"]["name"], cfg["privacy"]["max_grad_norm"]
    steps = steps_for_epochs(cfg["training"]["epochs"], q)
    readme = (ROOT / "README.md").read_text()
    cli = (ROOT / "docs" / "cli.md").read_text()
    cli = cli[cli.index("## The default run") :]
    cli = cli[: cli.index("\n## ", 1)]
    privacy = (ROOT / "docs" / "privacy.md").read_text()
    wanted = {
        "README.md": [f"model             {model} ", f"clip norm         {clip:g}\n", f"sampling rate     {q:.6f} (poisson,",
                      f"expected batch {cfg['training']['batch_size']})", f"steps             {steps} of {steps} "],
        "docs/cli.md": [f'`model.name = "{model}"`', f'`data.features = "{cfg["data"].get("features", "none")}"`',
                        f"{cfg['training']['epochs']} epochs at expected batch {cfg['training']['batch_size']}",
                        f"clip\nnorm {clip:g}" if "clip\nnorm" in cli else f"clip norm {clip:g}",
                        f"learning rate {cfg['training']['learning_rate']:g}"],
        "docs/privacy.md": [f"Poisson rate q = {cfg['training']['batch_size']}/{n}, {steps}\nsteps"],
    }
    text = {"README.md": readme, "docs/cli.md": cli, "docs/privacy.md": privacy}
    return [f"{page}: {w!r}" for page, ws in wanted.items() for w in ws if w not in text[page]]


def test_the_pages_describe_the_default_run_configs_default_toml_trains():
    assert default_run_claims() == []


def test_the_readme_report_and_privacy_md_give_the_attacker_bound_dptrain_account_prints(capsys):
    """The README's printed report and docs/privacy.md's example give the membership-inference bound of the default
    run's noise multiplier, rate and steps: `dptrain account` must print the same."""
    from dptrain.cli import main

    readme = (ROOT / "README.md").read_text()
    sigma = re.search(r"noise multiplier  ([\d.]+)\n", readme).group(1)
    rate = re.search(r"sampling rate     ([\d.]+) ", readme).group(1)
    steps = re.search(r"steps             (\d+) of", readme).group(1)
    low, high = re.search(r"attacker +membership inference: TPR <= ([\d.]+)% at FPR 1%, <= ([\d.]+)% at FPR 10%", readme).groups()
    privacy = (ROOT / "docs" / "privacy.md").read_text()
    assert f"noise multiplier {sigma}, Poisson rate" in privacy and f"{steps}\nsteps" in privacy
    assert f"**TPR <= {low}% at FPR 1% and <= {high}% at FPR 10%.**" in privacy
    import tomllib

    cfg = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    q = cfg["training"]["batch_size"] / 60000
    assert float(rate) == round(q, 6)
    assert main(["account", "--noise-multiplier", sigma, "--sampling-rate", repr(q), "--steps", steps,
                 "--delta", "1e-5", "--json"]) == 0
    bound = json.loads(capsys.readouterr().out)["membership_inference"]
    assert f"{100 * bound['tpr_at_fpr_1pct']:.2f}" == low and f"{100 * bound['tpr_at_fpr_10pct']:.1f}" == high


# --- the README's measured numbers, against the reproductions' JSON ------------------------------------------------


def medians(path: str, key: tuple[str, ...]) -> dict[tuple, dict[str, float]]:
    """cell (the ``key`` fields of a row) -> method -> median accuracy, from a reproduction's JSON rows."""
    cells: dict[tuple, dict[str, float]] = {}
    for row in json.loads((ROOT / "docs" / "reproduction" / path).read_text()):
        cells.setdefault(tuple(row[k] for k in key), {})[row.get("method", row.get("recipe"))] = row["accuracy_median"]
    return cells


def wins(cells: dict[tuple, dict[str, float]], method: str) -> tuple[int, int, int, float]:
    """(cells ahead of DP-SGD, cells compared, cells behind, mean difference of the medians in points)."""
    diffs = [c[method] - c["dpsgd"] for c in cells.values() if method in c and "dpsgd" in c]
    return sum(d > 0 for d in diffs), len(diffs), sum(d < 0 for d in diffs), 100 * sum(diffs) / len(diffs)


def test_the_readmes_measured_accuracies_are_the_reproductions():
    """The README's headline sentences give the numbers docs/reproduction/*/*.json hold (rounded as printed)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"weight averaging reaches ([\d.]+)% at epsilon 1, ([\d.]+)% at 3 .*? and ([\d.]+)% at 8", text)
    recipes = medians("recipes/recipes.json", ("target_epsilon",))
    assert [f"{100 * recipes[(e,)]['scatternet_linear+ema']:.1f}" for e in (1.0, 3.0, 8.0)] == list(m.groups())
    m = re.search(r"ahead in (\d+) of (\d+) cells, behind in (\d+), (-?[\d.]+) points on average", text)
    ahead, n, behind, mean = wins(medians("bandmf/decided.json", ("model", "epochs", "target_epsilon")), "bandmf")
    assert (str(ahead), str(n), str(behind), f"{mean:.2f}") == m.groups()
    m = re.search(r"ModelMix \(behind in (\d+) of (\d+)", text)
    ahead, n, behind, _ = wins(medians("modelmix/decided.json", ("model", "target_epsilon")), "modelmix")
    assert (str(behind), str(n)) == m.groups() and ahead == 0
    assert wins({(1,): {"dpsgd": 0.8, "x": 0.81}, (2,): {"dpsgd": 0.8, "x": 0.78}, (3,): {"dpsgd": 0.8}}, "x")[:3] == (
        1, 2, 1)


def cli_table_mismatches(readme: str, parser) -> list[str]:
    """The README's command-line table against the parser: one row per subcommand, and each flag a row shows (in the
    command or in backticks in its description) accepted by its subcommand."""
    commands = next(a for a in parser._actions if a.dest == "command").choices
    rows = re.findall(r"^\| `dptrain ([\w-]+)([^`]*)` \|(.*)\|$", readme, re.M)
    out = [f"no row: dptrain {c}" for c in commands if c not in [r[0] for r in rows]]
    for name, rest, description in rows:
        if name not in commands:
            out.append(f"no such command: dptrain {name}")
            continue
        flags = {s for a in commands[name]._actions for s in a.option_strings}
        shown = re.findall(r"--[\w-]+", rest) + re.findall(r"`(--[\w-]+)", description)
        out += [f"dptrain {name} has no {f}" for f in shown if f not in flags]
    return out


def test_the_readmes_command_table_is_the_parsers():
    from dptrain.cli import build_parser

    assert cli_table_mismatches((ROOT / "README.md").read_text(), build_parser()) == []
    table = "| `dptrain train --config C` | x; `--resume DIR`, `--bogus` |\n| `dptrain fly` | y |\n"
    found = cli_table_mismatches(table, build_parser())
    assert "no row: dptrain tune" in found and "no such command: dptrain fly" in found
    assert "dptrain train has no --bogus" in found and not any("--config" in f or "--resume" in f for f in found)


SECTION_REFERENCE = re.compile(r"\b([a-z_]+\.md)\)?, \"([^\"]+)\"")


def missing_sections(text: str, docs: Path) -> list[str]:
    """``page.md, "Section"`` (or ``[page.md](page.md), "Section"``) naming no heading of docs/page.md (a heading that
    begins with the name counts: "The model probe" for "The model probe and the sentinel: ...")."""
    out = []
    for page, section in SECTION_REFERENCE.findall(text):
        section = re.sub(r"\s*\n\s*#?\s*", " ", section)  # wrapped over lines (of a comment)
        target = docs / page
        headings = [m.group(1) for m in map(HEADING.match, target.read_text().splitlines()) if m] if target.exists() else []
        if not any(h.replace("`", "").startswith(section.replace("`", "")) for h in headings):
            out.append(f'{page}, "{section}"')
    return out


def test_every_section_named_in_the_docs_and_the_code_exists(tmp_path):
    docs = ROOT / "docs"
    files = [ROOT / "README.md", *docs.rglob("*.md"), *(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    bad = {str(f.relative_to(ROOT)): missing_sections(f.read_text(), docs) for f in files if f.name != "test_docs.py"}
    assert {k: v for k, v in bad.items() if v} == {}
    (tmp_path / "p.md").write_text("# Page\n## The model probe and the sentinel: more\n")
    assert missing_sections('[p.md](p.md), "The model\n  # probe" and p.md, "Gone" and q.md, "Page"', tmp_path) == [
        'p.md, "Gone"', 'q.md, "Page"']
