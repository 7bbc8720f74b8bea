"""The request fields a resumed stream relies on: vLLM's ``allowed_token_ids`` (only those tokens
may be generated) and the chat template switches ``continue_final_message`` /
``add_generation_prompt`` (the engine continues the final message in place of opening a new
one), through the sampler, the engine and the HTTP server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from fleetpilot.engine.reference import SamplingParams, SpeculativeConfig
from fleetpilot.engine.reference.engine import RequestRejectedError
from fleetpilot.engine.reference.sampling import probs_from_logits, sample
from fleetpilot.engine.reference.tokenizer import MIN_VOCAB_SIZE, ByteTokenizer
from fleetpilot.testing.engine_server import BackgroundServer
from tests.engine.reference.conftest import EngineFactory

MODEL = "tiny-model"
PRINTABLE = list(range(32, 127))
PROMPTS = ["The quick brown fox", "Lorem ipsum dolor sit amet", "fleetpilot"]
BOTH_SWITCHES = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


# ---- the sampler ---------------------------------------------------------------------------


def test_greedy_picks_the_best_allowed_token() -> None:
    """Greedy is the argmax over the allowed tokens only, even where a forbidden one scores far
    higher."""
    logits = torch.tensor([[0.0, 9.0, 1.0, 2.0, 0.5], [5.0, 4.0, 3.0, -1.0, 8.0]])
    params = SamplingParams(temperature=0, allowed_token_ids=(0, 2, 3))
    assert sample(logits, params, None) == [3, 0]
    assert sample(logits, SamplingParams(temperature=0), None) == [1, 4]  # unrestricted


def test_sampling_never_draws_a_forbidden_token() -> None:
    """The distribution sampled from is zero outside the allowed tokens and renormalized within
    them; draws (top-k and top-p applied after the restriction, as in vLLM) stay inside."""
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(0)) * 3
    allowed = (3, 17, 29)
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    probs = probs_from_logits(logits, params)
    outside = [t for t in range(40) if t not in allowed]
    assert torch.all(probs[:, outside] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(64))
    gen = torch.Generator().manual_seed(1)
    draws = sample(logits, params, gen)
    assert set(draws) <= set(allowed)
    assert len(set(draws)) > 1  # still sampled, not collapsed onto one token
    for extra in ({"top_k": 2}, {"top_p": 0.5}, {"temperature": 0.3}):
        narrowed = SamplingParams(**{"allowed_token_ids": allowed, **extra})  # type: ignore[arg-type]
        assert set(sample(logits, narrowed, gen)) <= set(allowed)


def test_a_negative_allowed_token_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(65, -1))


# ---- the engine ----------------------------------------------------------------------------


def printable_text(out: Any) -> str:
    assert all(32 <= t < 127 for t in out.token_ids), out.token_ids
    text: str = out.text
    assert text == bytes(out.token_ids).decode("ascii")
    return text


def test_greedy_generation_stays_within_printable_ascii(make_engine: EngineFactory) -> None:
    """Restricted to printable ASCII, greedy output is text whose bytes are its tokens; EOS is not
    allowed, so every answer runs to its limit. Unrestricted, the random model would not stay
    there (the restriction is what the test sees)."""
    params = SamplingParams(max_tokens=24, temperature=0, allowed_token_ids=tuple(PRINTABLE))
    outs = make_engine().generate(PROMPTS, params)
    for out in outs:
        printable_text(out)
        assert (len(out.token_ids), out.finish_reason) == (24, "length")
    free = make_engine().generate(
        PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    assert any(t not in PRINTABLE for out in free for t in out.token_ids)


def test_a_restricted_greedy_request_leaves_its_batch_neighbours_alone(
    make_engine: EngineFactory,
) -> None:
    """In one batch, a restricted greedy request and free greedy ones: each gets what it gets
    alone (the free rows still take the plain argmax, the restricted one its own)."""
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    few = SamplingParams(max_tokens=16, temperature=0, allowed_token_ids=(97, 98, 99))
    alone_free = make_engine().generate(PROMPTS[:2], free)
    alone_few = make_engine().generate(PROMPTS[2:], few)

    engine = make_engine()
    engine.add_request("free-0", PROMPTS[0], free)
    engine.add_request("few", PROMPTS[2], few)
    engine.add_request("free-1", PROMPTS[1], free)
    final: dict[str, Any] = {}
    while len(final) < 3:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["free-0"].token_ids == alone_free[0].token_ids
    assert final["free-1"].token_ids == alone_free[1].token_ids
    assert final["few"].token_ids == alone_few[0].token_ids
    assert set(final["few"].token_ids) <= {97, 98, 99}


def test_sampled_generation_stays_within_the_allowed_tokens(make_engine: EngineFactory) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, allowed_token_ids=(97, 98, 99))
    outs = make_engine().generate(PROMPTS, params)
    tokens = [t for out in outs for t in out.token_ids]
    assert len(tokens) == 3 * 40
    assert set(tokens) <= {97, 98, 99}
    assert all(set(out.text) <= set("abc") for out in outs)


def test_speculative_decoding_keeps_the_restriction(make_engine: EngineFactory) -> None:
    """Drafts and their verification obey allowed_token_ids: greedy output is the plain engine's
    token for token, sampled output stays inside."""
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_num_layers=1)
    greedy = SamplingParams(max_tokens=24, temperature=0, allowed_token_ids=tuple(PRINTABLE))
    plain = make_engine().generate(PROMPTS, greedy)
    drafted = make_engine(speculative=spec).generate(PROMPTS, greedy)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=3, allowed_token_ids=(120, 121))
    outs = make_engine(speculative=spec).generate(PROMPTS, sampled)
    assert all(set(o.token_ids) <= {120, 121} and len(o.token_ids) == 24 for o in outs)


def test_the_engine_refuses_tokens_past_its_vocabulary(make_engine: EngineFactory) -> None:
    engine = make_engine()
    with pytest.raises(RequestRejectedError, match="allowed_token_ids"):
        engine.add_request("r", "x", SamplingParams(allowed_token_ids=(65, MIN_VOCAB_SIZE)))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", "x", SamplingParams(allowed_token_ids=(MIN_VOCAB_SIZE - 1,)))


# ---- the chat template -----------------------------------------------------------------------


def test_the_template_can_end_inside_the_final_message() -> None:
    """continue_final_message ends the text right after the final message's content: the prompt of
    that message without its close, and no new assistant header."""
    tok = ByteTokenizer()
    question = [{"role": "user", "content": "hi"}]
    prefilled = [*question, {"role": "assistant", "content": "Hel"}]
    text = tok.apply_chat_template(prefilled, add_generation_prompt=False,
                                   continue_final_message=True)  # fmt: skip
    assert text == "<|user|>\nhi\n<|assistant|>\nHel"
    # The prompt a fresh answer starts from, plus the prefilled text.
    assert text == tok.apply_chat_template(question) + "Hel"
    closed = tok.apply_chat_template(prefilled, add_generation_prompt=False)
    assert closed == text + "\n"


# ---- over HTTP -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    argv = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
            "--max-model-len", "256", "--served-model-name", MODEL]  # fmt: skip
    srv = BackgroundServer.from_argv(argv).start()
    yield srv
    srv.stop()


@pytest.fixture
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/chat/completions", json={"model": MODEL, **body})
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ],
)
@pytest.mark.parametrize("bad", [[65, MIN_VOCAB_SIZE], [65, 10**6], [-1]])
def test_tokens_outside_the_vocabulary_are_a_400(
    http: httpx.Client, path: str, extra: dict[str, Any], bad: list[int]
) -> None:
    resp = http.post(path, json={"model": MODEL, "allowed_token_ids": bad, **extra})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["code"], error["type"]) == (400, "BadRequestError")
    assert "allowed_token_ids" in error["message"]
    assert http.get("/health").status_code == 200


def test_a_completion_over_http_keeps_to_the_allowed_tokens(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 30, "temperature": 1.0,
            "seed": 5, "allowed_token_ids": PRINTABLE}  # fmt: skip
    out = http.post("/v1/completions", json=body).json()
    text = out["choices"][0]["text"]
    assert len(text) == 30
    assert all(32 <= ord(c) < 127 for c in text)
    assert out["choices"][0]["finish_reason"] == "length"


def test_both_template_switches_on_are_vllms_400(http: httpx.Client) -> None:
    """continue_final_message with add_generation_prompt (its default: true) is refused with vLLM's
    message, on chat and on /tokenize alike."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        for body in ({"continue_final_message": True},
                     {"continue_final_message": True, "add_generation_prompt": True}):  # fmt: skip
            resp = http.post(path, json={"model": MODEL, "messages": messages, **body})
            assert resp.status_code == 400, (path, resp.text)
            error = resp.json()["error"]
            assert error["message"] == BOTH_SWITCHES
            assert (error["code"], error["type"]) == (400, "BadRequestError")


def test_tokenize_counts_a_continued_final_message(http: httpx.Client) -> None:
    """/tokenize with continue_final_message counts the prompt that ends in the final message's
    content: the fresh answer's prompt plus the prefilled text's bytes; chat usage agrees."""
    tok = ByteTokenizer()
    question = [{"role": "user", "content": "hi"}]
    prefilled = [*question, {"role": "assistant", "content": "Hello"}]
    fresh = http.post("/tokenize", json={"model": MODEL, "messages": question}).json()
    switches = {"continue_final_message": True, "add_generation_prompt": False}
    cont = http.post("/tokenize", json={"model": MODEL, "messages": prefilled, **switches}).json()
    assert cont["count"] == fresh["count"] + len("Hello")
    assert cont["tokens"] == [*fresh["tokens"], *b"Hello"]
    assert cont["tokens"] == tok.encode(
        tok.apply_chat_template(prefilled, add_generation_prompt=False,
                                continue_final_message=True)
    )  # fmt: skip
    done = chat(http, messages=prefilled, max_tokens=1, **switches)
    assert done["usage"]["prompt_tokens"] == cont["count"]
    # add_generation_prompt false alone closes the final message, no header after it.
    closed = http.post("/tokenize", json={"model": MODEL, "messages": prefilled,
                                          "add_generation_prompt": False}).json()  # fmt: skip
    assert closed["tokens"] == [*cont["tokens"], ord("\n")]


def test_a_greedy_answer_continued_from_its_start_is_the_same_answer(http: httpx.Client) -> None:
    """What a resumed stream rests on: greedy within printable ASCII, the answer's first k
    characters as a final assistant message to continue give exactly the rest of the answer, from
    a prompt k tokens longer."""
    messages = [{"role": "user", "content": "Tell me a story about a fox."}]
    limit = 40
    greedy = {"temperature": 0, "allowed_token_ids": PRINTABLE}
    whole = chat(http, messages=messages, max_tokens=limit, **greedy)
    answer = whole["choices"][0]["message"]["content"]
    assert len(answer) == limit
    assert all(32 <= ord(c) < 127 for c in answer)
    for k in (1, 13, limit - 1):
        rest = chat(
            http,
            messages=[*messages, {"role": "assistant", "content": answer[:k]}],
            max_tokens=limit - k,
            continue_final_message=True,
            add_generation_prompt=False,
            **greedy,
        )
        assert rest["choices"][0]["message"]["content"] == answer[k:], k
        assert rest["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + k
        assert rest["usage"]["completion_tokens"] == limit - k
