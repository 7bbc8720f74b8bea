"""The runner against scripted servers: bounds hold and errors are counted, never raised."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable

import httpx
import pytest

from fleetpilot.loadgen.runner import RunConfig, Runner, RunResult, Schedule, arrival_times
from fleetpilot.loadgen.workloads import ModelMix, make_workload
from tests.support.virtual_time import run_virtual

ROUTE = "tier=small; replica=small-0; prefix-match=0.50; reason=prefix"


def sse(*chunks: object) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def delta(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}}], "usage": None}


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 100,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 64},
    },
}


def good(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    stream = sse(delta(""), delta("a"), delta("b"), delta("c"), USAGE)
    return httpx.Response(200, content=stream, headers={"x-fleetpilot-route": ROUTE})


def config(**kw: object) -> RunConfig:
    base: dict[str, object] = {"base_url": "http://test/v1", "model": "m"}
    return RunConfig(**{**base, **kw})  # type: ignore[arg-type]


def runner(cfg: RunConfig, handler: object, clock: Callable[[], float] = time.monotonic) -> Runner:
    transport = httpx.MockTransport(handler)  # type: ignore[arg-type]
    return Runner(cfg, make_workload("shared-prefix", 0), transport=transport, clock=clock)


def run_on_virtual_time(cfg: RunConfig, handler: object) -> RunResult:
    """The run on a loop whose time only moves when every request waits on a timer, the runner
    reading that loop's clock: the slow servers' sleeps, the pacing and the timeouts all take
    exactly their virtual time, however busy the machine."""

    async def main() -> RunResult:
        return await runner(cfg, handler, asyncio.get_running_loop().time).run()

    return run_virtual(main())


@pytest.mark.asyncio
async def test_closed_loop_records_a_streamed_answer() -> None:
    """A streamed answer is recorded with TTFT from the first non-empty chunk, TPOT, usage, cached
    tokens and the route header, for exactly the requested number of requests."""
    result = await runner(config(concurrency=3, max_requests=10), good).run()
    assert [r.index for r in result.records] == list(range(10))
    r = result.records[0]
    assert r.ok
    assert r.status == 200
    assert r.chunks == 3  # the empty role chunk is not the first token
    assert r.ttft_s is not None
    assert r.tpot_s is not None
    assert r.e2e_s is not None
    assert r.ttft_s <= r.e2e_s
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (100, 3, 64)
    assert r.route.tier == "small"
    assert r.route.prefix_match == 0.5


@pytest.mark.asyncio
async def test_requests_alternate_over_the_router_replicas_urls() -> None:
    """With more base URLs (router replicas), request i goes to the (i mod n)th, as a Service
    spreads connections over its endpoints."""
    hosts: dict[int, str] = {}

    def record(request: httpx.Request) -> httpx.Response:
        index = len(hosts)
        hosts[index] = request.url.host
        return good(request)

    cfg = config(max_requests=6, more_urls=("http://second/v1", "http://third/v1/"))
    result = await runner(cfg, record).run()
    assert all(r.ok for r in result.records)
    assert [hosts[i] for i in range(6)] == ["test", "second", "third"] * 2


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (lambda req: httpx.Response(503, json={"error": "busy"}), "HTTP 503"),
        (lambda req: httpx.Response(429, text="slow down"), "HTTP 429"),
        (lambda req: httpx.Response(200, content=b"data: {not json\n\n"), "bad response"),
        (lambda req: httpx.Response(200, content=b"data: [1, 2]\n\n"), "bad response"),
        (
            lambda req: httpx.Response(200, content=sse({"error": {"message": "boom"}})),
            "stream error",
        ),
    ],
)
@pytest.mark.asyncio
async def test_errors_are_counted_by_kind(handler: object, kind: str) -> None:
    """HTTP errors, unparseable streams and in-stream errors become records of their kind with a
    detail, never exceptions that end the run."""
    result = await runner(config(concurrency=2, max_requests=4), handler).run()
    assert [r.error for r in result.records] == [kind] * 4
    assert all(r.detail for r in result.records)


@pytest.mark.asyncio
async def test_connection_errors_are_counted() -> None:
    """A refused connection is a 'connect' record per request, not a crash."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    result = await runner(config(max_requests=3), refuse).run()
    assert [r.error for r in result.records] == ["connect"] * 3


def test_slow_requests_time_out() -> None:
    """A server that never answers costs the per-request timeout, not its own pace, recorded as
    'timeout'."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(5)
        return good(request)

    result = run_on_virtual_time(config(concurrency=2, max_requests=2, timeout_s=0.2), slow)
    assert [r.error for r in result.records] == ["timeout", "timeout"]
    assert [r.end_s for r in result.records] == pytest.approx([0.2, 0.2])
    assert result.elapsed_s == pytest.approx(0.2)


def test_open_loop_stops_at_the_duration_and_drops_beyond_the_cap() -> None:
    """Open loop keeps the schedule's arrivals whatever the server does: an arrival finding
    max_in_flight requests open is recorded as dropped (and only then), none arrive past the
    duration, and the run ends when the last one sent is answered."""

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.3)
        return good(request)

    cfg = config(schedule=Schedule.constant(100.0), duration_s=0.5, max_in_flight=5, seed=1)
    result = run_on_virtual_time(cfg, slow)
    arrivals = list(arrival_times(Schedule.constant(100.0), 0.5, random.Random(1)))
    assert [r.start_s for r in result.records] == pytest.approx(arrivals)
    sent = [r for r in result.records if r.error is None]
    assert all(r.e2e_s == pytest.approx(0.3) for r in sent)
    for r in result.records:
        open_then = sum(1 for s in sent if s is not r and s.start_s < r.start_s < s.start_s + 0.3)
        assert (r.error == "dropped") == (open_then == 5), (r.index, r.error, open_then)
    assert len(sent) >= 5
    assert len(result.records) - len(sent) > 10  # 100 req/s against a 0.3 s server capped at 5
    assert result.elapsed_s == pytest.approx(max(r.start_s for r in sent) + 0.3)


def test_open_loop_honours_the_request_bound() -> None:
    """--requests bounds an open-loop run too: it ends at the first arrival past the bound (the
    eighth), not at its duration."""
    cfg = config(schedule=Schedule.constant(200.0), duration_s=10.0, max_requests=7)
    result = run_on_virtual_time(cfg, good)
    assert len(result.records) == 7
    arrivals = arrival_times(Schedule.constant(200.0), 10.0, random.Random(cfg.seed))
    eighth = next(itertools.islice(arrivals, 7, None))
    assert result.elapsed_s == pytest.approx(eighth)


def test_unbounded_runs_are_refused() -> None:
    """A run with no duration or request bound (or a schedule without a duration) is refused instead
    of running forever."""
    with pytest.raises(ValueError, match="--duration and/or"):
        RunConfig("http://x/v1", "m")
    with pytest.raises(ValueError, match="needs a --duration"):
        RunConfig("http://x/v1", "m", schedule=Schedule.constant(1.0), max_requests=5)


@pytest.mark.asyncio
async def test_a_model_mix_names_each_requests_model_by_its_index() -> None:
    """With LoRA adapters to spread over, every request asks for the mix's model of its index
    (whatever order a closed loop's workers send them in), never the default model."""
    mix = ModelMix(("sql", "legal", "tax"), 1.0, seed=3)
    asked: dict[int, str] = {}

    def record(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked[len(asked)] = body["model"]
        return good(request)

    result = await runner(config(concurrency=3, max_requests=30, model_mix=mix), record).run()
    assert all(r.ok for r in result.records)
    assert sorted(asked.values()) == sorted(mix.model(i) for i in range(30))
    assert "m" not in asked.values()
