"""Chat rendering as vLLM renders it (issue 14): content as text or parts as the template's AST
asks, developer messages, continue_final_message, transformers' Jinja setup and the template
variables vLLM passes."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.routing.tokenizer.errors import TokenizerError
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.routing.tokenizer_support import make, trained


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
