"""Chat replies kept on their way to the client for the tier's tokenizer.

A chat reply is handed to its tier's tokenizer (``RequestTokenizer.remember_reply``) at the end
of a successful response, so that the conversation's next turn encodes only its new message.
The proxy feeds a :class:`ReplyCapture` the bytes it relays; at the end the capture parses them
in a worker thread of its own (never ahead of a decision's keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from fleetpilot.routing.tokenizer.errors import TokenizerError

log = logging.getLogger(__name__)

# A streamed reply is kept as the SSE bytes it arrives in and parsed in the worker: parsing
# every chunk's JSON on the loop would cost it about what the encode saves. The bytes are
# bounded per request (~200 bytes a streamed token: ~1,300 tokens; a longer reply is not
# remembered and its next turn encodes it, in a worker if long) and over all requests together,
# request bodies included, until the tokenizer is done with them, so a backlog of replies holds
# at most that much.
REPLY_CAPTURE_MAX_BYTES = 256 * 1024
REPLY_CAPTURE_TOTAL_BYTES = 32 * 1024 * 1024


class ReplyMemory(Protocol):
    """What a capture hands the reply to (``tokenizer.request.RequestTokenizer``)."""

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None: ...


class CaptureBudget:
    """The bytes all reply captures may hold together (loop thread only)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class ReplyCapture:
    """One chat reply kept on its way to the client (``REPLY_CAPTURE_MAX_BYTES`` at most, from
    the shared budget) and handed to the tier's tokenizer at the end of a successful answer."""

    def __init__(
        self,
        tokenizer: ReplyMemory,
        payload: Mapping[str, Any],
        budget: CaptureBudget,
        reserved: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.payload = payload
        self.budget = budget
        self.reserved = reserved  # bytes of the budget held: the request body and the reply
        self.data = bytearray()
        self.closed = False

    def feed(self, chunk: bytes) -> None:
        if self.closed:
            return
        if len(self.data) + len(chunk) > REPLY_CAPTURE_MAX_BYTES or not self.budget.take(
            len(chunk)
        ):
            self.drop()  # too long to keep: its next turn encodes it
            return
        self.reserved += len(chunk)
        self.data += chunk

    def drop(self) -> None:
        if not self.closed:
            self.closed = True
            self.data = bytearray()
            self.budget.give(self.reserved)

    def remember(self, pool: ThreadPoolExecutor, *, streamed: bool) -> None:
        """Give the reply to the tokenizer in ``pool``; the budget is held until it is done."""
        if self.closed:
            return
        self.closed = True
        data, reserved = self.data, self.reserved
        self.data = bytearray()
        future = asyncio.get_running_loop().run_in_executor(
            pool, _remember_reply, self.tokenizer, self.payload, data, streamed
        )
        future.add_done_callback(lambda done: self._remembered(done, reserved))

    def _remembered(self, done: asyncio.Future[None], reserved: int) -> None:
        self.budget.give(reserved)
        if not done.cancelled() and done.exception() is not None:
            log.warning("remembering a reply failed", exc_info=done.exception())


def _remember_reply(
    tokenizer: ReplyMemory, payload: Mapping[str, Any], data: bytes | bytearray, streamed: bool
) -> None:
    """In a worker thread: the reply's text to the tokenizer (nothing for a reply it could not
    be: several choices, tool calls, an error, no text)."""
    reply = _streamed_reply(data) if streamed else _whole_reply(data)
    # A TokenizerError is unexpected (the request's own keys were computed) and harmless.
    if reply:
        with contextlib.suppress(TokenizerError):
            tokenizer.remember_reply(payload, reply)


def _whole_reply(data: bytes | bytearray) -> str | None:
    """The assistant text of a non-streamed chat completion with one choice."""
    try:
        choices = json.loads(data).get("choices")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict) or message.get("tool_calls"):
        return None
    content = message.get("content")
    return content if isinstance(content, str) else None


def _streamed_reply(data: bytes | bytearray) -> str | None:
    """The assistant text of a streamed chat completion (its SSE events' ``delta.content``)."""
    parts: list[str] = []
    for line in data.splitlines():
        if not line.startswith(b"data:"):
            continue
        event = line[5:].strip()
        if event == b"[DONE]":
            continue
        try:
            chunk = json.loads(event)
        except (ValueError, RecursionError):
            return None
        if not isinstance(chunk, dict) or "error" in chunk:
            return None
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                return None
            delta = choice.get("delta")
            if not isinstance(delta, dict) or delta.get("tool_calls"):
                return None
            content = delta.get("content")
            if isinstance(content, str):
                parts.append(content)
    return "".join(parts)
