"""Reading a file a user names, guarded: every config, manifest, endpoints or key file that an
entry point reads goes through here, so each is refused the same way, on one line that names
the file and the reason, instead of filling memory or ending in a traceback.

- size: reading stops after ``limit`` bytes, so a mistaken path (``/dev/zero``, a disk image,
  a log) is refused instead of swallowed;
- text: UTF-8 only; a stray byte is named with its offset;
- nesting: YAML and JSON deeper than :data:`MAX_DEPTH` levels are refused (PyYAML composes
  nodes recursively and CPython's JSON decoder recurses too: a few thousand levels would end in
  a ``RecursionError``, and anything past the parser would have to walk them again);
- YAML aliases: the nodes a document expands to, aliases counted as often as they are used,
  are capped at :data:`MAX_YAML_NODES`, so a "billion laughs" document (an anchor used ten
  times by an anchor used ten times...) is refused instead of being validated exponentially.

Everything here but the reads is pure: ``parse_*`` take text and return data or raise
:class:`FileError`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from yaml.error import Mark
from yaml.events import AliasEvent, Event, NodeEvent, ScalarEvent
from yaml.nodes import Node

# The files an entry point reads are ConfigMaps and Secrets (or the local runtime's copies of
# them), and Kubernetes caps each at 1 MiB; manifests, model configs and key files are a few
# KiB. Anything larger is the wrong file.
MAX_CONFIG_BYTES = 1 << 20

# The deepest schema we read (an InferenceService: spec.tiers[].serving.prefill.replicas...)
# nests about 10 levels; 100 leaves room for free-form fields and keeps PyYAML, which spends
# two Python frames per level, far from the interpreter's 1,000-frame limit.
MAX_DEPTH = 100

# Without aliases a file within MAX_CONFIG_BYTES holds at most ~512k nodes (`[1,1,1,...]`:
# two bytes each), so this budget lets anchors repeat shared settings as much as a plain file
# could spell them out, and no more.
MAX_YAML_NODES = 1 << 20


class FileError(ValueError):
    """A file refused, with one line that names it and says why."""

    # How a re-read that met this error is counted (the routers' reload metrics): the file
    # was read but cannot be used.
    result = "invalid"

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class UnreadableError(FileError):
    """The file could not be read at all (missing, no permission, a directory)."""

    result = "unreadable"


class TooLargeError(FileError):
    """The file holds more than the limit."""

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(str(path), f"larger than {limit} bytes")
        self.limit = limit


def read_limited(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; ``TooLargeError`` past ``limit`` bytes (a regular file is
    refused by its size before any is read; anything else after reading ``limit + 1``),
    ``OSError`` when it cannot be read."""
    with path.open("rb") as file:
        if path.is_file() and path.stat().st_size > limit:
            raise TooLargeError(path, limit)
        data = file.read(limit + 1)
    if len(data) > limit:
        raise TooLargeError(path, limit)
    return data


def size_reason(limit: int, what: str) -> str:
    """Why a file over ``limit`` bytes is refused, in words a user can act on."""
    article = "an" if what[:1].lower() in "aeiou" else "a"
    return (
        f"larger than {limit} bytes ({limit / (1 << 20):g} MiB), the most {article} {what} "
        "may be: is it the right file?"
    )


def decode_text(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text; a stray byte is named with its offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(
            source, f"not UTF-8 text (byte {exc.start}: {data[exc.start]:#04x})"
        ) from None


def read_text(path: Path, *, limit: int = MAX_CONFIG_BYTES, what: str = "config file") -> str:
    """The UTF-8 text of ``path``, reading at most ``limit + 1`` bytes whatever the file is;
    :class:`FileError` naming the file when it cannot be read, is too large or is not UTF-8.
    ``what`` names the kind of file in the size message."""
    source = str(path)
    try:
        data = read_limited(path, limit)
    except TooLargeError:
        raise FileError(source, size_reason(limit, what)) from None
    except OSError as exc:
        raise UnreadableError(source, f"cannot read file: {exc.strerror or exc}") from None
    return decode_text(data, source)


class WatchedFile:
    """A file re-read on every poll (a mounted ConfigMap or Secret, the local runtime's
    endpoints file), with the guards of :func:`read_text`, that tells each change once.

    :meth:`read_change` returns the text when the content differs from the last text it
    returned, None when it does not, and raises :class:`FileError` when the file cannot be
    read, is too large or is not UTF-8 - once per change (a new content, or a new reason it
    cannot be read), not once per poll, so a refusal is one log line and one count however
    long it lasts. Content is compared by digest: a ConfigMap changes by an atomic symlink
    swap that watching the file itself would miss.
    """

    def __init__(
        self, path: Path, *, limit: int = MAX_CONFIG_BYTES, what: str = "config file"
    ) -> None:
        self.path = path
        self.limit = limit
        self.what = what
        self._digest: bytes | None = None  # of the last content read (valid UTF-8 or not)
        self._refusal: str | None = None  # why the file could not be read, until it can again

    def prime(self) -> None:
        """Take the content there now as already seen (the caller loaded it itself), without
        reporting it; a file that cannot be read now is reported by the next read."""
        try:
            self.read_change()
        except FileError:
            self._digest, self._refusal = None, None

    def read_change(self) -> str | None:
        source = str(self.path)
        try:
            data = read_limited(self.path, self.limit)
        except TooLargeError:
            self._refuse(FileError(source, size_reason(self.limit, self.what)))
        except OSError as exc:
            self._refuse(UnreadableError(source, f"cannot read file: {exc.strerror or exc}"))
        else:
            self._refusal = None
            digest = hashlib.sha256(data).digest()
            if digest == self._digest:
                return None
            self._digest = digest
            return decode_text(data, source)
        return None

    def _refuse(self, error: FileError) -> None:
        if error.reason != self._refusal:
            self._refusal = error.reason
            raise error


# -- YAML ------------------------------------------------------------------------------------


class _LimitError(yaml.MarkedYAMLError):
    """A document past a guard's limit (not a syntax error)."""


class _GuardedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with a depth limit and an expansion budget checked while nodes are
    composed: the check comes before the recursion it guards and before any alias is expanded."""

    def __init__(self, stream: str, max_depth: int, max_nodes: int) -> None:
        super().__init__(stream)
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.depth = 0
        self.nodes = 0
        self.anchor_sizes: dict[str, int] = {}  # anchor -> the nodes one use of it expands to
        self.open_anchors: set[str] = set()  # anchors whose node is being composed

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        event: NodeEvent = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, AliasEvent):
            if event.anchor in self.open_anchors:
                # A node that contains itself: every consumer walking it would never end.
                raise _LimitError(
                    problem=f"alias *{event.anchor} refers to a node that contains it",
                    problem_mark=_mark(event),
                )
            node = super().compose_node(parent, index)
            self._spend(self.anchor_sizes.get(event.anchor or "", 1), event)
            return node
        if self.depth >= self.max_depth and not isinstance(event, ScalarEvent):
            raise _LimitError(
                problem=f"nested deeper than {self.max_depth} levels",
                problem_mark=_mark(event),
            )
        anchor = event.anchor
        before = self.nodes
        self._spend(1, event)
        self.depth += 1
        if anchor is not None:
            self.open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            if anchor is not None:
                self.open_anchors.discard(anchor)
        if anchor is not None:
            self.anchor_sizes[anchor] = self.nodes - before
        return node

    def _spend(self, nodes: int, event: Event) -> None:
        self.nodes += nodes
        if self.nodes > self.max_nodes:
            raise _LimitError(
                problem=f"expands to more than {self.max_nodes} nodes, aliases counted at each use",
                problem_mark=_mark(event),
            )


def _mark(event: Event) -> Mark | None:
    mark = event.start_mark
    return mark if isinstance(mark, Mark) else None


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if not isinstance(exc, yaml.MarkedYAMLError):
        return f"YAML error: {' '.join(str(exc).split())}"
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
    if isinstance(exc, _LimitError):
        return f"YAML {exc.problem} (at {where})"
    return f"YAML syntax error at {where}: {exc.problem or exc.context}"


def parse_yaml_documents(
    text: str,
    source: str,
    *,
    max_depth: int = MAX_DEPTH,
    max_nodes: int = MAX_YAML_NODES,
) -> list[Any]:
    """Every document of a YAML stream (empty ones dropped), or :class:`FileError` naming the
    line and column of a syntax error, of nesting past ``max_depth`` or of the alias that
    takes the document past ``max_nodes``."""
    loader = _GuardedLoader(text, max_depth, max_nodes)
    try:
        documents = []
        while loader.check_data():  # type: ignore[no-untyped-call]
            document = loader.get_data()
            if document is not None:
                documents.append(document)
        return documents
    except yaml.YAMLError as exc:
        raise FileError(source, _yaml_reason(exc)) from None
    except RecursionError:
        # Not reachable through nesting (checked above); a long chain of merge keys (`<<: *a`
        # over `<<: *b` ...) is flattened recursively by the constructor.
        raise FileError(source, "YAML nested too deeply") from None
    except ValueError as exc:
        # A scalar the constructor cannot convert: an integer of more than 4,300 digits.
        raise FileError(source, f"YAML value refused: {exc}") from None
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str, **limits: int) -> Any:
    """The one document of a YAML file (None for an empty file); a second document is refused
    rather than ignored."""
    documents = parse_yaml_documents(text, source, **limits)
    if len(documents) > 1:
        raise FileError(source, f"holds {len(documents)} YAML documents; expected one")
    return documents[0] if documents else None


# -- JSON ------------------------------------------------------------------------------------


def nesting_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether decoded data nests deeper than ``max_depth`` levels of lists and mappings.
    Iterative, so any depth the decoder produced can be measured."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(text: str, source: str, *, max_depth: int | None = MAX_DEPTH) -> Any:
    """Decoded JSON, or :class:`FileError` naming the line and column of a syntax error or the
    nesting past ``max_depth`` (None: only the decoder's own limit, for files too large to walk
    twice)."""
    limit = f"{max_depth} levels" if max_depth is not None else "the decoder's limit"
    deep = FileError(source, f"JSON nested deeper than {limit}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileError(
            source, f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:  # CPython's decoder stops at its recursion limit, cleanly
        raise deep from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise FileError(source, f"JSON value refused: {exc}") from None
    if max_depth is not None and nesting_depth_exceeds(data, max_depth):
        raise deep
    return data


def load_yaml(path: Path, *, limit: int = MAX_CONFIG_BYTES, what: str = "config file") -> Any:
    """The one YAML (or JSON: YAML's flow style reads it) document of ``path``, guarded."""
    return parse_yaml(read_text(path, limit=limit, what=what), str(path))


def load_json(path: Path, *, limit: int = MAX_CONFIG_BYTES, what: str = "config file") -> Any:
    """The JSON of ``path``, guarded."""
    return parse_json(read_text(path, limit=limit, what=what), str(path))
