"""Loading a tokenizer's files as transformers does (issue 14): chat_template.jinja wins over the
config, a missing or broken file is named, and ``hf://`` refs resolve from a Hub cache without
network."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetpilot.engine.reference.hf_tokenizer import SHIPPED
from fleetpilot.routing.tokenizer.errors import TokenizerError
from fleetpilot.routing.tokenizer.request import RequestTokenizer, load_tokenizer
from tests.routing.tokenizer_support import BYTES, chat


def test_a_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    """Like transformers, a chat_template.jinja beside tokenizer_config.json is the template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    t = RequestTokenizer.from_dir(tmp_path)
    assert t.token_ids("chat", chat("hi")) == BYTES.encode("hi!", add_bos=False)


FILE_ERRORS: list[tuple[Callable[[Path], object], str]] = [
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: no such file"),
    (lambda d: (d / "tokenizer_config.json").unlink(), "tokenizer_config.json: no such file"),
    (lambda d: (d / "tokenizer.json").write_text("{nope"), "tokenizer.json is not a tokenizer"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1"), "tokenizer_config.json: not JSON"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "not a JSON object"),
    (lambda d: (d / "chat_template.jinja").write_text("{% for %}"), "does not compile"),
    (
        lambda d: (d / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"x": {}}}'),
        "names unusable tokens",
    ),
]


@pytest.mark.parametrize(("damage", "message"), FILE_ERRORS)
def test_missing_or_invalid_files_are_named(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    """A model directory with a missing or broken file: TokenizerError naming the file."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    damage(tmp_path)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        load_tokenizer(str(tmp_path))


# ---- hf:// ---------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, files: dict[str, bytes], repo: str = "org/model") -> Path:
    """A Hugging Face Hub cache holding one snapshot of ``repo`` with ``files``, ``main``
    pointing at it, as huggingface_hub writes it (plain files instead of blob links)."""
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(COMMIT)
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return root


def shipped_files() -> dict[str, bytes]:
    return {n: (SHIPPED / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_an_hf_ref_resolves_from_the_hub_cache_offline(tmp_path: Path, revision: str) -> None:
    """hf://org/model@<branch or commit> is resolved by huggingface_hub itself from its cache
    (offline): the same tokenizer as the directory."""
    cache_dir = hub_cache(tmp_path, shipped_files())
    t = load_tokenizer(f"hf://org/model@{revision}", cache_dir=cache_dir, local_files_only=True)
    assert t.token_ids("completions", {"prompt": "hi"}) == BYTES.encode("hi")
    assert t.token_ids("chat", chat("hi")) == BYTES.encode(
        BYTES.apply_chat_template(chat("hi")["messages"])
    )
    assert t.source == f"hf://org/model@{revision}"


def test_an_hf_ref_with_a_chat_template_file_uses_it(tmp_path: Path) -> None:
    """chat_template.jinja in the snapshot is fetched and wins over the config's template."""
    files = {**shipped_files(), "chat_template.jinja": b"{{ messages[0]['content'] }}?"}
    cache_dir = hub_cache(tmp_path, files)
    t = load_tokenizer("hf://org/model@main", cache_dir=cache_dir, local_files_only=True)
    assert t.render_chat(chat("hi")) == "hi?"


@pytest.mark.parametrize(
    ("ref", "files", "message"),
    [
        ("hf://org/model@main", {"tokenizer_config.json": b"{}"}, "tokenizer.json"),
        ("hf://org/model@v9", None, "tokenizer.json"),
        ("hf://org/other@main", None, "tokenizer.json"),
        ("hf://model@main", None, "hf://<org>/<name>@<revision>"),
        ("/no/such/dir", None, "not a directory"),
    ],
)
def test_an_unresolvable_ref_names_what_is_missing(
    tmp_path: Path, ref: str, files: dict[str, bytes] | None, message: str
) -> None:
    """A missing file, revision or repository, or a malformed ref: TokenizerError naming it."""
    cache_dir = hub_cache(tmp_path, shipped_files() if files is None else files)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        load_tokenizer(ref, cache_dir=cache_dir, local_files_only=True)
