"""The reference engine's HTTP server, driven by the official ``openai`` client and raw HTTP.

Servers run in-process on a free loopback port (``BackgroundServer``: their own event loop in a
thread), on the tiny seeded model, so every request answers in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference.engine import LLMEngine
from fleetpilot.engine.reference.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from fleetpilot.engine.reference.server import MAX_BODY_BYTES, build_server
from fleetpilot.engine.reference.settings import add_arguments
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually_async
from tests.engine.reference.server_support import BASE_ARGS, MODEL, start_server

# A prompt of more than one 16-token block, so a repeat hits the prefix cache.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog, again and again and again."
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    # A small pool (12 blocks = 192 tokens, below max_model_len) so "too large for the KV pool"
    # is reachable; speculation on, so its counters move.
    srv = start_server(
        "--served-model-name", MODEL, "alias",
        "--num-gpu-blocks-override", "12",
        "--speculative-config", '{"num_speculative_tokens": 2, "draft_num_layers": 1}',
    )  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def slow_server() -> Iterator[BackgroundServer]:
    """Steps take >= 20 ms, so a request of 200 tokens runs for seconds unless aborted."""
    srv = start_server("--served-model-name", MODEL, "--step-delay-seconds", "0.02")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
def http(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    want = {("model_name", MODEL), ("engine", "0"), *labels.items()}
    for (n, got), value in metric_samples(text).items():
        if n == name and want <= got:
            return value
    raise AssertionError(f"{name} {labels} not in /metrics")


# ---- the openai client ---------------------------------------------------------------------


def test_completions_non_streaming(client: openai.OpenAI) -> None:
    """A completion has OpenAI's shape (id, object, model, finish_reason) and exact usage counts;
    greedy decoding gives the same text twice."""
    first = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, **GREEDY)
    again = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, **GREEDY)
    choice = first.choices[0]
    assert first.object == "text_completion"
    assert first.id.startswith("cmpl-")
    assert first.model == MODEL
    assert choice.finish_reason == "length"
    assert choice.text == again.choices[0].text  # greedy is deterministic
    assert first.usage is not None
    assert first.usage.prompt_tokens == len("Hello there") + 1  # bytes + BOS
    assert first.usage.completion_tokens == 8
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8


def test_completions_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    """Streamed chunks join into the non-streamed text; only the last choice has a finish_reason,
    and with include_usage one final chunk without choices carries the usage."""
    full = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=12, **GREEDY)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length"
    assert all(f is None for f in finals[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage is not None
    assert usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streaming_with_usage_reports_cached_tokens(client: openai.OpenAI) -> None:
    """Chat streaming opens with the assistant role and matches the non-streamed answer; the
    repeated prompt reports its prefix-cache hit in cached_tokens, in whole blocks."""
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": LONG_PROMPT},
    ]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY
    )
    assert full.object == "chat.completion"
    assert full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    usage = full.usage
    assert usage is not None
    assert usage.completion_tokens == 10

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    last = chunks[-1].usage
    assert last is not None
    assert last.prompt_tokens == usage.prompt_tokens
    # The second identical prompt reuses the first one's full KV blocks.
    assert last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens >= 16
    assert last.prompt_tokens_details.cached_tokens % 16 == 0


def test_a_chat_stream_opens_only_once_its_prompt_is_computed(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The role chunk comes with the first output, as vLLM's serving_chat sends it, not at once:
    with the engine's steps each taking a second, no byte of the stream arrives before the
    prefill step is over (a router takes the first chunk as the end of the request's
    prefill)."""
    runner = server.server.runner
    assert runner is not None
    engine = runner.engine
    step = engine.step
    step_s = 1.0

    def slow_step() -> Any:
        time.sleep(step_s)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}],
            "max_tokens": 2, "stream": True}  # fmt: skip
    started = time.monotonic()
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = (line for line in resp.iter_lines() if line)
        first = next(lines)
        waited = time.monotonic() - started
        rest = list(lines)
    assert waited >= 0.9 * step_s, f"the stream opened {waited:.2f} s in, before the prefill"
    assert json.loads(first[5:])["choices"][0]["delta"]["role"] == "assistant"
    assert rest[-1] == "data: [DONE]"


def test_chat_content_parts_and_max_tokens_alias(client: openai.OpenAI) -> None:
    """Chat content given as text parts is the same prompt as a plain string, and the legacy
    max_tokens limits a chat answer as max_completion_tokens does."""
    parts = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
        max_tokens=4,
        **GREEDY,
    )
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=4, **GREEDY
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 4


def test_models_lists_every_served_name(client: openai.OpenAI) -> None:
    """/v1/models lists every --served-model-name in order, and a request naming an alias is served
    and answered under that name."""
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    assert models.data[0].owned_by == "fleetpilot"
    # Any served name works; metrics still use the first.
    out = client.completions.create(model="alias", prompt="x", max_tokens=2, **GREEDY)
    assert out.model == "alias"


def test_stop_strings_cut_the_text_streaming_or_not(client: openai.OpenAI) -> None:
    """A stop string ends the text just before it, with finish_reason stop, streamed or not."""
    base = client.completions.create(
        model=MODEL, prompt="Stop here", max_tokens=24, **GREEDY
    ).choices[0]
    # A stop string from the middle of the greedy continuation: it must be cut there.
    text = base.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = text[: text.index(stop)]
    out = client.completions.create(
        model=MODEL, prompt="Stop here", max_tokens=24, stop=[stop, "never"], **GREEDY
    )
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="Stop here", max_tokens=24, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    """Sampling with a seed is reproducible (same seed, same text), and top_k from extra_body is
    applied: top_k 1 leaves only the likeliest token, so it samples exactly the greedy text."""
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "Sample", "max_tokens": 12}
    a = client.completions.create(**kwargs, temperature=1.0, top_p=0.9, seed=7)
    b = client.completions.create(**kwargs, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text
    k = client.completions.create(**kwargs, temperature=0.8, extra_body={"top_k": 1}, seed=1)
    greedy = client.completions.create(**kwargs, temperature=0.0)
    assert k.choices[0].text == greedy.choices[0].text


@pytest.mark.asyncio
async def test_async_client_concurrent_requests(server: BackgroundServer) -> None:
    """Concurrent requests from the async client each get all their tokens, and greedy output
    batched with others equals the same prompt alone."""
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x") as client:
        prompts = [f"Concurrent request number {i}" for i in range(6)]
        outs = await asyncio.gather(
            *(
                client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY)
                for p in prompts
            )
        )
        solo = await client.completions.create(
            model=MODEL, prompt=prompts[3], max_tokens=6, **GREEDY
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "async"}],
            max_tokens=5,
            stream=True,
            **GREEDY,
        )
        deltas = [c.choices[0].delta.content async for c in stream]
    assert [o.usage.completion_tokens for o in outs if o.usage] == [6] * 6
    # Batched with others or alone, greedy output is the same.
    assert outs[3].choices[0].text == solo.choices[0].text
    assert "".join(d for d in deltas if d), "the stream carried no content"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    """The openai client turns our errors into its typed exceptions: an unknown model is
    NotFoundError (404), n=2 a BadRequestError saying n=1."""
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert not_found.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2)
    assert "n=1" in str(bad.value)


# ---- errors ----------------------------------------------------------------------------


def _long(n: int) -> str:
    return "a" * n


ERROR_CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (id, path, body, status, param)
    ("bad-json", "/v1/completions", b"{not json", 400, None),
    ("not-an-object", "/v1/completions", [1, 2], 400, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad-role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "y"}]}, 400,
     "messages.0.role"),
    ("image-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("negative-temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("top-p-zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-k", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-string", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400,
     "max_tokens"),
    ("n-2", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("chat-logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ("penalty", "/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}, 400,
     "frequency_penalty"),
    ("empty-stop", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("batch", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("empty-token-prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, None),
    ("stream-options-without-stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("prompt-too-long", "/v1/completions", {"prompt": _long(300)}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "/v1/completions",
     {"prompt": _long(200), "max_tokens": 100}, 400, None),
    # 12 blocks of 16 tokens hold 192 tokens: 150 + 100 fits max_model_len, not the pool.
    ("larger-than-kv-pool", "/v1/completions", {"prompt": _long(150), "max_tokens": 100}, 400,
     None),
    ("chat-too-long", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": _long(300)}]}, 400, "messages"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, None),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt"),
    ("bool-token-ids", "/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("lone-surrogate", "/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("lone-surrogate-chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ("nan-temperature", "/v1/completions", {"prompt": "x", "temperature": float("nan")}, 400,
     "temperature"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_bad_requests_get_openai_shaped_errors(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    """Every refused request gets vLLM's error shape with the right status, type and param, and the
    server stays healthy after it."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert error["message"]
    assert error["param"] == param
    # And the server is still fine.
    assert http.get("/health").status_code == 200


def test_wrong_method_and_unknown_get_route(http: httpx.Client) -> None:
    """A GET on a POST route is a 405 and an unknown path a 404, both in the OpenAI error shape
    rather than aiohttp's plain text."""
    resp = http.get("/v1/completions")
    assert resp.status_code == 405
    assert resp.json()["error"]["code"] == 405
    resp = http.get("/nothing/here")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "NotFoundError"


def test_oversized_body_is_a_413(http: httpx.Client) -> None:
    """A body past MAX_BODY_BYTES is refused with a 413 in the OpenAI error shape."""
    huge = json.dumps({"prompt": "a" * (MAX_BODY_BYTES + 1)})
    resp = http.post("/v1/completions", content=huge, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == 413


def test_unknown_request_fields_are_ignored(http: httpx.Client) -> None:
    """Fields we do not know (user, newer API fields) are ignored as vLLM ignores them, not refused;
    the answer carries kv_transfer_params null as vLLM's does."""
    body = {"prompt": "x", "max_tokens": 2, "user": "u", "some_future_field": {"a": 1}}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.json()["kv_transfer_params"] is None


def test_token_id_prompts_and_return_token_ids(http: httpx.Client) -> None:
    """A prompt of token ids is the same prompt as its text, and return_token_ids echoes the
    prompt's ids and one id per generated token."""
    ids = ByteTokenizer().encode("token ids")
    by_ids = http.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    ).json()
    by_text = http.post(
        "/v1/completions",
        json={"prompt": "token ids", "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    ).json()
    assert by_ids["choices"][0]["prompt_token_ids"] == ids
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    assert len(by_ids["choices"][0]["token_ids"]) == by_ids["usage"]["completion_tokens"]


# ---- tokenize, health, metrics -------------------------------------------------------------


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    """/tokenize counts what a completion's usage reports (BOS unless add_special_tokens is false,
    the chat template for messages), refuses both inputs at once; /detokenize inverts it."""
    tok = ByteTokenizer()
    resp = http.post("/tokenize", json={"prompt": "abc"}).json()
    assert resp == {"count": 4, "max_model_len": 256, "tokens": [tok.bos_token_id, 97, 98, 99]}
    raw = http.post("/tokenize", json={"prompt": "abc", "add_special_tokens": False}).json()
    assert raw["tokens"] == [97, 98, 99]
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template(messages))
    # What /tokenize counts is what the completion's usage reports.
    done = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    both = http.post("/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400
    assert http.post("/detokenize", json={"tokens": raw["tokens"]}).json() == {"prompt": "abc"}


def test_health_and_version(http: httpx.Client) -> None:
    """A ready server answers /health with 200 and names its version at /version."""
    resp = http.get("/health")
    assert resp.status_code == 200
    assert http.get("/version").json()["version"]


VLLM_SERIES = [
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:request_time_per_output_token_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries_total", "counter"),
    ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:num_preemptions_total", "counter"),
    ("vllm:request_success_total", "counter"),
    ("vllm:cache_config_info", "gauge"),
    ("vllm:spec_decode_num_draft_tokens_total", "counter"),
    ("vllm:spec_decode_num_accepted_tokens_total", "counter"),
]


def test_metrics_expose_vllm_names_labels_and_buckets(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """/metrics exposes vLLM's series with vLLM's names, labels and bucket bounds, and they move
    with traffic: dashboards and the autoscaler read us as they read vLLM."""
    for _ in range(2):  # the repeat hits the prefix cache
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=8, **GREEDY)
    resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = resp.text
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    for name, kind in VLLM_SERIES:
        exposed = f"{name}_bucket" if kind == "histogram" else name
        matching = [line for line in lines if line.startswith(exposed + "{")]
        assert matching, f"{exposed} missing from /metrics"
        if name != "vllm:cache_config_info":  # vLLM labels the info with the engine only
            assert all('model_name="tiny-model"' in line for line in matching), matching
        assert all('engine="0"' in line for line in matching), matching
    samples = metric_samples(text)

    def value(name: str, **labels: str) -> float:
        want = {("engine", "0"), *labels.items()}
        if name != "vllm:cache_config_info":
            want.add(("model_name", MODEL))
        hits = [v for (n, got), v in samples.items() if n == name and want <= got]
        assert len(hits) == 1, (name, labels)
        return hits[0]

    assert value("vllm:prompt_tokens_total") >= 2 * (len(LONG_PROMPT) + 1)
    assert value("vllm:generation_tokens_total") >= 16
    assert value("vllm:prefix_cache_hits_total") >= 16
    assert value("vllm:prefix_cache_queries_total") >= value("vllm:prefix_cache_hits_total")
    assert value("vllm:request_success_total", finished_reason="length") >= 2
    value("vllm:request_success_total", finished_reason="stop")  # exposed: value() finds one
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    assert value("vllm:spec_decode_num_draft_tokens_total") > 0
    assert (
        0
        <= value("vllm:spec_decode_num_accepted_tokens_total")
        <= value("vllm:spec_decode_num_draft_tokens_total")
    )
    assert value("vllm:time_to_first_token_seconds_count") >= 2
    assert value("vllm:e2e_request_latency_seconds_count") >= 2
    assert value("vllm:cache_config_info", block_size="16", num_gpu_blocks="12") == 1
    info = next(k for k in samples if k[0] == "vllm:cache_config_info")
    assert dict(info[1])["enable_prefix_caching"] == "True"

    def buckets(name: str) -> list[float]:
        les = [float(dict(labels)["le"]) for (n, labels) in samples if n == f"{name}_bucket"]
        return sorted(le for le in les if le != float("inf"))

    assert buckets("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert buckets("vllm:inter_token_latency_seconds") == list(TOKEN_LATENCY_BUCKETS)
    assert buckets("vllm:request_time_per_output_token_seconds") == list(TOKEN_LATENCY_BUCKETS)
    assert buckets("vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    # vLLM's values, spot-checked against loggers.py rather than our own constants.
    assert TTFT_BUCKETS[:3] == (0.001, 0.005, 0.01)
    assert TTFT_BUCKETS[-1] == 2560.0
    assert TOKEN_LATENCY_BUCKETS[0] == 0.01
    assert TOKEN_LATENCY_BUCKETS[-1] == 80.0
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3
    assert REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_servers_in_one_process_have_separate_registries(server: BackgroundServer) -> None:
    """Two servers in one process expose only their own series: no shared global Prometheus
    registry."""
    other = start_server("--served-model-name", "second")
    try:
        httpx.post(other.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        text = httpx.get(other.url + "/metrics").text
        assert 'model_name="second"' in text
        assert 'model_name="tiny-model"' not in text
    finally:
        other.stop()


# ---- lifecycle -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_503_while_starting_then_ready() -> None:
    """While the engine loads, /health and requests answer 503 in the error shape and /metrics is
    scrapable; once loaded, both answer 200."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    srv = build_server(parser.parse_args(BASE_ARGS))
    release = threading.Event()
    build = srv.engine_factory

    def slow_factory() -> LLMEngine:
        release.wait(10)
        return build()

    srv.engine_factory = slow_factory
    await srv.start()
    try:
        async with aiohttp.ClientSession(base_url=srv.url) as session:
            async with session.get("/health") as resp:
                assert resp.status == 503
                body = await resp.json()
                assert body["error"]["type"] == "ServiceUnavailableError"
                assert body["error"]["code"] == 503
            async with session.post("/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 503
            async with session.get("/metrics") as resp:  # scrapable while starting
                assert resp.status == 200
            release.set()
            await srv.wait_ready()
            async with session.get("/health") as resp:
                assert resp.status == 200
            async with session.post("/v1/completions", json={"prompt": "x"}) as resp:
                assert resp.status == 200
    finally:
        release.set()
        await srv.drain(1.0)
        await srv.close()


@pytest.mark.asyncio
async def test_draining_refuses_new_requests_and_finishes_running_ones() -> None:
    """A draining server fails /health and refuses new requests with 503, while a request already
    running finishes in full."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    srv = build_server(parser.parse_args([*BASE_ARGS, "--step-delay-seconds", "0.005"]))
    await srv.start()
    await srv.wait_ready()
    body = {"prompt": "drain", "max_tokens": 60, "ignore_eos": True}
    async with aiohttp.ClientSession(base_url=srv.url) as session:

        async def post() -> tuple[int, Any]:
            async with session.post("/v1/completions", json=body) as resp:
                return resp.status, await resp.json()

        running = asyncio.create_task(post())
        await eventually_async(
            "the request in flight", lambda: srv.in_flight or None, 30, interval=0.005
        )
        drain = asyncio.create_task(srv.drain(10.0))
        await asyncio.sleep(0)
        async with session.get("/health") as resp:
            assert resp.status == 503
        status, refused = await post()
        assert status == 503
        assert refused["error"]["message"] == "the server is shutting down"
        status, done = await running
        assert status == 200
        assert done["usage"]["completion_tokens"] == 60
        await drain
        assert srv.in_flight == 0
    await srv.close()


@pytest.mark.asyncio
async def test_drain_aborts_what_outlives_the_grace_period() -> None:
    """Drain waits only its grace period: a request still running then is aborted (finish_reason
    abort) and the drain returns within seconds."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    srv = build_server(parser.parse_args([*BASE_ARGS, "--step-delay-seconds", "0.02"]))
    await srv.start()
    await srv.wait_ready()
    body = {"prompt": "too long to finish", "max_tokens": 200, "ignore_eos": True}
    async with aiohttp.ClientSession(base_url=srv.url) as session:

        async def post() -> Any:
            async with session.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                return await resp.json()

        running = asyncio.create_task(post())
        await eventually_async(
            "the request in flight", lambda: srv.in_flight or None, 30, interval=0.005
        )
        started = time.monotonic()
        await srv.drain(0.2)
        assert time.monotonic() - started < 3.0
        out = await running
    assert out["choices"][0]["finish_reason"] == "abort"
    assert out["usage"]["completion_tokens"] < 200
    await srv.close()


@pytest.mark.asyncio
async def test_engine_failure_fails_requests_and_stops_the_server() -> None:
    """An exception in the engine loop fails the waiting request with a 503 naming it and stops the
    server with exit code 1, instead of hanging."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    srv = build_server(parser.parse_args(BASE_ARGS))
    await srv.start()
    await srv.wait_ready()
    assert srv.engine is not None
    assert srv.stopped is not None

    def broken_step() -> list[Any]:
        raise RuntimeError("simulated engine bug")

    srv.engine.step = broken_step  # type: ignore[method-assign]
    async with aiohttp.ClientSession(base_url=srv.url) as session:
        async with session.post("/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
            assert "simulated engine bug" in (await resp.json())["error"]["message"]
        await asyncio.wait_for(srv.stopped.wait(), 5)
        async with session.get("/health") as resp:
            assert resp.status == 503
    assert srv.exit_code == 1
    await srv.close()


@pytest.mark.asyncio
async def test_client_disconnect_aborts_the_engine_request(slow_server: BackgroundServer) -> None:
    """A client that hangs up, streaming or not, aborts its engine request: counted as abort, no
    longer running, never generated to the end."""
    url = slow_server.url
    before = metric(url, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        # Streaming: read one chunk, then hang up.
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            await resp.content.readline()
        # Not streaming: the client gives up waiting.
        with pytest.raises(TimeoutError):
            async with session.post(
                url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)
            ) as resp:
                await resp.read()

    def aborted_and_running() -> tuple[float, float]:
        return (
            metric(url, "vllm:request_success_total", finished_reason="abort"),
            metric(url, "vllm:num_requests_running"),
        )

    await eventually_async(
        "both requests aborted, none running",
        aborted_and_running,
        3.0,  # 200 tokens x 20 ms: a request generated to the end takes 4 s
        until=lambda counts: counts == (before + 2, 0),
    )
    assert metric(url, "vllm:request_success_total", finished_reason="length") == 0
