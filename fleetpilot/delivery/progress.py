"""Progress of a model download as structured log lines.

One line when the plan is known (``event: plan``), one per file once it is on disk
(``event: file``: ``fetched`` false when an earlier run had already put it in place), and one at
the end (``event: complete``, or ``already-complete`` when a marker said there was nothing to
do). Each carries ``files_done``/``files_total`` and ``bytes_done``/``bytes_total``, so a log
pipeline (or the operator reading the Job's log) can show how far a download is without
parsing sentences. The lines go through the ``fleetpilot.delivery`` logger, formatted by
``fleetpilot.logs`` like every other fleetpilot process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

from fleetpilot.delivery.plan import RemoteFile

log = logging.getLogger("fleetpilot.delivery")


class Progress:
    """Counts finished files and bytes of one download; safe to call from worker threads."""

    def __init__(self, source: str, files: Sequence[RemoteFile]) -> None:
        self.source = source
        self.files_total = len(files)
        self.bytes_total = sum(f.size for f in files)
        self.files_done = 0
        self.bytes_done = 0
        self.files_fetched = 0
        self.bytes_fetched = 0
        self._lock = threading.Lock()

    def _counts(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "files_done": self.files_done,
            "files_total": self.files_total,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
        }

    def plan(self, **details: Any) -> None:
        log.info(
            "%s: %d files, %d bytes to verify or fetch",
            self.source,
            self.files_total,
            self.bytes_total,
            extra={"event": "plan", **self._counts(), **details},
        )

    def file_done(self, file: RemoteFile, *, fetched: bool) -> None:
        with self._lock:
            self.files_done += 1
            self.bytes_done += file.size
            if fetched:
                self.files_fetched += 1
                self.bytes_fetched += file.size
            counts = self._counts()
        log.info(
            "%s %s (%d/%d files, %d/%d bytes)",
            "fetched" if fetched else "already on disk:",
            file.path,
            counts["files_done"],
            counts["files_total"],
            counts["bytes_done"],
            counts["bytes_total"],
            extra={"event": "file", "file": file.path, "size": file.size, "fetched": fetched}
            | counts,
        )

    def complete(self, **details: Any) -> None:
        log.info(
            "%s: complete and verified: %d/%d files, %d/%d bytes (%d files, %d bytes fetched)",
            self.source,
            self.files_done,
            self.files_total,
            self.bytes_done,
            self.bytes_total,
            self.files_fetched,
            self.bytes_fetched,
            extra={
                "event": "complete",
                **self._counts(),
                "files_fetched": self.files_fetched,
                "bytes_fetched": self.bytes_fetched,
                **details,
            },
        )


def already_complete(source: str, files: Sequence[RemoteFile], **details: Any) -> None:
    """The one line of a run that found a matching marker and the files it lists on disk."""
    total = sum(f.size for f in files)
    log.info(
        "%s: already complete (%d files, %d bytes); nothing to do",
        source,
        len(files),
        total,
        extra={
            "event": "already-complete",
            "source": source,
            "files_done": len(files),
            "files_total": len(files),
            "bytes_done": total,
            "bytes_total": total,
            **details,
        },
    )


def fetch_all(
    fetch: Callable[[RemoteFile], bool],
    files: Sequence[RemoteFile],
    progress: Progress,
    workers: int,
) -> None:
    """``fetch`` every file on ``workers`` threads (``fetch`` answers whether it transferred
    the file or found it on disk), logging each as it ends; the first failure cancels the
    files not yet started and is raised once the running ones have ended."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="fetch") as pool:
        futures: dict[Future[bool], RemoteFile] = {pool.submit(fetch, f): f for f in files}
        try:
            for future in as_completed(futures):
                progress.file_done(futures[future], fetched=future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise
