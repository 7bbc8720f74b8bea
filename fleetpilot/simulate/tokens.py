"""Prompt tokens for the simulator: lengths like a real tokenizer's, ids from the content.
No I/O.

A real tokenizer costs tens of microseconds per hundred characters, more than the rest of a
simulated request. What the simulator needs from one is only what the engines and the router
do with it: how many tokens a prompt is, and equal ids for equal text so that shared prefixes
make shared KV blocks. So a chat renders as a chat template does - per message a header of
``message_tokens`` naming the role (Llama 3's header and end-of-turn are five; the reference
engine's template about twelve), then the content - and content becomes one token per
``chars_per_token`` bytes, its id a checksum of those bytes. Messages are memoised:
a tenant's system prompt or a conversation's history is cut once, not per request.

The same ids feed the engines' prefix caches and the router's KV index
(:class:`SimPromptKeys`, the router's tokenizer interface), as one tokenizer feeds both in a
real fleet.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetpilot.routing.features import Kind
from fleetpilot.routing.policies.kv_index import chain_keys

# Tokens of memoised messages before the memo starts over (4 bytes each): a long run's
# conversations are many, and a document with its question is new in every request.
_MEMO_TOKENS = 8_000_000


class SimTokenizer:
    """Text to token ids at ``chars_per_token`` characters a token."""

    def __init__(self, chars_per_token: float, message_tokens: int = 5) -> None:
        if chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")
        self.chars_per_token = chars_per_token
        self.message_tokens = message_tokens
        self._memo: dict[tuple[str, str], array[int]] = {}
        self._memo_tokens = 0
        self._headers: dict[str, array[int]] = {}

    def text(self, text: str) -> array[int]:
        """The ids of ``text``: one per ``chars_per_token`` bytes (at least one for any
        non-empty text), each a checksum of its bytes.

        Token ``i`` starts at byte ``int(i x chars_per_token)`` whatever follows, and only the
        last token takes the remainder, so a text's ids are a prefix of the ids of any longer
        text that starts with it (but for its last token), as with a real tokenizer: a
        document asked about with different questions in one message shares its blocks.
        """
        if not text:
            return array("I")
        data = text.encode("utf-8", "surrogatepass")
        per = self.chars_per_token
        count = max(1, round(len(data) / per))
        starts = [int(i * per) for i in range(count)]
        starts.append(len(data))
        crc = zlib.crc32
        return array("I", [crc(data[starts[i] : starts[i + 1]]) for i in range(count)])

    def message(self, role: str, content: str) -> array[int]:
        key = (role, content)
        ids = self._memo.get(key)
        if ids is None:
            header = self._headers.get(role)
            if header is None:
                seed = zlib.crc32(role.encode())
                header = array("I", [seed + i for i in range(self.message_tokens)])
                self._headers[role] = header
            ids = header + self.text(content)
            if self._memo_tokens + len(ids) > _MEMO_TOKENS:
                self._memo.clear()
                self._memo_tokens = 0
            self._memo[key] = ids
            self._memo_tokens += len(ids)
        return ids

    def chat(self, messages: Sequence[Mapping[str, Any]]) -> array[int]:
        """A conversation's prompt ids, with the assistant header that asks for the answer."""
        ids = array("I")
        for m in messages:
            content = m.get("content")
            ids += self.message(str(m.get("role", "")), content if isinstance(content, str) else "")
        ids += self.message("assistant", "")
        return ids


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the engines and the router's KV index see it."""

    token_ids: array[int]  # 4 bytes a token: a run holds millions of prompts in flight
    block_size: int
    keys: list[bytes]

    @classmethod
    def of(cls, token_ids: array[int], block_size: int) -> Prompt:
        return cls(token_ids, block_size, chain_keys(token_ids, block_size))

    def keys_at(self, block_size: int) -> list[bytes]:
        if block_size == self.block_size:
            return self.keys
        return chain_keys(self.token_ids, block_size)


class _Plan:
    """``router.PromptPlan`` of one simulated request: nothing left to encode."""

    pending_chars = 0

    def __init__(self, prompt: Prompt) -> None:
        self._prompt = prompt

    @property
    def prompt_tokens(self) -> int | None:
        return len(self._prompt.token_ids)

    def keys(self, block_size: int, lora_name: str | None = None) -> list[bytes]:
        return self._prompt.keys_at(block_size)


class SimPromptKeys:
    """One tier's tokenizer as the router uses it (``router.PromptKeys``), over the request
    being simulated (``begin``): the router asks only the chosen tier's, so a request is cut
    into that tier's tokens and blocks, once (``prompt``)."""

    def __init__(self, tokenizer: SimTokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self._messages: Sequence[Mapping[str, Any]] = ()
        self._prompt: Prompt | None = None

    def begin(self, messages: Sequence[Mapping[str, Any]]) -> None:
        self._messages = messages
        self._prompt = None

    def prompt(self) -> Prompt:
        if self._prompt is None:
            self._prompt = Prompt.of(self.tokenizer.chat(self._messages), self.block_size)
        return self._prompt

    def plan(self, kind: Kind, payload: Mapping[str, Any]) -> _Plan:
        return _Plan(self.prompt())

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None:
        return None
