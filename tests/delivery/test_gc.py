"""``fleetpilot model gc`` on caches the real fetchers wrote (the Hub's through
``hub_server.FakeHub``, S3's markers by the store's own writer): it removes exactly the
downloads not kept, the kept ones still load as an offline engine loads them, nothing it did not
write is touched, and a second run removes nothing."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants, try_to_load_from_cache

from fleetpilot.cli import main
from fleetpilot.delivery.gc import (
    HubKeep,
    HubRepoLayout,
    collect_garbage,
    hub_repo_garbage,
)
from fleetpilot.delivery.hub import fetch_hub
from fleetpilot.delivery.plan import (
    MARKER_NAME,
    DeliveryError,
    RemoteFile,
    hub_marker_path,
    marker_payload,
)
from fleetpilot.delivery.s3 import s3_source
from fleetpilot.delivery.store import write_marker
from tests.delivery.hub_server import FakeHub

REPO = "acme/tiny-llm"
OTHER = "acme/draft"
V1 = "1" * 40  # the commit tag v1 names
MAIN = "2" * 40  # the commit main names, later


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No token, endpoint or offline switch from this machine; logging as it was after (the
    CLI configures the root logger)."""
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored"))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@dataclass(frozen=True)
class Fetched:
    cache: Path
    v1: dict[str, bytes]
    main: dict[str, bytes]

    @property
    def storage(self) -> Path:
        return self.cache / "models--acme--tiny-llm"

    def blob(self, commit: str, name: str) -> Path:
        return Path(os.path.realpath(self.storage / "snapshots" / commit / name))


def _fetch(hub: FakeHub, repo: str, cache: Path, revision: str) -> None:
    fetch_hub(repo, cache, revision=revision, endpoint=hub.endpoint, workers=2)


@pytest.fixture
def fetched(tmp_path: Path) -> Fetched:
    """``REPO`` fetched at tag v1, then at main, a later commit that changed the config and
    the second shard (the tokenizer and the first shard are the same blobs in both)."""
    rng = random.Random(7)
    shared = {"model-00001-of-00002.safetensors": rng.randbytes(40_000), "tokenizer.json": b"{}"}
    v1 = shared | {
        "config.json": b'{"v": 1}',
        "model-00002-of-00002.safetensors": rng.randbytes(30_000),
    }
    main = shared | {
        "config.json": b'{"v": 2}',
        "model-00002-of-00002.safetensors": rng.randbytes(20_000),
    }
    cache = tmp_path / "hub"
    hub = FakeHub(REPO, v1, revision="v1", commit=V1)
    try:
        _fetch(hub, REPO, cache, "v1")
        hub.files, hub.revision, hub.commit = main, "main", MAIN
        hub.commits.add(MAIN)
        _fetch(hub, REPO, cache, "main")
    finally:
        hub.close()
    return Fetched(cache, v1, main)


def _gc(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[dict[str, Any]]]:
    code = main(["model", "gc", *argv])
    out, err = capsys.readouterr()
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    return code, out.strip(), lines


def _tree(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def _loads_offline(cache: Path, revision: str, files: dict[str, bytes]) -> bool:
    """Every file of ``revision`` resolves in the cache as huggingface_hub resolves it offline
    (refs, then the snapshot), with its bytes."""
    for name, content in files.items():
        path = try_to_load_from_cache(REPO, name, cache_dir=cache, revision=revision)
        if not isinstance(path, str) or Path(path).read_bytes() != content:
            return False
    return True


def test_keeping_main_removes_the_other_revision_and_only_its_own_blobs(
    fetched: Fetched, capsys: pytest.CaptureFixture[str]
) -> None:
    cache, storage = fetched.cache, fetched.storage
    v1_only = {fetched.blob(V1, n) for n in ("config.json", "model-00002-of-00002.safetensors")}
    shared = {fetched.blob(V1, n) for n in ("tokenizer.json", "model-00001-of-00002.safetensors")}
    assert _loads_offline(cache, "v1", fetched.v1)
    # The blobs' bytes, and the ref's and the marker's: all that was v1's alone.
    v1_files = [*v1_only, storage / "refs" / "v1", cache / hub_marker_path(REPO, "v1")]
    freed = sum(path.stat().st_size for path in v1_files)

    code, out, lines = _gc(capsys, "--hub-cache-dir", str(cache), "--keep-hub", f"{REPO}@main")
    assert code == 0
    assert out == f"freed {freed} bytes (7 paths removed)"
    removed = [line["path"] for line in lines if line.get("event") == "removed"]
    locks = cache / ".locks" / storage.name
    assert removed == [
        str(storage / "refs" / "v1"),  # first: no engine resolves v1 to a going snapshot
        str(storage / "snapshots" / V1),
        *sorted(str(blob) for blob in v1_only),
        *sorted(str(locks / f"{blob.name}.lock") for blob in v1_only),
        str(cache / hub_marker_path(REPO, "v1")),  # last: a killed run is finished by the next
    ]
    assert lines[-1]["event"] == "gc-complete"
    assert lines[-1]["bytes_freed"] == freed

    assert not any(blob.exists() for blob in v1_only)
    assert all(blob.exists() for blob in shared)
    assert sorted(p.name for p in (storage / "snapshots").iterdir()) == [MAIN]
    assert sorted(p.name for p in (storage / "refs").iterdir()) == ["main"]
    assert not _loads_offline(cache, "v1", fetched.v1)
    assert _loads_offline(cache, "main", fetched.main)
    # The fetcher still finds main complete under its marker: nothing to fetch again.
    assert fetch_hub(REPO, cache, revision="main", endpoint="http://127.0.0.1:9").already_complete

    before = _tree(cache)
    assert _gc(capsys, "--hub-cache-dir", str(cache), "--keep-hub", f"{REPO}@main")[1] == (
        "freed 0 bytes (0 paths removed)"
    )
    assert _tree(cache) == before


@pytest.mark.parametrize("kept", ["v1", V1])
def test_a_tag_or_a_commit_keeps_its_snapshot_and_the_refs_naming_it(
    fetched: Fetched, kept: str
) -> None:
    main_only = {fetched.blob(MAIN, n) for n in ("config.json", "model-00002-of-00002.safetensors")}
    result = collect_garbage(hub_cache_dir=fetched.cache, keep_hub=[HubKeep(REPO, kept)])
    assert sorted(p.name for p in (fetched.storage / "snapshots").iterdir()) == [V1]
    assert sorted(p.name for p in (fetched.storage / "refs").iterdir()) == ["v1"]
    assert _loads_offline(fetched.cache, kept, fetched.v1)
    assert {r.path for r in result.removed if r.path.parent.name == "blobs"} == main_only
    assert not (fetched.cache / hub_marker_path(REPO, "main")).exists()
    assert (fetched.cache / hub_marker_path(REPO, "v1")).exists()


def test_a_repo_nothing_keeps_goes_whole_and_what_fleetpilot_did_not_write_stays(
    fetched: Fetched, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = fetched.cache
    draft = FakeHub(OTHER, {"config.json": b"{}", "model.safetensors": b"w" * 5000})
    try:
        _fetch(draft, OTHER, cache, "main")
    finally:
        draft.close()
    draft_bytes = sum(
        p.stat().st_size for p in (cache / "models--acme--draft").rglob("*") if p.is_file()
    ) - sum(p.stat().st_size for p in (cache / "models--acme--draft").glob("snapshots/*/*"))
    # Someone else's on a shared volume: a Hub repo without our markers, another repo type,
    # a file of theirs; and the library's CACHEDIR.TAG.
    foreign = cache / "models--someone--else"
    (foreign / "blobs").mkdir(parents=True)
    (foreign / "blobs" / "abc").write_bytes(b"theirs")
    (cache / "datasets--acme--set").mkdir()
    (cache / "notes.txt").write_text("mine")
    theirs = {"models--someone--else/blobs/abc", "datasets--acme--set", "notes.txt", "CACHEDIR.TAG"}

    code, _, lines = _gc(capsys, "--hub-cache-dir", str(cache), "--keep-hub", REPO)  # main
    assert code == 0
    assert not (cache / "models--acme--draft").exists()
    assert not (cache / ".locks" / "models--acme--draft").exists()
    assert _loads_offline(cache, "main", fetched.main)
    assert theirs <= _tree(cache)
    left = [line["message"] for line in lines if line.get("event") == "left"]
    assert [m for m in left if m.startswith("models--someone--else: no .fleetpilot folder")]
    removed = {line["path"]: line["bytes"] for line in lines if line.get("event") == "removed"}
    assert removed[str(cache / "models--acme--draft")] == draft_bytes


def test_a_kept_revision_not_in_the_cache_leaves_its_repo_alone(fetched: Fetched) -> None:
    before = _tree(fetched.cache)
    result = collect_garbage(hub_cache_dir=fetched.cache, keep_hub=[HubKeep.parse(f"{REPO}@v9")])
    assert result.removed == ()
    assert _tree(fetched.cache) == before
    assert "the kept revision v9 is not in the cache" in result.notes[0]


def test_a_run_killed_midway_is_finished_by_the_next(fetched: Fetched) -> None:
    """A run killed after removing v1's ref and snapshot: the next one finds the blobs only v1
    linked to (no kept snapshot links them) and v1's marker, and removes them."""
    storage = fetched.storage
    v1_only = {fetched.blob(V1, n) for n in ("config.json", "model-00002-of-00002.safetensors")}
    (storage / "refs" / "v1").unlink()
    for link in (storage / "snapshots" / V1).iterdir():
        link.unlink()
    (storage / "snapshots" / V1).rmdir()
    result = collect_garbage(hub_cache_dir=fetched.cache, keep_hub=[HubKeep(REPO, "main")])
    assert {r.path for r in result.removed} >= v1_only | {
        fetched.cache / hub_marker_path(REPO, "v1")
    }
    assert _loads_offline(fetched.cache, "main", fetched.main)


def test_a_dry_run_removes_nothing_and_says_what_it_would(
    fetched: Fetched, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(fetched.cache)
    every_file = sum(p.stat().st_size for p in fetched.storage.rglob("*") if p.is_file())
    linked = sum(p.stat().st_size for p in fetched.storage.glob("snapshots/*/*"))
    code, out, _ = _gc(capsys, "--hub-cache-dir", str(fetched.cache), "--dry-run")
    assert code == 0
    # The whole repo (nothing kept), each blob once (not again through a snapshot's link).
    assert out == f"would free {every_file - linked} bytes (2 paths removed)"
    assert _tree(fetched.cache) == before


def _s3_download(folder: Path, files: dict[str, bytes]) -> None:
    """A finished S3 download, as ``fetch_s3`` leaves it: the files, then its marker."""
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    listed = [RemoteFile(name, len(content)) for name, content in files.items()]
    payload = marker_payload(s3_source("models", "llama"), listed, datetime.now(UTC))
    write_marker(folder / MARKER_NAME, payload)


def test_s3_downloads_not_kept_go_and_folders_without_a_marker_stay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3 = tmp_path / "s3"
    _s3_download(s3 / "models-aaaaaaaaaaaa", {"config.json": b"{}"})
    _s3_download(s3 / "models-bbbbbbbbbbbb", {"config.json": b"{}", "w/0.safetensors": b"w" * 99})
    (s3 / "models-cccccccccccc").mkdir()  # a download still running: no marker yet
    (s3 / "models-cccccccccccc" / "w.safetensors.part").write_bytes(b"half")
    (s3 / "README").write_text("a file of someone's")

    code, out, lines = _gc(
        capsys, "--s3-dir", str(s3), "--keep-s3", "models-aaaaaaaaaaaa", "models-dddddddddddd"
    )
    assert code == 0
    marker_size = (s3 / "models-aaaaaaaaaaaa" / MARKER_NAME).stat().st_size
    assert sorted(p.name for p in s3.iterdir()) == [
        "README", "models-aaaaaaaaaaaa", "models-cccccccccccc",
    ]  # fmt: skip
    assert out.startswith("freed ")
    assert int(out.split()[1]) > 2 + 99  # the files and the marker (about as big as a's)
    assert int(out.split()[1]) <= 2 + 99 + marker_size + 100
    left = " ".join(line["message"] for line in lines if line.get("event") == "left")
    assert "models-cccccccccccc: no .fleetpilot-model.json" in left
    assert "models-dddddddddddd: kept, but not in" in left
    assert _gc(capsys, "--s3-dir", str(s3), "--keep-s3", "models-aaaaaaaaaaaa")[1] == (
        "freed 0 bytes (0 paths removed)"
    )


def test_the_decision_for_one_repo() -> None:
    """Pure: refs first, then snapshots, what the library knows of their commits, blobs no
    kept snapshot links to (temporaries too) and their locks, markers last; a marker of a kept
    revision stays even when it names an older commit (the fetcher rewrites it)."""
    layout = HubRepoLayout(
        snapshots={"c1": frozenset({"a", "b"}), "c2": frozenset({"b", "c"})},
        refs={"main": "c2", "v1": "c1", "refs/pr/1": "c1"},
        markers={"main.json": "c1", "v1.json": "c1", "broken.json": None},
        marker_leftovers=frozenset({".main.json.1234abcd.tmp"}),
        blobs=frozenset({"a", "b", "c", "c.1a2b.incomplete"}),
        no_exist=frozenset({"c1"}),
        trees=frozenset({"c1", "c2"}),
        locks=frozenset({"a.lock", "c.lock"}),
    )
    decision = hub_repo_garbage("models--acme--x", layout, {"main"})
    assert [g.path.as_posix().removeprefix("models--acme--x/") for g in decision.garbage] == [
        "refs/refs/pr/1",
        "refs/v1",
        "snapshots/c1",
        ".no_exist/c1",
        "trees/c1.json",
        "blobs/a",
        "blobs/c.1a2b.incomplete",
        ".locks/models--acme--x/a.lock",
        ".fleetpilot/.main.json.1234abcd.tmp",
        ".fleetpilot/broken.json",
        ".fleetpilot/v1.json",
    ]
    unknown = hub_repo_garbage("models--acme--x", layout, {"main", "v9"})
    assert unknown.garbage == []
    whole = hub_repo_garbage("models--acme--x", layout, set())
    assert [g.path.as_posix() for g in whole.garbage] == [
        ".locks/models--acme--x",
        "models--acme--x",
    ]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "give --hub-cache-dir, --s3-dir or both"),
        (["--keep-hub", f"{REPO}@main"], "--keep-hub needs --hub-cache-dir"),
        (["--hub-cache-dir", "x", "--keep-hub", "../etc@main"], "not a Hugging Face repo id"),
        (["--hub-cache-dir", "x", "--keep-hub", f"{REPO}@"], "no revision after '@'"),
    ],
)
def test_a_wrong_command_line_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["model", "gc", *argv])
    assert exited.value.code == 2
    assert expected in capsys.readouterr().err


def test_an_s3_name_must_be_a_folder_name(tmp_path: Path) -> None:
    with pytest.raises(DeliveryError, match="kept by its folder's name"):
        collect_garbage(s3_dir=tmp_path, keep_s3=["../elsewhere"])
