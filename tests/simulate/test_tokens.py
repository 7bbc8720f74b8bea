"""The simulator's tokenizer: real-looking lengths, and ids that keep shared prefixes shared."""

from __future__ import annotations

import pytest

from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate.tokens import Prompt, SimPromptKeys, SimTokenizer

DOCUMENT = "The quarterly report says revenue grew in every region but one. " * 40


@pytest.mark.parametrize("chars_per_token", [1.0, 3.3, 4.0, 4.7])
def test_a_text_is_a_prefix_of_every_longer_text_that_starts_with_it(
    chars_per_token: float,
) -> None:
    """A document followed by different questions keeps its ids (but for its last token, which
    a real tokenizer may merge with what follows too)."""
    tokenizer = SimTokenizer(chars_per_token)
    alone = tokenizer.text(DOCUMENT)
    for question in ("Who?", "What grew, and where did it not? Answer in one line.", "x" * 333):
        longer = tokenizer.text(DOCUMENT + question)
        assert longer[: len(alone) - 1] == alone[:-1]


def test_lengths_follow_the_characters_per_token() -> None:
    tokenizer = SimTokenizer(4.0)
    assert len(tokenizer.text("a" * 4000)) == 1000
    assert len(tokenizer.text("a" * 4002)) == 1000  # the last token takes the remainder
    assert len(tokenizer.text("ab")) == 1  # any text is at least a token
    assert len(tokenizer.text("")) == 0
    # Bytes, not characters: a multi-byte character is as long as its UTF-8.
    assert len(tokenizer.text("é" * 400)) == 200


def test_equal_text_equal_ids_different_text_different_ids() -> None:
    tokenizer = SimTokenizer(4.0)
    assert tokenizer.text(DOCUMENT) == SimTokenizer(4.0).text(DOCUMENT)
    assert tokenizer.text("abcdefgh")[0] != tokenizer.text("abcxefgh")[0]


def test_a_chat_is_headers_and_contents_in_order() -> None:
    tokenizer = SimTokenizer(4.0, message_tokens=5)
    ids = tokenizer.chat(
        [{"role": "system", "content": "a" * 40}, {"role": "user", "content": "b"}]
    )
    # system header + 10 + user header + 1 + the assistant header asking for the answer
    assert len(ids) == 5 + 10 + 5 + 1 + 5
    assert ids[:5] != ids[15:20]  # each role its own header


def test_prompt_keys_are_shared_by_a_document_asked_about_twice() -> None:
    """The long-context workload puts a document and its question in one message; two
    requests for one document must share every full block of the document."""
    workload = make_workload("long-context", 3, documents=1)
    keys = SimPromptKeys(SimTokenizer(4.0), block_size=16)
    prompts: list[Prompt] = []
    for _ in range(2):
        keys.begin(workload.next().messages)
        prompts.append(keys.prompt())
    first, second = prompts
    shared = 0
    for a, b in zip(first.keys, second.keys, strict=False):
        if a != b:
            break
        shared += 1
    # ~6,000 characters of document at 4 a token, 16 a block: ~93 blocks.
    assert shared >= 6000 // 4 // 16 - 1
