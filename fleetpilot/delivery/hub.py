"""Fill a Hugging Face Hub cache folder with one revision of a model repo, once, verified.

The layout is the one huggingface_hub itself writes (``models--org--name/blobs/<etag>``,
``snapshots/<commit>/<file>`` as links to the blobs, ``refs/<revision>`` holding the commit),
written by the library's own ``hf_hub_download``, so that an engine started with
``HF_HUB_CACHE=<folder>`` and ``HF_HUB_OFFLINE=1`` finds the model by ``--model org/name
--revision <revision>`` as if it had downloaded it itself, without a network call.

A run: ``HfApi.model_info(files_metadata=True)`` resolves the revision to its commit and lists
its files with their sizes; the files matching the include patterns are fetched pinned to that
commit (a branch that moves meanwhile cannot mix two commits), by a few threads; then every
file is checked against the listed size, ``refs/<revision>`` is written, and last the marker
(``<repo folder>/.fleetpilot/<revision>.json``). A file whose size is wrong is removed, so a
retry fetches it again rather than failing on it forever.

Resuming: a file already in the snapshot with its listed size is not requested again (the
library returns a file pinned to a commit from disk without a request). A connection dropped
mid-file is resumed by the library with a ranged request, up to five times in a row. A
partial file does not survive the process: huggingface_hub 2.x downloads into a temporary
file of its own, unique to the process, that it deletes on failure, so a killed run fetches the
files it was in the middle of again; the temporaries a killed process could not delete are
removed once their file is complete.

The token comes from ``HF_TOKEN``; it is handed to the library and never logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import HfApi
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from fleetpilot.delivery import progress as progress_log
from fleetpilot.delivery.plan import (
    DeliveryError,
    RemoteFile,
    check_repo_id,
    check_revision,
    default_hub_include,
    hub_marker_path,
    hub_repo_folder,
    hub_snapshot_path,
    marker_files,
    marker_matches,
    marker_payload,
    safe_relative_path,
    select_files,
    size_problems,
    verify_sizes,
)
from fleetpilot.delivery.progress import Progress, fetch_all
from fleetpilot.delivery.store import (
    file_size,
    read_marker,
    sizes_on_disk,
    write_atomic,
    write_marker,
)

log = logging.getLogger("fleetpilot.delivery")

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
# snapshot_download's default: enough parallel streams to fill a link from the Hub's CDN.
DEFAULT_WORKERS = 8


@dataclass(frozen=True)
class HubResult:
    """A finished download: the commit, its snapshot folder, its files, what this run did."""

    repo: str
    revision: str
    commit: str
    snapshot: Path
    files: tuple[RemoteFile, ...]
    files_fetched: int
    already_complete: bool


def hub_endpoint(explicit: str | None = None) -> str:
    """The Hub to ask: ``explicit``, else ``$HF_ENDPOINT`` (a mirror), else huggingface.co."""
    return (explicit or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token() -> str | None:
    """The token in ``$HF_TOKEN`` (a Secret's key, often with a trailing newline), if any."""
    return os.environ.get("HF_TOKEN", "").strip() or None


def hub_source(repo: str, revision: str, include: Sequence[str] | None) -> dict[str, Any]:
    """What a marker records as asked for; ``include`` ``None`` is the default patterns."""
    return {
        "kind": "hub",
        "repo": repo,
        "revision": revision,
        "include": None if include is None else sorted(set(include)),
    }


def fetch_hub(
    repo: str,
    cache_dir: Path,
    *,
    revision: str = DEFAULT_REVISION,
    include: Sequence[str] | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    workers: int = DEFAULT_WORKERS,
) -> HubResult:
    """Download ``repo`` at ``revision`` into the Hub cache ``cache_dir`` and verify it.

    ``include``: shell patterns of the files to fetch (``None``: ``DEFAULT_HUB_INCLUDE``, see
    ``plan.default_hub_include``). ``endpoint``: the Hub (default ``hub_endpoint()``).
    ``token``: for private and gated repos (the CLI passes ``hub_token()``).
    Raises ``DeliveryError`` with a one-line message naming what failed.
    """
    check_repo_id(repo)
    check_revision(revision)
    endpoint = hub_endpoint(endpoint)
    # huggingface_hub resolves the folder the same way; the links it makes are relative to it.
    cache_dir = Path(cache_dir).expanduser().resolve()
    source = hub_source(repo, revision, include)
    marker_path = cache_dir / hub_marker_path(repo, revision)
    storage = cache_dir / hub_repo_folder(repo)

    finished = _finished(marker_path, source, cache_dir, repo, revision)
    if finished is not None:
        commit, files = finished
        progress_log.already_complete(
            f"{repo}@{revision}", files, commit=commit, marker=str(marker_path)
        )
        return HubResult(
            repo,
            revision,
            commit,
            cache_dir / hub_snapshot_path(repo, commit),
            tuple(files),
            0,
            True,
        )

    api = HfApi(endpoint=endpoint, token=token)
    commit, listing = _listing(api, repo, revision, token)
    patterns = (
        list(include) if include is not None else default_hub_include(f.path for f in listing)
    )
    files = select_files(listing, patterns)
    if not files:
        raise DeliveryError(
            f"{repo}@{revision}: none of the {len(listing)} files of commit {commit} matches "
            f"the include patterns {', '.join(patterns)}"
        )
    snapshot = cache_dir / hub_snapshot_path(repo, commit)
    progress = Progress(f"{repo}@{revision}", files)
    progress.plan(commit=commit, include=patterns, cache_dir=str(cache_dir))

    def fetch(file: RemoteFile) -> bool:
        pointer = snapshot / file.path
        if file_size(pointer) == file.size:
            return False
        # A wrong-sized file would be returned from disk as it is: remove it to fetch it again.
        _discard(pointer, storage)
        try:
            huggingface_hub.hf_hub_download(
                repo,
                file.path,
                revision=commit,
                cache_dir=cache_dir,
                endpoint=endpoint,
                token=token,
            )
        except Exception as exc:
            raise DeliveryError(
                f"{repo}@{revision}: {file.path}: {_describe(exc, endpoint)}"
            ) from exc
        return True

    fetch_all(fetch, files, progress, workers)

    on_disk = sizes_on_disk(snapshot, [f.path for f in files])
    if size_problems(files, on_disk):
        # Kept, a wrong file would be returned from disk by every later run and engine.
        for file in files:
            if on_disk[file.path] != file.size:
                _discard(snapshot / file.path, storage)
        verify_sizes(files, on_disk, source="the Hub")
    _remove_orphans(snapshot, files)
    if revision != commit:
        # What an offline engine reads to turn --revision into the snapshot folder; written
        # once the snapshot is whole, like huggingface_hub writes it (the commit, no newline).
        write_atomic(storage / "refs" / revision, commit.encode())
    write_marker(
        marker_path,
        marker_payload(
            source,
            files,
            datetime.now(UTC),
            endpoint=endpoint,
            commit=commit,
            include=patterns,
            snapshot=hub_snapshot_path(repo, commit).as_posix(),
        ),
    )
    progress.complete(commit=commit, snapshot=str(snapshot), marker=str(marker_path))
    return HubResult(repo, revision, commit, snapshot, tuple(files), progress.files_fetched, False)


def _finished(
    marker_path: Path, source: dict[str, Any], cache_dir: Path, repo: str, revision: str
) -> tuple[str, list[RemoteFile]] | None:
    """The commit and files of a matching marker whose files are all on disk, else ``None``."""
    marker = read_marker(marker_path)
    if marker is None or not marker_matches(marker, source):
        return None
    files = marker_files(marker) or []
    commit = marker.get("commit")
    if not isinstance(commit, str) or not commit:
        return None
    try:
        safe_relative_path(commit)
    except DeliveryError:
        return None
    snapshot = cache_dir / hub_snapshot_path(repo, commit)
    problems = size_problems(files, sizes_on_disk(snapshot, [f.path for f in files]))
    ref = cache_dir / hub_repo_folder(repo) / "refs" / revision
    if revision != commit and _read_text(ref) != commit:
        problems.append(f"refs/{revision} does not name {commit}")
    if problems:
        log.warning(
            "%s@%s: the marker says complete, but %s: fetching again",
            repo,
            revision,
            "; ".join(problems[:5]),
            extra={"event": "marker-stale"},
        )
        return None
    return commit, files


def _listing(
    api: HfApi, repo: str, revision: str, token: str | None
) -> tuple[str, list[RemoteFile]]:
    """The commit ``revision`` names and its files with their sizes."""
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True, token=token)
    except Exception as exc:
        raise DeliveryError(f"{repo}@{revision}: {_describe(exc, api.endpoint)}") from exc
    if not info.sha:
        raise DeliveryError(f"{repo}@{revision}: the Hub's answer names no commit")
    files = []
    for sibling in info.siblings or []:
        size = sibling.lfs.size if sibling.lfs is not None else sibling.size
        if size is None:
            raise DeliveryError(
                f"{repo}@{revision}: the Hub lists {sibling.rfilename} without a size"
            )
        try:
            safe_relative_path(sibling.rfilename)
        except DeliveryError as exc:
            raise DeliveryError(f"{repo}@{revision}: file {exc}") from None
        files.append(RemoteFile(sibling.rfilename, size))
    return info.sha, files


def _discard(pointer: Path, storage: Path) -> None:
    """Remove a snapshot file and the blob it links to (a wrong blob is wrong for every
    snapshot that links it: its name is its content's hash)."""
    blobs = storage / "blobs"
    if pointer.is_symlink():
        blob = Path(os.path.realpath(pointer))
        if blob.parent == blobs.resolve():
            blob.unlink(missing_ok=True)
    pointer.unlink(missing_ok=True)


def _remove_orphans(snapshot: Path, files: Sequence[RemoteFile]) -> None:
    """Delete the temporary files (``blobs/<etag>.<id>.incomplete``) a killed run left beside
    blobs that are now complete: nothing will ever finish or read them. A download of the same
    blob by another process holds the blob's lock, so it cannot be running once it exists."""
    for file in files:
        pointer = snapshot / file.path
        if not pointer.is_symlink():
            continue
        blob = Path(os.path.realpath(pointer))
        for orphan in blob.parent.glob(f"{blob.name}.*.incomplete"):
            log.info("removing %s, left by an interrupted download", orphan.name)
            orphan.unlink(missing_ok=True)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _describe(exc: BaseException, endpoint: str) -> str:
    """One line saying what went wrong, in the reader's terms (the library's messages run to
    several lines, with request ids and advice for notebook users)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, GatedRepoError):
        return f"gated repo: the token's account has not been granted access ({first})"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision not found ({first})"
    if isinstance(exc, RepositoryNotFoundError):
        return f"repository not found, or private and the token (HF_TOKEN) cannot read it ({first})"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:
            return f"the Hub refused the token in HF_TOKEN ({first})"
        return f"HTTP {status}: {first}"
    if type(exc).__module__.partition(".")[0] in ("httpx", "httpx2", "httpcore"):
        return f"cannot reach {endpoint}: {first}"
    if isinstance(exc, LocalEntryNotFoundError):
        cause = exc.__cause__
        detail = f": {str(cause).splitlines()[0]}" if cause is not None and str(cause) else ""
        return f"cannot reach {endpoint}{detail}"
    return f"{type(exc).__name__}: {first}"
