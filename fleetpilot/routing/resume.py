"""Streams that survive a dying engine: what a client has been sent of a streamed answer, the
request that continues it on another replica, and the continuation's events rewritten so the
client reads one uninterrupted stream. Purely computational; the proxy does the I/O.

The continuation is the request itself, extended by what was sent: for completions the
original prompt plus the text already sent, for chat the sent text as a final assistant
message that the engine continues (``continue_final_message``); in both ``max_tokens`` shrinks
by the tokens sent, as the new replica's tokenizer counts them. Where the sent text encodes to
the tokens that produced it, greedy decoding continues exactly where the dead engine stopped;
sampling continues validly. Text, not the stream's token ids (vLLM's ``return_token_ids``):
an engine holds back text that may begin a stop string or ends inside a character while it
streams those tokens' ids, so a continuation from the ids would skip text the client never got.

Only whole SSE events reach the client while a stream can be resumed: an event cut in half by
a dying engine would otherwise reach the client half-written, and no continuation can finish
it. The ledger keeps the relayed events' bytes (bounded) and parses them only when a stream
breaks, so an unbroken stream costs a byte search and a list append per chunk.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleetpilot.routing.features import Kind

EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]\n\n"
# Relayed bytes a ledger keeps per stream: ~8,000 events of a few hundred bytes, longer than
# most answers. A longer stream is not resumed (its memory is the router's to protect).
LEDGER_MAX_BYTES = 2 * 1024 * 1024
# The completions API's max_tokens when a request leaves it out (OpenAI's and vLLM's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Chat deltas whose continuation is not a continued assistant text: tool calls and reasoning
# are parsed by the engine from its whole output, which a new engine would not see.
_NOT_TEXT_DELTAS = ("tool_calls", "function_call", "reasoning_content", "reasoning")


class StreamLedger:
    """The whole events relayed of one streamed answer (up to ``max_bytes``), and the start
    of an event still in flight."""

    def __init__(self, max_bytes: int = LEDGER_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.events: list[bytes] = []
        self.size = 0
        self.overflowed = False
        self.done = False  # the engine's own [DONE] went out
        self._partial = b""

    def whole(self, chunk: bytes) -> bytes:
        """What of ``chunk`` (after the start held from earlier chunks) ends at an event
        boundary, to relay now; the rest waits for the next chunk."""
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(EVENT_END)
        if cut < 0:
            self._partial = data
            return b""
        cut += len(EVENT_END)
        whole, self._partial = data[:cut], data[cut:]
        return whole

    def record(self, relayed: bytes) -> None:
        """Note whole events as the client got them."""
        if relayed.endswith(DONE_EVENT):
            self.done = True
        if self.overflowed:
            return
        self.size += len(relayed)
        if self.size > self.max_bytes:
            self.overflowed = True
            self.events.clear()
        else:
            self.events.append(relayed)

    def rest(self) -> bytes:
        """The held start of an event, at the end of an unbroken stream (relayed as it is)."""
        rest, self._partial = self._partial, b""
        return rest


@dataclass(frozen=True, slots=True)
class Sent:
    """What the client has of a streamed answer, read from the relayed events."""

    id: str | None
    created: int | None
    model: str | None
    text: str
    events: int  # events carrying a part of the answer
    finished: bool  # a finish_reason went out: nothing is left to generate
    # vLLM's return_token_ids: the prompt's token ids, when the stream carries them.
    prompt_token_ids: list[int] | None
    # Why the answer cannot be continued elsewhere; None when it can.
    not_resumable: str | None = None


def read_sent(kind: Kind, ledger: StreamLedger) -> Sent:
    """Parse the relayed events of ``ledger``."""
    if ledger.overflowed:
        return _refused("longer than the ledger keeps")
    ident: str | None = None
    created: int | None = None
    model: str | None = None
    parts: list[str] = []
    prompt_ids: list[int] | None = None
    events = 0
    finished = False
    for event in b"".join(ledger.events).split(EVENT_END):
        data = _data_of(event)
        if data is None or data == "[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return _refused("an event is not JSON")
        if not isinstance(obj, dict):
            return _refused("an event is not a JSON object")
        if "error" in obj:
            return _refused("the engine sent an error event")
        ident = obj.get("id", ident)
        created = obj.get("created", created)
        model = obj.get("model", model)
        if isinstance(obj.get("prompt_token_ids"), list):  # chat carries them at the top
            prompt_ids = obj["prompt_token_ids"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return _refused("more than one choice")
            if kind == "chat":
                delta = choice.get("delta") or {}
                if any(delta.get(name) for name in _NOT_TEXT_DELTAS):
                    return _refused("the answer has tool calls or reasoning")
                piece = delta.get("content")
            else:
                piece = choice.get("text")
                if isinstance(choice.get("prompt_token_ids"), list):
                    prompt_ids = choice["prompt_token_ids"]
            if isinstance(piece, str) and piece:
                parts.append(piece)
                events += 1
            if choice.get("finish_reason") is not None:
                finished = True
    return Sent(
        id=ident,
        created=created,
        model=model,
        text="".join(parts),
        events=events,
        finished=finished,
        prompt_token_ids=prompt_ids,
    )


def _refused(why: str) -> Sent:
    return Sent(None, None, None, "", 0, False, None, not_resumable=why)


def _data_of(event: bytes) -> str | None:
    """The data of one SSE event (its ``data:`` lines joined), or None."""
    lines = [
        line[5:].lstrip() if line.startswith("data:") else None
        for line in event.decode("utf-8", errors="replace").splitlines()
    ]
    data = [line for line in lines if line is not None]
    return "\n".join(data) if data else None


def continuation(
    kind: Kind, body: Mapping[str, Any], sent: Sent, sent_tokens: int
) -> dict[str, Any] | None:
    """The request that continues ``body``'s answer after ``sent`` (``sent_tokens`` of it);
    None when nothing is left to generate (the limit is reached)."""
    resumed = copy.deepcopy(dict(body))
    resumed.pop("kv_transfer_params", None)
    if not sent.text:
        return resumed  # nothing of the answer went out: the request as it was
    limit = _limit(kind, resumed)
    if limit is not None:
        key, value = limit
        left = value - sent_tokens
        if left <= 0:
            return None
        resumed[key] = left
    if kind == "completions":
        resumed["prompt"] = _prompt_text(resumed["prompt"]) + sent.text
        return resumed
    messages = list(resumed["messages"])
    final = messages[-1] if messages else None
    if resumed.get("continue_final_message") and isinstance(final, dict):
        # The client had its reply prefilled already: the sent text extends it.
        messages[-1] = {**final, "content": str(final.get("content") or "") + sent.text}
    else:
        messages.append({"role": "assistant", "content": sent.text})
    resumed["messages"] = messages
    resumed["add_generation_prompt"] = False
    resumed["continue_final_message"] = True
    return resumed


def tokenize_request(sent: Sent) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body counting the tokens of the text sent (no BOS: it continues
    a prompt, it does not start one)."""
    return {"model": sent.model, "prompt": sent.text, "add_special_tokens": False}


def _limit(kind: Kind, body: Mapping[str, Any]) -> tuple[str, int] | None:
    """The answer's token limit: which field, and its value; None when unbounded."""
    keys = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    if kind == "completions" and body.get("max_tokens") is None:
        return "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS
    return None  # chat: up to the context length


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise ValueError("only a text prompt continues by text")


def resumable_body(kind: Kind, body: Mapping[str, Any]) -> bool:
    """Whether a stream of ``body`` could be continued elsewhere at all: one choice, no echo
    (the echoed prompt would be sent twice), no tools, and a text prompt to extend."""
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
        return False
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or body.get("tools"):
            return False
        final = messages[-1]
        # A prefilled reply in content parts: templates join parts in their own ways (vLLM
        # with newlines for string-content templates), so no extension is sure to match.
        return not (
            body.get("continue_final_message")
            and not (isinstance(final, dict) and isinstance(final.get("content"), str))
        )
    if body.get("echo") or body.get("suffix"):
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return True
    # A token-id prompt has no text to extend.
    return isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)


def closing(kind: Kind, sent: Sent) -> bytes:
    """The end of a stream whose answer is whole though its engine did not end it: the final
    chunk, when its finish_reason did not go out (the token limit was reached), and [DONE]."""
    if sent.finished:
        return DONE_EVENT
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    final = {
        "id": sent.id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": sent.created,
        "model": sent.model,
        "choices": [choice],
    }
    return b"data: " + _json_bytes(final) + EVENT_END + DONE_EVENT


class Rewriter:
    """The continuation's events as the client's stream goes on: the first answer's id and
    creation time, no second role announcement (chat), and usage counting the tokens sent
    before as completion, not prompt."""

    def __init__(self, kind: Kind, sent: Sent, sent_tokens: int) -> None:
        self.kind = kind
        self.sent = sent
        self.sent_tokens = sent_tokens

    def events(self, whole: bytes) -> bytes:
        """Rewrite the whole events of one relayed chunk."""
        out: list[bytes] = []
        for event in whole.split(EVENT_END):
            if not event.strip():
                continue
            data = _data_of(event)
            if data is None or data == "[DONE]":
                out.append(event + EVENT_END)
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                out.append(event + EVENT_END)
                continue
            fixed = self._fix(obj) if isinstance(obj, dict) else obj
            if fixed is None:
                continue
            out.append(b"data: " + _json_bytes(fixed) + EVENT_END)
        return b"".join(out)

    def _fix(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if "error" in obj:
            return obj
        if self.sent.id is not None:
            obj["id"] = self.sent.id
        if self.sent.created is not None:
            obj["created"] = self.sent.created
        if "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = self.sent.prompt_token_ids
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt = usage.get("prompt_tokens")
            completion = usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"] = max(0, prompt - self.sent_tokens)
                usage["completion_tokens"] = completion + self.sent_tokens
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    # The sent text, cached where the first answer's prefix was, is no prompt.
                    details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return obj
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = self.sent.prompt_token_ids
            delta = choice.get("delta")
            if self.kind == "chat" and isinstance(delta, dict):
                delta.pop("role", None)  # the client was told the role already
        if self.kind == "chat" and _empty_chat_event(obj):
            return None
        return obj


def _empty_chat_event(obj: Mapping[str, Any]) -> bool:
    """A chunk that said nothing but the role (now removed)."""
    if obj.get("usage"):
        return False
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            return False
        delta = choice.get("delta") or {}
        if any(v not in (None, "") for v in delta.values()):
            return False
        if choice.get("finish_reason") is not None or choice.get("logprobs"):
            return False
    return True


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
