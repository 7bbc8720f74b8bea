"""The hardened listener the router and the engine share, probed with raw sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import resource
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from fleetpilot.httpserver import (
    MIN_CONNECTIONS,
    RESERVED_FDS,
    ServerLimits,
    Throttle,
    body_verdict,
    connection_budget,
    make_runner,
    open_connections,
    start_site,
)
from fleetpilot.testing.polling import eventually_async
from tests.routing.support import make_config, router_process, stop_and_read_log, tier

# Generous bounds: the machine running the suite may be busy.
WAIT_S = 60.0


def test_throttle_lets_one_event_through_per_interval_and_counts_the_rest() -> None:
    """A burst of one kind of warning logs once per interval, and the next line logged says how many
    were held back."""
    throttle = Throttle(10.0)
    assert throttle.admit(100.0) == 0
    assert throttle.admit(101.0) is None
    assert throttle.admit(109.9) is None
    assert throttle.admit(110.0) == 2
    assert throttle.admit(125.0) == 0


def test_limits_refuse_nonsense() -> None:
    """Limits that would refuse every client (no connections, a zero timeout) are refused when the
    limits are made."""
    with pytest.raises(ValueError, match="max_connections"):
        ServerLimits(max_connections=0)
    with pytest.raises(ValueError, match="positive"):
        ServerLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="positive"):
        ServerLimits(min_body_rate=0)


BODY_LIMITS = ServerLimits(body_timeout_s=20.0, min_body_rate=500.0, body_idle_timeout_s=10.0)


@pytest.mark.parametrize(
    ("elapsed_s", "received", "idle_s", "cut", "recheck_s"),
    [
        (0.0, 0, 0.0, None, 10.0),  # just started: the idle limit is nearest
        (19.0, 5, 3.0, None, 1.0),  # a trickler, within the first 20 s
        (20.0, 5, 3.0, "under 500 bytes/s", 0.0),  # ... and at 20 s
        (60.0, 40_000, 1.0, None, 9.0),  # a slow link above the rate: 80 s allowed
        (80.0, 40_000, 1.0, "under 500 bytes/s", 0.0),
        (5.0, 4_000_000, 10.0, "no byte of it for 10.0s", 0.0),  # sent a lot, then stopped
    ],
)
def test_body_rule(
    elapsed_s: float, received: int, idle_s: float, cut: str | None, recheck_s: float
) -> None:
    """The body rule cuts a body trickling under the minimum rate once the grace time is over,
    and a body that stops, but never a body arriving at the minimum rate or faster; its recheck
    time is when it could next cut, so a trickler costs one timer, not one per byte."""
    verdict = body_verdict(elapsed_s, received, idle_s, BODY_LIMITS)
    if cut is None:
        assert verdict.cut is None
    else:
        assert verdict.cut is not None
        assert cut in verdict.cut
    assert verdict.recheck_s == pytest.approx(recheck_s)


Serve = Callable[[ServerLimits], Awaitable[tuple[web.Application, int]]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(limits: ServerLimits) -> tuple[web.Application, int]:
        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        async def echo(request: web.Request) -> web.Response:
            return web.Response(text=f"got {len(await request.read())}")

        app = web.Application()
        app.router.add_get("/", hello)
        app.router.add_post("/echo", echo)
        runner = make_runner(app, limits, access_log=None)
        runners.append(runner)
        site = await start_site(runner, "127.0.0.1", 0)
        assert site._server is not None
        return app, int(site._server.sockets[0].getsockname()[1])

    yield start
    for runner in runners:
        await runner.cleanup()


async def _get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), WAIT_S) == b""
    except ConnectionResetError:
        return True


@pytest.mark.asyncio
async def test_malformed_requests_get_400_and_one_warning_line_not_tracebacks(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: each malformed request logged an ERROR with a full traceback (~300 a
    second from one slowloris client). Now: aiohttp's 400, one throttled warning."""
    _, port = await serve(ServerLimits(warn_interval_s=3600))
    caplog.set_level(logging.DEBUG)
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\x00: y\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        assert answer.split(b" ", 2)[1] == b"400"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].levelno == logging.WARNING
    assert "malformed HTTP request from 127.0.0.1" in warnings[0].getMessage()
    assert warnings[0].exc_info is None
    assert b"hello" in await _get(port)


@pytest.mark.asyncio
async def test_clients_that_never_finish_their_headers_are_disconnected(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: 300 slow clients held their connections open indefinitely."""
    app, port = await serve(ServerLimits(header_timeout_s=0.5))
    slow = []
    for i in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Half of them send a partial request, half nothing at all.
        if i % 2:
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
        slow.append((reader, writer))
    assert all([await _closed_by_server(reader) for reader, _ in slow])
    for _, writer in slow:
        writer.close()
    assert open_connections(app) == 0
    assert b"hello" in await _get(port)
    assert any("no complete request headers" in r.getMessage() for r in caplog.records)


@pytest.mark.asyncio
async def test_a_kept_alive_connection_is_not_cut_by_the_header_timeout(serve: Serve) -> None:
    """The header deadline starts with a request's first byte, not while idle between
    requests: a pooled upstream connection must survive its idle time."""
    _, port = await serve(ServerLimits(header_timeout_s=0.3, keepalive_timeout_s=60))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    writer.write(request)
    await asyncio.wait_for(reader.readuntil(b"hello"), WAIT_S)
    await asyncio.sleep(1.0)  # idle for more than the header timeout
    writer.write(request)
    await asyncio.wait_for(reader.readuntil(b"hello"), WAIT_S)
    writer.close()


@pytest.mark.asyncio
async def test_connections_beyond_the_limit_are_closed_and_service_resumes(
    serve: Serve,
) -> None:
    """Past max_connections a new connection is closed at once while the open ones stay; once the
    slow ones time out, requests are served again."""
    app, port = await serve(ServerLimits(header_timeout_s=5.0, max_connections=5))
    slow = []
    for _ in range(5):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n")
        await writer.drain()
        slow.append((reader, writer))
    await eventually_async(
        "5 open connections", lambda: open_connections(app), WAIT_S, until=lambda n: n >= 5
    )
    assert open_connections(app) == 5

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await _closed_by_server(reader)
    writer.close()
    assert open_connections(app) == 5  # the slow ones are still there

    assert all([await _closed_by_server(reader) for reader, _ in slow])
    for _, writer in slow:
        writer.close()
    assert b"hello" in await _get(port)


def test_the_router_process_answers_malformed_http_with_400_and_one_warning(
    tmp_path: Path,
) -> None:
    """Regression: `fleetpilot router` logged an ERROR with a traceback for every malformed
    request. A real router process, raw sockets, its JSON log read after SIGTERM."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier("small", 1.0)]).to_wire()))
    with router_process(path, wait_s=WAIT_S) as (proc, port):
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n")
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            assert answer.split(b" ", 2)[1] == b"400"
        lines = stop_and_read_log(proc, WAIT_S)
    assert [line for line in lines if line["level"] in ("error", "critical") or "exc" in line] == []
    malformed = [line for line in lines if "malformed HTTP request" in line["message"]]
    assert len(malformed) == 1
    assert malformed[0]["level"] == "warning"
    assert any(line["message"] == "router started" for line in lines)


def test_the_default_connection_limit_follows_the_open_file_limit() -> None:
    """A router in front of thousands of clients must not be capped by a constant meant for a
    1024-descriptor default: the budget is half of what the (raised) open-file limit leaves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = connection_budget()
    raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raised >= soft
    assert budget == max(MIN_CONNECTIONS, (raised - RESERVED_FDS) // 2)
    assert ServerLimits().connection_limit() == budget
    # A router opens an upstream connection only per request in flight (its body arrived):
    # the budget is what the limit leaves after those, never less than half.
    usable = raised - RESERVED_FDS
    assert connection_budget(upstream=100) == max(MIN_CONNECTIONS, usable // 2, usable - 100)
    assert connection_budget(upstream=usable) == budget
    assert ServerLimits(upstream_connections=100).connection_limit() == connection_budget(100)
    assert ServerLimits(max_connections=7).connection_limit() == 7


async def _trickle(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, pause_s: float
) -> bytes:
    """Sends a byte every ``pause_s`` until the server answers; the answer."""
    answer = asyncio.ensure_future(reader.read())

    async def one_more_byte() -> bool:
        with contextlib.suppress(ConnectionError):
            writer.write(b"x")
        await asyncio.wait([answer], timeout=pause_s)
        return answer.done()

    try:
        # The probe itself waits pause_s for the answer: no sleep between rounds.
        await eventually_async("the server's answer", one_more_byte, WAIT_S, until=bool, interval=0)
        return await answer
    finally:
        writer.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_trickled_body_is_cut_with_408_and_one_warning(
    serve: Serve, caplog: pytest.LogCaptureFixture, framing: str
) -> None:
    """Regression (issue 41, probe 1): the header timeout did not cover the body, so a client
    sending its body a byte at a time held its connection and its request until the request
    timeout. Now the body rule cuts it: 408 OpenAI-shaped, the connection closed, one throttled
    warning; other clients are served meanwhile."""
    app, port = await serve(
        ServerLimits(body_timeout_s=0.5, min_body_rate=1000.0, body_idle_timeout_s=30.0)
    )
    caplog.set_level(logging.WARNING)
    framing_header = (
        b"Content-Length: 100000" if framing == "content-length" else b"Transfer-Encoding: chunked"
    )
    answers = []
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + framing_header + b"\r\n\r\n")
        if framing == "chunked":
            writer.write(b"186A0\r\n")  # one chunk of 100000 bytes, sent a byte at a time
        answers.append(await _trickle(writer, reader, 0.1))
        assert b"hello" in await _get(port)
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"408", answer
        assert b"connection: close" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == 408
        assert "did not arrive in time" in error["message"]
    cut = [r for r in caplog.records if "cut a request body" in r.getMessage()]
    assert len(cut) == 1
    assert cut[0].levelno == logging.WARNING
    assert cut[0].exc_info is None
    await eventually_async(
        "no open connection", lambda: open_connections(app), WAIT_S, until=lambda n: n == 0
    )


@pytest.mark.asyncio
async def test_a_body_that_stops_midway_is_cut(serve: Serve) -> None:
    """A client that sent most of its body at once and then stopped is cut by the idle limit,
    not held for the rest of its length at the minimum rate."""
    _, port = await serve(
        ServerLimits(body_timeout_s=0.5, min_body_rate=1.0, body_idle_timeout_s=0.5)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 50_000
    )
    answer = await asyncio.wait_for(reader.read(), WAIT_S)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"408", answer
    assert b"no byte of it" in answer


@pytest.mark.asyncio
async def test_a_large_body_on_a_slow_link_above_the_minimum_rate_is_served(serve: Serve) -> None:
    """A real client sending a large prompt over a slow link is not a trickler: a body arriving
    for longer than body_timeout_s but faster than min_body_rate is read whole and answered."""
    _, port = await serve(
        ServerLimits(body_timeout_s=0.3, min_body_rate=100.0, body_idle_timeout_s=30.0)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    size = 40 * 500
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n")
    writer.write(f"Content-Length: {size}\r\n\r\n".encode())
    for _ in range(40):  # ~2 s at ~10 kB/s, 100x the minimum rate
        writer.write(b"x" * 500)
        await writer.drain()
        await asyncio.sleep(0.05)
    answer = await asyncio.wait_for(reader.read(), WAIT_S)
    writer.close()
    assert answer.split(b" ", 2)[1] == b"200", answer
    assert answer.endswith(f"got {size}".encode())


@pytest.mark.asyncio
async def test_a_cut_body_leaves_no_garbage_for_the_cyclic_collector() -> None:
    """Regression (issue 41, slow-body p99): the reader of a cut body kept the timeout error it
    raised, whose traceback kept the frames awaiting that reader, a cycle through the request,
    its handler and its transport. Every cut connection waited for the cyclic collector, whose
    full collections under a flood of slow bodies scanned every open connection and paused the
    router for up to a second. With the collector off, a cut request must be freed anyway."""
    requests: list[weakref.ref[web.Request]] = []

    async def read(request: web.Request) -> web.Response:
        requests.append(weakref.ref(request))
        return web.Response(text=f"got {len(await request.read())}")

    app = web.Application()
    app.router.add_post("/read", read)
    limits = ServerLimits(body_timeout_s=0.3, min_body_rate=1000.0, body_idle_timeout_s=30.0)
    runner = make_runner(app, limits, access_log=None)
    site = await start_site(runner, "127.0.0.1", 0)
    assert site._server is not None
    port = int(site._server.sockets[0].getsockname()[1])
    gc.collect()
    gc.disable()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nx")
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        assert answer.split(b" ", 2)[1] == b"408", answer
        await eventually_async(
            "no open connection", lambda: open_connections(app), WAIT_S, until=lambda n: n == 0
        )
        await asyncio.sleep(0.05)  # the closed transport's callbacks run
        assert len(requests) == 1
        assert requests[0]() is None, "the cut request is only freed by the cyclic collector"
    finally:
        gc.enable()
        await runner.cleanup()
