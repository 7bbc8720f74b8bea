"""The disk side of a model download: atomic writes, the completion marker, sizes on disk.

The cache is a shared volume that several Jobs and many engine pods read: a file that appears
there must be whole. Everything written here goes to a temporary name in the same folder,
is flushed to the device and renamed over its final name, so a reader sees the old file or
the new one, and a killed writer leaves at most a temporary file behind.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("fleetpilot.delivery")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename) to the device, where the filesystem allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker at ``path``, or ``None`` when there is none or it cannot be read as one
    (a later run then downloads again and writes a fresh one)."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring the unreadable marker %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def write_marker(path: Path, payload: Mapping[str, Any]) -> None:
    write_atomic(path, (json.dumps(payload, indent=2, sort_keys=False) + "\n").encode())


def file_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` (a symlink is followed), ``None`` if there is
    none."""
    try:
        stat = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return stat.st_size if path.is_file() else None


def sizes_on_disk(root: Path, paths: Iterable[str]) -> dict[str, int | None]:
    """The size of each of ``paths`` (relative, '/'-separated) under ``root``."""
    return {path: file_size(root / path) for path in paths}
