"""The router end to end: real aiohttp engine doubles on loopback ports, the router app in
front of them, real HTTP in between."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web

from fleetpilot.api.router_config import RouterTier
from fleetpilot.routing import proxy as proxy_module
from fleetpilot.routing import relay as relay_module
from fleetpilot.routing.discovery import FileSource, MergedSource
from fleetpilot.routing.endpoints import StaticSource
from tests.routing.support import (
    HARD,
    SHORT,
    FakeEngine,
    RunningRouter,
    assert_openai_error,
    engines,
    make_config,
    post,
    route_of,
    running_router,
    tier,
    wait_for,
)

pytestmark = pytest.mark.asyncio


def waiting_seen(router: RunningRouter, engine: FakeEngine) -> float | None:
    """The queue length the router last scraped from an engine."""
    state = router.state.router.replica(engine.address)
    return state.metrics.waiting if state is not None and state.metrics is not None else None


async def test_requests_route_by_complexity() -> None:
    """A short prompt goes to the small tier, a long maths request to the large one; the model
    is rewritten to the tier's alias and every answer carries x-fleetpilot-route."""
    async with engines(FakeEngine("small"), FakeEngine("large")) as (small, large):
        config = make_config(
            [tier("small", 0.4, [small]), tier("large", 1.0, [large])], debugRouteHeader=True
        )
        async with running_router(config) as router:
            status, body, headers = await post(router, SHORT)
            assert status == 200
            assert body["served_by"] == "small"
            route = route_of(headers)
            assert route["tier"] == "small"
            assert route["replica"] == small.address
            assert route["reason"] == "complexity"
            assert small.requests[-1]["model"] == "small-model"

            status, body, headers = await post(router, HARD)
            assert (status, body["served_by"], route_of(headers)["tier"]) == (200, "large", "large")
            assert (
                router.metric(
                    "fleetpilot_router_decisions_total", tier="large", reason="complexity"
                )
                == 1
            )


async def test_header_and_model_alias_override_the_score() -> None:
    """x-fleetpilot-tier and a tier's model alias pin the tier; unknown ones are 4xx."""
    async with engines(FakeEngine("small"), FakeEngine("large")) as (small, large):
        config = make_config([tier("small", 0.4, [small]), tier("large", 1.0, [large])])
        async with running_router(config) as router:
            status, body, headers = await post(
                router, SHORT, headers={"x-fleetpilot-tier": "large"}
            )
            assert (status, body["served_by"], route_of(headers)["reason"]) == (
                200,
                "large",
                "header",
            )
            status, body, headers = await post(router, {**HARD, "model": "small-model"})
            assert (status, body["served_by"], route_of(headers)["reason"]) == (
                200,
                "small",
                "model",
            )
            status, body, headers = await post(router, {**SHORT, "model": "gpt-4"})
            assert_openai_error(status, body, 404)
            assert headers["x-fleetpilot-error"] == "model_not_found"
            status, body, _ = await post(router, SHORT, headers={"x-fleetpilot-tier": "huge"})
            assert_openai_error(status, body, 400)
            assert body["error"]["param"] == "x-fleetpilot-tier"


async def test_spillover_when_the_small_tier_queue_is_long_and_back() -> None:
    """The small tier's engine reports a waiting queue above the threshold in /metrics: its
    requests spill to the large tier (counted); once the queue drains they come back."""
    async with engines(FakeEngine("small"), FakeEngine("large")) as (small, large):
        config = make_config([tier("small", 0.4, [small]), tier("large", 1.0, [large])])
        async with running_router(config) as router:
            status, body, _ = await post(router, SHORT)
            assert body["served_by"] == "small"
            small.waiting = 10  # threshold is 4 per replica
            await wait_for(lambda: waiting_seen(router, small) == 10)
            status, body, headers = await post(router, SHORT)
            assert (status, body["served_by"]) == (200, "large")
            route = route_of(headers)
            assert (route["reason"], route["spilled-from"]) == ("spillover", "small")
            assert (
                router.metric(
                    "fleetpilot_router_spillovers_total", from_tier="small", to_tier="large"
                )
                == 1
            )
            small.waiting = 0
            await wait_for(lambda: waiting_seen(router, small) == 0)
            status, body, _ = await post(router, SHORT)
            assert body["served_by"] == "small"


async def test_repeated_prefixes_go_to_the_same_replica() -> None:
    """Prefix affinity: each conversation's follow-ups land where its prefix was sent, and
    distinct prefixes spread over the replicas."""
    fleet = [FakeEngine(f"e{i}") for i in range(4)]
    async with engines(*fleet) as started:
        config = make_config([tier("only", 1.0, started)])
        async with running_router(config) as router:
            first: dict[int, str] = {}
            for conversation in range(6):
                system = f"You are assistant number {conversation}. " * 20
                messages = [{"role": "system", "content": system}]
                for turn in range(3):
                    messages.append({"role": "user", "content": f"question {turn}"})
                    status, body, headers = await post(
                        router, {"model": "chat", "messages": messages}, "/v1/chat/completions"
                    )
                    assert status == 200
                    route = route_of(headers)
                    if turn == 0:
                        first[conversation] = body["served_by"]
                    else:
                        assert body["served_by"] == first[conversation]
                        assert float(route["prefix-match"]) >= 0.8
                    messages.append({"role": "assistant", "content": "ok"})
            assert len(set(first.values())) >= 3


async def test_streaming_is_passed_through_chunk_by_chunk() -> None:
    """The client reads the first SSE chunk while the engine is still holding the rest: the
    router does not buffer the stream."""
    engine = FakeEngine("s", gate=asyncio.Event())
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            started = time.monotonic()
            async with session.post(
                router.url + "/v1/completions", json={**SHORT, "stream": True}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                assert route_of(resp.headers)["tier"] == "only"
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                assert b"s-0" in first
                assert engine.last_chunk_sent_at == 0.0  # the engine has not sent the last yet
                assert engine.gate is not None
                engine.gate.set()
                rest = await resp.read()
            assert rest.endswith(b"data: [DONE]\n\n")
            assert rest.count(b"data: ") == 5  # chunks 1-4 and [DONE]
            assert engine.last_chunk_sent_at > started
            assert (
                router.metric("fleetpilot_router_time_to_first_token_seconds_count", tier="only")
                == 1
            )


async def test_official_openai_client_streams_through_the_router() -> None:
    """The openai package, pointed at the router, streams chat and completions and lists
    the models."""
    engine = FakeEngine("oa", chunks=4)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key="sk-test", max_retries=0
            ) as client:
                stream = await client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}], stream=True
                )
                parts = [c.choices[0].delta.content async for c in stream if c.choices]
                assert parts == [f"oa-{i} " for i in range(4)]
                completion = await client.completions.create(model="only-model", prompt="hi")
                assert completion.choices[0].text == "from oa"
                models = await client.models.list()
                assert [m.id for m in models.data] == ["chat", "only-model"]
            assert engine.headers[0]["authorization"] == "Bearer sk-test"


async def test_killed_replica_is_retried_around_ejected_and_probed_back() -> None:
    """Kill one of two replicas mid-test: no request fails (connect errors are retried on the
    other replica), the dead one is ejected, and after it restarts on the same port its
    /health probe readmits it and traffic returns."""
    a, b = FakeEngine("a"), FakeEngine("b")
    async with engines(a, b):
        config = make_config([tier("only", 1.0, [a, b])])
        async with running_router(config) as router:
            for _ in range(4):
                assert (await post(router, SHORT))[0] == 200
            port = b.port
            await b.stop()
            results = [await post(router, SHORT) for _ in range(12)]
            assert all(status == 200 for status, _, _ in results)
            assert {body["served_by"] for _, body, _ in results} == {"a"}
            state = router.state.router
            # Requests and the /metrics scrapes both count the refused connections.
            await wait_for(lambda: state.health.is_ejected(b.address))
            assert (
                router.metric(
                    "fleetpilot_router_upstream_errors_total",
                    tier="only",
                    replica=b.address,
                    cause="connect",
                )
                >= 1
            )
            await b.start(port)
            await wait_for(lambda: not state.health.is_ejected(b.address))
            assert router.metric("fleetpilot_router_readmissions_total", replica=b.address) == 1
            served = {(await post(router, SHORT))[1]["served_by"] for _ in range(12)}
            assert served == {"a", "b"}


async def test_single_replica_restarted_on_the_same_address_keeps_serving() -> None:
    """A tier's only replica restarts (same pod IP): requests after the restart succeed, even
    though the router's pooled keep-alive connections went with the old process."""
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            assert (await post(router, SHORT))[0] == 200
            port = engine.port
            await engine.stop()
            await engine.start(port)
            assert [(await post(router, SHORT))[0] for _ in range(3)] == [200] * 3


async def test_ejection_metric_counts_request_path_ejections() -> None:
    """Repeated 5xx from one replica eject it (and are retried on the other); its /health
    still passes, so the prober readmits it and it is ejected again."""
    a, b = FakeEngine("a", fail_next=100), FakeEngine("b")
    async with engines(a, b):
        config = make_config([tier("only", 1.0, [a, b])])
        async with running_router(config) as router:
            results = [await post(router, SHORT) for _ in range(40)]
            assert all(r[0] == 200 and r[1]["served_by"] == "b" for r in results)
            assert (
                router.metric("fleetpilot_router_ejections_total", tier="only", replica=a.address)
                >= 1
            )
            assert router.metric("fleetpilot_router_retries_total", tier="only") >= 1
            # Regression: a retried attempt once left its count on the first replica.
            assert [r.in_flight for r in router.state.router.replicas()] == [0, 0]


async def test_upstream_errors_pass_through_with_their_status() -> None:
    """A 4xx from the engine is the client's answer, unretried; a 5xx with no replica left to
    retry on is passed through too."""
    a = FakeEngine("a", fail_next=1, fail_status=400)
    async with engines(a):
        config = make_config([tier("only", 1.0, [a])], retries=0)
        async with running_router(config) as router:
            status, body, headers = await post(router, SHORT)
            assert (status, body["error"]["message"]) == (400, "a failed")
            assert "x-fleetpilot-route" in headers
            a.fail_next, a.fail_status = 1, 503
            status, body, _ = await post(router, SHORT)
            assert (status, body["error"]["message"]) == (503, "a failed")


async def test_429_with_retry_after_when_every_eligible_replica_is_full() -> None:
    """Two tiers of one replica each, max_num_seqs 1 and one waiting slot: four held requests
    fill everything; the fifth gets 429 with Retry-After; when they finish, service resumes."""
    gate = asyncio.Event()
    small, large = FakeEngine("small", gate=gate), FakeEngine("large", gate=gate)
    async with engines(small, large):
        config = make_config(
            [
                tier("small", 0.4, [small], max_num_seqs=1),
                tier("large", 1.0, [large], max_num_seqs=1),
            ],
            backpressure={"maxWaitingPerReplica": 1, "retryAfter": "2s"},
        )
        async with running_router(config) as router:
            held = [asyncio.create_task(post(router, SHORT)) for _ in range(4)]
            await wait_for(lambda: len(small.requests) + len(large.requests) == 4)
            assert (len(small.requests), len(large.requests)) == (2, 2)
            async with (
                aiohttp.ClientSession() as session,
                session.post(router.url + "/v1/completions", json=SHORT) as resp,
            ):
                body = await resp.json()
                assert_openai_error(resp.status, body, 429)
                assert resp.headers["Retry-After"] == "2"
            gate.set()
            assert [r[0] for r in await asyncio.gather(*held)] == [200] * 4
            assert (await post(router, SHORT))[0] == 200
            assert (
                router.metric(
                    "fleetpilot_router_rejected_requests_total", status="429", code="overloaded"
                )
                == 1
            )


async def test_429_at_the_router_in_flight_limit() -> None:
    """Past backpressure.maxInFlight requests held at once, the router answers 429 itself."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        # One client sends them all: no per-client cap (it would be maxInFlight / 4).
        config = make_config(
            [tier("only", 1.0, [engine])],
            backpressure={"maxInFlight": 2, "maxUnfinishedPerClient": 0},
        )
        async with running_router(config) as router:
            held = [asyncio.create_task(post(router, SHORT)) for _ in range(2)]
            await wait_for(lambda: len(engine.requests) == 2)
            status, body, headers = await post(router, SHORT)
            assert_openai_error(status, body, 429)
            assert headers["Retry-After"] == "1"
            gate.set()
            assert [r[0] for r in await asyncio.gather(*held)] == [200, 200]


async def test_unreachable_tier_is_502_naming_the_route() -> None:
    """Every replica refuses connections and retries run out: 502, OpenAI-shaped, with the
    route header naming the last replica tried."""
    dead = FakeEngine("dead")
    async with engines(dead):
        config = make_config([tier("only", 1.0, [dead])], debugRouteHeader=True)
        await dead.stop()
        async with running_router(config) as router:
            status, body, headers = await post(router, SHORT)
            assert_openai_error(status, body, 502)
            assert headers["x-fleetpilot-error"] == "upstream_unreachable"
            assert route_of(headers)["replica"] == dead.address


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    """A client that goes away mid-stream, or while waiting for a non-streamed answer, takes
    its upstream request with it: the engine sees the cancellation."""
    gate = asyncio.Event()
    engine = FakeEngine("d", gate=gate)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            async with aiohttp.ClientSession() as session:
                resp = await session.post(
                    router.url + "/v1/completions", json={**SHORT, "stream": True}
                )
                await resp.content.readuntil(b"\n\n")
                resp.close()  # drop the connection mid-stream
            await wait_for(lambda: engine.cancelled == 1)
            async with aiohttp.ClientSession() as session:
                with pytest.raises(TimeoutError):
                    await session.post(
                        router.url + "/v1/completions",
                        json=SHORT,
                        timeout=aiohttp.ClientTimeout(total=0.3),
                    )
            await wait_for(lambda: engine.cancelled == 2)
            await wait_for(lambda: router.state.router.replicas()[0].in_flight == 0)
            assert engine.completed == 0


async def test_request_timeout_is_504_and_a_hung_replica_is_ejected() -> None:
    """A replica that accepts connections but never answers: its requests end with 504 at the
    request timeout - or, since issue 41, move to the healthy replica once it is suspect (a
    request waited a tenth of the first-byte budget there and its scrape went unanswered) -
    it is ejected after repeated timeouts, and requests to the healthy replica stay fast
    throughout."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    hung_address = f"127.0.0.1:{hung.getsockname()[1]}"
    healthy = FakeEngine("ok")
    try:
        async with engines(healthy):
            config = make_config(
                [tier("only", 1.0, [healthy])],
                requestTimeout="1s",
                ejection={"failures": 2},
            )
            data = config.to_wire()
            data["tiers"][0]["endpoints"][0]["addresses"].append(hung_address)
            config = type(config).model_validate(data)
            async with running_router(config) as router:
                statuses = []
                fast = []
                for _ in range(10):
                    started = time.monotonic()
                    status, _, _ = await post(router, SHORT)
                    statuses.append(status)
                    if status == 200:
                        fast.append(time.monotonic() - started)
                moved = router.metric(
                    "fleetpilot_router_upstream_errors_total",
                    tier="only",
                    replica=hung_address,
                    cause="suspect",
                )
                assert set(statuses) <= {200, 504}
                assert 1 <= statuses.count(504) + moved <= 2
                state = router.state.router
                await wait_for(lambda: state.health.is_ejected(hung_address), timeout_s=10.0)
                # Healthy answers take milliseconds, never the hung replica's second (those
                # moved from it waited there first).
                assert max(sorted(fast)[: len(fast) - int(moved)]) < 0.5
    finally:
        hung.close()


BAD_INPUTS: list[tuple[str, bytes, int, str]] = [
    ("/v1/completions", b"{not json", 400, "invalid_json"),
    ("/v1/completions", b"", 400, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_type"),
    ("/v1/completions", b'"text"', 400, "invalid_type"),
    ("/v1/completions", b'{"model": "chat"}', 400, "missing_required_parameter"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "lots"}', 400, "invalid_type"),
    ("/v1/completions", b"\xff\xfe\x00garbage", 400, "invalid_json"),
    ("/v1/completions", b"[" * 3000 + b"]" * 3000, 400, "invalid_json"),
    ("/v1/completions", b'{"prompt": "x", "model": "nope"}', 404, "model_not_found"),
    ("/v1/completions", b'{"prompt": "' + b"x" * 9000 + b'"}', 413, "request_too_large"),
    # Over PARSE_OFF_LOOP_BYTES: parsed in a worker thread, refused alike.
    ("/v1/completions", b"{not json" + b" " * 5000, 400, "invalid_json"),
    ("/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'", "max_tokens": "lots"}', 400,
     "invalid_type"),
    ("/v1/chat/completions", b'{"messages": "' + b"x" * 5000 + b'"}', 400, "invalid_value"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "data", "status", "code"), BAD_INPUTS)
async def test_bad_input_is_an_openai_shaped_4xx(
    path: str, data: bytes, status: int, code: str
) -> None:
    """Invalid JSON, wrong types, missing fields, unknown model, oversize body: 4xx with an
    OpenAI error body, never a 500, and the engine never sees them."""
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])], maxBodyBytes=8192)
        async with running_router(config) as router:
            got, body, headers = await post(router, data, path)
            assert_openai_error(got, body, status)
            assert headers["x-fleetpilot-error"] == code
            assert engine.requests == []


async def test_a_long_body_is_parsed_off_the_loop_and_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body over PARSE_OFF_LOOP_BYTES is parsed and its features read in a worker thread (the
    marker regexes cost milliseconds on a long prompt), a short one on the loop; both are
    routed and answered alike."""
    threads: list[str] = []
    extract = proxy_module.extract_features

    def recording(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return extract(*args)

    monkeypatch.setattr(proxy_module, "extract_features", recording)
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            long = "why does the build fail? " * 400
            for content in ("hi", long):
                body = {"model": "chat", "messages": [{"role": "user", "content": content}]}
                assert (await post(router, body, "/v1/chat/completions"))[0] == 200
    assert threads[0] == "MainThread"
    assert threads[1].startswith("fleetpilot-tokenize")
    assert len(engine.requests) == 2


async def test_fuzzed_bodies_never_get_a_5xx() -> None:
    """Random mutations of valid requests: always a 2xx or a 4xx, and the router lives on."""
    engine = FakeEngine("e")
    rng = random.Random(5)
    valid = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            for _ in range(60):
                chars = list(valid)
                for _ in range(rng.randint(1, 4)):
                    i = rng.randrange(len(chars))
                    chars[i] = rng.choice(['"', "{", "]", "1", "x", ",", ":", "\\", "null"])
                status, _, _ = await post(router, "".join(chars).encode(), "/v1/chat/completions")
                assert status < 500
            assert (await post(router, json.loads(valid), "/v1/chat/completions"))[0] == 200


async def test_unknown_paths_and_methods_are_openai_errors() -> None:
    """404 and 405 from the web framework come back OpenAI-shaped too."""
    config = make_config([tier("only", 1.0, [])])
    async with running_router(config) as router, aiohttp.ClientSession() as session:
        async with session.get(router.url + "/v1/completions") as resp:
            assert_openai_error(resp.status, await resp.json(), 405)
        async with session.post(router.url + "/v1/embeddings", json={}) as resp:
            assert_openai_error(resp.status, await resp.json(), 404)


async def test_no_ready_replica_is_503() -> None:
    """A tier with no endpoints at all answers 503, OpenAI-shaped."""
    async with running_router(make_config([tier("only", 1.0, [])])) as router:
        status, body, headers = await post(router, SHORT)
        assert_openai_error(status, body, 503)
        assert headers["x-fleetpilot-error"] == "no_ready_replicas"


async def test_health_models_and_metrics() -> None:
    """/health answers, /v1/models lists the service name and tier aliases, /metrics exposes
    the router's series."""
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("small", 0.4, [engine]), tier("large", 1.0, [engine])])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            async with session.get(router.url + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["endpoints"] == 1  # same address in both: once
            async with session.get(router.url + "/v1/models") as resp:
                ids = [m["id"] for m in (await resp.json())["data"]]
                assert ids == ["chat", "small-model", "large-model"]
            await post(router, SHORT)
            async with session.get(router.url + "/metrics") as resp:
                text = await resp.text()
            for series in (
                "fleetpilot_router_requests_total",
                "fleetpilot_router_decision_seconds_bucket",
                "fleetpilot_router_e2e_request_latency_seconds_bucket",
                "fleetpilot_router_predicted_prefix_match_ratio_bucket",
                'fleetpilot_router_endpoints{role="unified",state="active",tier="small"} 1.0',
            ):
                assert series in text


async def test_an_adapter_is_asked_for_by_name_and_listed_with_its_parent() -> None:
    """A request naming a LoRA adapter of the large tier goes to that tier's engine with the
    adapter still named in `model` (the engine applies it), whatever the prompt's score, and
    says so in x-fleetpilot-route; /v1/models lists the adapter as vLLM does, its parent the
    base model it adapts."""
    small, large = FakeEngine("small"), FakeEngine("large")
    async with engines(small, large):
        adapted = tier("large", 1.0, [large]).model_copy(update={"adapters": ["sql"]})
        config = make_config([tier("small", 0.4, [small]), adapted])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            status, _, headers = await post(router, {**SHORT, "model": "sql"})
            assert status == 200
            assert large.requests[-1]["model"] == "sql"
            assert small.requests == []
            assert "tier=large; adapter=sql;" in headers["x-fleetpilot-route"]
            async with session.get(router.url + "/v1/models") as resp:
                listed = {m["id"]: m["parent"] for m in (await resp.json())["data"]}
            assert listed == {
                "chat": None, "small-model": None, "large-model": None, "sql": "large-model"
            }  # fmt: skip


async def test_router_only_calls_discovered_addresses() -> None:
    """No request content becomes an address: a model that looks like a URL is an unknown
    model, a Host header changes nothing, and client kv_transfer_params (which would make an
    engine pull KV from a host of the client's choosing) are dropped."""
    engine, canary = FakeEngine("e"), FakeEngine("canary")
    async with engines(engine, canary):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router:
            status, _, _ = await post(router, {**SHORT, "model": f"http://{canary.address}/v1"})
            assert status == 404
            status, _, _ = await post(
                router,
                {**SHORT, "kv_transfer_params": {"remote_host": "127.0.0.1",
                                                  "remote_port": canary.port}},
                headers={"Host": canary.address},
            )  # fmt: skip
            assert status == 200
            assert "kv_transfer_params" not in engine.requests[-1]
            assert canary.requests == []


async def test_config_file_changes_are_picked_up(tmp_path: Path) -> None:
    """The router re-reads its config file: moving the tier to another engine moves the
    traffic; an invalid edit is refused and the last good config keeps serving."""
    a, b = FakeEngine("a"), FakeEngine("b")
    async with engines(a, b):
        path = tmp_path / "router.yaml"
        config = make_config([tier("only", 1.0, [a])])
        path.write_text(yaml.safe_dump(config.to_wire()))
        async with running_router(config, config_path=path, reload_interval_s=0.05) as router:
            assert (await post(router, SHORT))[1]["served_by"] == "a"
            moved = make_config([tier("only", 1.0, [b])])
            path.write_text(yaml.safe_dump(moved.to_wire()))
            await wait_for(
                lambda: (
                    router.metric("fleetpilot_router_config_reloads_total", result="applied") == 1
                )
            )
            assert (await post(router, SHORT))[1]["served_by"] == "b"
            path.write_text("tiers: not-a-list\n")
            await wait_for(
                lambda: (
                    router.metric("fleetpilot_router_config_reloads_total", result="invalid") == 1
                )
            )
            assert (await post(router, SHORT))[1]["served_by"] == "b"


async def test_an_adapter_added_to_the_config_file_is_routed_without_a_restart(
    tmp_path: Path,
) -> None:
    """A lora.dynamic tier's adapter list changes in the router's ConfigMap: the router, which
    answered 404 for the new name, routes it once it re-reads the file, and lists it."""
    engine = FakeEngine("e")
    async with engines(engine):
        path = tmp_path / "router.yaml"
        before = tier("only", 1.0, [engine]).model_copy(update={"adapters": ["sql"]})
        config = make_config([before])
        path.write_text(yaml.safe_dump(config.to_wire()))
        async with running_router(config, config_path=path, reload_interval_s=0.05) as router:
            status, _, _ = await post(router, {**SHORT, "model": "essay"})
            assert status == 404
            after = before.model_copy(update={"adapters": ["sql", "essay"]})
            path.write_text(yaml.safe_dump(make_config([after]).to_wire()))
            await wait_for(
                lambda: (
                    router.metric("fleetpilot_router_config_reloads_total", result="applied") == 1
                )
            )
            status, _, _ = await post(router, {**SHORT, "model": "essay"})
            assert status == 200
            assert engine.requests[-1]["model"] == "essay"


async def test_endpoints_file_source_follows_the_local_runtime(tmp_path: Path) -> None:
    """The local runtime's endpoints file: engines listed there are routed to, and rewriting
    the file moves the traffic."""
    a, b = FakeEngine("a"), FakeEngine("b")
    async with engines(a, b):
        path = tmp_path / "endpoints.yaml"
        path.write_text(
            yaml.safe_dump(
                {"endpoints": [{"tier": "only", "role": "unified", "address": a.address}]}
            )
        )
        config = make_config([tier("only", 1.0, [])])
        source = MergedSource([StaticSource(config), FileSource(path, interval_s=0.05)])
        async with running_router(config, source) as router:
            assert (await post(router, SHORT))[1]["served_by"] == "a"
            path.write_text(yaml.safe_dump({"endpoints": [{"tier": "only", "address": b.address}]}))
            await wait_for(lambda: [r.id for r in router.state.router.replicas()] == [b.address])
            assert (await post(router, SHORT))[1]["served_by"] == "b"


async def test_a_request_for_a_tier_at_zero_is_held_until_a_replica_appears(
    tmp_path: Path,
) -> None:
    """With a cold-start wait, a request finding no replica at all is held and counted as
    pending for its tier's roles (what the autoscaler scales from zero on); the replica that
    appears serves it, and the gauge goes back to zero."""
    engine = FakeEngine("late")
    async with engines(engine):
        path = tmp_path / "router.yaml"
        config = make_config([tier("only", 1.0, [])], coldStartWait="20s")
        path.write_text(yaml.safe_dump(config.to_wire()))
        async with running_router(config, config_path=path, reload_interval_s=0.05) as router:
            held = asyncio.create_task(post(router, SHORT))
            await wait_for(
                lambda: (
                    router.metric("fleetpilot_router_pending_requests", tier="only", role="unified")
                    == 1
                )
            )
            assert not held.done()
            path.write_text(yaml.safe_dump(make_config([tier("only", 1.0, [engine])]).to_wire()))
            status, body, _ = await asyncio.wait_for(held, 10)
            assert status == 200
            assert body["served_by"] == "late"
            pending = router.metric(
                "fleetpilot_router_pending_requests", tier="only", role="unified"
            )
            assert pending == 0


async def test_a_held_request_is_refused_when_the_cold_start_wait_ends() -> None:
    """A request held for a tier at zero is refused with a 503 naming the tier and the
    cold-start wait when no replica appears in time, and no longer counts as pending; with no
    cold start observed there is no estimate, and Retry-After is the least delay."""
    config = make_config([tier("only", 1.0, [])], coldStartWait="300ms")
    async with running_router(config) as router:
        status, body, headers = await post(router, SHORT)
        assert_openai_error(status, body, 503)
        message = body["error"]["message"]
        assert "no replica of tier only became ready within the cold-start wait (0.3s" in message
        assert "no cold start observed yet" in message
        assert headers["Retry-After"] == "1"
        assert headers["x-fleetpilot-error"] == "no_ready_replicas"
        assert router.metric("fleetpilot_router_pending_requests", tier="only", role="unified") == 0


def observed(name: str, seconds: float) -> RouterTier:
    """A tier at zero replicas whose cold start the operator observed as ``seconds``."""
    return tier(name, 1.0, []).model_copy(
        update={"cold_start_observed": timedelta(seconds=seconds)}
    )


async def test_the_hold_for_a_tier_at_zero_lasts_its_observed_cold_start_and_a_margin() -> None:
    """Issue 19 item 4: a tier that starts in 0.2 s is held 0.2 x 1.5 + 0.1 = 0.4 s, not the
    20 s cold-start wait (the bound); the 503 then names the observed start, and Retry-After
    is 1 s: the request has already waited longer than a start takes."""
    config = make_config(
        [observed("only", 0.2)], coldStartWait="20s", coldStartFactor=1.5, coldStartMargin="100ms"
    )
    async with running_router(config) as router:
        started = time.monotonic()
        status, body, headers = await post(router, SHORT)
        waited = time.monotonic() - started
        assert_openai_error(status, body, 503)
        assert 0.4 <= waited < 5.0, waited
        message = body["error"]["message"]
        assert "tier only" in message
        assert "within the cold-start wait (0.4s; observed cold start 0.2s)" in message
        assert headers["Retry-After"] == "1"
        assert router.metric("fleetpilot_router_pending_requests", tier="only", role="unified") == 0


async def test_a_hold_cut_short_by_its_bound_tells_the_client_when_the_start_is_due() -> None:
    """A tier whose observed cold start (3 s) is longer than the cold-start wait (0.3 s) is
    held for the wait, then answered 503 with Retry-After: the 2.7 s of the start still to
    come, rounded up - so clients come back about when the replica is expected."""
    config = make_config([observed("only", 3)], coldStartWait="300ms")
    async with running_router(config) as router:
        started = time.monotonic()
        status, body, headers = await post(router, SHORT)
        waited = time.monotonic() - started
        assert_openai_error(status, body, 503)
        assert 0.3 <= waited < 3.0, waited
        assert headers["Retry-After"] == "3"
        assert "observed cold start 3s" in body["error"]["message"]


async def test_a_hold_the_request_timeout_ends_is_a_503_with_retry_after_not_a_504() -> None:
    """The request timeout bounds a hold too (its default bound is that timeout): a held
    request it ends is answered as the hold running out - 503 with Retry-After from the
    observed start (3 s, 0.5 s of it waited) - not as an upstream timeout."""
    config = make_config([observed("only", 3)], coldStartWait="20s", requestTimeout="500ms")
    async with running_router(config) as router:
        status, body, headers = await post(router, SHORT)
        assert_openai_error(status, body, 503)
        assert headers["Retry-After"] == "3"
        assert "tier only" in body["error"]["message"]
        assert router.metric("fleetpilot_router_pending_requests", tier="only", role="unified") == 0
        assert (
            router.metric(
                "fleetpilot_router_rejected_requests_total", status="503", code="no_ready_replicas"
            )
            == 1
        )


async def test_the_openai_client_waits_out_retry_after_and_is_served_by_the_started_replica(
    tmp_path: Path,
) -> None:
    """The official client honours the 503's Retry-After (2 s: a 2 s start, 0.3 s of it
    waited) instead of its own half-second backoff, and its retry reaches the replica that
    appeared in the meantime."""
    engine = FakeEngine("late")
    async with engines(engine):
        path = tmp_path / "router.yaml"
        config = make_config([observed("only", 2)], coldStartWait="300ms")
        path.write_text(yaml.safe_dump(config.to_wire()))
        async with running_router(config, config_path=path, reload_interval_s=0.05) as router:
            async with openai.AsyncOpenAI(
                base_url=router.url + "/v1", api_key="sk-test", max_retries=1
            ) as client:
                started = time.monotonic()
                call = asyncio.create_task(client.completions.create(model="chat", prompt="hi"))
                await wait_for(
                    lambda: (
                        router.metric(
                            "fleetpilot_router_rejected_requests_total",
                            status="503",
                            code="no_ready_replicas",
                        )
                        == 1
                    )
                )
                ready = make_config([tier("only", 1.0, [engine])], coldStartWait="300ms")
                path.write_text(yaml.safe_dump(ready.to_wire()))
                completion = await asyncio.wait_for(call, 10)
                waited = time.monotonic() - started
            assert completion.choices[0].text == "from late"
            assert waited >= 0.3 + 2.0 - 0.1, waited
            assert len(engine.requests) == 1


async def test_the_route_header_names_no_replica_address_by_default() -> None:
    """Issue 12 item 12: x-fleetpilot-route tells a client its tier, reason and prefix match,
    never the fleet's internal pod addresses - unless the router runs with the debug flag."""
    engine = FakeEngine("e")
    async with engines(engine):
        async with running_router(make_config([tier("only", 1.0, [engine])])) as router:
            status, _, headers = await post(router, SHORT)
            assert status == 200
            assert set(route_of(headers)) == {
                "tier",
                "prefix-match",
                "prefix-source",
                "reason",
                "score",
            }
            assert engine.address not in headers["x-fleetpilot-route"]
            assert str(engine.port) not in headers["x-fleetpilot-route"]
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config, debug_route_header=True) as router:
            _, _, headers = await post(router, SHORT)
            assert route_of(headers)["replica"] == engine.address


async def test_a_client_that_drops_a_non_streamed_request_is_counted_as_499() -> None:
    """Issue 12 item 9: a client that leaves while its non-streamed answer is being generated
    is counted in fleetpilot_router_requests_total with status 499, as proxies do."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            with pytest.raises(TimeoutError):
                await session.post(
                    router.url + "/v1/completions",
                    json=SHORT,
                    timeout=aiohttp.ClientTimeout(total=0.3),
                )
            await wait_for(lambda: engine.cancelled == 1)
            labels = {"tier": "only", "replica": engine.address, "status": "499"}
            await wait_for(lambda: router.metric("fleetpilot_router_requests_total", **labels) == 1)


async def test_engine_errors_are_relayed_in_vllms_shape() -> None:
    """Issue 12 item 10: an engine error in another shape (no code, no param, a non-vLLM type)
    reaches the client in vLLM's shape with its message and status; an engine that breaks
    mid-stream ends the stream with an error event of the same shape."""
    a = FakeEngine("a", fail_next=1, fail_status=400)
    async with engines(a):
        config = make_config([tier("only", 1.0, [a])], retries=0)
        async with running_router(config) as router:
            status, body, headers = await post(router, SHORT)
            assert_openai_error(status, body, 400)
            assert body["error"]["message"] == "a failed"
            assert "x-fleetpilot-error" not in headers  # the engine's error, not the router's


async def test_a_stream_cut_mid_way_ends_with_a_vllm_shaped_error_event() -> None:
    """The replica stalls after the first chunk until the request timeout: the client gets a
    final error event shaped as vLLM's (integer code, vLLM type name)."""
    gate = asyncio.Event()
    engine = FakeEngine("e", gate=gate)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])], requestTimeout="1s")
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            try:
                async with session.post(
                    router.url + "/v1/completions", json={**SHORT, "stream": True}
                ) as resp:
                    rest = (await resp.read()).decode()
            finally:
                gate.set()
            events = [e for e in rest.split("\n\n") if e.startswith("data: {")]
            error = json.loads(events[-1][len("data: ") :])
            assert error == {
                "error": {
                    "message": "request timeout exceeded",
                    "type": "GatewayTimeoutError",
                    "param": None,
                    "code": 504,
                }
            }


class _ClientLeftAfterDone(web.StreamResponse):
    """The race of issue 12 item 9, made certain: the client read ``[DONE]`` and closed its
    socket just before the router ended the chunked body."""

    async def write_eof(self, data: bytes = b"") -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")


async def test_a_client_that_leaves_right_after_done_is_no_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12 item 9: write_eof failing because the client left after ``[DONE]`` logged
    "unexpected error"; the client had the whole answer, so it is a 200 and no error."""
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            # Only the router's responses: the engine double's own stay real.
            monkeypatch.setattr(
                relay_module,
                "web",
                SimpleNamespace(**{**vars(web), "StreamResponse": _ClientLeftAfterDone}),
            )
            caplog.set_level(logging.INFO)
            body = b""
            with contextlib.suppress(aiohttp.ClientPayloadError):
                async with session.post(
                    router.url + "/v1/completions", json={**SHORT, "stream": True}
                ) as resp:
                    assert resp.status == 200
                    async for chunk in resp.content.iter_any():
                        body += chunk
            assert b"data: [DONE]" in body
            labels = {"tier": "only", "replica": engine.address, "status": "200"}
            await wait_for(lambda: router.metric("fleetpilot_router_requests_total", **labels) == 1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


async def test_pending_prefill_counts_a_request_until_its_first_chunk() -> None:
    """The prefill-cost scorer's queue: a streamed request's prompt blocks are pending on its
    replica from the moment it is sent until the first chunk comes back, and nothing stays
    pending afterwards - streamed, non-streamed or failed, a leak would slowly push every
    request away from its cache."""
    engine = FakeEngine("p", delay_s=0.5)
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])])
        async with running_router(config) as router, aiohttp.ClientSession() as session:
            replica = router.state.router.replicas()[0]
            prompt = {"model": "chat", "prompt": "tell me about prefill " * 40, "stream": True}
            request = asyncio.ensure_future(
                session.post(router.url + "/v1/completions", json=prompt)
            )
            await wait_for(lambda: replica.pending_prefill > 0, timeout_s=5.0)
            resp = await request
            await resp.read()
            assert replica.pending_prefill == 0
            status, _, _ = await post(router, {**prompt, "stream": False})
            assert status == 200
            engine.fail_next = 1
            status, _, _ = await post(router, {**prompt, "stream": False})
            assert status == 500
            assert replica.pending_prefill == 0
