"""The import graph of the package, as import-linter's own graph library (grimp) builds it, and
the modules that say they do no I/O, as its no-I/O contract checks them."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("fleetpilot", cache_dir=None)


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative):
    files that import each other, directly or around a circle - type-only imports included,
    as a circle of them still means two modules that cannot be read apart."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    imported = sorted(graph.find_modules_directly_imported_by(child))
                    work.append((child, iter(imported)))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_module_imports_itself_around_a_circle(graph: grimp.ImportGraph) -> None:
    assert module_cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above can fail: a graph with a circle of three modules is reported."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(name)
    for importer, imported in (("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a")):
        graph.add_import(importer=importer, imported=imported)
    graph.add_import(importer="pkg.d", imported="pkg.a")
    assert module_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


# A module's docstring claims it does no I/O in one of these words; the tests below keep the
# claims and the import-linter contract that checks them one list.
NO_IO_CLAIM = re.compile(r"purely\s+computational|\bno I/O\b|\bpure:", re.IGNORECASE)


def no_io_contract() -> list[str]:
    """The source modules of the no-I/O import-linter contract (pyproject.toml)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if "no I/O" in c["name"]]
    return list(contract["source_modules"])


def docstrings() -> dict[str, str]:
    """Every module of the package (a package by its ``__init__``), by dotted name."""
    found = {}
    for path in sorted((ROOT / "fleetpilot").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.get_docstring(ast.parse(path.read_text())) or ""
    return found


def claims_off_contract(docs: dict[str, str], contract: list[str]) -> tuple[list[str], list[str]]:
    """Modules that claim no I/O but the contract does not check (a module is checked with a
    package the contract names), and contract entries whose docstring makes no such claim."""
    packages = {name.rpartition(".")[0] for name in docs}

    def checked(name: str) -> bool:
        return any(name == c or name.startswith(c + ".") for c in contract)

    unchecked = [
        name
        for name, doc in docs.items()
        if name not in packages and NO_IO_CLAIM.search(doc) and not checked(name)
    ]
    unclaimed = [name for name in contract if not NO_IO_CLAIM.search(docs.get(name, ""))]
    return unchecked, unclaimed


def test_every_module_that_claims_no_io_is_in_the_contract_and_back() -> None:
    assert claims_off_contract(docstrings(), no_io_contract()) == ([], [])


def test_a_claim_outside_the_contract_and_a_silent_entry_are_reported() -> None:
    docs = {
        "pkg": "Pure parts: no I/O.",
        "pkg.a": "Purely\ncomputational.",
        "pkg.b": "Reads files.",
        "pkg.c": "No I/O.",
    }
    assert claims_off_contract(docs, ["pkg", "pkg.b"]) == ([], ["pkg.b"])
    assert claims_off_contract(docs, ["pkg.b"]) == (["pkg.a", "pkg.c"], ["pkg.b"])
