"""The router's request tokenizer: a request's prompt token ids exactly as the engine computes
them, and their chained KV-index keys (``policies.kv_index.chain_keys``), with a prefix cache so
that a growing conversation re-tokenizes only its new tail.

What is matched, and where it comes from (vLLM 0.33.0 with the transformers 5.x it requires):

* Loading (``transformers/tokenization_utils_base.py`` ``_from_pretrained``,
  ``tokenization_utils_tokenizers.py`` ``TokenizersBackend.__init__``): ``tokenizer.json`` is the
  pipeline; ``add_bos_token``/``add_eos_token`` of ``tokenizer_config.json`` are dropped when a
  ``tokenizer.json`` exists, so BOS/EOS come from its post-processor alone; the config's named
  special tokens (``bos_token`` ... ``mask_token``), ``additional_special_tokens`` and
  ``added_tokens_decoder`` entries that ``tokenizer.json`` lacks are added as added tokens (so a
  ``bos_token`` that is a plain vocabulary entry becomes a token the text splits on);
  ``split_special_tokens`` sets ``encode_special_tokens``; a ``chat_template.jinja`` beside the
  config wins over the config's ``chat_template``.
* Chat (``vllm/renderers/online_renderer.py`` ``preprocess_chat``, ``vllm/renderers/hf.py``
  ``safe_apply_chat_template``/``resolve_chat_template_kwargs``/``_detect_content_format``,
  ``vllm/renderers/chat_utils/chat_message.py`` ``parse_chat_message_content``,
  ``transformers/utils/chat_template_utils.py`` ``render_jinja_template``): messages are
  normalized as vLLM does for text-only content (text parts joined with ``"\\n"`` when the
  template takes string content, kept as ``{"type": "text", ...}`` parts, strings included,
  when its AST iterates over ``message.content``; assistant ``tool_calls`` arguments parsed to
  dicts; ``developer`` turned into ``system`` when the template never names it); the template
  runs in transformers' Jinja setup (``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, ``raise_exception``,
  ``strftime_now`` and a ``tojson`` that does not escape HTML) with the special-token names,
  ``add_generation_prompt`` (default true), ``documents``, ``reasoning_effort`` and
  ``chat_template_kwargs`` merged as vLLM merges them; ``continue_final_message`` cuts the text
  as transformers does. The online server renders to text (``tokenize=False``) and encodes it
  with the request's ``add_special_tokens`` (default false for chat: BOS only if the template
  writes it).
* Completions (``vllm/renderers/base.py`` ``default_cmpl_tok_params``): a string prompt is
  encoded with ``add_special_tokens`` (default true: the post-processor's BOS/EOS); a token-id
  prompt is used as is.

What is not matched (raises :class:`TokenizerError`, so the router falls back to its guessed
index): ``tools``, a request ``chat_template`` (vLLM refuses it unless
``--trust-request-chat-template``), non-text content parts, ``truncate_prompt_tokens``,
``prompt_embeds``, batched prompts, chat-template kwargs that change tokenization, Mistral and
Harmony (gpt-oss) tokenizers, model-specific transformers tokenizer classes that rebuild their
pipeline instead of loading ``tokenizer.json``, and a LoRA adapter's own tokenizer. A template
calling ``strftime_now`` renders the router's clock, which differs from the engine's only across
a date change.

The prefix cache. ``tokenizers`` splits its input at added tokens before normalizing and
pre-tokenizing, and encodes the pieces between them independently, so for a text ``a + b``
where ``a`` ends with an added token ``T`` that no other added token can overlap, the ids of
``a + b`` are the ids of ``a`` followed by the ids of ``T + b`` without ``T``'s (encoding
``T + b`` rather than ``b`` keeps ``b`` off offset 0, which a Metaspace ``prepend_scheme=first``
pre-tokenizer treats differently). For a tokenizer whose model is character by character (BPE
without merges, no normalizer, ByteLevel without a prefix space: the reference engine's byte
tokenizer) any point outside an added token's text is such a cut. The cache maps a prefix of
the text that ends at a cut to its ids and chained keys; a request encodes only what follows
the longest cached prefix and chains its keys from the cached last key. Each chat request leaves
two prefixes: up to its final message (a retry or branch finds it; from scratch it may be a
shared system prompt) and the whole prompt (its next turn extends it, the reply and the new
message being new); :meth:`RequestTokenizer.remember_reply`, given the reply the router saw on
its way back, leaves the next turn only its new message. A conversation's newer entries replace
its older ones, so it holds a few entries, not one per turn. A tokenizer offering no safe cut
is encoded whole every time. The property is tested on the shipped byte tokenizer and
on trained BPE tokenizers (ByteLevel and Metaspace) in ``tests/routing/test_tokenize.py``.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from datetime import datetime
from hashlib import blake2b
from pathlib import Path
from typing import Any, Literal, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, ROOT, chain_keys

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"

Kind = Literal["completions", "chat"]
ContentFormat = Literal["auto", "string", "openai"]

# The most characters tokenized for one request: the bound on what one request costs the router.
# tokenizers' byte-level BPE runs at ~0.6 us a character on one core of the benchmark machine
# (bench/router_tokenize.py), so a cold prompt at 128k characters (~32k tokens at ~4 characters
# a token, 2,000 blocks of 16) costs the caller ~80 ms (~40 ms with the byte tokenizer), far less
# than the engine's prefill of it. A longer prompt is tokenized only up to its last safe cut
# before the cap: its keys are exact for that head, which is where prompts share prefixes and
# already tells the replicas apart. Raw input over four times the cap is refused before rendering.
DEFAULT_MAX_CHARS = 128 * 1024
# RequestTokenizer.plan looks a request up in the prefix cache (render, find the cuts, digest the
# prefixes) at once only when its text is at most this long, so that a caller learns what is left
# to encode before deciding where to encode it. That pass is linear in the whole text: ~3 ns a
# character for render, digest and an ``added``-mode scan (BPE tokenizers), but ~0.08 us for a
# ``chars``-mode scan (the byte tokenizer: a lookahead at every character), so ~1.3 ms here at
# worst. A longer request costs milliseconds even when its prefix is cached (a 100k-character
# next turn took 4-7 ms here), so it is not probed: its whole pass belongs off the caller's loop.
PLAN_INLINE_MAX_CHARS = 16 * 1024

# The prefix cache holds, per conversation in flight, the prefix of its latest turn until the
# next turn arrives, plus prefixes many requests share (a system prompt). 2**23 tokens are ~1,000
# conversations of 8k tokens or ~4,000 of 2k; memory is 4 bytes a token of ids plus one ~50-byte
# key per block (~3 bytes a token at 16-token blocks): ~60 MB at the bound. 4,096 entries is the
# ~4,000 short conversations; the extended entry of a conversation replaces its previous one (see
# _Entry.derived), so a long conversation holds one entry, not one per turn.
DEFAULT_CACHE_ENTRIES = 4096
DEFAULT_CACHE_TOKENS = 1 << 23
# Block sizes x LoRA names x BOS variants whose keys one entry keeps (normally one).
_MAX_VARIANTS = 4
# Completions prompts of a character-wise tokenizer have no turns to cut at: cut every this many
# characters, so a shared prefix is found to within this many re-tokenized characters.
_PLAIN_STRIDE_CHARS = 512
# Lookup candidates per request: the first few (shared system prompts) and the latest.
_MAX_CANDIDATES = 256
_FIRST_CANDIDATES = 16
# How much of a message's text locates it in the rendered prompt.
_NEEDLE_CHARS = 256

# transformers' apply_chat_template parameters: never passed on to the template itself.
_APPLY_PARAMS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
# chat_template_kwargs that would change tokenization or vLLM's call itself: not followed.
_REFUSED_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "chat_template", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)  # fmt: skip
_NAMED_SPECIAL = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_BILLING_HEADER = "x-anthropic-billing-header"
# vLLM's text part types and the field each carries its text in (chat_message.py).
_TEXT_PARTS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
    "thinking": "thinking",
}  # fmt: skip
# Fields of vLLM's content-part types; others are passed on to the template in "openai" format.
_KNOWN_PART_FIELDS = frozenset(
    {
        "type", "text", "refusal", "thinking", "uuid", "name", "image_url", "audio_url",
        "video_url", "input_audio", "input_image", "image_pil", "image_embeds", "audio_embeds",
        "video_embeds", "prompt_embeds", "data", "detail", "file",
    }
)  # fmt: skip


class TokenizerError(Exception):
    """The request cannot be tokenized as the engine would (bad shape, unsupported feature, a
    template that raised, too large) or the tokenizer files are unusable; the router falls back
    to its guessed index, it never fails the request for this."""


# ---- Jinja as transformers sets it up ----------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block (it marks assistant text for training masks):
    rendering emits its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---- vLLM's content-format detection (vllm/renderers/hf.py), on the template's AST ------------


def _is_var_access(node: jinja2.nodes.Node, varname: str) -> bool:
    if isinstance(node, jinja2.nodes.Name):
        return node.ctx == "load" and node.name == varname
    if isinstance(node, jinja2.nodes.Getattr) and "." in varname:
        base, _, attr = varname.rpartition(".")
        return node.attr == attr and _is_var_access(node.node, base)
    return False


def _is_attr_access(node: jinja2.nodes.Node, varname: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_var_access(node.node, varname)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var_access(node.node, varname) and node.attr == key
    return False


def _is_var_or_elems_access(node: jinja2.nodes.Node, varname: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems_access(node.node, varname, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems_access(node.node, varname, key)
    return _is_attr_access(node, varname, key) if key else _is_var_access(node, varname)


def _dotted_name(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts: list[str] = []
    while isinstance(node, jinja2.nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, jinja2.nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases(root: jinja2.nodes.Template, varname: str) -> list[str]:
    """``varname`` and every variable assigned from it or its elements (vLLM's
    ``_iter_nodes_assign_var_or_elems``)."""
    names = [varname]
    seen = {varname}
    queue = [varname]
    while queue:
        related = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            lhs, rhs = assign.target, assign.node
            found: list[str] = []
            if isinstance(lhs, jinja2.nodes.Name) and _is_var_or_elems_access(rhs, related):
                found.append(lhs.name)
            if (
                isinstance(lhs, jinja2.nodes.Name)
                and isinstance(rhs, jinja2.nodes.Call)
                and isinstance(rhs.node, jinja2.nodes.Name)
                and rhs.node.name == "namespace"
            ):
                found += [
                    f"{lhs.name}.{kw.key}"
                    for kw in rhs.kwargs
                    if _is_var_or_elems_access(kw.value, related)
                ]
            elif isinstance(
                lhs, jinja2.nodes.Getattr | jinja2.nodes.NSRef
            ) and _is_var_or_elems_access(rhs, related):
                dotted = _dotted_name(lhs)
                found += [dotted] if dotted is not None else []
            for name in found:
                names.append(name)
                if name not in seen:
                    seen.add(name)
                    queue.append(name)
    return names


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """Whether the template iterates over a message's content (vLLM's
    ``_iter_nodes_assign_content_item``): then it gets content as a list of parts."""
    message_vars: list[str] = []
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(
            _is_var_or_elems_access(loop.iter, v) for v in _aliases(root, "messages")
        ):
            message_vars.append(loop.target.name)
    content_params: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(
                    _is_var_or_elems_access(arg, v, "content") for v in message_vars
                ):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in param_names and any(
                    _is_var_or_elems_access(kw.value, v, "content") for v in message_vars
                ):
                    params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if params:
                content_params[id(loop)] = params
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems_access(loop.iter, v, "content") for v in message_vars):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in content_params.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


# ---- messages as vLLM hands them to the template -----------------------------------------------


def _bad(message: str) -> NoReturn:
    raise TokenizerError(message)


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops Claude Code's per-request attribution line from system text parts."""
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: Any, wrap: bool) -> str | list[dict[str, Any]]:
    """A message's content as vLLM gives it to the template: text parts joined with newlines
    ("string" format) or as a list of text parts, a plain string included ("openai")."""
    if isinstance(content, str) and not (role == "system" and _BILLING_HEADER in content):
        return [{"type": "text", "text": content}] if wrap else content  # the usual case
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        _bad("message content must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts: list[str] = []
    wrapped: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            wrapped.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            _bad("a content part must be an object or a string")
        kind = part.get("type")
        if kind == "tool_reference":
            name = part.get("name")
            if not isinstance(name, str):
                _bad("a tool_reference part needs a name")
            texts.append(name)
            wrapped.append({"type": "tool_reference", "name": name})
            continue
        if kind not in _TEXT_PARTS or part.get("uuid") is not None:
            _bad(f"content parts of type {kind!r} are not tokenized by the router")
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in ("text", "refusal"):
            continue  # vLLM skips them with a warning
        if not isinstance(text, str):
            _bad(f"a {kind} part needs a string")
        texts.append(text)
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        wrapped.append({"type": "text", "text": text, **extra})
    return wrapped if wrap else "\n".join(texts)


def _conversation(messages: Any, wrap: bool) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (text-only; ``parse_chat_messages``)."""
    if not isinstance(messages, list) or not messages:
        _bad("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            _bad("each message must be an object with a string role")
        role: str = message["role"]
        msg: dict[str, Any] = {
            "role": role,
            "content": _content(role, message.get("content"), wrap),
        }
        if len(message) == 2 and role not in ("developer", "tool"):
            out.append(msg)  # role and content only: nothing else to carry over
            continue
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls is not None:
                if not isinstance(calls, list):
                    _bad("tool_calls must be a list")
                if calls:  # vLLM drops an empty list
                    msg["tool_calls"] = _tool_calls(calls)
            reasoning = message.get("reasoning")
            if reasoning is not None:
                msg["reasoning"] = msg["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            body = msg["content"]
            if isinstance(body, list) and all(p.get("type") == "text" for p in body):
                msg["content"] = "\n".join(p["text"] for p in body)
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                msg[key] = message[key]
        if role == "developer":
            msg["tools"] = message.get("tools")
        out.append(msg)
    return out


def _tool_calls(calls: list[Any]) -> list[Any]:
    """vLLM's ``_postprocess_messages``: arguments as dicts (``{}`` when empty or not an object).
    Copies, so the request's own objects stay as they were."""
    out: list[Any] = []
    for item in calls:
        if not isinstance(item, dict):
            _bad("assistant tool_calls entries must be objects")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, dict):
            _bad("only tool_calls of type function are supported")
        arguments = function.get("arguments")
        parsed: Any = {}
        if isinstance(arguments, dict):
            parsed = arguments
        elif arguments:
            parsed = arguments
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = {}
            if not isinstance(parsed, dict):
                parsed = {}
        out.append({**item, "function": {**function, "arguments": parsed}})
    return out


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's ``_convert_developer_to_system`` then ``_consolidate_system_messages``."""
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"} | {"role": "system"}
        converted.append(msg)
    contents: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            rest.append(msg)
            continue
        merge = merge or i > 0 or bool(contents)
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p)
            )
        if content:
            contents.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *rest]


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of None or "auto" leaves the default."""
    out = dict(defaults)
    for key, value in overrides.items():
        if value is None or (isinstance(value, str) and value == "auto"):
            continue
        out[key] = value
    return out


def _flag(payload: Mapping[str, Any], key: str, default: bool) -> bool:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        _bad(f"{key} must be a boolean")
    return value


def _needles(content: Any) -> tuple[str, str] | None:
    """The first and last stretches of a message's text, to find where it starts and ends in
    the rendered prompt (without surrounding whitespace, which templates may trim)."""
    if isinstance(content, str):
        texts = [content.strip()]
    elif isinstance(content, list):
        texts = [p["text"].strip() for p in content if isinstance(p.get("text"), str)]
    else:
        return None
    texts = [t for t in texts if t]
    if not texts:
        return None
    return texts[0][:_NEEDLE_CHARS], texts[-1][-_NEEDLE_CHARS:]


# ---- where a text may be cut ---------------------------------------------------------------------


def _trie_regex(words: Sequence[str]) -> str:
    """An alternation of ``words`` as a trie, longest match first: Python's ``re`` tries an
    alternation branch by branch at every position, a trie rejects most positions at once."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        end = "" in node
        branches = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return "(?:" + body + ")?" if end else body

    return build(trie)


def _overlaps(tokens: Sequence[str]) -> set[str]:
    """The tokens an occurrence of which another token's occurrence (or another of its own) can
    overlap: one contains another, or a proper suffix of one is a proper prefix of another."""
    contents = set(tokens)
    prefixes: dict[str, set[str]] = {}
    for t in contents:
        for k in range(1, len(t)):
            prefixes.setdefault(t[:k], set()).add(t)
    bad: set[str] = set()
    for t in contents:
        for i in range(len(t)):
            for j in range(i + 1, len(t) + 1):
                if (i, j) != (0, len(t)) and t[i:j] in contents:
                    bad |= {t, t[i:j]}
        for k in range(1, len(t)):
            others = prefixes.get(t[-k:], set())
            if others:  # a proper suffix of t starts another token (t itself: a border)
                bad |= {t, *others}
    return bad


@dataclass(frozen=True)
class _CutRule:
    """Where a text this tokenizer encodes may be cut so that encoding the parts apart gives the
    ids of encoding it whole (the module docstring says why).

    ``chars``: anywhere outside an added token's text (the model maps each character alone);
    ``added``: just after an isolated added token, encoding the rest with that token in front;
    ``none``: nowhere."""

    mode: Literal["chars", "added", "none"]
    pattern: re.Pattern[str] | None
    lead_ids: Mapping[str, int] = field(default_factory=dict)

    def scan(self, text: str) -> _Cuts:
        if self.mode == "none":
            return _NoCuts()
        if self.mode == "added":
            assert self.pattern is not None
            matches = list(self.pattern.finditer(text))
            return _AddedCuts([m.end() for m in matches], [m.end() - m.start() for m in matches])
        starts: list[int] = []
        stops: list[int] = []
        for m in self.pattern.finditer(text) if self.pattern is not None else ():
            start, stop = m.start(), m.start() + len(m.group(1))
            if starts and start < stops[-1]:
                stops[-1] = max(stops[-1], stop)
            else:
                starts.append(start)
                stops.append(stop)
        return _CharCuts(starts, stops)


@dataclass(frozen=True)
class _AddedCuts:
    """The cuts of one text in ``added`` mode: just after each isolated added token."""

    ends: list[int]  # ascending
    widths: list[int]  # the length of the token before each

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        """The last cut at or before ``pos``, with the characters before it (the added token)
        that the rest is encoded after."""
        i = bisect_right(self.ends, pos) - 1
        return (self.ends[i], self.widths[i]) if i >= 0 else None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        i = bisect_left(self.ends, pos)
        return (self.ends[i], self.widths[i]) if i < len(self.ends) else None

    def plain_cuts(self, length: int) -> list[int]:
        """Cuts to look a text without turns (a completions prompt) up at."""
        return list(self.ends)


@dataclass(frozen=True)
class _CharCuts:
    """The cuts of one text in ``chars`` mode: anywhere outside the (merged, disjoint) spans of
    added-token text."""

    starts: list[int]  # ascending
    stops: list[int]

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, pos - 1) - 1  # the last span starting before pos
        if i >= 0 and pos < self.stops[i]:
            pos = self.starts[i]
        return (pos, 0) if pos > 0 else None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        i = bisect_right(self.starts, pos - 1) - 1
        if i >= 0 and pos < self.stops[i]:
            pos = self.stops[i]
        return (pos, 0) if pos > 0 else None

    def plain_cuts(self, length: int) -> list[int]:
        points = range(_PLAIN_STRIDE_CHARS, length, _PLAIN_STRIDE_CHARS)
        return sorted({c[0] for p in points if (c := self.at_or_before(p)) is not None})


@dataclass(frozen=True)
class _NoCuts:
    """A tokenizer that offers no safe cut: every text is encoded whole."""

    def at_or_before(self, pos: int) -> tuple[int, int] | None:
        return None

    def at_or_after(self, pos: int) -> tuple[int, int] | None:
        return None

    def plain_cuts(self, length: int) -> list[int]:
        return []


_Cuts = _AddedCuts | _CharCuts | _NoCuts


def _cut_rule(spec: Mapping[str, Any], tokenizer: Tokenizer) -> _CutRule:
    added = list(tokenizer.get_added_tokens_decoder().values())
    contents = [t.content for t in added if t.content]
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    char_model = (
        model.get("type") == "BPE"
        and not model.get("merges")
        and not model.get("ignore_merges")
        and not model.get("continuing_subword_prefix")
        and not model.get("end_of_word_suffix")
        and not model.get("fuse_unk")
    )
    char_pre = pre is None or (pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space"))
    plain_added = all(not (t.lstrip or t.rstrip or t.single_word) for t in added)
    if char_model and spec.get("normalizer") is None and char_pre and plain_added:
        if not contents:
            return _CutRule("chars", None)
        longest_first = sorted(set(contents), key=len, reverse=True)
        return _CutRule("chars", re.compile("(?=(" + _trie_regex(longest_first) + "))"))
    overlapping = _overlaps(contents)
    normalizer = spec.get("normalizer") is not None
    safe = {
        t.content
        for t in added
        if t.content
        and t.content not in overlapping
        and not t.single_word
        and not (normalizer and t.normalized)
        and not (t.special and tokenizer.encode_special_tokens)
    }
    if not safe:
        return _CutRule("none", None)
    lead_ids = {}
    for content in safe:
        token_id = tokenizer.token_to_id(content)
        if token_id is not None:
            lead_ids[content] = token_id
    pattern = re.compile(_trie_regex(sorted(lead_ids, key=len, reverse=True)))
    return _CutRule("added", pattern, lead_ids)


# ---- the prefix cache ----------------------------------------------------------------------

_Variant = tuple[int, str | None, tuple[int, ...]]  # block size, LoRA name, leading special ids
_CacheKey = tuple[int, bytes]  # cut position, blake2b of the text before it


@dataclass
class _Entry:
    ids: array[int]  # the prefix text's ids, without post-processor specials
    # Chained keys of the full blocks of (leading specials + ids), per variant.
    keys: dict[_Variant, list[bytes]] = field(default_factory=dict)
    # A conversation's own prefix (the whole prompt, a remembered reply, or one that extended
    # another entry), which its next turn's entries replace; an entry encoded from scratch
    # before a request's final message may be a prefix many requests share (a system prompt),
    # and stays.
    derived: bool = False
    # The keys one turn stored (its request's entries and its remembered reply's; one list
    # object): when a later request extends one of them, the turn's derived entries go.
    family: list[_CacheKey] = field(default_factory=list)


@dataclass
class CacheStats:
    """Counts since the tokenizer was made (tests and the benchmark read them)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    tokens: int = 0
    encoded_chars: int = 0  # characters handed to the tokenizer
    whole_encodes: int = 0  # texts encoded whole (no safe cut, specials not separable)


class _PrefixCache:
    """An LRU of prefix -> ids and keys, bounded in entries and in total tokens."""

    def __init__(self, max_entries: int, max_tokens: int, stats: CacheStats) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.stats = stats
        self._entries: OrderedDict[_CacheKey, _Entry] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: _CacheKey) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def peek(self, key: _CacheKey) -> _Entry | None:
        return self._entries.get(key)

    def put(self, key: _CacheKey, entry: _Entry) -> None:
        if len(entry.ids) > self.max_tokens or self.max_entries < 1:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.tokens -= len(old.ids)
        self._entries[key] = entry
        self.stats.tokens += len(entry.ids)
        while len(self._entries) > self.max_entries or self.stats.tokens > self.max_tokens:
            _, evicted = self._entries.popitem(last=False)
            self.stats.tokens -= len(evicted.ids)
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def drop(self, key: _CacheKey, entry: _Entry) -> None:
        """Drop ``entry`` if ``key`` still holds it."""
        if self._entries.get(key) is entry:
            del self._entries[key]
            self.stats.tokens -= len(entry.ids)
            self.stats.entries = len(self._entries)


@dataclass
class _Prompt:
    """A request's prompt: ``head + body + tail`` are its ids (head and tail the post-processor's
    specials); ``base`` the cached entry its body starts with, ``stored`` the entries it made."""

    head: tuple[int, ...]
    body: array[int]
    tail: tuple[int, ...]
    truncated: bool = False
    base: _Entry | None = None
    stored: list[_Entry] = field(default_factory=list)


@dataclass
class _Lookup:
    """A text prompt looked up in the prefix cache and not yet encoded: ``text`` from ``start``
    follows the cached prefix ``base``; ``stores`` (cut, conversation-specific) are the prefixes
    to cache once encoded, ``digests`` their keys'."""

    text: str
    scan: _Cuts
    stores: list[tuple[int, bool]]
    digests: dict[int, bytes]
    head: tuple[int, ...]
    tail: tuple[int, ...]
    truncated: bool = False
    join: bool = False  # a remembered reply: joins the family of the prefix found
    # A post-processor whose specials depend on the text: one whole encode, nothing cached.
    whole_with_specials: bool = False
    start: int = 0
    base: _Entry | None = None

    @property
    def pending_chars(self) -> int:
        return len(self.text) - self.start


# ---- the tokenizer ------------------------------------------------------------------------------


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


def _affixes(tokenizer: Tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids the post-processor puts before and after a text (BOS, EOS, [CLS]/[SEP]), if they
    are the same for every text (template processors); None if not."""
    found: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    for probe in ("a", "Hello, world. 12"):
        plain = tokenizer.encode(probe, add_special_tokens=False).ids
        full = tokenizer.encode(probe, add_special_tokens=True).ids
        n = len(plain)
        at = next((i for i in range(len(full) - n + 1) if full[i : i + n] == plain), None)
        if at is None:
            return None
        pair = (tuple(full[:at]), tuple(full[at + n :]))
        if found is not None and found != pair:
            return None
        found = pair
    return found


class RequestTokenizer:
    """Tokenizes OpenAI-style requests as a vLLM engine serving these tokenizer files would.

    ``chat_template``, ``content_format`` and ``default_template_kwargs`` mirror ``vllm serve``'s
    ``--chat-template``, ``--chat-template-content-format`` and
    ``--default-chat-template-kwargs``.

    Thread-safe, for the router's worker threads: the prefix cache (and the stats) are behind one
    lock, held only to look prefixes up, store them and read or extend an entry's keys, never
    across an encode or a render, so a caller on an event loop waits at most for another thread's
    dictionary operations, never for its tokenizing. Entries' ids are never changed once stored
    (readers copy them outside the lock); two threads encoding the same new prefix both store it,
    the later replacing the earlier with the same ids. The ``tokenizers`` object is immutable once
    built and releases the GIL while it encodes; Jinja templates render per call.
    """

    def __init__(
        self,
        tokenizer_json: str,
        config: Mapping[str, Any],
        *,
        source: str = "<memory>",
        chat_template: str | None = None,
        content_format: ContentFormat = "auto",
        default_template_kwargs: Mapping[str, Any] | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        self.source = source
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
            self._add_config_tokens(tokenizer, config)
        except Exception as e:
            raise TokenizerError(f"{source}: {CONFIG_FILE} names unusable tokens: {e}") from e
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._rule = _cut_rule(spec, tokenizer)
        self._affixes = _affixes(tokenizer)
        self.special_tokens = {
            name: content
            for name in _NAMED_SPECIAL
            if (content := _token_content(config.get(name))) is not None
        }
        self.max_chars = max_chars
        self.stats = CacheStats()
        self._cache = _PrefixCache(cache_entries, cache_tokens, self.stats)
        self._default_kwargs = dict(default_template_kwargs or {})
        template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._template: jinja2.Template | None = None
        self._template_vars: frozenset[str] = frozenset()
        self._wrap_content = content_format == "openai"
        if self.chat_template is not None:
            env = _environment()
            try:
                self._template = env.from_string(self.chat_template)
                ast = env.parse(self.chat_template)
            except jinja2.TemplateError as e:
                raise TokenizerError(f"{source}: the chat template does not compile: {e}") from e
            self._template_vars = frozenset(jinja2.meta.find_undeclared_variables(ast))
            if content_format == "auto":
                try:
                    self._wrap_content = _loops_over_content(ast)
                except Exception:  # vLLM falls back to "string" when the walk fails
                    self._wrap_content = False
        self._names_developer = self.chat_template is not None and (
            '"developer"' in self.chat_template or "'developer'" in self.chat_template
        )

    @staticmethod
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

    @classmethod
    def from_dir(cls, path: Path, **options: Any) -> RequestTokenizer:
        """The tokenizer of a model directory: ``tokenizer.json``, ``tokenizer_config.json`` and,
        if present, ``chat_template.jinja``. ``options`` as for the constructor."""
        files = {name: path / name for name in (TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE)}
        return cls._from_files(files, source=str(path), **options)

    @classmethod
    def _from_files(
        cls, files: Mapping[str, Path | None], *, source: str, **options: Any
    ) -> RequestTokenizer:
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
        return cls(tokenizer_json, config, source=source, **options)

    # ---- public API -------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers`` pipeline as loaded (the config's special tokens added)."""
        return self._tokenizer

    def token_ids(self, kind: Kind, payload: Mapping[str, Any]) -> list[int]:
        """The prompt token ids the engine prefills for this request body. Raises
        :class:`TokenizerError` as :meth:`keys` does, and for a prompt over ``max_chars``."""
        prompt = self._prompt(kind, payload)
        if prompt.truncated:
            raise TokenizerError(f"the prompt is longer than {self.max_chars} characters")
        return [*prompt.head, *prompt.body, *prompt.tail]

    def keys(
        self,
        kind: Kind,
        payload: Mapping[str, Any],
        block_size: int,
        lora_name: str | None = None,
    ) -> list[bytes]:
        """The chained content keys (``chain_keys``) of the full blocks of the request's prompt,
        at most ``MAX_MATCH_BLOCKS``: what the KV index matches. A prompt over ``max_chars`` gives
        the keys of its head up to its last safe cut before the cap. Raises
        :class:`TokenizerError` for anything the engine would not tokenize this way."""
        return self.plan(kind, payload).keys(block_size, lora_name)

    def plan(self, kind: Kind, payload: Mapping[str, Any]) -> KeysPlan:
        """:meth:`keys` in two steps: this one looks the request up in the prefix cache (for a
        text of at most ``PLAN_INLINE_MAX_CHARS``), so that ``pending_chars`` says what the
        second, :meth:`KeysPlan.keys`, will encode, which may then run on another thread. Raises
        :class:`TokenizerError` as :meth:`keys` does (a longer text: from ``KeysPlan.keys``)."""
        _check_payload(payload)
        if kind == "completions" and not isinstance(payload.get("prompt"), str):
            return KeysPlan(self, kind, payload, 0, given=self._token_prompt(payload))
        size = _input_chars(kind, payload)
        if size > PLAN_INLINE_MAX_CHARS:
            return KeysPlan(self, kind, payload, size)
        found = self._plan_prompt(kind, payload)
        pending = found.pending_chars if isinstance(found, _Lookup) else 0
        return KeysPlan(self, kind, payload, pending, found=found)

    def _chain(self, prompt: _Prompt, variant: _Variant, tail: Sequence[int] = ()) -> list[bytes]:
        """The keys of ``head + body + tail`` for ``variant``, chained on from the keys of the
        prefix found; the keys of the prefixes it stored are left on them for later requests."""
        block_size, lora_name, head = variant
        ids = array("I", head)
        ids += prompt.body
        ids += array("I", tail)
        with self._cache.lock:
            known = list(prompt.base.keys.get(variant, ())) if prompt.base is not None else []
        if len(known) >= MAX_MATCH_BLOCKS:
            keys = known[:MAX_MATCH_BLOCKS]
        else:
            rest = chain_keys(
                ids[len(known) * block_size :],
                block_size,
                lora_name,
                parent=known[-1] if known else ROOT,
                max_blocks=MAX_MATCH_BLOCKS - len(known),
            )
            keys = known + rest
        with self._cache.lock:
            for entry in [prompt.base, *prompt.stored]:
                if entry is None or variant in entry.keys:
                    continue
                if len(entry.keys) >= _MAX_VARIANTS:
                    entry.keys.pop(next(iter(entry.keys)))
                entry.keys[variant] = keys[: (len(head) + len(entry.ids)) // block_size]
        return keys

    def render_chat(self, payload: Mapping[str, Any]) -> str:
        """The chat prompt text vLLM renders for this ``/v1/chat/completions`` body."""
        return self._render_chat(payload).text

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None:
        """Cache the prefix this conversation's next turn starts with: the chat request's
        messages followed by the assistant's reply as the engine generated it (the router sees
        it on its way back), up to the cut after the reply. The next request then tokenizes
        only its new message. A reply the client sends back otherwise is only a miss. Raises
        :class:`TokenizerError` as :meth:`keys` does."""
        if not isinstance(payload, Mapping) or not isinstance(reply, str):
            _bad("remember_reply takes a chat body and the reply's text")
        if _flag(payload, "continue_final_message", False) or not reply.strip():
            return  # the reply continues a message: the next turn's text is not known
        messages = payload.get("messages")
        if not isinstance(messages, list):
            _bad("messages must be a non-empty list")
        body = {
            **payload,
            "messages": [*messages, {"role": "assistant", "content": reply}],
            "add_generation_prompt": False,
        }
        r = self._render_chat(body)
        scan = self._rule.scan(r.text)
        after = scan.at_or_after(r.final[1]) if r.final is not None else None
        if after is None or after[0] > len(r.text):
            return
        stop = after[0]
        cuts = [c for c in _span_cuts(scan, r.spans) if c < stop]
        prompt = self._text_prompt(r.text[:stop], scan, cuts, [(stop, True)], r.specials, join=True)
        if prompt.base is not None:  # the request's keys, extended over the reply
            with self._cache.lock:
                variants = list(prompt.base.keys)
            for variant in variants:
                self._chain(prompt, variant)

    # ---- requests ---------------------------------------------------------------------------

    def _prompt(self, kind: Kind, payload: Mapping[str, Any]) -> _Prompt:
        found = self._plan_prompt(kind, payload)
        return found if isinstance(found, _Prompt) else self._finish(found)

    def _plan_prompt(self, kind: Kind, payload: Mapping[str, Any]) -> _Prompt | _Lookup:
        """The request's prompt looked up in the cache (a token-id prompt: its ids at once)."""
        _check_payload(payload)
        if kind == "chat":
            r = self._render_chat(payload)
            scan = self._rule.scan(r.text)
            # Stored: the prefix before the final message (a retry or another branch of this
            # conversation has it; from scratch, it may be a shared system prompt) and the whole
            # prompt to its last cut (the next turn extends it when the template renders the
            # generation prompt as the start of the reply, as nearly all do).
            before_final = scan.at_or_before(r.final[0]) if r.final is not None else None
            whole = scan.at_or_before(len(r.text))
            stores = [(before_final[0], False)] if before_final is not None else []
            stores += [(whole[0], True)] if whole is not None else []
            return self._look_up(r.text, scan, _span_cuts(scan, r.spans), stores, r.specials)
        if kind != "completions":
            _bad(f"unknown request kind {kind!r}")
        prompt = self._single_prompt(payload)
        if not isinstance(prompt, str):
            ids = self._token_prompt(payload)
            return _Prompt((), array("I", ids), ())
        self._check_input_size(len(prompt))
        scan = self._rule.scan(prompt)
        cuts = scan.plain_cuts(len(prompt))
        specials = _flag(payload, "add_special_tokens", True)
        return self._look_up(prompt, scan, cuts, [(cuts[-1], False)] if cuts else [], specials)

    def _single_prompt(self, payload: Mapping[str, Any]) -> str | list[int]:
        if payload.get("prompt_embeds") is not None:
            _bad("prompt_embeds are not tokenized")
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1:
            item = prompt[0]
            if isinstance(item, str):
                return item
            if isinstance(item, list) and item and all(_is_token_id(t) for t in item):
                return item
        if (
            isinstance(prompt, list)
            and len(prompt) > 1
            and all(isinstance(p, str | list) for p in prompt)
        ):
            _bad("batched prompts are not routed by content")
        _bad("prompt must be a string or a list of token ids")

    def _token_prompt(self, payload: Mapping[str, Any]) -> list[int]:
        prompt = self._single_prompt(payload)
        if isinstance(prompt, str):
            _bad("prompt is text, not token ids")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            _bad(f"a prompt token id is outside the vocabulary (0..{self.vocab_size - 1})")
        return list(prompt)

    def _check_input_size(self, chars: int) -> None:
        if chars > 4 * self.max_chars:
            _bad(f"the prompt is too large to tokenize ({chars} characters)")

    def _render_chat(self, payload: Mapping[str, Any]) -> _Rendered:
        """The rendered chat text, where its messages' text is in it, and whether it is encoded
        with the post-processor's special tokens."""
        if not isinstance(payload, Mapping):
            _bad("the request body must be a JSON object")
        if self._template is None:
            _bad(f"{self.source}: the tokenizer has no chat template")
        if payload.get("chat_template") is not None:
            _bad("a request chat_template is refused (vLLM: --trust-request-chat-template)")
        if payload.get("tools") is not None:
            _bad("requests with tools are not rendered by the router")
        user_kwargs = payload.get("chat_template_kwargs")
        user_kwargs = {} if user_kwargs is None else user_kwargs
        if not isinstance(user_kwargs, Mapping):
            _bad("chat_template_kwargs must be an object")
        refused = _REFUSED_KWARGS & user_kwargs.keys()
        if refused:
            _bad(f"chat_template_kwargs {sorted(refused)} are not followed by the router")
        effort = payload.get("reasoning_effort")
        if effort is not None and not isinstance(effort, str):
            _bad("reasoning_effort must be a string")
        documents = payload.get("documents")
        if documents is not None and not (
            isinstance(documents, list) and all(isinstance(d, Mapping) for d in documents)
        ):
            _bad("documents must be a list of objects")
        extra: dict[str, Any] = {
            "add_generation_prompt": _flag(payload, "add_generation_prompt", True),
            "continue_final_message": _flag(payload, "continue_final_message", False),
            "documents": documents,
            "reasoning_effort": effort,
        }
        if effort is not None and "enable_thinking" not in user_kwargs:
            extra["enable_thinking"] = effort != "none"
        server = _merge(self._default_kwargs, {"tokenize": False})
        kwargs = _merge(server, _merge(user_kwargs, extra))
        generation = kwargs.pop("add_generation_prompt", False)
        continue_final = kwargs.pop("continue_final_message", False)
        tokenize = kwargs.pop("tokenize", True)
        documents = kwargs.pop("documents", None)
        if continue_final and generation:
            _bad("continue_final_message and add_generation_prompt cannot both be true")

        messages = payload.get("messages")
        self._check_input_size(_content_chars(messages))
        chat = _conversation(messages, self._wrap_content)
        if any(m["role"] == "developer" for m in chat) and not self._names_developer:
            chat = _developer_as_system(chat)
        final_text: str | None = None
        if continue_final:
            chat, final_text = self._tag_final(chat)
        variables = {
            **self.special_tokens,
            **{
                k: v
                for k, v in kwargs.items()
                if k in self._template_vars and k not in _APPLY_PARAMS
            },
        }
        assert self._template is not None
        try:
            text = self._template.render(
                messages=chat,
                tools=None,
                documents=documents,
                add_generation_prompt=generation,
                **variables,
            )
        except Exception as e:
            raise TokenizerError(f"the chat template failed: {e}") from e
        if final_text is not None:
            text = _cut_continued(text, final_text)
        spans: list[tuple[int, int]] = []
        final: tuple[int, int] | None = None
        pos = 0
        for msg in chat:
            final = None
            needles = _needles(msg.get("content"))
            if needles is None:
                continue
            head, tail = needles
            at = text.find(head, pos)
            if at < 0:
                continue
            end = at + len(head) if head == tail else text.find(tail, at) + len(tail)
            if end >= at + len(head):
                final = (at, end)
                spans.append(final)
                pos = end
        specials = not tokenize and _flag(payload, "add_special_tokens", False)
        return _Rendered(text, spans, final, specials)

    def _tag_final(self, chat: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """transformers' continue_final_message: tag the final message's text to cut after it."""
        assert self.chat_template is not None
        chat = deepcopy(chat)
        final = chat[-1].get("content")
        if final is None:
            _bad('continue_final_message is set but the final message has no "content"')
        if "content" not in self.chat_template:
            _bad("continue_final_message needs a template that renders content")
        if isinstance(final, list):
            for block in reversed(final):
                if "text" in block:
                    text: str = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    return chat, text
            _bad("continue_final_message: the final message has no text to continue")
        if not isinstance(final, str):
            _bad("continue_final_message: the final message's content is not text")
        chat[-1]["content"] = final + _CONTINUE_TAG
        return chat, final

    # ---- encoding -----------------------------------------------------------------------------

    def _text_prompt(
        self,
        text: str,
        scan: _Cuts,
        cuts: list[int],
        stores: list[tuple[int, bool]],
        specials: bool,
        *,
        join: bool = False,
    ) -> _Prompt:
        """Ids of ``text`` from the longest cached prefix ending at one of ``cuts``; the prefixes
        ending at ``stores`` (cut, conversation-specific) are cached for later requests, as one
        turn's family (``join``: the family of the prefix found, for a remembered reply)."""
        return self._finish(self._look_up(text, scan, cuts, stores, specials, join=join))

    def _look_up(
        self,
        text: str,
        scan: _Cuts,
        cuts: list[int],
        stores: list[tuple[int, bool]],
        specials: bool,
        *,
        join: bool = False,
    ) -> _Lookup:
        """The first half of :meth:`_text_prompt`: the longest cached prefix, nothing encoded."""
        if specials and self._affixes is None:
            # A post-processor whose specials depend on the text: encode whole, no cache.
            if len(text) > self.max_chars:
                _bad(f"the prompt is longer than {self.max_chars} characters")
            return _Lookup(text, scan, [], {}, (), (), join=join, whole_with_specials=True)
        head, tail = self._affixes if specials and self._affixes is not None else ((), ())
        truncated = False
        if len(text) > self.max_chars:
            cut = scan.at_or_before(self.max_chars)
            if cut is None:
                _bad(f"the prompt is longer than {self.max_chars} characters and has no cut")
            text = text[: cut[0]]
            truncated = True
            cuts = [c for c in cuts if c <= cut[0]]
            stores = [(c, own) for c, own in stores if c <= cut[0]]
        if len(cuts) > _MAX_CANDIDATES:
            cuts = cuts[:_FIRST_CANDIDATES] + cuts[-(_MAX_CANDIDATES - _FIRST_CANDIDATES) :]
        digests = _prefix_digests(text, sorted({*cuts, *(c for c, _ in stores)}))
        found = _Lookup(text, scan, stores, digests, head, tail, truncated, join)
        with self._cache.lock:
            for c in reversed(cuts):
                entry = self._cache.get((c, digests[c]))
                if entry is not None:
                    found.start, found.base = c, entry
                    break
            if found.base is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return found

    def _finish(self, found: _Lookup) -> _Prompt:
        """The second half of :meth:`_text_prompt`: encode what follows the prefix found and
        store the new prefixes. Runs on any thread; the lock is taken only to store."""
        text, scan, base, start = found.text, found.scan, found.base, found.start
        if found.whole_with_specials:
            ids = self._encode(text, scan, 0, len(text), specials=True, whole=True)
            return _Prompt((), array("I", ids), ())
        body = array("I", base.ids) if base is not None else array("I")
        join = found.join
        family: list[_CacheKey] = base.family if join and base is not None else []
        made: list[tuple[_CacheKey, _Entry]] = []
        try:
            for stop, own in sorted(set(found.stores)):
                if stop <= start:
                    continue
                body += array("I", self._encode(text, scan, start, stop))
                entry = _Entry(array("I", body), derived=own or base is not None, family=family)
                made.append(((stop, found.digests[stop]), entry))
                start = stop
            if start < len(text):
                body += array("I", self._encode(text, scan, start, len(text)))
        except _CutMismatchError:  # impossible if the module docstring's argument holds; stay exact
            body = array("I", self._encode(text, scan, 0, len(text), whole=True))
            return _Prompt(found.head, body, found.tail, found.truncated)
        with self._cache.lock:
            if base is not None and made and base.derived and not join:
                # The conversation moved on: the turn it extends is replaced by this one.
                for key in base.family:
                    old = self._cache.peek(key)
                    if old is not None and old.derived and old.family is base.family:
                        self._cache.drop(key, old)
            for key, entry in made:
                family.append(key)
                self._cache.put(key, entry)
        stored = [entry for _, entry in made]
        return _Prompt(found.head, body, found.tail, found.truncated, base, stored)

    def _encode(
        self,
        text: str,
        scan: _Cuts,
        start: int,
        stop: int,
        *,
        specials: bool = False,
        whole: bool = False,
    ) -> list[int]:
        """The ids of ``text[start:stop]`` as part of ``text`` (``start`` a cut): in ``added``
        mode encoded after the added token that ends at ``start``, whose id is dropped
        (``whole``: counted as a whole encode)."""
        lead = 0
        if start > 0:
            cut = scan.at_or_before(start)
            if cut is None or cut[0] != start:
                raise _CutMismatchError
            lead = cut[1]
        segment = text[start - lead : stop]
        with self._cache.lock:  # counters shared with other threads' requests
            self.stats.encoded_chars += len(segment)
            self.stats.whole_encodes += whole
        try:
            ids = self._tokenizer.encode_batch_fast([segment], add_special_tokens=specials)[0].ids
        except Exception as e:
            raise TokenizerError(f"the tokenizer failed: {e}") from e
        if not lead:
            return ids
        if not ids or ids[0] != self._rule.lead_ids.get(text[start - lead : start]):
            raise _CutMismatchError
        return ids[1:]


class _CutMismatchError(Exception):
    pass


@dataclass
class _Rendered:
    text: str
    spans: list[tuple[int, int]]  # where the messages' text was found in it, in order
    final: tuple[int, int] | None  # the final message's span, if found
    specials: bool  # encoded with the post-processor's special tokens


def _span_cuts(scan: _Cuts, spans: list[tuple[int, int]]) -> list[int]:
    """Where to look a chat's prefixes up: the last cut before each message's text and the
    first after it (where a remembered reply's prefix ends)."""
    cuts: set[int] = set()
    for start, end in spans:
        for cut in (scan.at_or_before(start), scan.at_or_after(end)):
            if cut is not None:
                cuts.add(cut[0])
    return sorted(cuts)


def _content_chars(messages: Any) -> int:
    """The characters of text a chat body carries, counted before anything is rendered."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, str):
                    total += len(part)
                elif isinstance(part, dict):
                    total += sum(len(v) for v in part.values() if isinstance(v, str))
    return total


def _check_payload(payload: Any) -> None:
    if not isinstance(payload, Mapping):
        _bad("the request body must be a JSON object")
    if payload.get("truncate_prompt_tokens") is not None:
        _bad("truncate_prompt_tokens is not followed by the router")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cut_continued(text: str, final: str) -> str:
    """transformers' cut of a rendered chat after the tagged final message."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        _bad("continue_final_message: the template dropped the final message's text")
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


def _prefix_digests(text: str, points: Sequence[int]) -> dict[int, bytes]:
    """blake2b of ``text[:p]`` for each ascending ``p``, in one pass over the text."""
    digests: dict[int, bytes] = {}
    h = blake2b(digest_size=16)
    prev = 0
    for p in points:
        h.update(text[prev:p].encode("utf-8", "surrogatepass"))
        prev = p
        digests[p] = h.copy().digest()
    return digests


class KeysPlan:
    """A request's :meth:`RequestTokenizer.keys`, split where the cheap part ends: made by
    :meth:`RequestTokenizer.plan`, then :meth:`keys` (any thread) encodes what the prefix cache
    lacks and chains the keys, per block size.

    ``pending_chars``: the characters :meth:`keys` will encode (past the longest cached prefix)
    when the plan looked the request up; for a request over ``PLAN_INLINE_MAX_CHARS``, left whole
    to :meth:`keys`, the size of its text; 0 for a token-id prompt. One plan is for one thread at
    a time; its tokenizer serves many at once."""

    def __init__(
        self,
        tokenizer: RequestTokenizer,
        kind: Kind,
        payload: Mapping[str, Any],
        pending_chars: int,
        *,
        found: _Prompt | _Lookup | None = None,
        given: list[int] | None = None,
    ) -> None:
        self.pending_chars = pending_chars
        self._tokenizer = tokenizer
        self._kind: Kind = kind
        self._payload = payload
        self._found = found
        self._given = given
        self._prompt: _Prompt | None = found if isinstance(found, _Prompt) else None

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens once :meth:`keys` ran; None for a prompt cut at the
        tokenizer's ``max_chars``, whose keys cover only its head (keys are also cut at
        ``MAX_MATCH_BLOCKS``: a caller that needs the whole prompt checks their number too)."""
        if self._given is not None:
            return len(self._given)
        prompt = self._prompt
        if prompt is None or prompt.truncated:
            return None
        return len(prompt.head) + len(prompt.body) + len(prompt.tail)

    def keys(self, block_size: int, lora_name: str | None = None) -> list[bytes]:
        """As :meth:`RequestTokenizer.keys`; the prompt is encoded once for all block sizes."""
        if self._given is not None:
            return chain_keys(self._given, block_size, lora_name, max_blocks=MAX_MATCH_BLOCKS)
        tokenizer = self._tokenizer
        prompt = self._prompt
        if prompt is None:
            found = self._found
            if found is None:
                found = tokenizer._plan_prompt(self._kind, self._payload)
            prompt = found if isinstance(found, _Prompt) else tokenizer._finish(found)
            self._prompt = prompt
        tail = () if prompt.truncated else prompt.tail
        return tokenizer._chain(prompt, (block_size, lora_name, prompt.head), tail)


def _input_chars(kind: Kind, payload: Mapping[str, Any]) -> int:
    """The characters of text a request carries, counted without rendering it."""
    if kind == "chat":
        return _content_chars(payload.get("messages"))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0


def load_tokenizer(
    ref: str,
    *,
    cache_dir: Path | None = None,
    local_files_only: bool = False,
    **options: Any,
) -> RequestTokenizer:
    """The tokenizer ``ref`` names: a local model directory, or ``hf://<org>/<name>@<revision>``
    (revision a commit, tag or branch; ``main`` when left out), of which only ``tokenizer.json``,
    ``tokenizer_config.json`` and, if the repository has it, ``chat_template.jinja`` are fetched
    with ``huggingface_hub`` (its cache, ``HF_TOKEN``, ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE``
    as it reads them; ``cache_dir`` and ``local_files_only`` override the last two). Raises
    :class:`TokenizerError` naming the file that is missing or unusable."""
    if not ref.startswith("hf://"):
        path = Path(ref)
        if not path.is_dir():
            raise TokenizerError(f"{ref}: not a directory (nor an hf://org/name@revision)")
        return RequestTokenizer.from_dir(path, **options)
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

    files = {
        TOKENIZER_FILE: fetch(TOKENIZER_FILE),
        CONFIG_FILE: fetch(CONFIG_FILE),
        TEMPLATE_FILE: fetch(TEMPLATE_FILE, optional=True),
    }
    return RequestTokenizer._from_files(files, source=ref, **options)
