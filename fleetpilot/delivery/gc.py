"""Free a model cache of the downloads nothing keeps any more (``fleetpilot model gc``).

What the fetchers leave in a cache (``fleetpilot.delivery.hub`` and ``.s3``):

- a Hub cache folder, laid out by huggingface_hub: per repo ``models--org--name/`` with
  ``blobs/<etag>`` (the bytes), ``snapshots/<commit>/<file>`` (links to the blobs),
  ``refs/<revision>`` (the commit a branch or tag named), the library's ``.no_exist/<commit>/``
  and ``trees/<commit>.json`` (what it learnt of a commit), our markers
  ``.fleetpilot/<revision>.json``, and beside the repos the library's lock files
  ``.locks/models--org--name/<etag>.lock``;
- an S3 folder: one folder per download (the operator names it, ``s3_key``), with the marker
  ``.fleetpilot-model.json``.

Given what to keep (Hub repos at a revision, S3 folders by name), a run removes from a Hub repo
the snapshot of every other commit with the refs, markers, ``.no_exist`` and ``trees`` entries
of those commits, then the blobs no kept snapshot links to (and their lock files); a Hub repo
nothing keeps goes whole, and so does an S3 folder not kept. A revision is found as
huggingface_hub finds it offline (what an engine does): ``refs/<revision>`` names its commit,
else it is a commit itself; so keeping ``main`` keeps the snapshot ``refs/main`` names.

Only what a fetcher wrote is touched: a Hub repo folder holding our marker folder, an S3 folder
holding its marker. One without (someone else's on a shared volume, or a first download still
running or killed before its marker) stays, and is reported, as does everything else in the
cache (other repo types, ``CACHEDIR.TAG``, other files). A kept revision that is not on disk
leaves its whole repo as it is: which snapshot it needs is unknown.

Idempotent: a second run finds nothing to remove. The markers go last, so a repo or folder a
killed run left half removed is still recognised, and the next run finishes it (a download
asked again meanwhile sees its files missing under the marker and fetches them again).

It must not run beside a download into the same cache: the files of a revision it does not
keep would be removed under their writer (that download then fails its verification, and its
Job retries). The operator runs it once every download it plans is complete
(``fleetpilot.operator.model_cache``).

The decisions (:func:`hub_repo_garbage`, :func:`s3_garbage`) are pure functions of what a scan
found; :func:`collect_garbage` scans, and removes what they decided.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

from fleetpilot.delivery.plan import (
    HUB_MARKER_DIR,
    MARKER_NAME,
    DeliveryError,
    check_repo_id,
    check_revision,
    hub_repo_folder,
)
from fleetpilot.delivery.store import read_marker

log = logging.getLogger("fleetpilot.delivery")

HUB_REPO_PREFIX = "models--"
LOCKS_DIR = ".locks"
# A marker file, as opposed to the temporary one an interrupted write left (".<name>.tmp").
_MARKER_SUFFIX = ".json"


@dataclass(frozen=True)
class HubKeep:
    """A Hub download to keep: ``repo`` at ``revision`` (a branch, tag or commit)."""

    repo: str
    revision: str

    @classmethod
    def parse(cls, text: str) -> HubKeep:
        """``ORG/NAME@REVISION`` (no ``@``: ``main``, as the fetcher's default), checked as the
        fetcher checks them; ``DeliveryError`` otherwise."""
        repo, at, revision = text.partition("@")
        if at and not revision:
            raise DeliveryError(f"{text!r}: no revision after '@'")
        return cls(check_repo_id(repo), check_revision(revision or "main"))

    def __str__(self) -> str:
        return f"{self.repo}@{self.revision}"


@dataclass(frozen=True)
class HubRepoLayout:
    """What one Hub repo folder holds, by name, as a scan found it."""

    # commit -> the names (in blobs/) of the blobs its files link to
    snapshots: Mapping[str, frozenset[str]]
    # revision ("main", "refs/pr/1") -> the commit its ref file names
    refs: Mapping[str, str] = field(default_factory=dict)
    # marker file name -> the commit it records (None: unreadable)
    markers: Mapping[str, str | None] = field(default_factory=dict)
    # other files in the marker folder: temporaries an interrupted marker write left
    marker_leftovers: frozenset[str] = frozenset()
    blobs: frozenset[str] = frozenset()  # names in blobs/, temporaries (*.incomplete) too
    no_exist: frozenset[str] = frozenset()  # commits with a .no_exist/<commit> folder
    trees: frozenset[str] = frozenset()  # commits with a trees/<commit>.json listing
    locks: frozenset[str] = frozenset()  # names in .locks/<repo folder>/ (<etag>.lock)


@dataclass(frozen=True)
class Garbage:
    """One path to remove (relative to the folder scanned) and why, for the log."""

    path: PurePosixPath
    reason: str


@dataclass(frozen=True)
class Decision:
    """What to remove, in order, and what was left that a reader should know of."""

    garbage: list[Garbage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def marker_revision(file_name: str) -> str:
    """The revision a marker file is named after (``hub_marker_path`` quotes it)."""
    return unquote(file_name.removesuffix(_MARKER_SUFFIX))


def resolve_revision(revision: str, layout: HubRepoLayout) -> str | None:
    """The commit ``revision`` names in the cache, as huggingface_hub resolves it offline
    (``try_to_load_from_cache``): its ref file's commit, else the revision itself; ``None``
    when that commit has no snapshot."""
    commit = layout.refs.get(revision, revision)
    return commit if commit in layout.snapshots else None


def hub_repo_garbage(folder: str, layout: HubRepoLayout, keep: Collection[str]) -> Decision:
    """What to remove of the repo folder ``folder`` (paths relative to the Hub cache folder)
    to keep only the revisions ``keep`` (none: the whole repo)."""
    locks = PurePosixPath(LOCKS_DIR, folder)
    if not keep:
        # The lock files first: once the repo folder is gone, nothing would find them again.
        return Decision(
            [
                Garbage(locks, "the lock files of a repo no kept download reads"),
                Garbage(PurePosixPath(folder), "no kept download reads this repo"),
            ]
        )
    kept: dict[str, str] = {}
    for revision in sorted(keep):
        commit = resolve_revision(revision, layout)
        if commit is None:
            return Decision(
                notes=[
                    f"{folder}: the kept revision {revision} is not in the cache (no ref "
                    "naming a snapshot, no snapshot of that name): nothing of it removed"
                ]
            )
        kept[revision] = commit
    commits = set(kept.values())
    repo = PurePosixPath(folder)
    garbage: list[Garbage] = []

    def not_kept(commit: str) -> str:
        return f"commit {commit}, not kept (kept: {', '.join(sorted(commits))})"

    # Refs first: an engine starting meanwhile no longer resolves a revision to a snapshot
    # that is going; the markers last (see the module's docstring).
    for revision, commit in sorted(layout.refs.items()):
        if commit not in commits:
            garbage.append(Garbage(repo / "refs" / revision, f"names {not_kept(commit)}"))
    for commit in sorted(layout.snapshots.keys() - commits):
        garbage.append(Garbage(repo / "snapshots" / commit, f"snapshot of {not_kept(commit)}"))
    for commit in sorted(layout.no_exist - commits):
        garbage.append(Garbage(repo / ".no_exist" / commit, f"what {not_kept(commit)} lacks"))
    for commit in sorted(layout.trees - commits):
        garbage.append(Garbage(repo / "trees" / f"{commit}.json", f"listing of {not_kept(commit)}"))
    linked = frozenset().union(*(layout.snapshots[c] for c in commits))
    for blob in sorted(layout.blobs - linked):
        garbage.append(Garbage(repo / "blobs" / blob, "no kept snapshot links to it"))
    for lock in sorted(layout.locks):
        if lock.removesuffix(".lock") not in linked:
            garbage.append(Garbage(locks / lock, "the lock file of a blob no snapshot keeps"))
    for name in sorted(layout.marker_leftovers):
        garbage.append(Garbage(repo / HUB_MARKER_DIR / name, "left by an interrupted write"))
    for name, commit in sorted(layout.markers.items()):
        if marker_revision(name) not in kept and commit not in commits:
            why = not_kept(commit) if commit else "unreadable, of a revision not kept"
            garbage.append(Garbage(repo / HUB_MARKER_DIR / name, f"marker of {why}"))
    return Decision(garbage)


def s3_garbage(folders: Mapping[str, bool], keep: Collection[str]) -> Decision:
    """What to remove of an S3 downloads folder holding ``folders`` (name -> whether it holds
    a fetcher's marker) to keep only the folders ``keep``."""
    decision = Decision()
    for name, ours in sorted(folders.items()):
        if name in keep:
            continue
        if ours:
            decision.garbage.append(Garbage(PurePosixPath(name), "an S3 download not kept"))
        else:
            decision.notes.append(
                f"{name}: no {MARKER_NAME} (not a finished fleetpilot download): left"
            )
    return decision


# -- the disk ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Removed:
    path: Path
    bytes: int
    reason: str


@dataclass(frozen=True)
class GcResult:
    removed: tuple[Removed, ...]
    notes: tuple[str, ...]
    dry_run: bool

    @property
    def bytes_freed(self) -> int:
        return sum(r.bytes for r in self.removed)

    def summary(self) -> str:
        verb = "would free" if self.dry_run else "freed"
        return f"{verb} {self.bytes_freed} bytes ({len(self.removed)} paths removed)"


def collect_garbage(
    *,
    hub_cache_dir: Path | None = None,
    keep_hub: Iterable[HubKeep] = (),
    s3_dir: Path | None = None,
    keep_s3: Iterable[str] = (),
    dry_run: bool = False,
) -> GcResult:
    """Remove from the Hub cache folder ``hub_cache_dir`` every download but ``keep_hub``, and
    from the S3 downloads folder ``s3_dir`` every folder but ``keep_s3`` (see the module's
    docstring for what is recognised). A folder not given is not looked at; one given but
    absent holds nothing. ``dry_run``: report, remove nothing. Raises ``DeliveryError`` naming
    a path it could not remove."""
    keep_hub, keep_s3 = list(keep_hub), list(keep_s3)
    if keep_hub and hub_cache_dir is None:
        raise DeliveryError("Hub downloads to keep, but no Hub cache folder")
    if keep_s3 and s3_dir is None:
        raise DeliveryError("S3 downloads to keep, but no S3 downloads folder")
    for name in keep_s3:
        if "/" in name or name in ("", ".", ".."):
            raise DeliveryError(f"{name!r}: an S3 download is kept by its folder's name")
    removed: list[Removed] = []
    notes: list[str] = []
    if hub_cache_dir is not None:
        root = Path(hub_cache_dir).expanduser().resolve()
        for decision in _hub_decisions(root, keep_hub):
            removed += _carry_out(root, decision, dry_run)
            notes += decision.notes
    if s3_dir is not None:
        root = Path(s3_dir).expanduser().resolve()
        folders = {
            entry.name: (Path(entry.path) / MARKER_NAME).is_file()
            for entry in _entries(root)
            if entry.is_dir(follow_symlinks=False)
        }
        decision = s3_garbage(folders, set(keep_s3))
        decision.notes.extend(
            f"{name}: kept, but not in {root}" for name in sorted(set(keep_s3) - folders.keys())
        )
        removed += _carry_out(root, decision, dry_run)
        notes += decision.notes
    for note in notes:
        log.info("%s", note, extra={"event": "left"})
    result = GcResult(tuple(removed), tuple(notes), dry_run)
    log.info(
        "%s",
        result.summary(),
        extra={
            "event": "gc-complete",
            "bytes_freed": result.bytes_freed,
            "removed": len(removed),
            "dry_run": dry_run,
        },
    )
    return result


def _hub_decisions(root: Path, keep: Sequence[HubKeep]) -> list[Decision]:
    wanted: dict[str, list[HubKeep]] = {}
    for item in keep:
        wanted.setdefault(hub_repo_folder(item.repo), []).append(item)
    decisions = []
    for entry in _entries(root):
        if not entry.name.startswith(HUB_REPO_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        repo = Path(entry.path)
        kept = wanted.pop(entry.name, [])
        if not (repo / HUB_MARKER_DIR).is_dir():
            note = f"{entry.name}: no {HUB_MARKER_DIR} folder (not a fleetpilot download, or "
            decisions.append(Decision(notes=[note + "its first one is unfinished): left"]))
            continue
        layout = scan_hub_repo(repo, root / LOCKS_DIR / entry.name)
        decisions.append(hub_repo_garbage(entry.name, layout, {k.revision for k in kept}))
    missing = sorted(str(item) for items in wanted.values() for item in items)
    if missing:
        decisions.append(Decision(notes=[f"kept, but not in {root}: {', '.join(missing)}"]))
    return decisions


def scan_hub_repo(repo: Path, locks: Path) -> HubRepoLayout:
    """Read a Hub repo folder (and its lock folder) into a :class:`HubRepoLayout`."""
    blobs_dir = (repo / "blobs").resolve()
    snapshots = {
        entry.name: frozenset(_linked_blobs(Path(entry.path), blobs_dir))
        for entry in _entries(repo / "snapshots")
        if entry.is_dir(follow_symlinks=False)
    }
    refs = {}
    refs_dir = repo / "refs"
    for path in _files_under(refs_dir):
        text = _read_text(path)
        if text is not None and text.strip():
            refs[path.relative_to(refs_dir).as_posix()] = text.strip()
    markers: dict[str, str | None] = {}
    leftovers = set()
    for entry in _entries(repo / HUB_MARKER_DIR):
        if entry.name.endswith(_MARKER_SUFFIX) and not entry.name.startswith("."):
            commit = (read_marker(Path(entry.path)) or {}).get("commit")
            markers[entry.name] = commit if isinstance(commit, str) and commit else None
        elif entry.is_file(follow_symlinks=False):
            leftovers.add(entry.name)
    return HubRepoLayout(
        snapshots=snapshots,
        refs=refs,
        markers=markers,
        marker_leftovers=frozenset(leftovers),
        blobs=frozenset(e.name for e in _entries(repo / "blobs") if not e.is_dir()),
        no_exist=frozenset(e.name for e in _entries(repo / ".no_exist") if e.is_dir()),
        trees=frozenset(
            e.name.removesuffix(".json")
            for e in _entries(repo / "trees")
            if e.name.endswith(".json")
        ),
        locks=frozenset(e.name for e in _entries(locks) if e.name.endswith(".lock")),
    )


def _linked_blobs(snapshot: Path, blobs_dir: Path) -> Iterable[str]:
    """The names of the blobs the links under ``snapshot`` point to."""
    for path in _files_under(snapshot):
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if target.parent == blobs_dir:
                yield target.name


def _carry_out(root: Path, decision: Decision, dry_run: bool) -> list[Removed]:
    removed = []
    for item in decision.garbage:
        path = root / item.path
        if not os.path.lexists(path):
            continue
        size = _size(path)
        if not dry_run:
            try:
                _remove(path)
            except OSError as exc:
                raise DeliveryError(f"cannot remove {path}: {exc}") from exc
        log.info(
            "%s %s (%d bytes): %s",
            "would remove" if dry_run else "removed",
            path,
            size,
            item.reason,
            extra={"event": "removed", "path": str(path), "bytes": size, "reason": item.reason},
        )
        removed.append(Removed(path, size, item.reason))
    return removed


def _remove(path: Path) -> None:
    """Remove a file, link or folder; a folder's markers last (see the module's docstring)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    children = sorted(path.iterdir(), key=lambda p: p.name in (HUB_MARKER_DIR, MARKER_NAME))
    for child in children:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink(missing_ok=True)
    path.rmdir()


def _size(path: Path) -> int:
    """The bytes of the regular files at or under ``path`` (links are not followed)."""
    if path.is_dir() and not path.is_symlink():
        return sum(_size(file) for file in _files_under(path))
    status = path.lstat()
    return status.st_size if stat.S_ISREG(status.st_mode) else 0


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _files_under(folder: Path) -> Iterable[Path]:
    """Every file and link under ``folder``, without following links to folders."""
    for entry in _entries(folder):
        if entry.is_dir(follow_symlinks=False):
            yield from _files_under(Path(entry.path))
        else:
            yield Path(entry.path)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
