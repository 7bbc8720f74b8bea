"""A byte-level tokenizer: token ids 0..255 are the UTF-8 bytes, then BOS and EOS.

Byte-level keeps the reference engine self-contained (no vocabulary file to ship or fetch) and
makes every string encodable. Token counts are byte counts, which is what the router's
character-block prefix hashing approximates anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

NUM_BYTE_TOKENS = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
# The smallest vocabulary a model must have to be driven by this tokenizer.
MIN_VOCAB_SIZE = 258


def complete_utf8_prefix_len(data: bytes) -> int:
    """Length of the longest prefix of ``data`` that does not end inside a UTF-8 sequence.

    Streaming must not emit half a character: a multi-byte character arrives one token per
    byte, so the trailing incomplete sequence is held back until its last byte is generated.
    Invalid bytes are not held back (they decode to U+FFFD either way).
    """
    n = len(data)
    # A UTF-8 sequence is at most 4 bytes, so only the last 3 bytes can start an incomplete one.
    for back in range(1, min(3, n) + 1):
        byte = data[n - back]
        if byte & 0b1100_0000 == 0b1000_0000:  # continuation byte: keep looking for the lead
            continue
        if byte >= 0b1111_1000:  # not a valid lead byte: nothing to wait for
            need = 1
        elif byte >= 0b1111_0000:
            need = 4
        elif byte >= 0b1110_0000:
            need = 3
        elif byte >= 0b1100_0000:
            need = 2
        else:
            need = 1
        return n - back if back < need else n
    return n


class ByteTokenizer:
    """Encodes text as ``[BOS] + utf8 bytes``; decodes skipping special tokens."""

    bos_token_id = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    vocab_size = MIN_VOCAB_SIZE

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_TOKEN_ID, *ids] if add_bos else ids

    def decode_bytes(self, token_ids: Iterable[int]) -> bytes:
        """The bytes of the non-special tokens, in order."""
        return bytes(t for t in token_ids if 0 <= t < NUM_BYTE_TOKENS)

    def decode(self, token_ids: Iterable[int], *, hold_incomplete: bool = False) -> str:
        """Text of ``token_ids``; ``hold_incomplete`` drops a trailing partial character."""
        data = self.decode_bytes(token_ids)
        if hold_incomplete:
            data = data[: complete_utf8_prefix_len(data)]
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """A minimal ChatML-like template, so chat prompts with equal history share a prefix.

        ``continue_final_message`` ends the text right after the final message's content, as
        transformers cuts a rendered chat, so the model continues that message (a prefilled
        reply, or a stream the router resumes on another replica)."""
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        if continue_final_message:
            return "".join(parts)[:-1]  # the final message's closing newline
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)
