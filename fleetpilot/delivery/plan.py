"""The decisions of a model download, as plain functions over plain data.

A download Job fills a model cache once per model revision (``fleetpilot.delivery.hub`` for the
Hugging Face Hub, ``fleetpilot.delivery.s3`` for S3-compatible object storage). What it fetches,
where each remote name may land on disk, how much of a partial file can be kept, whether what is
on disk is what the source listed and whether an earlier run already finished are decided here,
without network or disk access, so that each rule is tested on its own.

The completion marker is a small JSON document written last, atomically, once every file is on
disk and verified: its presence means "complete and verified", and a later run whose request
matches it does nothing.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

MARKER_NAME = ".fleetpilot-model.json"
MARKER_VERSION = 1
# Where a Hub download's markers live, inside the repo's cache folder: huggingface_hub's cache
# scan ignores names it does not know there (a file at the cache root would be reported as a
# corrupted repo), and one cache folder holds many repos and revisions.
HUB_MARKER_DIR = ".fleetpilot"
PART_SUFFIX = ".part"

# What vLLM reads from a Hub repo: config and generation config, tokenizer files (tokenizer.json,
# vocab.json + merges.txt, SentencePiece *.model, tiktoken ranks, chat templates as *.jinja or
# in JSON), preprocessor configs for multimodal models, the safetensors weights and their index,
# and the Python code of models loaded with --trust-remote-code. Left out on purpose: PyTorch
# pickles (*.bin, *.pt, *.pth: duplicates of the safetensors in most repos, and the
# consolidated checkpoints under original/), GGUF, ONNX and TensorFlow/Flax files, which vLLM
# never reads for a safetensors model and which can double the bytes fetched.
DEFAULT_HUB_INCLUDE: tuple[str, ...] = (
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.py",
    "*.tiktoken",
    "*.jinja",
)
# vLLM's own fallback (load format "auto" tries *.safetensors, then *.bin): a revision without
# safetensors weights is served from its PyTorch pickles, so the default takes them then.
PICKLE_WEIGHTS = "*.bin"

# huggingface_hub's rules for a repo id (utils/_validators.py): one optional namespace, word
# characters, '-' and '.', no '--' or '..', at most 96 characters.
_REPO_ID = re.compile(r"^(?:[\w\-.]{1,96}/)?[\w\-.]{1,96}$")
_MD5_HEX = re.compile(r"^[0-9a-f]{32}$")


class DeliveryError(Exception):
    """A download that cannot complete; the message is one line and names the file at fault."""


class UnsafePathError(DeliveryError):
    """A remote name that would land outside the destination, or on top of another file."""


class VerificationError(DeliveryError):
    """What is on disk is not what the source listed."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a source listing: its path relative to the destination, as '/'-separated
    text, its size in bytes, and (S3) the object's ETag, kept for the MD5 check."""

    path: str
    size: int
    etag: str | None = None


def check_repo_id(repo: str) -> str:
    """``repo`` when it is a Hub model id (``org/name`` or ``name``), else ``DeliveryError``."""
    if not _REPO_ID.match(repo) or "--" in repo or ".." in repo or repo.endswith(".git"):
        raise DeliveryError(f"{repo!r} is not a Hugging Face repo id (expected ORG/NAME)")
    return repo


def safe_relative_path(name: str) -> PurePosixPath:
    """``name`` as a relative path that stays inside whatever folder it is joined to.

    Refused: empty names, absolute paths, ``..`` or ``.`` segments, empty segments (``a//b``,
    a trailing '/'), backslashes (a separator on some filesystems) and control characters.
    """
    if not name:
        raise UnsafePathError("an empty name")
    if any(ord(ch) < 0x20 or ch == "\x7f" for ch in name):
        raise UnsafePathError(f"{name!r}: control characters in the name")
    if "\\" in name:
        raise UnsafePathError(f"{name!r}: a backslash in the name")
    if name.startswith("/"):
        raise UnsafePathError(f"{name!r}: an absolute path")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafePathError(f"{name!r}: would leave the destination ('..', '.' or '//')")
    return PurePosixPath(*parts)


def check_revision(revision: str) -> str:
    """``revision`` when it can name a ref file in the Hub cache (``refs/<revision>``): a branch,
    a tag, ``refs/pr/N`` or a commit hash; else ``DeliveryError``."""
    try:
        safe_relative_path(revision)
    except UnsafePathError as exc:
        raise DeliveryError(f"revision {exc}") from None
    return revision


def hub_repo_folder(repo: str) -> str:
    """The repo's folder in a Hub cache, as huggingface_hub names it (``models--org--name``)."""
    return "--".join(["models", *repo.split("/")])


def hub_marker_path(repo: str, revision: str) -> PurePosixPath:
    """Where, relative to the cache folder, the marker of ``repo`` at ``revision`` lives."""
    return PurePosixPath(hub_repo_folder(repo), HUB_MARKER_DIR, quote(revision, safe="") + ".json")


def hub_snapshot_path(repo: str, commit: str) -> PurePosixPath:
    """The snapshot folder of ``repo`` at ``commit``, relative to the cache folder."""
    return PurePosixPath(hub_repo_folder(repo), "snapshots", commit)


def default_hub_include(paths: Iterable[str]) -> tuple[str, ...]:
    """The default include patterns for a revision holding ``paths``: ``DEFAULT_HUB_INCLUDE``,
    plus the PyTorch pickles when the revision has no safetensors weights."""
    paths = list(paths)
    if any(matches(path, ("*.safetensors",)) for path in paths):
        return DEFAULT_HUB_INCLUDE
    return (*DEFAULT_HUB_INCLUDE, PICKLE_WEIGHTS)


def matches(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` matches one of ``patterns``, with huggingface_hub's rules
    (``filter_repo_objects``): shell patterns over the whole path, where ``*`` also crosses
    '/', so ``*.json`` takes ``original/params.json``; a pattern ending in '/' takes the
    folder's contents."""
    return any(
        fnmatch.fnmatch(path, pattern + "*" if pattern.endswith("/") else pattern)
        for pattern in patterns
    )


def select_files(files: Iterable[RemoteFile], include: Sequence[str]) -> list[RemoteFile]:
    """The files matching one of ``include``, sorted by path."""
    return sorted((f for f in files if matches(f.path, include)), key=lambda f: f.path)


def s3_prefix(prefix: str) -> str:
    """A user's prefix as the folder it names: no leading '/', one trailing '/' unless empty,
    so ``models/llama`` does not also take ``models/llama-2/...``."""
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


def s3_files(objects: Iterable[tuple[str, int, str | None]], prefix: str) -> list[RemoteFile]:
    """The files a listing of ``(key, size, etag)`` under the folder ``prefix`` (already
    normalised by ``s3_prefix``) becomes, each at its key relative to the prefix.

    Folder placeholders (keys ending in '/', the prefix's own among them) are skipped; a key
    outside the prefix, or one that would leave the destination or collide with another (see
    ``check_layout``), fails the whole listing before anything is written.
    """
    files = []
    for key, size, etag in objects:
        if not key.startswith(prefix):
            raise UnsafePathError(f"{key!r}: outside the prefix {prefix!r}")
        relative = key[len(prefix) :]
        if not relative or relative.endswith("/"):
            continue
        try:
            path = safe_relative_path(relative)
        except UnsafePathError as exc:
            raise UnsafePathError(f"object {key!r} refused: {exc}") from None
        if path.as_posix() == MARKER_NAME:
            raise UnsafePathError(f"object {key!r} refused: it is named like the marker")
        files.append(RemoteFile(path.as_posix(), size, etag))
    check_layout(f.path for f in files)
    return sorted(files, key=lambda f: f.path)


def check_layout(paths: Iterable[str]) -> None:
    """Refuse a listing whose files cannot all exist side by side on disk: one path that is
    also a folder of another (``a`` and ``a/b``), or a file named like another's partial
    download (``a`` and ``a.part``)."""
    paths = sorted(set(paths))
    taken = set(paths)
    for path in paths:
        parents = PurePosixPath(path).parents
        for parent in list(parents)[:-1]:
            if parent.as_posix() in taken:
                raise UnsafePathError(f"{parent.as_posix()!r} is both a file and a folder")
        if path + PART_SUFFIX in taken:
            raise UnsafePathError(
                f"{path + PART_SUFFIX!r} collides with the partial file of {path!r}"
            )


def resume_offset(size: int, part_size: int | None) -> int:
    """Where to continue a file of ``size`` bytes from a partial file of ``part_size`` bytes
    (``None``: none): its length when it is a prefix's length, 0 (start over) when it is longer
    than the file, which a partial file of this file cannot be."""
    if part_size is None or part_size > size:
        return 0
    return part_size


def md5_of_etag(etag: str | None) -> str | None:
    """The MD5 digest an S3 ETag carries, or ``None`` when it carries none: an object uploaded
    in parts has ``<md5 of the parts' md5s>-<parts>``, and servers that encrypt with KMS or a
    customer key send an ETag that is not an MD5 at all (the caller checks for those)."""
    if etag is None:
        return None
    value = etag.strip().strip('"').lower()
    return value if _MD5_HEX.match(value) else None


def size_problems(expected: Iterable[RemoteFile], on_disk: Mapping[str, int | None]) -> list[str]:
    """One line per file of ``expected`` whose size on disk (``None``: absent) differs."""
    problems = []
    for file in expected:
        actual = on_disk.get(file.path)
        if actual is None:
            problems.append(f"{file.path}: missing")
        elif actual != file.size:
            problems.append(f"{file.path}: {actual} bytes on disk, {file.size} listed")
    return problems


def verify_sizes(
    expected: Sequence[RemoteFile], on_disk: Mapping[str, int | None], *, source: str
) -> None:
    """``VerificationError`` naming the files (the first five) whose size on disk is not the
    size ``source`` listed."""
    problems = size_problems(expected, on_disk)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise VerificationError(
            f"verification against {source} failed: {'; '.join(problems[:5])}{more}"
        )


def marker_payload(
    source: Mapping[str, Any],
    files: Sequence[RemoteFile],
    finished: datetime,
    **details: Any,
) -> dict[str, Any]:
    """The marker of a verified download: what was asked for (``source``, compared by later
    runs), the files with their sizes, when it finished, and ``details`` (endpoint, commit...)."""
    return {
        "version": MARKER_VERSION,
        "source": dict(source),
        **details,
        "files": [{"path": f.path, "size": f.size} for f in files],
        "bytes": sum(f.size for f in files),
        "finished": finished.isoformat(timespec="seconds"),
    }


def marker_files(marker: Mapping[str, Any]) -> list[RemoteFile] | None:
    """The files a marker lists, or ``None`` when it is not a marker this version wrote."""
    if marker.get("version") != MARKER_VERSION or not isinstance(marker.get("files"), list):
        return None
    files = []
    for entry in marker["files"]:
        if not isinstance(entry, dict):
            return None
        path, size = entry.get("path"), entry.get("size")
        if not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool):
            return None
        files.append(RemoteFile(path, size))
    return files


def marker_matches(marker: Mapping[str, Any] | None, source: Mapping[str, Any]) -> bool:
    """Whether ``marker`` records a finished download of exactly ``source``."""
    return (
        marker is not None
        and marker_files(marker) is not None
        and marker.get("source") == dict(source)
    )
