"""The layout table of docs/design.md is the import graph: every module is in
it, every import goes down it, and a path that is not in it is no module."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import flat_tokens_jax

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flat_tokens_jax"
DESIGN = ROOT / "docs" / "design.md"


def layout_table(text: str) -> list[tuple[str, list[str]]]:
    """The rows of the "How the code is laid out" table: (place, modules in order),
    a place being a subpackage (``core/``) or a top-level module (``cli.py``)."""
    section = text.split("## How the code is laid out", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"`\w+(/|\.py)`", cells[0]):
            rows.append((cells[0].strip("`"), re.findall(r"`(\w+)`", cells[1])))
    return rows


def dotted(place: str, module: str) -> str:
    if place.endswith("/"):
        return f"flat_tokens_jax.{place[:-1]}.{module}"
    return f"flat_tokens_jax.{module}"


def module_files() -> dict[str, Path]:
    """Every module of the package but the ``__init__`` files, by dotted name."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem != "__init__":
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts)] = path
    return files


def imported(path: Path) -> set[str]:
    """The package's modules (or subpackages) that ``path`` imports, at the top or
    inside a function, by an import statement or ``importlib.import_module``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if _exists(f"{node.module}.{alias.name}")
            )
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return {name for name in names if name.split(".")[0] == "flat_tokens_jax"}


def _exists(name: str) -> bool:
    where = ROOT.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def upward_imports(table: list[tuple[str, list[str]]], graph: dict[str, set[str]]) -> list[str]:
    """The imports in ``graph`` that go up ``table``: to a later row, to a later
    module of the same row, or to the package root (only the top may); and those
    of a path that is no module of the table."""
    rank: dict[str, tuple[int, int]] = {"flat_tokens_jax": (len(table), 0)}
    for row, (place, modules) in enumerate(table):
        if place.endswith("/"):
            rank[f"flat_tokens_jax.{place[:-1]}"] = (row, -1)
        for column, module in enumerate(modules):
            rank[dotted(place, module)] = (row, column)
    found = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target not in rank:
                found.append(f"{source} imports {target}, which is no module of the table")
            elif target != source and rank[target] >= rank[source]:
                found.append(f"{source} imports {target}, which the table puts after it")
    return found


def test_every_module_is_in_the_table_and_every_entry_exists() -> None:
    table = layout_table(DESIGN.read_text())
    listed = [dotted(place, module) for place, modules in table for module in modules]
    assert len(listed) == len(set(listed)), "a module is listed twice in docs/design.md"
    assert sorted(listed) == sorted(module_files())
    folders = {p.parent.name + "/" for p in PACKAGE.glob("*/__init__.py")}
    assert {place for place, _ in table if place.endswith("/")} == folders


def test_no_module_is_over_500_lines_and_the_package_over_23000() -> None:
    """Issue 47's bound of 22,000 lines held the engine's features of then; issue 49
    added the corpus importers (datatrove, dolma, Levanter, on Beam too) and the
    trainer adapters in about 1,000 lines more."""
    lines = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(lines) > 50, "the package looks empty"
    assert {p: n for p, n in lines.items() if n > 500} == {}
    assert sum(lines.values()) <= 23_000


def test_every_import_goes_down_the_table() -> None:
    table = layout_table(DESIGN.read_text())
    graph = {name: imported(path) for name, path in module_files().items()}
    assert sum(map(len, graph.values())) > 100, "the import graph looks empty"
    assert upward_imports(table, graph) == []


def test_an_upward_import_is_reported() -> None:
    table = layout_table(DESIGN.read_text())
    graph = {
        "flat_tokens_jax.core.format": {"flat_tokens_jax.store.store"},
        "flat_tokens_jax.store.store": {"flat_tokens_jax.core.format"},
        "flat_tokens_jax.data.records": {"flat_tokens_jax"},
        "flat_tokens_jax.loader.prefetch": {"flat_tokens_jax.readahead"},
    }
    assert upward_imports(table, graph) == [
        "flat_tokens_jax.core.format imports flat_tokens_jax.store.store,"
        " which the table puts after it",
        "flat_tokens_jax.data.records imports flat_tokens_jax, which the table puts after it",
        "flat_tokens_jax.loader.prefetch imports flat_tokens_jax.readahead,"
        " which is no module of the table",
    ]


@pytest.mark.parametrize(
    "old", ["flat_tokens_jax.batch", "flat_tokens_jax.records", "flat_tokens_jax.phaseshow"]
)
def test_a_module_path_from_before_the_subpackages_is_no_module(
    old: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{old}'"):
        importlib.import_module(old)
    with pytest.raises(AttributeError, match=f"has no attribute '{old.rpartition('.')[2]}'"):
        getattr(flat_tokens_jax, old.rpartition(".")[2])


def test_the_documented_import_paths_give_the_names_of_the_namesake_module() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from flat_tokens_jax.grain import FlatTokensSource
        from flat_tokens_jax.store import remote_bytes, remote_reads

    from flat_tokens_jax.grain.grain import FlatTokensSource as source
    from flat_tokens_jax.store.store import remote_bytes as bytes_read
    from flat_tokens_jax.store.store import remote_reads as reads

    assert FlatTokensSource is source
    assert remote_bytes is bytes_read and remote_reads is reads
    with pytest.raises(ImportError, match="cannot import name 'Store'"):
        from flat_tokens_jax.store import Store  # noqa: F401


def test_the_subpackages_leave_the_public_names_as_they_are() -> None:
    """A subpackage, once imported, is an attribute of the package: none may be
    named like a public name (``ftj.decode`` is a function)."""
    importlib.import_module("flat_tokens_jax.decoding.batch")
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders.isdisjoint(flat_tokens_jax.__all__)
    assert callable(flat_tokens_jax.decode) and flat_tokens_jax.decode.__name__ == "decode"
    for name in flat_tokens_jax.__all__:
        assert getattr(flat_tokens_jax, name).__name__ == name
