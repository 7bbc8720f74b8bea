"""``fleetpilot model fetch hub`` against a Hub on 127.0.0.1 (``hub_server.FakeHub``), with the
real huggingface_hub doing the HTTP: the cache it leaves is what an offline vLLM reads, it
resumes and never fetches a finished file twice, it fails loudly on a file of the wrong size,
and the token reaches the Hub and nowhere else."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from fleetpilot.cli import main
from fleetpilot.delivery.hub import fetch_hub
from fleetpilot.delivery.plan import DeliveryError, hub_marker_path
from tests.delivery.hub_server import FakeHub, git_blob_id

REPO = "acme/tiny-llm"
DEFAULT_FILES = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


def _repo_files() -> dict[str, bytes]:
    rng = random.Random(19)
    shards = {
        "model-00001-of-00002.safetensors": rng.randbytes(300_000),
        "model-00002-of-00002.safetensors": rng.randbytes(200_000),
    }
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(),
        "generation_config.json": b'{"do_sample": true}',
        "tokenizer.json": json.dumps({"model": {"vocab": list(range(500))}}).encode(),
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors.index.json": json.dumps(index).encode(),
        **shards,
        # Not for vLLM: a pickled duplicate of the weights, and the model card.
        "original/consolidated.00.pth": rng.randbytes(50_000),
        "README.md": b"# tiny\n",
    }


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    server = FakeHub(REPO, _repo_files())
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No token, endpoint or offline switch from this machine; logging as it was after."""
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored"))
    loggers = [logging.getLogger(), logging.getLogger("huggingface_hub")]
    loggers += [logging.getLogger(name) for name in ("httpx", "httpx2", "httpcore")]
    saved = [(logger, logger.handlers[:], logger.level) for logger in loggers]
    yield
    for logger, handlers, level in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _fetch(cache: Path, *extra: str, endpoint: str | None = None) -> int:
    argv = ["model", "fetch", "hub", "--repo", REPO, "--cache-dir", str(cache), *extra]
    if endpoint is not None:
        argv += ["--endpoint", endpoint]
    return main(argv)


def _log_lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def _snapshot(cache: Path, hub: FakeHub) -> Path:
    return cache / "models--acme--tiny-llm" / "snapshots" / hub.commit


def test_download_lands_in_the_hub_cache_an_offline_vllm_reads(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    out, err = capsys.readouterr()
    snapshot = _snapshot(cache, hub)
    assert out.strip() == str(snapshot)

    # huggingface_hub's layout: content-addressed blobs, snapshot links, the ref.
    storage = cache / "models--acme--tiny-llm"
    assert (storage / "refs" / "main").read_text() == hub.commit
    assert sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*")) == DEFAULT_FILES
    for name in DEFAULT_FILES:
        link = snapshot / name
        assert link.is_symlink()
        blob = Path(os.path.realpath(link))
        assert blob.parent == storage / "blobs"
        assert blob.read_bytes() == hub.files[name]
        expected = hub.sha256(name) if hub.is_lfs(name) else git_blob_id(hub.files[name])
        assert blob.name == expected
    assert not list(storage.glob("blobs/*.incomplete"))

    # What vLLM does at start with HF_HUB_CACHE and HF_HUB_OFFLINE=1, in a process that has
    # only that environment (vllm/transformers_utils/repo_utils.py resolve_revision, then
    # config files by hf_hub_download, weights by snapshot_download with allow_patterns),
    # with the Hub gone.
    hub.close()
    probe = f"""
import json
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
revision = HfApi().resolve_revision({REPO!r}, revision="main", local_files_only=True)
folder = snapshot_download({REPO!r}, revision="main", allow_patterns="*.safetensors")
config = hf_hub_download({REPO!r}, "config.json", revision="main")
print(json.dumps({{"commit": revision.resolved, "folder": folder, "config": open(config).read()}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "h")}
    seen = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout
    )
    assert seen == {
        "commit": hub.commit,
        "folder": str(snapshot),
        "config": hub.files["config.json"].decode(),
    }

    lines = _log_lines(err)
    files = [line for line in lines if line.get("event") == "file"]
    assert sorted(line["file"] for line in files) == DEFAULT_FILES
    assert all(line["fetched"] for line in files)
    total = sum(len(hub.files[name]) for name in DEFAULT_FILES)
    assert lines[-1]["event"] == "complete"
    assert (lines[-1]["files_done"], lines[-1]["files_total"]) == (7, 7)
    assert (lines[-1]["bytes_done"], lines[-1]["bytes_total"]) == (total, total)
    # Only our lines at info: no request line a file from the HTTP client.
    assert {line["logger"] for line in lines} == {"fleetpilot.delivery"}


def test_marker_records_the_download_and_a_second_run_asks_nothing(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    marker = json.loads((cache / hub_marker_path(REPO, "main")).read_text())
    assert marker["source"] == {"kind": "hub", "repo": REPO, "revision": "main", "include": None}
    assert marker["commit"] == hub.commit
    assert marker["files"] == [{"path": p, "size": len(hub.files[p])} for p in DEFAULT_FILES]
    assert marker["finished"].endswith("+00:00")
    capsys.readouterr()

    asked = len(hub.seen)
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    out, err = capsys.readouterr()
    assert len(hub.seen) == asked  # not even the API
    assert out.strip() == str(_snapshot(cache, hub))
    assert [line["event"] for line in _log_lines(err)] == ["already-complete"]
    assert "already complete" in err


def test_a_marker_whose_files_are_gone_is_not_trusted(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    link = _snapshot(cache, hub) / "config.json"
    Path(os.path.realpath(link)).unlink()  # e.g. removed by `hf cache delete`
    link.unlink()
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    assert "marker-stale" in [line.get("event") for line in _log_lines(capsys.readouterr().err)]
    assert hub.gets("config.json") == 2
    assert all(hub.gets(name) == 1 for name in DEFAULT_FILES if name != "config.json")


def test_a_branch_moving_during_the_download_does_not_mix_commits(
    hub: FakeHub, tmp_path: Path
) -> None:
    """Someone pushes to main while the Job runs: every file still comes from the commit the
    listing named, and refs/main names that commit."""
    first = hub.commit
    hub.advance_after_api = "f" * 40
    cache = tmp_path / "cache"
    result = fetch_hub(REPO, cache, endpoint=hub.endpoint)
    storage = cache / "models--acme--tiny-llm"
    assert result.commit == first
    assert (storage / "refs" / "main").read_text() == first
    assert [p.name for p in (storage / "snapshots").iterdir()] == [first]
    asked = {s.revision for s in hub.seen if s.origin == "hub" and s.file is not None}
    assert asked == {first}


def test_a_commit_as_revision_needs_no_ref(hub: FakeHub, tmp_path: Path) -> None:
    """Pinned to a commit, the snapshot folder is found by the commit itself."""
    cache = tmp_path / "cache"
    result = fetch_hub(REPO, cache, revision=hub.commit, endpoint=hub.endpoint)
    assert result.snapshot == _snapshot(cache, hub)
    assert not (cache / "models--acme--tiny-llm" / "refs").exists()
    assert (cache / hub_marker_path(REPO, hub.commit)).exists()
    asked = len(hub.seen)
    assert fetch_hub(REPO, cache, revision=hub.commit, endpoint=hub.endpoint).already_complete
    assert len(hub.seen) == asked


def test_a_file_of_the_wrong_size_fails_verification_naming_it(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Hub lists one size and serves another (HEAD and GET agree, so the library is
    content): the download fails naming the file, and keeps nothing of it to trust later."""
    cache = tmp_path / "cache"
    listed = len(hub.files["tokenizer.json"])
    hub.serve["tokenizer.json"] = hub.files["tokenizer.json"][:-10]
    assert _fetch(cache, endpoint=hub.endpoint) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ")
    assert f"tokenizer.json: {listed - 10} bytes on disk, {listed} listed" in last
    assert not (_snapshot(cache, hub) / "tokenizer.json").exists()
    assert not (cache / hub_marker_path(REPO, "main")).exists()

    hub.serve.clear()
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    assert (_snapshot(cache, hub) / "tokenizer.json").read_bytes() == hub.files["tokenizer.json"]
    assert hub.gets("tokenizer.json") == 2


def test_a_failed_run_is_continued_without_fetching_finished_files_again(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    broken = "model-00002-of-00002.safetensors"
    hub.fail_get.add(broken)
    assert _fetch(cache, endpoint=hub.endpoint) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ")
    assert broken in last
    assert "HTTP 500" in last

    hub.fail_get.clear()
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    # Each file was asked for (HEAD) and fetched (GET) once over both runs; the broken one
    # twice. Files that finished in the first run were not even asked about in the second.
    assert {name: hub.gets(name) for name in DEFAULT_FILES} == {
        name: 2 if name == broken else 1 for name in DEFAULT_FILES
    }
    heads = {name: len(hub.requests("HEAD", name)) for name in DEFAULT_FILES}
    assert heads == {name: 2 if name == broken else 1 for name in DEFAULT_FILES}
    assert (_snapshot(cache, hub) / broken).read_bytes() == hub.files[broken]


def test_a_connection_dropped_mid_file_is_resumed_with_a_range(tmp_path: Path) -> None:
    """The library keeps what it received in whole download chunks and asks for the rest."""
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    name = "model.safetensors"
    content = random.Random(3).randbytes(2 * chunk + 4096)
    hub = FakeHub(REPO, {name: content, "config.json": b"{}"})
    try:
        hub.drop_once.add(name)
        result = fetch_hub(REPO, tmp_path / "cache", endpoint=hub.endpoint)
        gets = hub.requests("GET", name)
    finally:
        hub.close()
    assert (result.snapshot / name).read_bytes() == content
    assert len(gets) == 2
    assert "range" not in gets[0].headers
    first_byte = int(gets[1].headers["range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < first_byte <= len(content) // 2


def test_a_killed_runs_temporary_files_are_removed(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """huggingface_hub downloads into ``blobs/<etag>.<id>.incomplete`` and deletes it on
    failure, but a killed process cannot; once the blob is whole the leftover goes."""
    cache = tmp_path / "cache"
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    blob = Path(os.path.realpath(_snapshot(cache, hub) / "model-00001-of-00002.safetensors"))
    orphan = blob.with_name(f"{blob.name}.1a2b3c4d.incomplete")
    orphan.write_bytes(b"half a shard")
    other = blob.with_name("0" * 64 + ".1a2b3c4d.incomplete")  # not a blob of this snapshot
    other.write_bytes(b"someone else's")
    (cache / hub_marker_path(REPO, "main")).unlink()
    asked = len(hub.requests("GET"))
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    assert not orphan.exists()
    assert other.exists()
    assert len(hub.requests("GET")) == asked + 1  # the API; no file again


def test_include_patterns_choose_the_files_and_the_marker_remembers_them(
    hub: FakeHub, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    assert _fetch(cache, "--include", "*.json", endpoint=hub.endpoint) == 0
    snapshot = _snapshot(cache, hub)
    jsons = [name for name in DEFAULT_FILES if name.endswith(".json")]
    assert sorted(p.name for p in snapshot.iterdir()) == jsons
    marker = json.loads((cache / hub_marker_path(REPO, "main")).read_text())
    assert marker["source"]["include"] == ["*.json"]

    # Asked with the default patterns, the marker does not match: the rest is fetched.
    assert _fetch(cache, endpoint=hub.endpoint) == 0
    assert sorted(p.name for p in snapshot.iterdir()) == DEFAULT_FILES
    assert all(hub.gets(name) == 1 for name in DEFAULT_FILES)


def test_the_token_reaches_the_hub_as_bearer_and_nothing_prints_it(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token = "hf_PrivateAndSecretValue0123456789"
    hub.token = token
    monkeypatch.setenv("HF_TOKEN", token + "\n")  # as a Secret's key often ends
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # the endpoint from the environment
    cache = tmp_path / "cache"
    assert _fetch(cache, "--log-level", "debug") == 0
    out, err = capsys.readouterr()

    to_hub = hub.requests(None)
    assert to_hub
    for seen in to_hub:
        if seen.origin == "hub":
            assert seen.headers.get("authorization") == f"Bearer {token}"
        else:  # the CDN's URLs are signed; the token must not leave the Hub
            assert "authorization" not in seen.headers
    assert any(seen.origin == "cdn" for seen in to_hub)
    assert "Secret" not in out + err
    for path in cache.rglob("*"):
        if path.is_file():
            assert b"Secret" not in path.read_bytes()


def test_a_private_repo_without_a_token_says_so(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hub.token = "hf_needed"
    assert _fetch(tmp_path / "cache", endpoint=hub.endpoint) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: {REPO}@main: repository not found, or private")
    assert "HF_TOKEN" in last


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--revision", "v9"], "@v9: revision not found"),
        (["--revision", "../../escape"], "revision '../../escape'"),
        (["--include", "*.gguf"], "none of the 9 files of commit"),
    ],
)
def test_failures_are_one_clear_line(
    hub: FakeHub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: str,
) -> None:
    assert _fetch(tmp_path / "cache", *argv, endpoint=hub.endpoint) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(errors) == 1
    assert errors[0].startswith("error: ")
    assert expected in errors[0]


def test_an_unknown_repo_and_an_unreachable_hub_are_named(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(DeliveryError, match="acme/other@main: repository not found"):
        fetch_hub("acme/other", tmp_path, endpoint=hub.endpoint)
    endpoint = _closed_port()
    with pytest.raises(DeliveryError, match=f"cannot reach {endpoint}"):
        fetch_hub(REPO, tmp_path, endpoint=endpoint)


def test_a_wrong_repo_id_is_refused_before_any_request(tmp_path: Path, hub: FakeHub) -> None:
    with pytest.raises(DeliveryError, match="not a Hugging Face repo id"):
        fetch_hub("../etc", tmp_path, endpoint=hub.endpoint)
    assert hub.seen == []
