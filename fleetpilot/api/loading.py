"""Reading InferenceService manifests from YAML with errors a person can act on."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleetpilot.api.service import GROUP, KIND, InferenceService
from fleetpilot.files import (
    MAX_CONFIG_BYTES,
    FileError,
    TooLargeError,
    decode_text,
    parse_json,
    parse_yaml_documents,
    read_text,
    size_reason,
)

# An InferenceService manifest is a few KiB; even a file of many services stays far below this
# (the cap of every config file an entry point reads, which Kubernetes sets for a ConfigMap).
# Reading stops here, so `-f /dev/zero` or a wrong multi-GB file is refused, not swallowed.
MAX_MANIFEST_BYTES = MAX_CONFIG_BYTES


@dataclass(frozen=True)
class FieldProblem:
    """One reason a manifest was refused: where, and why."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidManifestError(ValueError):
    """A manifest that cannot become an InferenceService; every problem names its field."""

    def __init__(self, source: str, problems: list[FieldProblem]) -> None:
        self.source = source
        self.problems = problems
        if len(problems) == 1 and not problems[0].path:
            # A problem with the file as a whole (unreadable, too big, not YAML): one line.
            super().__init__(f"{source}: {problems[0].message}")
            return
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: invalid InferenceService\n{lines}")


def field_path(loc: Iterable[int | str]) -> str:
    """``('spec', 'tiers', 1, 'serving')`` -> ``spec.tiers[1].serving``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else part
    return path


def _message(error: Any) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    text = str(error["msg"])
    # pydantic prefixes validator messages with "Value error, "; the rule text stands alone.
    return text.removeprefix("Value error, ")


def problems_of(error: ValidationError) -> list[FieldProblem]:
    """Translate pydantic's errors into field paths in manifest (camelCase) terms."""
    problems = []
    for item in error.errors(include_url=False):
        # Union/tagged-type bookkeeping entries (e.g. 'function-after[...]') are not fields.
        loc = [p for p in item["loc"] if isinstance(p, int) or "[" not in str(p)]
        problems.append(FieldProblem(field_path(loc), _message(item)))
    return problems


def parse_service(obj: Any, source: str = "<object>") -> InferenceService:
    """Validate one decoded manifest; raise :class:`InvalidManifestError` naming every bad field."""
    if not isinstance(obj, dict):
        raise InvalidManifestError(source, [FieldProblem("", "expected a mapping (a YAML object)")])
    try:
        return InferenceService.from_object(obj)
    except ValidationError as exc:
        raise InvalidManifestError(source, problems_of(exc)) from None


def load_documents(text: str, source: str) -> list[Any]:
    """Parse YAML documents with the guards every file an entry point reads gets
    (:mod:`fleetpilot.files`): a syntax error names the line and column; nesting past
    ``MAX_DEPTH`` and alias bombs are refused."""
    try:
        return parse_yaml_documents(text, source)
    except FileError as exc:
        raise InvalidManifestError(source, [FieldProblem("", exc.reason)]) from None


# `-f -`: the manifest comes on standard input (kubectl's convention).
STDIN = "-"


def _source(path: Path) -> str:
    return "<stdin>" if str(path) == STDIN else str(path)


def _read_stdin(limit: int) -> bytes:
    data = sys.stdin.buffer.read(limit + 1)
    if len(data) > limit:
        raise TooLargeError(Path(STDIN), limit)
    return data


def read_manifest(path: Path, limit: int = MAX_MANIFEST_BYTES) -> str:
    """The text of a manifest file (``-``: standard input), refused (naming why) when
    unreadable, larger than ``limit`` bytes or not UTF-8. Reads at most ``limit + 1`` bytes,
    whatever the file is."""
    source = _source(path)
    try:
        if str(path) != STDIN:
            return read_text(path, limit=limit, what="manifest file")
        try:
            data = _read_stdin(limit)
        except TooLargeError:
            raise FileError(source, size_reason(limit, "manifest file")) from None
        return decode_text(data, source)
    except FileError as exc:
        raise InvalidManifestError(source, [FieldProblem("", exc.reason)]) from None


# What ``-f DIR`` reads, as kubectl does: the manifests in the folder, by name.
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
_SUFFIX_WORDS = "*.yaml, *.yml or *.json"


def _note_on_stderr(note: str) -> None:
    print(f"note: {note}", file=sys.stderr)


@dataclass(frozen=True)
class _Manifests:
    """What one file holds: its InferenceServices, and what was skipped (``Kind/name``)."""

    services: list[InferenceService]
    skipped: list[str]


def _kind_and_name(obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return f"{obj.get('kind')}/{name if isinstance(name, str) and name else '<unnamed>'}"


def _not_ours(obj: Any) -> tuple[str, str] | None:
    """What a decoded object is and why it is skipped rather than read (another kind, or
    another API group's InferenceService, such as KServe's), or None when it is read as an
    InferenceService: a mapping without ``kind`` is ours (the kind is the default), and a list
    or scalar is refused by :func:`parse_service`."""
    if not isinstance(obj, dict) or "kind" not in obj:
        return None
    what = _kind_and_name(obj)
    if obj["kind"] != KIND:
        return what, "not an InferenceService"
    api_version = obj.get("apiVersion")
    if isinstance(api_version, str) and api_version.split("/")[0] != GROUP:
        return f"{what} ({api_version})", f"not a {GROUP} InferenceService"
    return None


def _read_objects(path: Path) -> list[tuple[str, Any]]:
    """Every object of one manifest file, with where it is: its YAML documents (JSON for
    ``*.json``), a ``kind: List``'s items in its place, as kubectl reads them."""
    source = _source(path)
    text = read_manifest(path)
    if path.suffix == ".json" and str(path) != STDIN:
        try:
            documents = [parse_json(text, source)]
        except FileError as exc:
            raise InvalidManifestError(source, [FieldProblem("", exc.reason)]) from None
    else:
        documents = load_documents(text, source)
    objects: list[tuple[str, Any]] = []
    for d, document in enumerate(documents, start=1):
        where = f"{source} (document {d})"
        if isinstance(document, dict) and document.get("kind") == "List":
            items = document.get("items")
            for i, item in enumerate(items if isinstance(items, list) else [], start=1):
                objects.append((f"{source} (document {d}, item {i})", item))
        else:
            objects.append((where, document))
    return objects


def _load_file(path: Path, on_skip: Callable[[str], None]) -> _Manifests:
    services: list[InferenceService] = []
    skipped: list[str] = []
    for where, obj in _read_objects(path):
        other = _not_ours(obj)
        if other is None:
            services.append(parse_service(obj, where))
        else:
            what, reason = other
            skipped.append(what)
            on_skip(f"{where}: skipped {what}: {reason}")
    return _Manifests(services, skipped)


def manifest_files(folder: Path, *, recursive: bool = False) -> list[Path]:
    """The manifests ``-f FOLDER`` reads: its ``*.yaml``, ``*.yml`` and ``*.json`` files, sorted
    by path; with ``recursive``, those of every folder below it too."""
    try:
        entries = folder.rglob("*") if recursive else folder.iterdir()
        return sorted(p for p in entries if p.suffix in MANIFEST_SUFFIXES and p.is_file())
    except OSError as exc:
        raise InvalidManifestError(
            str(folder), [FieldProblem("", f"cannot read folder: {exc.strerror or exc}")]
        ) from None


def load_services(
    path: Path,
    *,
    recursive: bool = False,
    on_skip: Callable[[str], None] = _note_on_stderr,
) -> list[InferenceService]:
    """Every InferenceService of a manifest file (``-``: standard input) or, as kubectl's
    ``-f`` reads one, of a folder's ``*.yaml``, ``*.yml`` and ``*.json`` files (sorted;
    ``recursive``: its subfolders' too), in order.

    Other kinds (a Namespace, a PersistentVolumeClaim applied with the service) and other API
    groups' InferenceServices are skipped, each with a line to ``on_skip`` (by default a note
    on stderr) naming the file, the document and ``Kind/name``. A file (or folder) that holds no
    InferenceService at all is an :class:`InvalidManifestError` naming it, as is any document
    that is one but is invalid."""
    if str(path) != STDIN and path.is_dir():
        files = manifest_files(path, recursive=recursive)
        if not files:
            reason = f"no {_SUFFIX_WORDS} file in folder"
            raise InvalidManifestError(str(path), [FieldProblem("", reason)])
        services = [s for file in files for s in _load_file(file, on_skip).services]
        if not services:
            reason = f"no InferenceService in any {_SUFFIX_WORDS} file of the folder"
            raise InvalidManifestError(str(path), [FieldProblem("", reason)])
        return services
    source = _source(path)
    notes: list[str] = []
    manifests = _load_file(path, notes.append)
    if not manifests.services:
        if not manifests.skipped:
            raise InvalidManifestError(source, [FieldProblem("", "no YAML document in file")])
        found = ", ".join(manifests.skipped)
        reason = f"no {GROUP} InferenceService in file (it holds {found})"
        raise InvalidManifestError(source, [FieldProblem("", reason)])
    for note in notes:
        on_skip(note)
    return manifests.services
