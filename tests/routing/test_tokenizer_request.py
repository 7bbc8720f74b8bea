"""The router's request tokenizer (issue 14, hot-path tokenization): a request's prompt ids and
KV-index keys are the engine's, for chat and completions, on the reference engine's shipped byte
tokenizer and on BPE tokenizers trained here; the bodies the engine would not tokenize so are
refused (the router falls back on the error); a plan knows the prompt's length."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from fleetpilot.engine.reference.hf_tokenizer import SHIPPED
from fleetpilot.engine.reference.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.tokenizer.errors import TokenizerError
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.routing.tokenizer_support import ALPHABET, BYTES, EXAMPLES, SHIPPED_CONFIG, chat, make

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
