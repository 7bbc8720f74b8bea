"""pyproject.toml declares what fleetpilot/ imports, and bounds it as the code uses it.

Every third-party module the package imports belongs to a distribution that pyproject.toml
declares, in the base install or in an extra; the mapping from import name to distribution is
the installed one (importlib.metadata), so `google.protobuf` is protobuf, `yaml` PyYAML. An
extra's distribution may only be needed, at import time and through fleetpilot's own imports,
by the modules that extra is for: a base install (`pip install fleetpilot`) must be able to
import everything else, which a test here does in a process where boto3 cannot be imported.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fleetpilot"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Extras that live in virtualenvs of their own and that fleetpilot/ never imports.
OWN_VENV_EXTRAS = {"vllm", "baselines"}
# Where each extra's distributions may be needed at import time (paths under the repository).
# The engine extra: the reference engine, and the simulator's calibration and the test harness,
# which run it in-process.
EXTRA_HOMES: dict[str, tuple[str, ...]] = {
    "engine": (
        "fleetpilot/engine/reference/",
        "fleetpilot/simulate/calibrate",
        "fleetpilot/testing/",
    ),
    "s3": ("fleetpilot/delivery/s3.py",),
    "dev": ("fleetpilot/testing/",),
}


def _requirements(texts: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(text) for text in texts]
    return {canonicalize_name(req.name): req for req in reqs}


BASE = _requirements(PROJECT["dependencies"])
EXTRAS = {
    extra: _requirements(texts)
    for extra, texts in PROJECT["optional-dependencies"].items()
    if extra not in OWN_VENV_EXTRAS
}


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository
    module: str  # the dotted name imported
    lineno: int
    at_import_time: bool  # module level (not in a function, not under TYPE_CHECKING)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> Iterator[Import]:
    """Every absolute import in ``path`` (relative ones resolved), marked by when it runs."""
    rel = path.relative_to(REPO).as_posix()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)

    def visit(node: ast.AST, eager: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, alias.name, node.lineno, eager)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield Import(rel, module, node.lineno, eager)
            if module.startswith("fleetpilot"):  # `from fleetpilot.x import y` may name module y
                for alias in node.names:
                    name = f"{module}.{alias.name}"
                    if _is_fleetpilot_module(name):
                        yield Import(rel, name, node.lineno, eager)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for grandchild in child.body:
                    yield from visit(grandchild, False)
                for grandchild in child.orelse:
                    yield from visit(grandchild, eager)
            else:
                yield from visit(child, eager)

    yield from visit(ast.parse(path.read_text(), str(path)), True)


@cache
def _is_fleetpilot_module(name: str) -> bool:
    return _module_path(name) is not None


@cache
def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


SOURCES = sorted(PACKAGE.rglob("*.py"))
IMPORTS = [found for path in SOURCES for found in _imports(path)]


def _third_party(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top not in sys.stdlib_module_names and top not in {"fleetpilot"}


@cache
def _top_level_providers() -> dict[str, list[str]]:
    """importlib's map of top-level names to distributions: it reads every installed
    distribution's file list, so once for the module, not once per import."""
    return dict(importlib.metadata.packages_distributions())


@cache
def _distribution(module: str) -> str | None:
    """The installed distribution that provides ``module`` (canonical name), None if none does.
    A top-level name several distributions share (a namespace package such as ``google``) is
    told apart by which one's files hold the module."""
    top = module.split(".")[0]
    candidates = sorted(set(_top_level_providers().get(top, [])))
    if len(candidates) == 1:
        return canonicalize_name(candidates[0])
    if not candidates:
        return None
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    location = Path(spec.origin or next(iter(spec.submodule_search_locations or []))).resolve()
    for name in candidates:
        files = importlib.metadata.distribution(name).files or []
        if any(Path(str(file.locate())).resolve() == location for file in files):
            return canonicalize_name(name)
    raise AssertionError(f"{module}: none of {candidates} holds {location}")


def test_the_scan_sees_the_imports() -> None:
    """The AST walk finds imports of each kind (a broken walk would make the tests vacuous)."""
    modules = {found.module for found in IMPORTS}
    assert {"aiohttp", "kopf", "torch", "boto3", "google.protobuf", "fleetpilot.delivery.s3"} <= (
        modules
    )
    lazy = {(f.path, f.module) for f in IMPORTS if not f.at_import_time}
    assert ("fleetpilot/delivery/cli.py", "fleetpilot.delivery.s3") in lazy


def test_every_third_party_import_is_declared() -> None:
    """Each distribution fleetpilot/ imports is in pyproject.toml's dependencies or an extra."""
    declared = set(BASE).union(*EXTRAS.values())
    undeclared: dict[str, list[str]] = {}
    for found in IMPORTS:
        if not _third_party(found.module):
            continue
        dist = _distribution(found.module)
        where = f"{found.path}:{found.lineno} imports {found.module}"
        if dist is None:
            undeclared.setdefault("(not installed)", []).append(where)
        elif dist not in declared:
            undeclared.setdefault(dist, []).append(where)
    assert undeclared == {}


def _module_of(path: str) -> str:
    return _module_name(REPO / path)


@cache
def _eager_graph() -> dict[str, set[str]]:
    """fleetpilot module -> the modules importing it runs (its import-time imports, fleetpilot's
    ones with their parent packages)."""
    graph: dict[str, set[str]] = {
        _module_of(p.relative_to(REPO).as_posix()): set() for p in SOURCES
    }
    for found in IMPORTS:
        if not found.at_import_time:
            continue
        source = _module_of(found.path)
        if _third_party(found.module):
            graph[source].add(found.module)
            continue
        parts = found.module.split(".")
        for end in range(1, len(parts) + 1):
            name = ".".join(parts[:end])
            if _is_fleetpilot_module(name):
                graph[source].add(name)
    return graph


def _needs_at_import(module: str) -> dict[str, list[str]]:
    """Third-party distribution -> the import chain through which importing ``module`` needs it."""
    graph = _eager_graph()
    needs: dict[str, list[str]] = {}
    chains = {module: [module]}
    stack = [module]
    while stack:
        current = stack.pop()
        for target in graph.get(current, ()):
            if _third_party(target):
                dist = _distribution(target)
                if dist is not None and dist not in needs:
                    needs[dist] = [*chains[current], target]
            elif target not in chains:
                chains[target] = [*chains[current], target]
                stack.append(target)
    return needs


def _home(path: str, extra: str) -> bool:
    return path.startswith(EXTRA_HOMES.get(extra, ()))


def test_extras_are_needed_only_where_they_are_for() -> None:
    """Importing a module outside an extra's home needs none of the extra's distributions (not
    directly, not through fleetpilot's own import-time imports): a base install can import it."""
    extra_only = {
        dist: [extra for extra, reqs in EXTRAS.items() if dist in reqs]
        for dist in set().union(*EXTRAS.values())
        if dist not in BASE
    }
    assert {"torch", "boto3"} <= set(extra_only)
    leaks = []
    for path in SOURCES:
        rel = path.relative_to(REPO).as_posix()
        for dist, chain in _needs_at_import(_module_of(rel)).items():
            extras = extra_only.get(dist)
            if extras and not any(_home(rel, extra) for extra in extras):
                leaks.append(f"{rel} needs {dist} ({'/'.join(extras)}): {' -> '.join(chain)}")
    assert leaks == []


def test_extra_homes_exist() -> None:
    """Each home names a file or folder that exists (a rename would widen nothing silently)."""
    for homes in EXTRA_HOMES.values():
        for home in homes:
            assert list(REPO.glob(home + "*")), home


def test_aiohttp_is_bounded_to_the_minor_release_the_tests_run_on() -> None:
    """fleetpilot/httpserver.py subclasses aiohttp's RequestHandler and reads its private
    attributes: the range must be the installed (tested) minor release, no wider."""
    installed = Version(importlib.metadata.version("aiohttp"))
    major, minor = installed.major, installed.minor
    assert BASE["aiohttp"].specifier == SpecifierSet(f">={major}.{minor},<{major}.{minor + 1}")
    source = (PACKAGE / "httpserver.py").read_text()
    assert "from aiohttp.web_protocol import RequestHandler" in source  # why the bound exists


def test_boto3_is_an_extra_not_the_base_install() -> None:
    assert "boto3" not in BASE
    assert {"boto3", "botocore"} <= set(EXTRAS["s3"])
    assert "s3" in _setup_extras()


def _setup_extras() -> set[str]:
    """The extras `make setup` installs into the test virtualenv."""
    makefile = (REPO / "Makefile").read_text()
    match = re.search(r"pip install .* -e '\.\[([\w,]+)\]'", makefile)
    assert match, "no `pip install -e '.[...]'` in the Makefile"
    return set(match.group(1).split(","))


def test_the_test_virtualenv_installs_every_extra_the_code_imports() -> None:
    """The tests import every module, so `make setup` installs every extra with a home."""
    assert set(EXTRA_HOMES) <= _setup_extras()


BLOCK_BOTO3 = """
import sys
sys.modules["boto3"] = None  # as if the s3 extra were not installed
from fleetpilot.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_boto3(*argv: str) -> subprocess.CompletedProcess[str]:
    """`fleetpilot ARGV` in a fresh interpreter where importing boto3 fails."""
    return subprocess.run(
        [sys.executable, "-c", BLOCK_BOTO3, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )


def test_s3_fetch_without_the_extra_names_the_extra(tmp_path: Path) -> None:
    """Without boto3 the rest of the command line works, and `model fetch s3` fails in one line
    naming the extra that brings it (no traceback)."""
    done = _without_boto3(
        "model", "fetch", "s3", "--bucket", "models", "--dest", str(tmp_path / "m")
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    extra = re.search(r"fleetpilot\[(\w+)\]", line)
    assert extra, line
    assert "boto3" in EXTRAS[extra.group(1)]
    assert not (tmp_path / "m").exists()
    helped = _without_boto3("model", "fetch", "s3", "--help")
    assert helped.returncode == 0, helped.stderr


@pytest.mark.parametrize("dist", ["requests", "urllib3"])
def test_autoscaler_http_stack_is_declared_in_the_base_install(dist: str) -> None:
    """The autoscaler (base install, the operator image) drives requests/urllib3 itself."""
    assert dist in BASE
    users = {f.path for f in IMPORTS if f.module.split(".")[0] == dist}
    assert "fleetpilot/autoscaler/prometheus.py" in users
    installed = Version(importlib.metadata.version(dist))
    assert BASE[dist].specifier.contains(installed)
