"""The hardened listener the router and the engine share, probed with raw sockets on loopback."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
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
    connection_budget,
    make_runner,
    open_connections,
    start_site,
)
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


Serve = Callable[[ServerLimits], Awaitable[tuple[web.Application, int]]]


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(limits: ServerLimits) -> tuple[web.Application, int]:
        async def hello(request: web.Request) -> web.Response:
            return web.Response(text="hello")

        app = web.Application()
        app.router.add_get("/", hello)
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
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while open_connections(app) < 5 and loop.time() < deadline:
        await asyncio.sleep(0.01)
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
    malformed = [line for line in lines if "malformed HTTP request" in line["msg"]]
    assert len(malformed) == 1
    assert malformed[0]["level"] == "warning"
    assert any(line["msg"] == "router started" for line in lines)


def test_the_default_connection_limit_follows_the_open_file_limit() -> None:
    """A router in front of thousands of clients must not be capped by a constant meant for a
    1024-descriptor default: the budget is half of what the (raised) open-file limit leaves."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    budget = connection_budget()
    raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raised >= soft
    assert budget == max(MIN_CONNECTIONS, (raised - RESERVED_FDS) // 2)
    assert ServerLimits().connection_limit() == budget
    assert ServerLimits(max_connections=7).connection_limit() == 7
