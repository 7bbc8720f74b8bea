"""A resumed stream's requests as the pinned vLLM reads them (``vllm_judge.py``, ops
``openai_request`` and ``chat_render``): the continuation bodies of ``routing/resume.py``, the
token count the router asks for, and the reference engine's rendering of a continued chat
against vLLM's (transformers' ``continue_final_message`` on the reference tokenizer's own
chat template)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.features import Kind
from fleetpilot.routing.resume import Sent, continuation, tokenize_request
from tests.contract.conftest import VllmJudge

PRINTABLE = list(range(32, 127))
SENT = Sent(id="cmpl-1", created=1, model="m", text="Once upon", events=2, finished=False,
            prompt_token_ids=None)  # fmt: skip
BODIES: dict[Kind, dict[str, Any]] = {
    "completions": {"model": "m", "prompt": "Tell a story.", "max_tokens": 40, "stream": True,
                    "temperature": 0, "allowed_token_ids": PRINTABLE},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "Tell a story."}],
             "max_completion_tokens": 40, "stream": True, "temperature": 0,
             "stream_options": {"include_usage": True}, "allowed_token_ids": PRINTABLE},
}  # fmt: skip


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_vllm_reads_a_continuation_as_the_rest_of_the_answer(
    vllm_judge: VllmJudge, kind: Kind
) -> None:
    """The continuation is a request vLLM accepts, with the sent tokens off its limit, the
    client's token restriction kept and, for chat, the sent text continued in place."""
    body = continuation(kind, BODIES[kind], SENT, 3)
    assert body is not None
    answer = vllm_judge.ask({"op": "openai_request", "kind": kind, "body": body})
    assert answer["ok"], answer
    fields = answer["fields"]
    assert fields["max_tokens"] == 37
    assert fields["allowed_token_ids"] == PRINTABLE
    if kind == "chat":
        assert fields["continue_final_message"] is True
        assert fields["add_generation_prompt"] is False
        assert fields["messages"] == 2
    else:
        assert fields["prompt"] == "Tell a story.Once upon"


def test_vllm_refuses_both_template_switches_as_the_reference_engine_does(
    vllm_judge: VllmJudge,
) -> None:
    """Both set true: vLLM's validator refuses with the message the reference engine gives.
    (With add_generation_prompt left out vLLM refuses when it renders the template, as the
    reference engine refuses at once: a continuation sets it false explicitly.)"""
    body = {**BODIES["chat"], "continue_final_message": True, "add_generation_prompt": True}
    answer = vllm_judge.ask({"op": "openai_request", "kind": "chat", "body": body})
    assert not answer["ok"]
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in answer["error"]


def test_the_token_count_request_is_vllm_s_tokenize(vllm_judge: VllmJudge) -> None:
    answer = vllm_judge.ask(
        {"op": "openai_request", "kind": "tokenize", "body": tokenize_request(SENT)}
    )
    assert answer == {"ok": True, "fields": {"prompt": "Once upon", "add_special_tokens": False}}


@pytest.mark.parametrize(
    ("generation", "continue_final"), [(True, False), (False, True), (False, False)]
)
def test_the_reference_engine_renders_a_continued_chat_as_vllm_does(
    vllm_judge: VllmJudge, generation: bool, continue_final: bool
) -> None:
    """transformers' continue_final_message (which vLLM calls) on the reference tokenizer's
    shipped template gives the text the reference engine renders, BOS token aside (the engine
    adds BOS as a token id, the template as text)."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell a story."},
                {"role": "assistant", "content": "Once upon"}]  # fmt: skip
    answer = vllm_judge.ask({"op": "chat_render", "tokenizer": str(REFERENCE_TOKENIZER),
                             "messages": messages, "add_generation_prompt": generation,
                             "continue_final_message": continue_final})  # fmt: skip
    assert answer["ok"], answer
    ours = ByteTokenizer().apply_chat_template(
        messages, add_generation_prompt=generation, continue_final_message=continue_final
    )
    assert answer["text"].removeprefix("<|bos|>") == ours
