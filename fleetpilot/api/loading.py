"""Reading InferenceService manifests from YAML with errors a person can act on."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fleetpilot.api.service import InferenceService
from fleetpilot.files import (
    MAX_CONFIG_BYTES,
    FileError,
    TooLargeError,
    decode_text,
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


def load_services(path: Path) -> list[InferenceService]:
    """Every InferenceService in a YAML file (other kinds are refused, not skipped)."""
    source = _source(path)
    text = read_manifest(path)
    documents = load_documents(text, source)
    if not documents:
        raise InvalidManifestError(source, [FieldProblem("", "no YAML document in file")])
    return [parse_service(doc, f"{source} (document {i + 1})") for i, doc in enumerate(documents)]
