"""Request features the routing policies read: the prompt text (for prefix hashing) and the
cheap complexity signals. Purely computational: a parsed JSON body and headers in, a frozen
``RequestFeatures`` out, or ``InvalidRequestError`` for a body no engine would accept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fleetpilot.routing.errors import InvalidRequestError

TIER_HEADER = "x-fleetpilot-tier"
Kind = Literal["completions", "chat"]

# English text averages about four characters per token with Llama/Qwen-style BPE vocabularies;
# a tokenizer per tier would be exact but costs more than the routing decision it informs.
CHARS_PER_TOKEN = 4
# Markers are looked for in the most recent text only: the signal is what is being asked now,
# and scanning a 1 MB prompt on every request would cost more than the rest of the routing.
MARKER_SCAN_CHARS = 32_768

_CODE = re.compile(
    r"```|\bdef \w+\s*\(|\bclass \w+\s*[:({]|\bfunction\s*\w*\s*\(|#include\s*<|\bimport \w+|"
    r"\bSELECT\b[^;]{0,200}\bFROM\b|\bpublic static\b|=>|\bfn \w+\s*\(|\bconsole\.log\b|"
    r"\b(?:refactor|debug|stack trace|traceback|compile error|segfault|unit tests?)\b",
    re.IGNORECASE,
)
_MATH = re.compile(
    r"\\(?:frac|int|sum|sqrt|prod|lim|begin\{(?:equation|align))|\$[^$\n]{1,200}\$|[∫∑√∏∞≤≥≠±]|"
    r"\b(?:prove|proof|theorem|lemma|integral|derivative|differentiate|equation|eigen\w*|"
    r"matrix|polynomial|probability|combinatori\w*|modulo)\b|\b\d+\s*[\^*/]\s*\d+",
    re.IGNORECASE,
)
_REASONING = re.compile(
    r"\b(?:step[- ]by[- ]step|think (?:carefully|through)|explain why|reason(?:ing)? about|"
    r"analy[sz]e|compare and contrast|trade-?offs?|justify|pros and cons|root cause|"
    r"design (?:a|an|the)|plan (?:a|an|the)|evaluate|critique|derive)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """What routing needs from one OpenAI request."""

    kind: Kind
    model: str | None
    prompt_text: str
    approx_tokens: int
    max_tokens: int | None
    turns: int
    system_chars: int
    has_code: bool
    has_math: bool
    has_reasoning: bool
    stream: bool
    tier_header: str | None = None
    # The request body as sent, for the router's tokenizer to render and tokenize as the
    # engine will (chat template options included) and match against the engines' KV events.
    payload: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, reason=code)


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    # bool is an int subclass; true is not a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{key}' must be an integer", key, "invalid_type")
    if value < 0:
        raise _bad(f"'{key}' must not be negative", key)
    return value


def _prompt_text(prompt: Any) -> tuple[str, int]:
    """The completions ``prompt`` as text, and its approximate token count.

    Token-id prompts become their ids joined by spaces: a stable, prefix-preserving text whose
    blocks hash like any other prompt's.
    """
    if isinstance(prompt, str):
        return prompt, len(prompt) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            text = "\n".join(prompt)
            return text, len(text) // CHARS_PER_TOKEN
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)
        if all(
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return "\n".join(" ".join(map(str, p)) for p in prompt), sum(len(p) for p in prompt)
    raise _bad("'prompt' must be a string, a list of strings, or a list of token ids", "prompt")


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise _bad(
                    f"messages[{index}].content parts must be objects",
                    f"messages[{index}].content",
                    "invalid_type",
                )
            text = part.get("text")
            if isinstance(text, str):
                parts.append(text)
        return "".join(parts)
    raise _bad(
        f"messages[{index}].content must be a string or a list of parts",
        f"messages[{index}].content",
        "invalid_type",
    )


def _chat_text(messages: Any) -> tuple[str, int, int]:
    """The conversation as ``role: content`` lines (the order a chat template renders it in),
    the number of user turns, and the characters of system prompts."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    lines = []
    turns = 0
    system_chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a string", f"messages[{i}].role")
        text = _content_text(message.get("content"), i)
        if role == "user":
            turns += 1
        elif role in ("system", "developer"):
            system_chars += len(text)
        lines.append(f"{role}: {text}\n")
    return "".join(lines), turns, system_chars


def extract_features(
    body: Any, kind: Kind, headers: Mapping[str, str] | None = None
) -> RequestFeatures:
    """Validate what routing relies on and read the features; the engine validates the rest."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    if kind == "completions":
        if "prompt" not in body:
            raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
        text, tokens = _prompt_text(body["prompt"])
        turns, system_chars = 1, 0
        max_tokens = _optional_int(body, "max_tokens")
    else:
        if "messages" not in body:
            raise _bad("'messages' is required", "messages", "missing_required_parameter")
        text, turns, system_chars = _chat_text(body["messages"])
        tokens = len(text) // CHARS_PER_TOKEN
        completion = _optional_int(body, "max_completion_tokens")
        max_tokens = completion if completion is not None else _optional_int(body, "max_tokens")
    recent = text[-MARKER_SCAN_CHARS:]
    tier = None
    if headers is not None:
        tier = headers.get(TIER_HEADER) or None
    return RequestFeatures(
        kind=kind,
        model=model,
        prompt_text=text,
        approx_tokens=tokens,
        max_tokens=max_tokens,
        turns=turns,
        system_chars=system_chars,
        has_code=_CODE.search(recent) is not None,
        has_math=_MATH.search(recent) is not None,
        has_reasoning=_REASONING.search(recent) is not None,
        stream=stream,
        tier_header=tier.strip() if tier else None,
        payload=body,
    )
