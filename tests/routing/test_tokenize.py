"""The router's request tokenizer (issue 14, hot-path tokenization): a request's prompt ids and
KV-index keys are the engine's, for chat and completions, on the reference engine's shipped byte
tokenizer and on BPE tokenizers trained here; the prefix cache gives the ids of a whole encode
and re-tokenizes only a conversation's new tail; its bounds, the errors the router falls back
on, and ``hf://`` resolution from a Hub cache without network."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from fleetpilot.engine.reference.hf_tokenizer import SHIPPED
from fleetpilot.engine.reference.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, ByteTokenizer
from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, KVIndex, chain_keys
from fleetpilot.routing.tokenizer.errors import TokenizerError
from fleetpilot.routing.tokenizer.request import RequestTokenizer, load_tokenizer

SHIPPED_CONFIG = json.loads((SHIPPED / "tokenizer_config.json").read_text())
BYTES = ByteTokenizer()
EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ChatML with a loop over content parts (vLLM gives such a template content as parts).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-2 style: BOS from the template, string content, SentencePiece-like pre-tokenizer.
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
SPECIALS = {
    "bytelevel": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "metaspace": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
}
ALPHABET = "abcdefghij klmnop\n\tXYZ0123.,!?<>|/[]é中🙂"


def corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(3000)]
    ends = [".", "!", "\n", "?"]
    return [" ".join(rng.choices(words, k=60)) + rng.choice(ends) for _ in range(lines)]


@cache
def trained(style: str, vocab_size: int = 2000) -> tuple[str, dict[str, Any]]:
    """A BPE tokenizer trained on generated text, with a chat template: ``bytelevel`` (GPT-2/Qwen
    style, ChatML) or ``metaspace`` (SentencePiece/Llama-2 style: NFKC, prepend-first, BOS from
    the post-processor and the template)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>") if style == "metaspace" else models.BPE())
    if style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        config["chat_template"] = CHATML
    else:
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace()
        alphabet = list(ALPHABET)
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        config["chat_template"] = LLAMA2
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS[style], initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus(7, 1500), trainer)
    if style == "metaspace":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    return tok.to_str(), config


def make(style: str, **options: Any) -> RequestTokenizer:
    """``shipped`` (the reference engine's files as a router loads them) or a trained style."""
    if style == "shipped":
        return RequestTokenizer.from_dir(SHIPPED, **options)
    tokenizer_json, config = trained(style)
    return RequestTokenizer(tokenizer_json, config, source=style, **options)


def whole(t: RequestTokenizer, kind: str, payload: dict[str, Any]) -> list[int]:
    """The prompt ids by one ``tokenizers`` call on the request's whole text: no cache, no cut."""
    if kind == "chat":
        text, specials = t.render_chat(payload), payload.get("add_special_tokens", False)
    else:
        text, specials = payload["prompt"], payload.get("add_special_tokens", True)
    return t.tokenizer.encode(text, add_special_tokens=specials).ids


def text_with(style: str) -> st.SearchStrategy[str]:
    """Text that mixes ordinary characters with the tokenizer's special tokens' names."""
    names = SPECIALS.get(style, ["<|bos|>", "<|eos|>"])
    piece = st.one_of(st.text(ALPHABET, max_size=12), st.sampled_from(names))
    return st.lists(piece, max_size=10).map("".join)


def chat(*contents: str, system: str | None = None) -> dict[str, Any]:
    """A chat body whose messages alternate user/assistant, starting and ending with user."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"messages": messages}


# ---- the reference engine's own token ids --------------------------------------------------------


@EXAMPLES
@given(st.text())
def test_completions_ids_are_the_engines(text: str) -> None:
    """A completions prompt is encoded as the reference engine encodes it (BOS, then the UTF-8
    bytes; without BOS when add_special_tokens is false), for any text that does not spell the
    special tokens' names (see the next test), cold and with its prefix cached."""
    assume(not re.search(r"<\|[be]os\|>", text))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        assume(False)
    t = make("shipped")
    for _ in range(2):
        assert t.token_ids("completions", {"prompt": text}) == BYTES.encode(text)
        plain = {"prompt": text, "add_special_tokens": False}
        assert t.token_ids("completions", plain) == BYTES.encode(text, add_bos=False)


def test_special_token_names_in_text_are_special_tokens_as_in_transformers() -> None:
    """transformers 5 (vLLM 0.33's) adds the config's named special tokens that tokenizer.json
    lacks as added tokens, so a prompt spelling <|eos|> gets id 257, as
    ``AutoTokenizer.from_pretrained`` on the shipped files gives; the reference engine's
    ByteTokenizer keeps such text as bytes (a difference of the engine, not of the router)."""
    t = make("shipped")
    ids = t.token_ids("completions", {"prompt": "a<|eos|>b"})
    assert ids == [BOS_TOKEN_ID, 97, EOS_TOKEN_ID, 98]


messages_st = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant"]),
            "content": st.text(ALPHABET, max_size=40),
        }
    ),
    min_size=1,
    max_size=5,
)


@EXAMPLES
@given(messages_st, st.booleans())
def test_chat_ids_are_the_engines(messages: list[dict[str, str]], generation_prompt: bool) -> None:
    """A chat request's ids are the reference engine's (BOS, then its chat text as bytes: the
    shipped template writes the BOS token, which the config makes a special token); twice, the
    second time from the cache."""
    t = make("shipped")
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    expected = BYTES.encode(
        BYTES.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    )
    assert t.token_ids("chat", body) == expected
    assert t.token_ids("chat", body) == expected


def test_a_template_without_bos_gives_chat_prompts_without_bos() -> None:
    """vLLM encodes rendered chat text without special tokens: a template that writes no BOS
    gives a prompt without BOS, unless the request sets add_special_tokens."""
    template = SHIPPED_CONFIG["chat_template"].removeprefix("{{ bos_token }}")
    t = make("shipped", chat_template=template)
    body = chat("Hi there")
    text = BYTES.apply_chat_template(body["messages"])
    assert t.token_ids("chat", body) == BYTES.encode(text, add_bos=False)
    assert t.token_ids("chat", {**body, "add_special_tokens": True}) == BYTES.encode(text)


@pytest.mark.asyncio
async def test_router_keys_match_the_blocks_a_reference_engine_publishes() -> None:
    """End to end: a reference engine with KV events serves a chat request; the router's KV-event
    client indexes what it publishes; the keys the router computes for the same request match
    every full block of its prompt there. One differing token (a missing BOS, another
    template) and the match would stop at the first block."""
    import httpx

    from fleetpilot.kv_events import kv_events_config
    from fleetpilot.routing.kv_events_client import KVEventsClient
    from fleetpilot.routing.metrics import RouterMetrics
    from fleetpilot.testing.engine_server import BackgroundServer
    from tests.routing.support import wait_for

    events = json.dumps(kv_events_config("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"))
    argv = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny"]
    argv += ["--max-model-len", "512", "--kv-events-config", events]
    bg = BackgroundServer.from_argv(argv)
    client = KVEventsClient(KVIndex(), RouterMetrics(), probe_s=0.2)
    try:
        bg.start()
        pub = bg.server.kv_publisher
        assert pub is not None
        assert pub.replay_endpoint is not None
        client.set_endpoints({"ref": (pub.endpoint, pub.replay_endpoint)})
        body = chat(
            "Name the colours of the rainbow, in order, please.",
            "Red, orange, yellow, green, blue, indigo, violet.",
            "And in reverse?",
            system="You are a terse assistant.",
        )
        request = {**body, "max_tokens": 2, "temperature": 0}
        async with httpx.AsyncClient(timeout=30) as http:
            response = await http.post(bg.url + "/v1/chat/completions", json=request)
            response.raise_for_status()
        keys = make("shipped").keys("chat", body, 16)
        prompt = BYTES.encode(BYTES.apply_chat_template(body["messages"]))
        assert len(keys) == len(prompt) // 16 >= 8
        await wait_for(lambda: client.index.match_keys(keys).get("ref") == len(keys), 20.0)
    finally:
        await client.stop()
        bg.stop()


# ---- where a text may be cut -------------------------------------------------------------------


def spans_cut(text: str, cut: int, names: list[str]) -> bool:
    """Whether an occurrence of one of ``names`` in ``text`` straddles ``cut``."""
    return any(
        m.start() < cut < m.start() + len(name)
        for name in names
        for m in re.finditer(f"(?={re.escape(name)})", text)
    )


@EXAMPLES
@given(text_with("shipped"), text_with("shipped"))
def test_the_shipped_tokenizer_encodes_the_parts_of_any_cut_apart(a: str, b: str) -> None:
    """The byte tokenizer maps each character alone: any cut outside a special token's name
    splits the ids of the whole into the ids of the parts."""
    assume(not spans_cut(a + b, len(a), ["<|bos|>", "<|eos|>"]))
    tok = make("shipped").tokenizer
    joined = tok.encode(a + b, add_special_tokens=False).ids
    parts = [tok.encode(x, add_special_tokens=False).ids for x in (a, b)]
    assert joined == parts[0] + parts[1]


@EXAMPLES
@given(st.sampled_from(["bytelevel", "metaspace"]), st.data())
def test_a_trained_bpe_encodes_the_parts_of_a_cut_after_an_added_token_apart(
    style: str, data: st.DataObject
) -> None:
    """The property the cache rests on, for a real BPE: with ``a`` ending in an added token T,
    the ids of ``a + b`` are those of ``a`` then those of ``T + b`` without T's, whatever the
    text (merges, other special names, NFKC, Metaspace's prepend-first)."""
    a = data.draw(text_with(style))
    b = data.draw(text_with(style))
    token = data.draw(st.sampled_from(SPECIALS[style]))
    tok = make(style).tokenizer
    first = tok.encode(a + token, add_special_tokens=False).ids
    rest = tok.encode(token + b, add_special_tokens=False).ids
    assert rest[0] == tok.token_to_id(token)
    assert tok.encode(a + token + b, add_special_tokens=False).ids == first + rest[1:]


def test_a_cut_encoded_without_its_token_in_front_would_be_wrong() -> None:
    """Why the tail is encoded after its cut's token: Metaspace's prepend-first treats text at
    offset 0 differently, so encoding the parts plainly gives other ids; the router does not."""
    t = make("metaspace")
    tok = t.tokenizer
    a, b = "<s>[INST] hello [/INST]", "foo bar"
    parts = [tok.encode(x, add_special_tokens=False).ids for x in (a, b)]
    naive = parts[0] + parts[1]
    assert naive != tok.encode(a + b, add_special_tokens=False).ids
    body = {"prompt": a, "add_special_tokens": False}
    t.token_ids("completions", body)
    longer = {**body, "prompt": a + b}
    assert t.token_ids("completions", longer) == whole(t, "completions", longer)
    assert t.stats.hits == 1


def test_an_added_token_another_can_overlap_is_no_cut() -> None:
    """A cut after <|a|> is wrong when another added token, <|a|>!, can start at the same place
    (or any two added tokens can overlap): such tokens are never cut after."""
    tokenizer_json, config = trained("bytelevel")
    tok = Tokenizer.from_str(tokenizer_json)
    tok.add_special_tokens(["<|a|>", "<|a|>!", "x<|b|>", "<|b|>"])
    t = RequestTokenizer(tok.to_str(), config)
    for prompt in ("hello <|a|>", "hello <|a|>! there", "y<|b|>", "y<|b|>x<|b|>z"):
        body = {"prompt": prompt, "add_special_tokens": False}
        assert t.token_ids("completions", body) == whole(t, "completions", body)
    assert t.stats.hits == 0


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


# ---- vLLM's rendering ----------------------------------------------------------------------------


def rendered(template: str, body: dict[str, Any], **options: Any) -> str:
    tokenizer_json, config = trained("bytelevel")
    config = {**config, "chat_template": template}
    return RequestTokenizer(tokenizer_json, config, **options).render_chat(body)


def test_content_parts_are_joined_with_newlines_for_a_string_template() -> None:
    """A template that uses content as a string gets text parts joined with newlines (vLLM's
    "string" content format); a null text part is skipped."""
    parts = [
        {"type": "text", "text": "a"},
        {"type": "text", "text": None},
        "b",
        {"type": "input_text", "text": "c"},
    ]
    body = {"messages": [{"role": "user", "content": parts}], "add_generation_prompt": False}
    assert make("shipped").render_chat(body) == "<|bos|><|user|>\na\nb\nc\n"


def test_a_template_looping_over_content_gets_parts_even_for_string_content() -> None:
    """A template whose AST iterates over message content gets every content as a list of text
    parts (vLLM's "openai" format), plain strings included; --chat-template-content-format
    string overrides the detection."""
    template = (
        "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}"
        "{% endfor %}"
    )
    body = {"messages": [{"role": "user", "content": "xy"}]}
    assert rendered(template, body) == "[xy]"
    assert rendered(template, body, content_format="string") == "[][]"
    aliased = (
        "{% set msgs = messages %}{% for m in msgs %}"
        "{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    )
    assert rendered(aliased, body) == "<xy>"


def test_developer_messages_become_system_when_the_template_never_names_developer() -> None:
    """vLLM turns developer messages into system ones (merged into one first system message) for
    templates that do not know the role; a template naming 'developer' gets them as they are."""
    template = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    body = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "developer", "content": "d"},
        ]
    }
    assert rendered(template, body) == "system:s\n\nd;user:u;"
    knows = template + "{# 'developer' #}"
    assert rendered(knows, body) == "system:s;user:u;developer:d;"


def test_continue_final_message_ends_the_prompt_with_the_final_text() -> None:
    """continue_final_message (with add_generation_prompt false) cuts the prompt right after the
    final message's text, as transformers does; with add_generation_prompt true it is refused."""
    t = make("bytelevel")
    body = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert t.render_chat(body) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel"
    with pytest.raises(TokenizerError, match="cannot both"):
        t.render_chat({**body, "add_generation_prompt": True})


def test_the_template_runs_in_transformers_jinja_setup() -> None:
    """trim_blocks/lstrip_blocks, tojson that keeps HTML characters and non-ASCII, strftime_now,
    loop controls and the {% generation %} tag render as in transformers; raise_exception
    becomes a TokenizerError carrying the template's message."""
    template = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 1 %}{% break %}{% endif %}\n"
        "{{ m['content'] | tojson }}{% generation %}!{% endgeneration %}\n"
        "{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    body = {"messages": [{"role": "user", "content": "<a & é>"}, {"role": "user", "content": "x"}]}
    assert rendered(template, body) == '"<a & é>"!4'
    refusing = "{{ raise_exception('only user and assistant roles are supported') }}"
    with pytest.raises(TokenizerError, match="only user and assistant roles"):
        rendered(refusing, body)


def test_template_variables_reach_the_template_as_vllm_passes_them() -> None:
    """Special-token names, chat_template_kwargs the template uses, reasoning_effort (and
    enable_thinking from it), documents, and tool-call arguments parsed into objects."""
    template = (
        "{{ eos_token }}|{{ flavour }}|{{ reasoning_effort }}|{{ enable_thinking }}|"
        "{{ documents[0]['title'] }}|"
        "{{ messages[0]['tool_calls'][0]['function']['arguments']['x'] }}"
    )
    function = {"name": "f", "arguments": '{"x": 5}'}
    call = {"type": "function", "function": function}
    body = {
        "messages": [{"role": "assistant", "content": "", "tool_calls": [call]}],
        "chat_template_kwargs": {"flavour": "mint"},
        "reasoning_effort": "none",
        "documents": [{"title": "T", "text": "body"}],
    }
    assert rendered(template, body) == "<|im_end|>|mint|none|False|T|5"
    assert function["arguments"] == '{"x": 5}'  # the request itself is left alone


def test_a_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    """Like transformers, a chat_template.jinja beside tokenizer_config.json is the template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    t = RequestTokenizer.from_dir(tmp_path)
    assert t.token_ids("chat", chat("hi")) == BYTES.encode("hi!", add_bos=False)


# ---- errors --------------------------------------------------------------------------------------


CHAT_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": ["hi"]}, "string role"),
    ({"messages": [{"role": 1, "content": "x"}]}, "string role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}
            ]
        },
        "image_url",
    ),
    ({"messages": [{"role": "user", "content": [7]}]}, "content part"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    (
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        "trust-request-chat-template",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"tokenizer_kwargs": {}},
        },
        "not followed",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
        "must be an object",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"},
        "boolean",
    ),
    ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": 1}, "string"),
    ({"messages": [{"role": "user", "content": "x"}], "documents": ["d"]}, "documents"),
    (
        {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 5},
        "truncate",
    ),
    (
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"type": "web"}]}]},
        "function",
    ),
]
COMPLETION_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({}, "prompt must be"),
    ({"prompt": 5}, "prompt must be"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": ["a", "b"]}, "batched"),
    ({"prompt": [[]]}, "prompt must be"),
    ({"prompt": [1, True]}, "prompt must be"),
    ({"prompt": [1, 999]}, "outside the vocabulary"),
    ({"prompt": [-1]}, "outside the vocabulary"),
    ({"prompt": "x", "prompt_embeds": "abc"}, "prompt_embeds"),
    ({"prompt": [1, 2], "truncate_prompt_tokens": 1}, "truncate"),
]


@pytest.mark.parametrize(("body", "message"), CHAT_ERRORS)
def test_a_chat_body_the_engine_would_not_tokenize_so_is_refused(
    body: dict[str, Any], message: str
) -> None:
    """Each bad or unsupported chat body raises TokenizerError naming what is wrong."""
    with pytest.raises(TokenizerError, match=re.escape(message)):
        make("bytelevel").keys("chat", body, 16)


@pytest.mark.parametrize(("body", "message"), COMPLETION_ERRORS)
def test_a_completions_body_the_engine_would_not_tokenize_so_is_refused(
    body: dict[str, Any], message: str
) -> None:
    """Each bad or unsupported completions body raises TokenizerError naming what is wrong."""
    with pytest.raises(TokenizerError, match=re.escape(message)):
        make("shipped").keys("completions", body, 16)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    """A JSON array or string as the body: TokenizerError for either kind, not a crash."""
    t = make("shipped")
    for kind in ("chat", "completions"):
        with pytest.raises(TokenizerError, match="JSON object"):
            t.keys(kind, ["not", "an", "object"], 16)  # type: ignore[arg-type]


def test_text_that_is_not_unicode_is_refused() -> None:
    """A lone surrogate (JSON can carry one) cannot be encoded: TokenizerError, not a crash."""
    with pytest.raises(TokenizerError, match="tokenizer failed"):
        make("shipped").keys("completions", {"prompt": "a\ud800b"}, 16)


def test_a_tokenizer_without_a_chat_template_refuses_chat(tmp_path: Path) -> None:
    """No template in the config nor beside it: chat requests raise, completions work."""
    (tmp_path / "tokenizer.json").write_bytes((SHIPPED / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|bos|>"}')
    t = RequestTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        t.keys("chat", chat("hi"), 16)
    assert t.token_ids("completions", {"prompt": "hi"}) == BYTES.encode("hi")


FILE_ERRORS: list[tuple[Callable[[Path], object], str]] = [
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: no such file"),
    (lambda d: (d / "tokenizer_config.json").unlink(), "tokenizer_config.json: no such file"),
    (lambda d: (d / "tokenizer.json").write_text("{nope"), "tokenizer.json is not a tokenizer"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1"), "tokenizer_config.json: not JSON"),
    (lambda d: (d / "tokenizer_config.json").write_text("[1]"), "not a JSON object"),
    (lambda d: (d / "chat_template.jinja").write_text("{% for %}"), "does not compile"),
    (
        lambda d: (d / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"x": {}}}'),
        "names unusable tokens",
    ),
]


@pytest.mark.parametrize(("damage", "message"), FILE_ERRORS)
def test_missing_or_invalid_files_are_named(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    """A model directory with a missing or broken file: TokenizerError naming the file."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((SHIPPED / name).read_bytes())
    damage(tmp_path)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        load_tokenizer(str(tmp_path))


# ---- hf:// ---------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, files: dict[str, bytes], repo: str = "org/model") -> Path:
    """A Hugging Face Hub cache holding one snapshot of ``repo`` with ``files``, ``main``
    pointing at it, as huggingface_hub writes it (plain files instead of blob links)."""
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(COMMIT)
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return root


def shipped_files() -> dict[str, bytes]:
    return {n: (SHIPPED / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_an_hf_ref_resolves_from_the_hub_cache_offline(tmp_path: Path, revision: str) -> None:
    """hf://org/model@<branch or commit> is resolved by huggingface_hub itself from its cache
    (offline): the same tokenizer as the directory."""
    cache_dir = hub_cache(tmp_path, shipped_files())
    t = load_tokenizer(f"hf://org/model@{revision}", cache_dir=cache_dir, local_files_only=True)
    assert t.token_ids("completions", {"prompt": "hi"}) == BYTES.encode("hi")
    assert t.token_ids("chat", chat("hi")) == BYTES.encode(
        BYTES.apply_chat_template(chat("hi")["messages"])
    )
    assert t.source == f"hf://org/model@{revision}"


def test_an_hf_ref_with_a_chat_template_file_uses_it(tmp_path: Path) -> None:
    """chat_template.jinja in the snapshot is fetched and wins over the config's template."""
    files = {**shipped_files(), "chat_template.jinja": b"{{ messages[0]['content'] }}?"}
    cache_dir = hub_cache(tmp_path, files)
    t = load_tokenizer("hf://org/model@main", cache_dir=cache_dir, local_files_only=True)
    assert t.render_chat(chat("hi")) == "hi?"


@pytest.mark.parametrize(
    ("ref", "files", "message"),
    [
        ("hf://org/model@main", {"tokenizer_config.json": b"{}"}, "tokenizer.json"),
        ("hf://org/model@v9", None, "tokenizer.json"),
        ("hf://org/other@main", None, "tokenizer.json"),
        ("hf://model@main", None, "hf://<org>/<name>@<revision>"),
        ("/no/such/dir", None, "not a directory"),
    ],
)
def test_an_unresolvable_ref_names_what_is_missing(
    tmp_path: Path, ref: str, files: dict[str, bytes] | None, message: str
) -> None:
    """A missing file, revision or repository, or a malformed ref: TokenizerError naming it."""
    cache_dir = hub_cache(tmp_path, shipped_files() if files is None else files)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        load_tokenizer(ref, cache_dir=cache_dir, local_files_only=True)


def test_a_plan_knows_the_prompts_length_once_keyed_unless_it_was_cut() -> None:
    """What the router compares with the blocks an engine holds (the tokens a P/D decode
    replica would compute itself): the whole prompt's length as the engine tokenizes it, for
    chats, text and token-id prompts; none for a prompt cut at the character cap, whose keys
    say nothing of the rest."""
    tokenizer = RequestTokenizer.from_dir(SHIPPED)
    chat = {"messages": [{"role": "user", "content": "how long is this prompt? " * 9}]}
    text = {"prompt": "a completion prompt of some length " * 7}
    ids = {"prompt": list(range(5, 60))}
    for kind, payload in (("chat", chat), ("completions", text), ("completions", ids)):
        plan = tokenizer.plan(kind, payload)
        plan.keys(16)
        assert plan.prompt_tokens == len(tokenizer.token_ids(kind, payload))
    capped = RequestTokenizer.from_dir(SHIPPED, max_chars=100)
    plan = capped.plan("completions", text)
    assert len(plan.keys(16)) > 0
    assert plan.prompt_tokens is None
