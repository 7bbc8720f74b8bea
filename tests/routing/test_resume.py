"""What a resumed stream is made of, without any I/O: the ledger of relayed events, what the
client was sent, the continuation request, the closing of an answer already whole, and the
continuation's events rewritten into the client's stream.

Streams are built as vLLM writes them: ``data: {compact json}\\n\\n`` per event, ``data: [DONE]``
at the end.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from fleetpilot.routing.features import Kind
from fleetpilot.routing.resume import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    DONE_EVENT,
    Rewriter,
    Sent,
    StreamLedger,
    closing,
    continuation,
    read_sent,
    resumable_body,
)

CREATED = 1_700_000_000
MODEL = "m"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def events_of(raw: bytes) -> list[Any]:
    """The JSON of each data event of ``raw`` ("[DONE]" as the string), in order."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        if not event:
            continue
        assert event.startswith(b"data: "), event
        data = event[len(b"data: ") :].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def cmpl_chunk(
    text: str,
    *,
    ident: str = "cmpl-1",
    finish: str | None = None,
    index: int = 0,
    **choice_extra: Any,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
              "stop_reason": None, **choice_extra}  # fmt: skip
    return {"id": ident, "object": "text_completion", "created": CREATED, "model": MODEL,
            "choices": [choice]}  # fmt: skip


def chat_chunk(
    delta: dict[str, Any],
    *,
    ident: str = "chatcmpl-1",
    finish: str | None = None,
    index: int = 0,
    created: int = CREATED,
    **top: Any,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": MODEL,
            "choices": [choice], **top}  # fmt: skip


def relay(ledger: StreamLedger, *chunks: bytes) -> bytes:
    """Feed ``chunks`` through the ledger as the proxy does; what the client got."""
    out = b""
    for chunk in chunks:
        whole = ledger.whole(chunk)
        if whole:
            ledger.record(whole)
            out += whole
    return out


def sent_of(kind: Kind, *events: bytes) -> Sent:
    ledger = StreamLedger()
    relay(ledger, *events)
    return read_sent(kind, ledger)


# ---- the ledger ---------------------------------------------------------------------------


def test_a_partial_event_is_held_back_until_it_is_whole() -> None:
    """Only whole events are relayed: an event cut anywhere (even between its two newlines) waits
    for its end, and the start of the next event waits in turn."""
    first, second = sse(cmpl_chunk("Hello")), sse(cmpl_chunk(" world"))
    ledger = StreamLedger()
    assert ledger.whole(first[:10]) == b""
    assert ledger.whole(first[10:-1]) == b""  # cut between the two newlines
    assert ledger.whole(first[-1:] + second[:7]) == first
    assert ledger.whole(second[7:]) == second
    assert ledger.rest() == b""


def test_every_cut_of_a_stream_relays_it_whole_and_in_order() -> None:
    """However a stream is cut into chunks, what is relayed is whole events only, and all of them
    concatenated (with the held rest at the end) are the stream itself."""
    stream = sse(cmpl_chunk("ab")) + sse(cmpl_chunk("c")) + DONE_EVENT
    for i in range(len(stream) + 1):
        for j in range(i, len(stream) + 1, 7):
            ledger = StreamLedger()
            pieces = [ledger.whole(c) for c in (stream[:i], stream[i:j], stream[j:])]
            assert all(p == b"" or p.endswith(b"\n\n") for p in pieces)
            assert b"".join(pieces) + ledger.rest() == stream
            assert all(p.startswith(b"data: ") for p in pieces if p)


def test_the_held_start_of_an_event_comes_out_once_at_the_end() -> None:
    """rest() hands over a stream's unterminated tail once, and forgets it."""
    ledger = StreamLedger()
    assert ledger.whole(b'data: {"x":1}\n\ndata: {"y"') == b'data: {"x":1}\n\n'
    assert ledger.rest() == b'data: {"y"'
    assert ledger.rest() == b""
    assert ledger.whole(b"data: [DONE]\n\n") == DONE_EVENT  # nothing stale glued in front


def test_done_is_noted_when_the_engines_done_goes_out() -> None:
    ledger = StreamLedger()
    relay(ledger, sse(cmpl_chunk("a", finish="length")))
    assert not ledger.done
    relay(ledger, DONE_EVENT)
    assert ledger.done


def test_a_ledger_past_its_bound_disables_resumption_but_still_sees_done() -> None:
    """A stream longer than the ledger keeps is not resumed (its events are dropped, not kept
    growing); a stream of exactly the bound still is."""
    events = [sse(cmpl_chunk(c)) for c in "abcd"]
    exact = StreamLedger(max_bytes=sum(map(len, events)))
    relay(exact, *events)
    assert not exact.overflowed
    assert read_sent("completions", exact).text == "abcd"

    ledger = StreamLedger(max_bytes=sum(map(len, events)) - 1)
    relay(ledger, *events)
    assert ledger.overflowed
    assert ledger.events == []
    sent = read_sent("completions", ledger)
    assert sent.not_resumable is not None
    assert sent.text == ""
    relay(ledger, sse(cmpl_chunk("e")), DONE_EVENT)
    assert ledger.overflowed
    assert ledger.events == []
    assert ledger.done


# ---- what was sent --------------------------------------------------------------------------


def test_a_completions_stream_reads_as_its_text_id_and_prompt_ids() -> None:
    """The sent text is the pieces in order; id, created and model are the stream's; the prompt's
    token ids come from the first choice (vLLM's return_token_ids)."""
    sent = sent_of(
        "completions",
        sse(cmpl_chunk("", prompt_token_ids=[1, 2, 3])),
        sse(cmpl_chunk("Hel")),
        b": keep-alive comment\n\n",
        sse(cmpl_chunk("lo")),
    )
    assert sent == Sent(
        id="cmpl-1",
        created=CREATED,
        model=MODEL,
        text="Hello",
        events=2,
        finished=False,
        prompt_token_ids=[1, 2, 3],
    )
    assert sent.not_resumable is None


def test_a_finish_reason_marks_the_answer_finished() -> None:
    """A sent finish_reason (even on an empty piece) means nothing is left to generate; the usage
    chunk (no choices) and [DONE] are no part of the text."""
    usage = {"id": "cmpl-1", "object": "text_completion", "created": CREATED, "model": MODEL,
             "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                      "total_tokens": 5}}  # fmt: skip
    sent = sent_of(
        "completions",
        sse(cmpl_chunk("ab")),
        sse(cmpl_chunk("", finish="stop")),
        sse(usage),
        DONE_EVENT,
    )
    assert (sent.text, sent.events, sent.finished) == ("ab", 1, True)
    assert sent.not_resumable is None


def test_a_chat_stream_reads_past_its_role_only_first_chunk() -> None:
    """vLLM's first chat chunk announces the role with empty content: no part of the answer. The
    prompt's token ids sit at the top of a chat chunk."""
    sent = sent_of(
        "chat",
        sse(chat_chunk({"role": "assistant", "content": ""}, prompt_token_ids=[7, 8])),
        sse(chat_chunk({"content": "Hi"})),
        sse(chat_chunk({"content": " there", "reasoning_content": None, "tool_calls": []})),
    )
    assert sent == Sent(
        id="chatcmpl-1",
        created=CREATED,
        model=MODEL,
        text="Hi there",
        events=2,
        finished=False,
        prompt_token_ids=[7, 8],
    )


def test_events_cut_across_chunks_read_as_whole_ones() -> None:
    """The ledger's events, relayed in odd chunks, parse to the same answer."""
    stream = (
        sse(chat_chunk({"role": "assistant", "content": ""}))
        + sse(chat_chunk({"content": "ab"}))
        + sse(chat_chunk({"content": "cd"}))
    )
    ledger = StreamLedger()
    relay(ledger, *(stream[i : i + 5] for i in range(0, len(stream), 5)))
    assert read_sent("chat", ledger).text == "abcd"


NOT_RESUMABLE: list[tuple[str, Kind, bytes]] = [
    ("not-json", "completions", b"data: {not json\n\n"),
    ("not-an-object", "completions", b"data: [1,2]\n\n"),
    ("error-event", "completions",
     sse({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})),
    ("second-choice", "completions", sse(cmpl_chunk("x", index=1))),
    ("second-choice-chat", "chat", sse(chat_chunk({"content": "x"}, index=1))),
    ("tool-calls", "chat", sse(chat_chunk({"tool_calls": [{"index": 0, "id": "c",
                                                          "function": {"name": "f"}}]}))),
    ("function-call", "chat", sse(chat_chunk({"function_call": {"name": "f"}}))),
    ("reasoning-content", "chat", sse(chat_chunk({"reasoning_content": "hmm"}))),
    ("reasoning", "chat", sse(chat_chunk({"reasoning": "hmm"}))),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "bad"), [c[1:] for c in NOT_RESUMABLE], ids=[c[0] for c in NOT_RESUMABLE]
)
def test_what_cannot_be_continued_says_why(kind: Kind, bad: bytes) -> None:
    """An answer that is not plain text of one choice, or a stream that is not vLLM's JSON, is
    refused with a reason, whatever was sent before it."""
    good = sse(cmpl_chunk("ok")) if kind == "completions" else sse(chat_chunk({"content": "ok"}))
    sent = sent_of(kind, good, bad)
    assert sent.not_resumable
    assert (sent.text, sent.events, sent.id) == ("", 0, None)


# ---- the continuation request ----------------------------------------------------------------


def sent_text(text: str, **fields: Any) -> Sent:
    base: dict[str, Any] = {"id": "x", "created": CREATED, "model": MODEL, "text": text,
                            "events": 1 if text else 0, "finished": False,
                            "prompt_token_ids": None}  # fmt: skip
    return Sent(**{**base, **fields})


def test_a_completion_continues_from_its_prompt_and_the_sent_text() -> None:
    """The prompt grows by the sent text, max_tokens shrinks by the tokens sent, everything else is
    the client's; the prefill hop's kv_transfer_params are not the new replica's; the client's
    body is untouched."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 20, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n"],
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    before = copy.deepcopy(body)
    resumed = continuation("completions", body, sent_text(" a time"), 2)
    assert resumed is not None
    assert body == before
    expected = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert resumed == {**expected, "prompt": "Once upon a time", "max_tokens": 18}
    resumed["stream_options"]["include_usage"] = False
    assert body == before  # a deep copy


def test_a_completion_without_max_tokens_gets_the_apis_default_less_the_sent() -> None:
    """Leaving max_tokens out means 16 (OpenAI's and vLLM's completions default), so the
    continuation must not run unbounded."""
    assert COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    for body in ({"prompt": "p"}, {"prompt": "p", "max_tokens": None}):
        resumed = continuation("completions", body, sent_text("abc"), 3)
        assert resumed is not None
        assert resumed["max_tokens"] == 13
        assert resumed["prompt"] == "pabc"


def test_a_prompt_list_of_one_text_continues_as_text() -> None:
    resumed = continuation("completions", {"prompt": ["p"], "max_tokens": 5}, sent_text("q"), 1)
    assert resumed is not None
    assert (resumed["prompt"], resumed["max_tokens"]) == ("pq", 4)


@pytest.mark.parametrize("sent_tokens", [10, 11])
def test_nothing_left_to_generate_is_no_continuation(sent_tokens: int) -> None:
    """When the sent tokens reach the limit there is no request to make (the proxy closes the
    stream); one token short of it there is."""
    completion = {"prompt": "p", "max_tokens": 10}
    assert continuation("completions", completion, sent_text("x" * 10), sent_tokens) is None
    chat = {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 10}
    assert continuation("chat", chat, sent_text("x" * 10), sent_tokens) is None
    assert continuation("completions", {"prompt": "p"}, sent_text("x"), 16) is None
    resumed = continuation("completions", completion, sent_text("x" * 9), 9)
    assert resumed is not None
    assert resumed["max_tokens"] == 1


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_with_nothing_sent_the_request_goes_again_as_it_was(kind: Kind) -> None:
    """Nothing of the answer went out: the same request, limits untouched, as a copy, less the
    prefill hop's kv_transfer_params."""
    body: dict[str, Any] = {"max_tokens": 4, "kv_transfer_params": {"do_remote_prefill": True}}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "q"}]
    else:
        body["prompt"] = "p"
    before = copy.deepcopy(body)
    resumed = continuation(kind, body, sent_text(""), 0)
    assert resumed is not None
    assert resumed == {k: v for k, v in before.items() if k != "kv_transfer_params"}
    assert body == before
    if kind == "chat":
        resumed["messages"].append({"role": "assistant", "content": "!"})
        assert body == before


def test_a_chat_answer_continues_as_a_final_assistant_message() -> None:
    """The sent text becomes a final assistant message the engine continues (no new generation
    prompt), max_completion_tokens shrinks (it wins over max_tokens, as in vLLM)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 50, "max_tokens": 99,
            "temperature": 0.7, "stream": True}  # fmt: skip
    before = copy.deepcopy(body)
    resumed = continuation("chat", body, sent_text("Hello, I"), 3)
    assert resumed is not None
    assert body == before
    assert resumed == {
        **body,
        "messages": [*messages, {"role": "assistant", "content": "Hello, I"}],
        "max_completion_tokens": 47,
        "max_tokens": 99,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }


def test_a_chat_limit_in_max_tokens_shrinks_and_no_limit_stays_none() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    resumed = continuation(
        "chat", {"messages": messages, "max_completion_tokens": None, "max_tokens": 8},
        sent_text("ab"), 2,
    )  # fmt: skip
    assert resumed is not None
    assert (resumed["max_tokens"], resumed["max_completion_tokens"]) == (6, None)
    unbounded = continuation("chat", {"messages": messages}, sent_text("ab"), 2)
    assert unbounded is not None
    assert "max_tokens" not in unbounded
    assert "max_completion_tokens" not in unbounded


def test_a_prefilled_chat_reply_is_extended_not_followed() -> None:
    """A client that prefilled the reply (continue_final_message) had the engine continue that
    message: the sent text extends it, rather than opening a message after it."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"messages": messages, "continue_final_message": True,
            "add_generation_prompt": False, "max_tokens": 10}  # fmt: skip
    resumed = continuation("chat", body, sent_text(" yes"), 1)
    assert resumed is not None
    assert resumed["messages"] == [messages[0], {"role": "assistant", "content": "Well, yes"}]
    assert messages[1]["content"] == "Well,"
    assert (resumed["continue_final_message"], resumed["add_generation_prompt"]) == (True, False)
    assert resumed["max_tokens"] == 9


def test_a_prefilled_reply_in_content_parts_is_not_resumed() -> None:
    """A prefilled reply given as content parts (the OpenAI array form): templates join parts
    in their own ways (vLLM with newlines for string-content templates), so no extension is
    sure to render the prompt the first engine continued; such a stream is not resumed, and
    the same reply as a string is."""
    prefill = {"role": "assistant", "content": [{"type": "text", "text": "Well,"}]}
    body = {"messages": [{"role": "user", "content": "Hi"}, prefill],
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    assert not resumable_body("chat", body)
    as_text = {**body, "messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Well,"}]}  # fmt: skip
    assert resumable_body("chat", as_text)


USER = {"role": "user", "content": "q"}
RESUMABLE: list[tuple[str, Kind, dict[str, Any], bool]] = [
    ("text-prompt", "completions", {"prompt": "p"}, True),
    ("one-text-in-a-list", "completions", {"prompt": ["p"]}, True),
    ("n-1-best-of-none", "completions", {"prompt": "p", "n": 1, "best_of": None}, True),
    ("two-prompts", "completions", {"prompt": ["p", "q"]}, False),
    ("token-ids", "completions", {"prompt": [1, 2, 3]}, False),
    ("token-id-lists", "completions", {"prompt": [[1, 2]]}, False),
    ("no-prompt", "completions", {}, False),
    ("n-2", "completions", {"prompt": "p", "n": 2}, False),
    ("best-of-2", "completions", {"prompt": "p", "best_of": 2}, False),
    ("echo", "completions", {"prompt": "p", "echo": True}, False),
    ("suffix", "completions", {"prompt": "p", "suffix": "s"}, False),
    ("chat", "chat", {"messages": [{"role": "user", "content": "q"}]}, True),
    ("chat-empty-tools", "chat", {"messages": [USER], "tools": []}, True),
    ("chat-tools", "chat", {"messages": [USER], "tools": [{"type": "function"}]}, False),
    ("chat-n-2", "chat", {"messages": [USER], "n": 2}, False),
    ("chat-empty-messages", "chat", {"messages": []}, False),
    ("chat-no-messages", "chat", {"prompt": "p"}, False),
]


@pytest.mark.parametrize(
    ("kind", "body", "expected"), [c[1:] for c in RESUMABLE], ids=[c[0] for c in RESUMABLE]
)
def test_which_requests_could_be_continued_at_all(
    kind: Kind, body: dict[str, Any], expected: bool
) -> None:
    assert resumable_body(kind, body) is expected


# ---- closing an answer that is whole -------------------------------------------------------


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_finished_answer_closes_with_done_only(kind: Kind) -> None:
    assert closing(kind, sent_text("abc", finished=True)) == DONE_EVENT


def test_an_answer_at_its_limit_closes_with_a_length_chunk_then_done() -> None:
    """The token limit was reached but its finish_reason never went out: the client gets the final
    chunk vLLM would have sent (finish_reason length, the stream's id), then [DONE]."""
    sent = sent_text("abc", id="cmpl-9", finished=False)
    raw = closing("completions", sent)
    assert raw.endswith(b"\n\n" + DONE_EVENT)
    final, done = events_of(raw)
    assert done == "[DONE]"
    assert final == {"id": "cmpl-9", "object": "text_completion", "created": CREATED,
                     "model": MODEL,
                     "choices": [{"index": 0, "finish_reason": "length", "text": ""}]}  # fmt: skip

    chat_final, _ = events_of(closing("chat", sent_text("abc", id="chatcmpl-9")))
    assert chat_final["object"] == "chat.completion.chunk"
    assert chat_final["id"] == "chatcmpl-9"
    assert chat_final["choices"] == [{"index": 0, "finish_reason": "length", "delta": {}}]


# ---- rewriting the continuation --------------------------------------------------------------


def test_continuation_events_take_the_first_answers_id_and_time() -> None:
    sent = sent_text("ab", id="cmpl-first", prompt_token_ids=[1, 2])
    rewriter = Rewriter("completions", sent, 2)
    chunk = sse(cmpl_chunk("cd", ident="cmpl-second", prompt_token_ids=[1, 2, 97, 98]))
    chunk = chunk.replace(str(CREATED).encode(), b"1800000000")
    (event,) = events_of(rewriter.events(chunk))
    assert (event["id"], event["created"]) == ("cmpl-first", CREATED)
    assert event["choices"][0]["text"] == "cd"
    # The client's prompt was the first answer's, not the prompt extended by the sent text.
    assert event["choices"][0]["prompt_token_ids"] == [1, 2]


def test_continuation_usage_counts_the_sent_tokens_as_completion() -> None:
    """The continuation's prompt included the sent tokens: usage moves them back to completion,
    so the client's totals are those of one uninterrupted answer, and cached prompt tokens never
    exceed the prompt."""
    rewriter = Rewriter("completions", sent_text("abcdefgh"), 8)

    def usage_of(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}  # fmt: skip
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        chunk = {**cmpl_chunk(""), "choices": [], "usage": usage}
        (event,) = events_of(rewriter.events(sse(chunk)))
        return dict(event["usage"])

    assert usage_of(20, 4, None) == {"prompt_tokens": 12, "completion_tokens": 12,
                                     "total_tokens": 24}  # fmt: skip
    clamped = usage_of(20, 4, 16)  # the sent text was cached on the new replica
    assert (clamped["prompt_tokens"], clamped["completion_tokens"]) == (12, 12)
    assert clamped["prompt_tokens_details"] == {"cached_tokens": 12}
    assert usage_of(20, 4, 5)["prompt_tokens_details"] == {"cached_tokens": 5}
    assert usage_of(5, 1, 5)["prompt_tokens"] == 0  # never negative


def test_chat_continuation_drops_its_role_announcement() -> None:
    """The client was told the role: the continuation's role-only first chunk is dropped, a role
    riding with content is removed, everything else (finish, usage, [DONE]) goes through, and
    each rewritten event is a whole compact one."""
    sent = sent_text("Hi", id="chatcmpl-first", prompt_token_ids=[5])
    rewriter = Rewriter("chat", sent, 1)
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    chunk = (
        sse(chat_chunk({"role": "assistant", "content": ""}, ident="c2", prompt_token_ids=[5, 6]))
        + sse(chat_chunk({"role": "assistant", "content": " there"}, ident="c2"))
        + sse(chat_chunk({"content": "!"}, ident="c2"))
        + sse(chat_chunk({}, ident="c2", finish="stop"))
        + sse({**chat_chunk({}, ident="c2"), "choices": [], "usage": usage})
        + DONE_EVENT
    )
    raw = rewriter.events(chunk)
    assert raw.endswith(b"\n\n")
    events = events_of(raw)
    assert events[-1] == "[DONE]"
    assert raw.endswith(DONE_EVENT)
    objs = events[:-1]
    assert [e["id"] for e in objs] == ["chatcmpl-first"] * 4
    assert [e["choices"][0]["delta"] for e in objs[:3]] == [{"content": " there"},
                                                            {"content": "!"}, {}]  # fmt: skip
    assert objs[2]["choices"][0]["finish_reason"] == "stop"
    assert objs[3]["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    for line in raw.split(b"\n\n")[:-2]:
        assert line.startswith(b"data: {")
        assert b": " not in line[6:]


def test_a_role_only_chunk_carrying_the_prompt_ids_is_still_dropped() -> None:
    """vLLM's first chat chunk carries prompt_token_ids at the top with return_token_ids: the
    client had them from the first answer, so the chunk says nothing new."""
    rewriter = Rewriter("chat", sent_text("Hi", prompt_token_ids=[5]), 1)
    first = chat_chunk({"role": "assistant", "content": ""}, prompt_token_ids=[5, 6])
    assert rewriter.events(sse(first)) == b""


def test_errors_and_unknown_events_pass_as_they_are() -> None:
    """An engine's error event keeps its own shape (no stream id forced into it); comments and
    [DONE] pass byte for byte."""
    rewriter = Rewriter("chat", sent_text("Hi", id="chatcmpl-first"), 1)
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    raw = rewriter.events(b": ping\n\n" + sse(error) + DONE_EVENT)
    assert raw == b": ping\n\n" + sse(error) + DONE_EVENT


def test_a_sent_without_id_keeps_the_continuations() -> None:
    rewriter = Rewriter("completions", sent_text("a", id=None, created=None), 1)
    (event,) = events_of(rewriter.events(sse(cmpl_chunk("b", ident="cmpl-2"))))
    assert (event["id"], event["created"]) == ("cmpl-2", CREATED)


# ---- the pieces together ---------------------------------------------------------------------


def test_a_broken_chat_stream_and_its_rewritten_continuation_read_as_one_answer() -> None:
    """A stream cut mid-event, continued: the client reads one id, one role, and the answer's
    text exactly once."""
    first = (
        sse(chat_chunk({"role": "assistant", "content": ""}, ident="a"))
        + sse(chat_chunk({"content": "The "}, ident="a"))
        + sse(chat_chunk({"content": "cat"}, ident="a"))
        + sse(chat_chunk({"content": " sat"}, ident="a"))
    )
    cut = len(first) - 5  # the engine died inside the last event
    ledger = StreamLedger()
    client = relay(ledger, first[:20], first[20:cut])
    sent = read_sent("chat", ledger)
    assert sent.text == "The cat"
    body = {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 10, "stream": True}
    resumed = continuation("chat", body, sent, 7)
    assert resumed is not None
    assert resumed["messages"][-1] == {"role": "assistant", "content": "The cat"}
    assert resumed["max_tokens"] == 3

    rewriter = Rewriter("chat", sent, 7)
    second = (
        sse(chat_chunk({"role": "assistant", "content": ""}, ident="b"))
        + sse(chat_chunk({"content": " sat"}, ident="b"))
        + sse(chat_chunk({"content": ""}, ident="b", finish="length"))
        + DONE_EVENT
    )
    resumed_ledger = StreamLedger()
    for i in range(0, len(second), 9):
        whole = resumed_ledger.whole(second[i : i + 9])
        if whole:
            client += rewriter.events(whole)
    events = events_of(client)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"a"}
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "The cat sat"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
