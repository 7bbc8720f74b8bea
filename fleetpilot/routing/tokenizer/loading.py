"""A tokenizer's files, found and read as transformers 5 loads them (the version vLLM 0.33.0
requires: ``transformers/tokenization_utils_base.py`` ``_from_pretrained``,
``tokenization_utils_tokenizers.py`` ``TokenizersBackend.__init__``).

``tokenizer.json`` is the pipeline; ``add_bos_token``/``add_eos_token`` of
``tokenizer_config.json`` are dropped when a ``tokenizer.json`` exists, so BOS/EOS come from its
post-processor alone; the config's named special tokens (``bos_token`` ... ``mask_token``),
``additional_special_tokens`` and ``added_tokens_decoder`` entries that ``tokenizer.json`` lacks
are added as added tokens (so a ``bos_token`` that is a plain vocabulary entry becomes a token
the text splits on); ``split_special_tokens`` sets ``encode_special_tokens``; a
``chat_template.jinja`` beside the config wins over the config's ``chat_template``. The files
come from a local directory or, for ``hf://<org>/<name>@<revision>``, from the Hugging Face Hub
(``huggingface_hub``: its cache, or the network).

Not matched: model-specific transformers tokenizer classes that rebuild their pipeline instead
of loading ``tokenizer.json`` (and Mistral and Harmony tokenizers, which vLLM loads its own way).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from fleetpilot.routing.tokenizer.errors import TokenizerError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

_NAMED_SPECIAL = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip

# Where each of a tokenizer's files is (None: not there).
Files = Mapping[str, Path | None]


def pipeline(
    tokenizer_json: str, config: Mapping[str, Any], source: str
) -> tuple[Tokenizer, dict[str, Any]]:
    """The ``tokenizers`` pipeline transformers builds from these files' contents (the config's
    special tokens added), and ``tokenizer.json`` parsed (the cut rule reads its model)."""
    try:
        spec = json.loads(tokenizer_json)
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as e:
        raise TokenizerError(f"{source}: {TOKENIZER_FILE} is not a tokenizer: {e}") from e
    if not isinstance(spec, dict):
        raise TokenizerError(f"{source}: {TOKENIZER_FILE} is not a JSON object")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    try:
        _add_config_tokens(tokenizer, config)
    except Exception as e:
        raise TokenizerError(f"{source}: {CONFIG_FILE} names unusable tokens: {e}") from e
    return tokenizer, spec


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The config's named special tokens (``bos_token`` ...) as the template sees them."""
    return {
        name: content
        for name in _NAMED_SPECIAL
        if (content := _token_content(config.get(name))) is not None
    }


def chat_template(config: Mapping[str, Any], override: str | None) -> str | None:
    """The chat template: ``override`` (``vllm serve --chat-template``), else the config's;
    of named templates, transformers uses "default"."""
    template = override if override is not None else config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _add_config_tokens(tokenizer: Tokenizer, config: Mapping[str, Any]) -> None:
    """transformers 5 adds the config's special tokens that tokenizer.json lacks."""
    present = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        for _, value in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            token = _added_token(value, special=False)
            if token is not None and token.content not in present:
                to_add.append(token)
                present.add(token.content)
    named = [config.get(name) for name in _NAMED_SPECIAL]
    for value in [*named, *_extra_special(config)]:
        token = _added_token(value, special=True)
        if token is not None and token.content not in present:
            to_add.append(token)
            present.add(token.content)
    if to_add:
        tokenizer.add_tokens(to_add)


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    """A config's token (a string or a serialized AddedToken) as transformers adds it."""
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    content = _token_content(value)
    if content is None:
        return None
    return AddedToken(
        content,
        single_word=bool(value.get("single_word", False)),
        lstrip=bool(value.get("lstrip", False)),
        rstrip=bool(value.get("rstrip", False)),
        normalized=bool(value.get("normalized", not special)),
        special=special or bool(value.get("special", False)),
    )


def _extra_special(config: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        if isinstance(value, Mapping):
            out += list(value.values())
        elif isinstance(value, list):
            out += value
    return out


def dir_files(path: Path) -> dict[str, Path | None]:
    """The files of a model directory (``chat_template.jinja`` is read only if present)."""
    return {name: path / name for name in (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE)}


def read_files(files: Files, source: str) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json``'s text and the config, with ``chat_template.jinja`` as its template
    when there is one (transformers: the file wins)."""

    def read(name: str) -> str:
        path = files.get(name)
        if path is None:
            raise TokenizerError(f"{source}: {name} is missing")
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: unreadable: {e}") from e

    tokenizer_json = read(TOKENIZER_FILE)
    try:
        config = json.loads(read(CONFIG_FILE))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{files[CONFIG_FILE]}: not JSON: {e}") from e
    if not isinstance(config, dict):
        raise TokenizerError(f"{files[CONFIG_FILE]}: not a JSON object")
    template_path = files.get(TEMPLATE_FILE)
    if template_path is not None and template_path.is_file():
        config["chat_template"] = read(TEMPLATE_FILE)  # transformers: the file wins
    return tokenizer_json, config


def locate(
    ref: str, *, cache_dir: Path | None = None, local_files_only: bool = False
) -> dict[str, Path | None]:
    """The files of the tokenizer ``ref`` names: a local model directory, or
    ``hf://<org>/<name>@<revision>`` (revision a commit, tag or branch; ``main`` when left out),
    of which only ``tokenizer.json``, ``tokenizer_config.json`` and, if the repository has it,
    ``chat_template.jinja`` are fetched with ``huggingface_hub`` (its cache, ``HF_TOKEN``,
    ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` as it reads them; ``cache_dir`` and
    ``local_files_only`` override the last two). Raises :class:`TokenizerError` naming the file
    that is missing."""
    if not ref.startswith("hf://"):
        path = Path(ref)
        if not path.is_dir():
            raise TokenizerError(f"{ref}: not a directory (nor an hf://org/name@revision)")
        return dir_files(path)
    repo, _, revision = ref.removeprefix("hf://").partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise TokenizerError(f"{ref}: expected hf://<org>/<name>@<revision>")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    def fetch(name: str, *, optional: bool = False) -> Path | None:
        try:
            return Path(
                hf_hub_download(
                    repo,
                    name,
                    revision=revision or "main",
                    cache_dir=cache_dir,
                    local_files_only=local_files_only,
                )
            )
        except EntryNotFoundError as e:
            if optional:
                return None
            raise TokenizerError(f"{ref}: {name} is not there: {e}") from e
        except Exception as e:
            raise TokenizerError(f"{ref}: cannot fetch {name}: {e}") from e

    return {
        TOKENIZER_FILE: fetch(TOKENIZER_FILE),
        CONFIG_FILE: fetch(CONFIG_FILE),
        TEMPLATE_FILE: fetch(TEMPLATE_FILE, optional=True),
    }
