"""The rules of a model download, without network or disk: what is fetched, where a remote
name may land, how much of a partial file is kept, what counts as verified and finished."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import PurePosixPath

import pytest
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import filter_repo_objects

from fleetpilot.delivery.plan import (
    DEFAULT_HUB_INCLUDE,
    MARKER_NAME,
    PICKLE_WEIGHTS,
    DeliveryError,
    RemoteFile,
    UnsafePathError,
    VerificationError,
    check_layout,
    check_repo_id,
    check_revision,
    default_hub_include,
    hub_marker_path,
    hub_repo_folder,
    marker_files,
    marker_matches,
    marker_payload,
    md5_of_etag,
    resume_offset,
    s3_files,
    s3_prefix,
    safe_relative_path,
    select_files,
    verify_sizes,
)

LLAMA_REPO = [
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "LICENSE",
    "README.md",
    ".gitattributes",
    "USE_POLICY.md",
]


def _files(paths: list[str]) -> list[RemoteFile]:
    return [RemoteFile(p, 10) for p in paths]


def test_default_include_takes_what_vllm_reads_and_skips_pickled_duplicates() -> None:
    chosen = [f.path for f in select_files(_files(LLAMA_REPO), default_hub_include(LLAMA_REPO))]
    assert chosen == sorted(
        [
            "config.json",
            "generation_config.json",
            "model-00001-of-00004.safetensors",
            "model-00002-of-00004.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "original/params.json",
            "original/tokenizer.model",
        ]
    )


def test_default_include_falls_back_to_pickles_without_safetensors() -> None:
    """vLLM's load format "auto" reads *.bin when a revision has no safetensors."""
    old = ["config.json", "pytorch_model.bin", "vocab.json", "merges.txt"]
    assert default_hub_include(old) == (*DEFAULT_HUB_INCLUDE, PICKLE_WEIGHTS)
    assert [f.path for f in select_files(_files(old), default_hub_include(old))] == sorted(old)
    assert PICKLE_WEIGHTS not in default_hub_include(LLAMA_REPO)


@pytest.mark.parametrize(
    "patterns",
    [["*.json"], ["original/"], ["original/*"], ["*.safetensors", "tokenizer*"], ["LICENSE"]],
)
def test_patterns_select_what_huggingface_hub_selects(patterns: list[str]) -> None:
    """The same rules as huggingface_hub's allow_patterns (what vLLM passes to it)."""
    ours = [f.path for f in select_files(_files(LLAMA_REPO), patterns)]
    theirs = sorted(filter_repo_objects(LLAMA_REPO, allow_patterns=patterns))
    assert ours == theirs


def test_repo_folder_and_marker_path_follow_the_hub_cache_names() -> None:
    assert hub_repo_folder("meta-llama/Llama-3.1-8B") == repo_folder_name(
        repo_id="meta-llama/Llama-3.1-8B", repo_type="model"
    )
    assert hub_repo_folder("gpt2") == "models--gpt2"
    # One marker a revision, inside the repo folder; a '/' in a revision stays in the name.
    assert hub_marker_path("org/m", "refs/pr/1") == PurePosixPath(
        "models--org--m/.fleetpilot/refs%2Fpr%2F1.json"
    )


@pytest.mark.parametrize("repo", ["org/name", "gpt2", "Org_1/model.v2-instruct"])
def test_repo_ids_accepted(repo: str) -> None:
    assert check_repo_id(repo) == repo


@pytest.mark.parametrize(
    "repo", ["", "a/b/c", "../x", "org/..", "org--x/y", "/abs", "org/name.git", "org name/x"]
)
def test_repo_ids_refused(repo: str) -> None:
    with pytest.raises(DeliveryError, match="not a Hugging Face repo id"):
        check_repo_id(repo)


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/12", "a" * 40])
def test_revisions_accepted(revision: str) -> None:
    assert check_revision(revision) == revision


@pytest.mark.parametrize("revision", ["", "../main", "/etc/passwd", "a/../../b", "x//y"])
def test_revisions_that_would_leave_refs_are_refused(revision: str) -> None:
    """The revision names a file under refs/: it must stay there."""
    with pytest.raises(DeliveryError):
        check_revision(revision)


@pytest.mark.parametrize(
    "name",
    ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "a/", "", "a\\..\\b", "a\x00b", ".."],
)
def test_unsafe_names_are_refused(name: str) -> None:
    with pytest.raises(UnsafePathError):
        safe_relative_path(name)


def test_safe_names_keep_their_folders() -> None:
    assert safe_relative_path("original/params.json") == PurePosixPath("original", "params.json")
    assert safe_relative_path("..hidden") == PurePosixPath("..hidden")


@pytest.mark.parametrize(
    ("given", "folder"),
    [("", ""), ("/", ""), ("models/llama", "models/llama/"), ("/models/llama/", "models/llama/")],
)
def test_s3_prefix_names_a_folder(given: str, folder: str) -> None:
    assert s3_prefix(given) == folder


def test_s3_listing_becomes_paths_relative_to_the_prefix() -> None:
    objects = [
        ("models/llama/config.json", 10, '"abc"'),
        ("models/llama/", 0, None),  # a folder placeholder some tools write
        ("models/llama/original/params.json", 5, None),
    ]
    assert s3_files(objects, "models/llama/") == [
        RemoteFile("config.json", 10, '"abc"'),
        RemoteFile("original/params.json", 5, None),
    ]


@pytest.mark.parametrize(
    "key", ["models/llama/../../etc/cron.d/x", "models/llama//abs", "models/llama/a/./b"]
)
def test_s3_keys_that_would_leave_the_destination_fail_the_listing(key: str) -> None:
    objects = [("models/llama/config.json", 1, None), (key, 1, None)]
    with pytest.raises(UnsafePathError, match="refused"):
        s3_files(objects, "models/llama/")


def test_s3_key_named_like_the_marker_fails_the_listing() -> None:
    """The marker is written last into the same folder: it must not be an object."""
    with pytest.raises(UnsafePathError, match="named like the marker"):
        s3_files([(f"m/{MARKER_NAME}", 1, None)], "m/")
    assert s3_files([(f"m/sub/{MARKER_NAME}", 1, None)], "m/")


def test_s3_keys_outside_the_prefix_fail_the_listing() -> None:
    with pytest.raises(UnsafePathError, match="outside the prefix"):
        s3_files([("models/llama-2/config.json", 1, None)], "models/llama/")


@pytest.mark.parametrize(
    "paths",
    [["a", "a/b"], ["x/y", "x/y/z.json"], ["w.safetensors", "w.safetensors.part"]],
)
def test_layouts_that_cannot_exist_on_disk_are_refused(paths: list[str]) -> None:
    with pytest.raises(UnsafePathError):
        check_layout(paths)


def test_layout_of_siblings_and_nested_files_is_fine() -> None:
    check_layout(["a/b", "a/c", "ab", "a.json", "b/part"])


@pytest.mark.parametrize(
    ("size", "part", "offset"),
    [(100, None, 0), (100, 0, 0), (100, 40, 40), (100, 100, 100), (100, 140, 0), (0, None, 0)],
)
def test_resume_offset(size: int, part: int | None, offset: int) -> None:
    assert resume_offset(size, part) == offset


@pytest.mark.parametrize(
    ("etag", "md5"),
    [
        ('"9e107d9d372bb6826bd81d3542a419d6"', "9e107d9d372bb6826bd81d3542a419d6"),
        ("9E107D9D372BB6826BD81D3542A419D6", "9e107d9d372bb6826bd81d3542a419d6"),
        ('"d41d8cd98f00b204e9800998ecf8427e-3"', None),  # multipart: not the file's MD5
        ('"not-an-md5"', None),
        (None, None),
    ],
)
def test_md5_only_from_single_part_etags(etag: str | None, md5: str | None) -> None:
    assert md5_of_etag(etag) == md5


def test_verification_names_every_wrong_file() -> None:
    expected = [RemoteFile("a.json", 10), RemoteFile("b.safetensors", 20), RemoteFile("c", 3)]
    verify_sizes(expected, {"a.json": 10, "b.safetensors": 20, "c": 3}, source="the Hub")
    with pytest.raises(VerificationError) as failure:
        verify_sizes(expected, {"a.json": 10, "b.safetensors": 19, "c": None}, source="the Hub")
    message = str(failure.value)
    assert "b.safetensors: 19 bytes on disk, 20 listed" in message
    assert "c: missing" in message
    assert "a.json" not in message
    assert "\n" not in message


def test_marker_matches_only_the_same_request() -> None:
    source = {"kind": "hub", "repo": "o/m", "revision": "main", "include": None}
    files = [RemoteFile("config.json", 7)]
    marker = marker_payload(source, files, datetime(2025, 1, 1, tzinfo=UTC), commit="c" * 40)
    assert marker["finished"] == "2025-01-01T00:00:00+00:00"
    assert marker_files(marker) == files
    assert marker_matches(marker, source)
    assert not marker_matches(marker, source | {"revision": "v2"})
    assert not marker_matches(marker, source | {"include": ["*.json"]})
    assert not marker_matches(None, source)
    assert not marker_matches(marker | {"version": 99}, source)
    assert not marker_matches(marker | {"files": [{"path": "x"}]}, source)
