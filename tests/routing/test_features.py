"""Request features: what routing reads from an OpenAI body, and the 4xx for bodies it cannot
read."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.errors import InvalidRequestError
from fleetpilot.routing.features import CHARS_PER_TOKEN, extract_features


def test_completions_prompt_text_tokens_and_max_tokens() -> None:
    """A completions request: its prompt is the text; tokens are ~chars/4."""
    f = extract_features({"model": "m", "prompt": "x" * 400, "max_tokens": 7}, "completions")
    assert f.prompt_text == "x" * 400
    assert f.approx_tokens == 400 // CHARS_PER_TOKEN
    assert f.max_tokens == 7
    assert f.model == "m"
    assert f.turns == 1
    assert not f.stream


def test_token_id_prompts_hash_as_text_and_count_exactly() -> None:
    """Token-id prompts: a stable text, and their exact length as the token count."""
    f = extract_features({"prompt": [1, 2, 3, 4]}, "completions")
    assert f.prompt_text == "1 2 3 4"
    assert f.approx_tokens == 4
    batch = extract_features({"prompt": [[1, 2], [3]]}, "completions")
    assert batch.approx_tokens == 3


def test_chat_messages_keep_roles_turns_and_system_size() -> None:
    """Chat: roles are part of the text (so a shared system prompt is a shared prefix), user
    messages count as turns, system prompt size is measured, content parts are joined."""
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
        ],
        "max_completion_tokens": 9,
        "max_tokens": 100,
        "stream": True,
    }
    f = extract_features(body, "chat", {"x-fleetpilot-tier": " large "})
    assert f.prompt_text == "system: You are terse.\nuser: hi\nassistant: \nuser: a\n"
    assert f.turns == 2
    assert f.system_chars == len("You are terse.")
    assert f.max_tokens == 9  # max_completion_tokens wins, as in the OpenAI API
    assert f.stream
    assert f.tier_header == "large"


@pytest.mark.parametrize(
    ("text", "code", "math", "reasoning"),
    [
        ("What is the capital of France?", False, False, False),
        ("```python\nprint(1)\n```", True, False, False),
        ("def fib(n): return n", True, False, False),
        ("Fix this traceback in my unit tests", True, False, False),
        ("Prove the theorem that sqrt 2 is irrational", False, True, False),
        ("compute $x^2 + 1$", False, True, False),
        ("Think through this step by step", False, False, True),
        ("Analyze the trade-offs of the design", False, False, True),
    ],
)
def test_markers(text: str, code: bool, math: bool, reasoning: bool) -> None:
    """Code, maths and reasoning markers are spotted in the prompt."""
    f = extract_features({"prompt": text}, "completions")
    assert (f.has_code, f.has_math, f.has_reasoning) == (code, math, reasoning)


BAD: list[tuple[str, Any, str | None]] = [
    ("completions", [], None),
    ("completions", "a string", None),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "x", "model": 3}, "model"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("chat", {"model": "m"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages[0]"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [5]}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5},
     "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "body", "param"), BAD)
def test_bad_bodies_are_invalid_requests_naming_the_field(
    kind: Any, body: Any, param: str | None
) -> None:
    """Bodies no engine would accept are refused with the offending field named."""
    with pytest.raises(InvalidRequestError) as info:
        extract_features(body, kind)
    assert info.value.status == 400
    assert info.value.param == param


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(body=json_values, kind=st.sampled_from(["completions", "chat"]))
def test_any_json_is_features_or_a_400_never_a_crash(body: Any, kind: Any) -> None:
    """Whatever JSON arrives, extraction returns features or raises InvalidRequestError."""
    with contextlib.suppress(InvalidRequestError):
        extract_features(body, kind)


@given(
    messages=st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}
        ),
        min_size=1,
        max_size=6,
    )
)
def test_chat_text_of_a_conversation_prefixes_its_continuation(
    messages: list[dict[str, str]],
) -> None:
    """A conversation's next turn extends its text: the basis of multi-turn prefix affinity."""
    before = extract_features({"messages": messages}, "chat").prompt_text
    after = extract_features(
        {"messages": [*messages, {"role": "user", "content": "more"}]}, "chat"
    ).prompt_text
    assert after.startswith(before)
