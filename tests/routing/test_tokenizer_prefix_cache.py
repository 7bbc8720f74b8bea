"""The prefix cache (issue 14): prompts extending cached ones get the ids and keys of a whole
encode, a conversation's next turn re-tokenizes only its new tail (its reply remembered: only
its new message), shared system prompts are reused, and the cache's bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, chain_keys
from fleetpilot.routing.tokenizer.errors import TokenizerError
from tests.routing.tokenizer_support import EXAMPLES, chat, make, text_with, whole


@EXAMPLES
@given(st.sampled_from(["shipped", "bytelevel", "metaspace"]), st.data())
def test_a_completions_prompt_extending_a_cached_one_has_whole_encode_ids(
    style: str, data: st.DataObject
) -> None:
    """Completions prompts that extend earlier ones (few-shot, pre-rendered chats) reuse the
    earlier prefix's ids and give exactly the ids of encoding them whole, with and without
    the post-processor's BOS."""
    t = make(style)
    prompt = ""
    for _ in range(3):
        prompt += data.draw(text_with(style)) * data.draw(st.integers(1, 60))
        for specials in (True, False):
            body = {"prompt": prompt, "add_special_tokens": specials}
            assert t.token_ids("completions", body) == whole(t, "completions", body)


# ---- the prefix cache on conversations -----------------------------------------------------------


@EXAMPLES
@given(st.sampled_from(["shipped", "bytelevel", "metaspace"]), st.data())
def test_a_growing_conversation_has_whole_encode_ids_and_keys_every_turn(
    style: str, data: st.DataObject
) -> None:
    """Turn after turn (the earlier turns cached, the replies sometimes remembered, sometimes
    sent back otherwise than remembered), a conversation's ids equal one whole encode of its
    rendered text and its keys equal chain_keys of those ids, at two block sizes, with and
    without a LoRA name; special names inside the content included."""
    t = make(style)
    system = data.draw(st.one_of(st.none(), text_with(style)))
    contents: list[str] = []
    for _ in range(data.draw(st.integers(1, 5))):
        contents += [data.draw(text_with(style)) * data.draw(st.integers(1, 20))]
        body = chat(*contents, system=system)
        expected = whole(t, "chat", body)
        assert t.token_ids("chat", body) == expected
        for block_size, lora in ((16, None), (4, "adapter")):
            keys = t.keys("chat", body, block_size, lora)
            assert keys == chain_keys(expected, block_size, lora)
        reply = data.draw(text_with(style)) * data.draw(st.integers(1, 20))
        if data.draw(st.booleans()):
            t.remember_reply(body, data.draw(st.sampled_from([reply, reply + "!", "x" + reply])))
        contents += [reply]


@pytest.mark.parametrize("style", ["shipped", "bytelevel", "metaspace"])
def test_a_follow_up_turn_tokenizes_only_its_new_tail(style: str) -> None:
    """A conversation with a long system prompt: the second turn hands the tokenizer about its
    new messages (the reply and the next question), not the system prompt again."""
    t = make(style)
    system = "You are a helpful assistant. " * 200
    first = chat("What is the capital of France?", system=system)
    t.keys("chat", first, 16)
    before = t.stats.encoded_chars
    reply, question = "Paris is the capital of France.", "And of Italy?"
    second = chat("What is the capital of France?", reply, question, system=system)
    keys = t.keys("chat", second, 16)
    assert keys == chain_keys(whole(t, "chat", second), 16)
    assert t.stats.encoded_chars - before < len(reply) + len(question) + 150 < len(system) // 10
    assert t.stats.hits >= 1


@pytest.mark.parametrize("style", ["shipped", "bytelevel", "metaspace"])
def test_a_remembered_reply_leaves_only_the_new_question_to_tokenize(style: str) -> None:
    """The router hands the engine's reply back (remember_reply): the next turn tokenizes its
    new question and the template's framing, not the reply again, and stays exact."""
    t = make(style)
    system = "You are a helpful assistant. " * 200
    first = chat("What is the capital of France?", system=system)
    t.keys("chat", first, 16)
    reply = "Paris is the capital of France, and its largest city. " * 5
    t.remember_reply(first, reply)
    before = t.stats.encoded_chars
    question = "And of Italy?"
    second = chat("What is the capital of France?", reply, question, system=system)
    assert t.keys("chat", second, 16) == chain_keys(whole(t, "chat", second), 16)
    assert t.stats.encoded_chars - before < len(question) + 100 < len(reply)


def test_remembered_replies_keep_one_turn_per_conversation() -> None:
    """With every reply remembered, each turn replaces the previous turn's entries (the
    request's and the reply's): 30 turns hold four entries, and every turn's reply is found."""
    t = make("bytelevel")
    contents = ["hello"]
    for turn in range(30):
        body = chat(*contents)
        t.keys("chat", body, 16)
        reply = f"reply {turn} " * 10
        t.remember_reply(body, reply)
        contents += [reply, f"question {turn}"]
    assert t.stats.entries <= 4
    assert t.stats.hits == 29 + 30  # each request finds the reply before; each reply its request


def test_a_reply_that_continues_a_message_or_is_empty_is_not_remembered() -> None:
    """continue_final_message replies extend the final message (the next turn's text is not
    known) and empty replies say nothing: nothing is stored; a non-chat body is refused."""
    t = make("bytelevel")
    body = {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}
    body["add_generation_prompt"] = False
    t.remember_reply(body, "more")
    t.remember_reply(chat("hi"), "  ")
    assert t.stats.entries == 0
    with pytest.raises(TokenizerError, match="messages"):
        t.remember_reply({"prompt": "x"}, "reply")


def test_another_conversation_with_the_same_system_prompt_reuses_it() -> None:
    """Two users, one system prompt: the second conversation's first request finds the first's
    prefix (system prompt and the first user's header) and tokenizes little more than its own
    question."""
    t = make("bytelevel")
    system = "You answer in French. " * 200
    t.keys("chat", chat("How are you?", system=system), 16)
    before = t.stats.encoded_chars
    other = chat("Where is the station?", system=system)
    assert t.keys("chat", other, 16) == chain_keys(whole(t, "chat", other), 16)
    assert t.stats.encoded_chars - before < 120


def test_keys_at_another_block_size_from_a_cached_prefix_are_right() -> None:
    """Keys are cached per block size, LoRA name and BOS: a hit at another block size or LoRA
    chains from scratch, never from the wrong variant's keys."""
    t = make("bytelevel")
    body = chat("one " * 50, "two " * 50, "three")
    t.keys("chat", chat("one " * 50), 16)
    expected = whole(t, "chat", body)
    for block_size, lora in ((16, None), (8, None), (16, "x"), (16, None), (8, None)):
        assert t.keys("chat", body, block_size, lora) == chain_keys(expected, block_size, lora)


# ---- bounds --------------------------------------------------------------------------------------


def test_the_cache_is_bounded_in_entries_and_in_tokens() -> None:
    """Many conversations: the cache never holds more than its entries or its tokens, evicts
    the least recently used, and stays exact."""
    t = make("bytelevel", cache_entries=3, cache_tokens=100_000)
    for i in range(10):
        body = chat(f"conversation {i} " * 20, "reply", "question")
        assert t.keys("chat", body, 16) == chain_keys(whole(t, "chat", body), 16)
        assert t.stats.entries <= 3
    assert t.stats.evictions >= 7
    small = make("bytelevel", cache_tokens=300)
    for i in range(10):
        small.keys("chat", chat(f"conversation {i} " * 20, "reply", "question"), 16)
        assert small.stats.tokens <= 300


def test_a_long_conversation_holds_one_entry_not_one_per_turn() -> None:
    """Each turn's two prefixes (before its final message, and the whole prompt) replace the
    previous turn's; the first turn's prefix before its question, encoded from scratch, may be
    shared and stays: 30 turns hold three entries, not sixty."""
    t = make("bytelevel")
    contents = ["hello"]
    for turn in range(30):
        t.keys("chat", chat(*contents), 16)
        contents += [f"reply {turn} " * 10, f"question {turn}"]
    assert t.stats.entries == 3
    assert t.stats.hits == 29


@pytest.mark.parametrize("style", ["shipped", "bytelevel"])
def test_a_prompt_over_the_cap_gives_the_exact_keys_of_its_head(style: str) -> None:
    """A chat longer than max_chars is tokenized only up to its last cut before the cap: its
    keys are the first keys of the whole prompt, as many as that head holds; token_ids, which
    promises the whole prompt, refuses it."""
    t = make(style, max_chars=2000)
    body = chat(*[f"message {i} " * 30 for i in range(15)])
    full = chain_keys(whole(make(style), "chat", body), 16)
    keys = t.keys("chat", body, 16)
    assert keys == full[: len(keys)]
    head = t.tokenizer.encode(t.render_chat(body)[:1600], add_special_tokens=False).ids
    assert len(head) // 16 <= len(keys) < len(full)
    assert t.stats.encoded_chars <= 2000
    with pytest.raises(TokenizerError, match="longer than 2000"):
        t.token_ids("chat", body)


def test_input_far_over_the_cap_is_refused_unread() -> None:
    """Over four times max_chars of message text, a request is refused before rendering."""
    t = make("bytelevel", max_chars=1000)
    with pytest.raises(TokenizerError, match="too large"):
        t.keys("chat", chat("x" * 4001), 16)
    with pytest.raises(TokenizerError, match="too large"):
        t.keys("completions", {"prompt": "x" * 4001}, 16)


def test_keys_stop_at_max_match_blocks() -> None:
    """A token-id prompt is used as is and chained to MAX_MATCH_BLOCKS blocks at most."""
    t = make("shipped")
    ids = [i % 250 for i in range(MAX_MATCH_BLOCKS + 40)]
    keys = t.keys("completions", {"prompt": ids}, 1)
    assert keys == chain_keys(ids, 1, max_blocks=MAX_MATCH_BLOCKS)
    assert len(keys) == MAX_MATCH_BLOCKS
    assert t.token_ids("completions", {"prompt": [ids[:5]]}) == ids[:5]
