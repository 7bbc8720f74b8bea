"""The byte-level tokenizer and UTF-8-safe streaming text."""

from __future__ import annotations

from fleetpilot.engine.reference.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    ByteTokenizer,
    complete_utf8_prefix_len,
)


def test_round_trip_with_bos_and_specials_skipped() -> None:
    """Any text encodes to BOS + its UTF-8 bytes and decodes back; specials never show."""
    tok = ByteTokenizer()
    text = "héllo, 世界 🚀"
    ids = tok.encode(text)
    assert ids[0] == BOS_TOKEN_ID
    assert len(ids) == 1 + len(text.encode())
    assert tok.decode([*ids, EOS_TOKEN_ID]) == text


def test_streaming_holds_back_an_incomplete_character() -> None:
    """A multi-byte character generated one byte per step is emitted only once complete."""
    tok = ByteTokenizer()
    data = "a世🚀".encode()
    seen = [tok.decode(data[:n], hold_incomplete=True) for n in range(len(data) + 1)]
    assert seen == ["", "a", "a", "a", "a世", "a世", "a世", "a世", "a世🚀"]
    assert complete_utf8_prefix_len(b"\xff") == 1  # invalid bytes are not held


def test_chat_template_shares_the_prefix_of_a_conversation() -> None:
    """A longer conversation starts with the shorter one's prompt (prefix-cache friendly)."""
    tok = ByteTokenizer()
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    short = tok.apply_chat_template(first, add_generation_prompt=False)
    assert tok.apply_chat_template(second).startswith(short)
