"""The reference engine against bad input: hostile JSON, out-of-range sampling values, broken
HTTP and clients that never finish. Real servers on loopback, raw sockets and raw bodies."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetpilot.engine.reference.server import build_server
from fleetpilot.httpserver import ServerLimits, open_connections
from fleetpilot.testing.engine_server import BackgroundServer
from fleetpilot.testing.polling import eventually
from tests.engine.reference.server_support import BASE_ARGS, MODEL, start_server

WAIT_S = 60.0


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    srv = start_server("--served-model-name", MODEL)
    yield srv
    srv.stop()


def _post(server: BackgroundServer, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=WAIT_S,
    )


def _error(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == response.status_code
    assert error["type"] == "BadRequestError"
    return error


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_deeply_nested_json_is_a_400_not_a_500(server: BackgroundServer, path: str) -> None:
    """Regression: JSON nested ~1,000 deep raised RecursionError and answered 500."""
    nested = b'{"prompt": "hi", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = _post(server, path, nested)
    assert response.status_code == 400
    assert "nested too deeply" in _error(response)["message"]


@pytest.mark.parametrize(
    ("path", "field", "raw"),
    [
        ("/v1/completions", "temperature", b"Infinity"),
        ("/v1/completions", "temperature", b"NaN"),
        ("/v1/completions", "temperature", b"1e308"),
        ("/v1/completions", "temperature", b"2.5"),
        ("/v1/chat/completions", "temperature", b"-Infinity"),
        ("/v1/completions", "top_p", b"NaN"),
        ("/v1/completions", "max_tokens", b"true"),
        ("/v1/chat/completions", "max_tokens", b"true"),
        ("/v1/chat/completions", "max_completion_tokens", b"false"),
        ("/v1/completions", "max_tokens", b"1.0"),
    ],
)
def test_out_of_range_sampling_values_are_refused_as_vllm_does(
    server: BackgroundServer, path: str, field: str, raw: bytes
) -> None:
    """Regression: temperature Infinity / 1e308 and max_tokens true were accepted. vLLM's
    SamplingParams refuses a non-finite temperature and one outside [0, 2]; a boolean is not
    a token count."""
    if path == "/v1/completions":
        body = b'{"prompt": "hi", "%s": %s}' % (field.encode(), raw)
    else:
        body = b'{"messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (
            field.encode(),
            raw,
        )
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == field


def test_in_range_values_still_work(server: BackgroundServer) -> None:
    """The bounds are not over-tight: temperature 2 (vLLM's maximum) and top_p 0.5 are still
    served."""
    body = b'{"prompt": "hi", "temperature": 2, "top_p": 0.5, "max_tokens": 2}'
    assert _post(server, "/v1/completions", body).status_code == 200


def _raw_exchange(url: str, payload: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(payload)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_malformed_http_is_a_400_and_one_warning_not_tracebacks(
    server: BackgroundServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: every malformed request logged an ERROR with a full traceback."""
    caplog.set_level(logging.INFO)
    for _ in range(10):
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n"
        answer = _raw_exchange(server.url, request)
        assert answer.split(b" ", 2)[1] == b"400"
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert noisy == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "malformed HTTP request" in w]) == 1


def test_slow_clients_are_cut_and_the_connection_limit_holds() -> None:
    """Regression: 300 slow clients held their connections indefinitely. Past the limit a new
    connection is closed; once the slow ones are cut, a normal client is served."""
    import argparse

    from fleetpilot.engine.reference.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = build_server(parser.parse_args([*BASE_ARGS, "--served-model-name", MODEL]))
    limits = ServerLimits(header_timeout_s=3.0, max_connections=4)
    engine.settings = dataclasses.replace(engine.settings, limits=limits)
    with BackgroundServer(engine) as srv:
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        slow = [socket.create_connection((host, int(port)), timeout=WAIT_S) for _ in range(4)]
        for sock in slow:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        # The server accepts them before the next one (it does so in order).
        eventually(
            "the 4 slow connections accepted",
            lambda: open_connections(engine.app),
            WAIT_S,
            until=lambda n: n >= 4,
            interval=0.02,
        )
        with socket.create_connection((host, int(port)), timeout=WAIT_S) as extra:
            assert _closed(extra)
        # Cut by the header timeout (3 s), long before each socket's own (WAIT_S) would end a
        # wait for a server that never cuts them.
        assert all(_closed(sock) for sock in slow)
        for sock in slow:
            sock.close()
        assert httpx.get(srv.url + "/health", timeout=WAIT_S).status_code == 200


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
