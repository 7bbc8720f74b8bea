"""Request bodies as vLLM hands them on (vLLM 0.33.0, ``vllm/renderers/chat_utils/chat_message.py``
``parse_chat_message_content``, ``vllm/renderers/hf.py``, ``vllm/renderers/base.py``): chat messages
normalized for text-only content (text parts joined with ``"\\n"`` for a template that takes
string content, kept as ``{"type": "text", ...}`` parts, strings included, for one that iterates
over ``message.content``; assistant ``tool_calls`` arguments parsed to dicts; ``developer``
turned into ``system`` when the template never names it), a completions prompt as one string or
one list of token ids, and the request's size counted before anything is rendered. Pure: plain
data in, plain data out; anything else raises :class:`TokenizerError`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from fleetpilot.routing.tokenizer.errors import TokenizerError, bad

Kind = Literal["completions", "chat"]

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

# How much of a message's text locates it in the rendered prompt.
NEEDLE_CHARS = 256


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
        bad("message content must be a string, a list of parts or null")
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
            bad("a content part must be an object or a string")
        kind = part.get("type")
        if kind == "tool_reference":
            name = part.get("name")
            if not isinstance(name, str):
                bad("a tool_reference part needs a name")
            texts.append(name)
            wrapped.append({"type": "tool_reference", "name": name})
            continue
        if kind not in _TEXT_PARTS or part.get("uuid") is not None:
            bad(f"content parts of type {kind!r} are not tokenized by the router")
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in ("text", "refusal"):
            continue  # vLLM skips them with a warning
        if not isinstance(text, str):
            bad(f"a {kind} part needs a string")
        texts.append(text)
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        wrapped.append({"type": "text", "text": text, **extra})
    return wrapped if wrap else "\n".join(texts)


def conversation(messages: Any, wrap: bool) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the template (text-only; ``parse_chat_messages``)."""
    if not isinstance(messages, list) or not messages:
        bad("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            bad("each message must be an object with a string role")
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
                    bad("tool_calls must be a list")
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
            bad("assistant tool_calls entries must be objects")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, dict):
            bad("only tool_calls of type function are supported")
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


def developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
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


def flag(payload: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean request field; null is the default, as in vLLM's request models."""
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        bad(f"{key} must be a boolean")
    return value


def needles(content: Any) -> tuple[str, str] | None:
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
    return texts[0][:NEEDLE_CHARS], texts[-1][-NEEDLE_CHARS:]


def content_chars(messages: Any) -> int:
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


def check_payload(payload: Any) -> None:
    """What both kinds of request are refused for before anything is read from them."""
    if not isinstance(payload, Mapping):
        bad("the request body must be a JSON object")
    if payload.get("truncate_prompt_tokens") is not None:
        bad("truncate_prompt_tokens is not followed by the router")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def input_chars(kind: Kind, payload: Mapping[str, Any]) -> int:
    """The characters of text a request carries, counted without rendering it."""
    if kind == "chat":
        return content_chars(payload.get("messages"))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0


def single_prompt(payload: Mapping[str, Any]) -> str | list[int]:
    """A completions prompt: one string or one list of token ids (batched prompts refused)."""
    if payload.get("prompt_embeds") is not None:
        bad("prompt_embeds are not tokenized")
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
        bad("batched prompts are not routed by content")
    raise TokenizerError("prompt must be a string or a list of token ids")


def token_prompt(payload: Mapping[str, Any], vocab_size: int) -> list[int]:
    """A completions prompt of token ids, each inside the vocabulary."""
    prompt = single_prompt(payload)
    if isinstance(prompt, str):
        bad("prompt is text, not token ids")
    if any(t < 0 or t >= vocab_size for t in prompt):
        bad(f"a prompt token id is outside the vocabulary (0..{vocab_size - 1})")
    return list(prompt)


def check_input_size(chars: int, max_chars: int) -> None:
    """Refuse raw input over four times the cap before rendering it: past its last safe cut
    before ``max_chars`` a prompt is not encoded anyway (see ``request.DEFAULT_MAX_CHARS``)."""
    if chars > 4 * max_chars:
        bad(f"the prompt is too large to tokenize ({chars} characters)")
