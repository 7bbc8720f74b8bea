"""Engines trust nobody (issue 12 item 11): the P/D hand-off only between allowed peers.

Real reference servers on loopback. Every 127.x.y.z is loopback on Linux, so a client bound to
127.0.0.2 models a peer outside a list that names 127.0.0.1, and a listener on 127.0.0.2 models
a host a hostile ``kv_transfer_params`` points a decoder at.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetpilot.engine.reference.settings import ConfigError
from fleetpilot.testing.engine_server import BackgroundServer
from tests.engine.reference.pd_support import (
    COMMON,
    NIXL,
    REQUEST,
    do_prefill,
    fallbacks,
    value,
)

OUTSIDER = "127.0.0.2"


@pytest.fixture(scope="module")
def prefill() -> Iterator[BackgroundServer]:
    srv = BackgroundServer.from_argv(
        [
            *COMMON,
            "--kv-transfer-config",
            NIXL % ("kv_producer", ""),
            "--allowed-remote-hosts",
            "127.0.0.1",
        ]
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def decode(prefill: BackgroundServer) -> Iterator[BackgroundServer]:
    """Trusts exactly the prefill server's host and port."""
    port = httpx.URL(prefill.url).port
    srv = BackgroundServer.from_argv(
        [
            *COMMON,
            "--kv-transfer-config",
            NIXL % ("kv_consumer", ""),
            "--allowed-remote-hosts",
            f"127.0.0.1:{port}",
        ]
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listener on a loopback address outside the decoder's list; records any connection."""
    sock = socket.socket()
    sock.bind((OUTSIDER, 0))
    sock.listen(8)
    sock.settimeout(0.5)
    yield sock
    sock.close()


def assert_never_connected(trap: socket.socket) -> None:
    # A connect completes in the kernel's backlog before any HTTP is exchanged, so a pull
    # that had started would be waiting here.
    try:
        conn, _ = trap.accept()
    except TimeoutError:
        return
    conn.close()
    raise AssertionError("the decoder connected to a host outside its list")


def assert_vllm_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


def test_decode_refuses_a_kv_source_outside_the_list_without_connecting(
    prefill: BackgroundServer, decode: BackgroundServer, trap: socket.socket
) -> None:
    """Regression: the decoder pulled KV from any remote_host a request body named."""
    params = do_prefill(prefill)
    refused = fallbacks(decode.url, "refused")
    host, port = trap.getsockname()
    hostile = {**params, "remote_host": host, "remote_port": port}
    resp = httpx.post(
        decode.url + "/v1/completions", json={**REQUEST, "kv_transfer_params": hostile}
    )
    error = assert_vllm_error(resp, 400)
    assert error["param"] == "kv_transfer_params.remote_host"
    assert "not an allowed KV source" in error["message"]
    assert_never_connected(trap)
    # The allowed host but another port than the listed one: refused as well.
    other_port = {**params, "remote_port": port}
    resp = httpx.post(
        decode.url + "/v1/completions", json={**REQUEST, "kv_transfer_params": other_port}
    )
    assert_vllm_error(resp, 400)
    assert fallbacks(decode.url, "refused") == refused + 2
    assert value(decode.url, "fleetpilot_kv_transfer_pulls_total") == 0

    # The listed source still works: the pin survived the refused attempts.
    out = httpx.post(decode.url + "/v1/completions", json={**REQUEST, "kv_transfer_params": params})
    assert out.status_code == 200, out.text
    assert value(decode.url, "fleetpilot_kv_transfer_pulls_total") == 1


def test_internal_kv_answers_only_allowed_peers(prefill: BackgroundServer) -> None:
    """Regression: /internal/kv/<id> handed KV blocks and prompt token ids to any caller."""
    params = do_prefill(prefill)
    url = f"{prefill.url}/internal/kv/{params['remote_request_id']}"
    outsider = httpx.Client(transport=httpx.HTTPTransport(local_address=OUTSIDER))
    with outsider:
        for method in ("POST", "DELETE"):
            error = assert_vllm_error(outsider.request(method, url, json={}), 403)
            assert OUTSIDER in error["message"]
    # Refused calls changed nothing: an allowed peer still gets the pinned KV.
    resp = httpx.post(url, json={"release": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/octet-stream"


def test_a_bare_engine_trusts_only_loopback(trap: socket.socket) -> None:
    """Without the flag a decoder pulls from loopback only; 192.0.2.1 (TEST-NET) is refused."""
    srv = BackgroundServer.from_argv(
        [*COMMON, "--kv-transfer-config", NIXL % ("kv_consumer", "")]
    ).start()
    try:
        base = {"do_remote_prefill": True, "remote_request_id": "cmpl-x", "remote_port": 8000}
        resp = httpx.post(
            srv.url + "/v1/completions",
            json={**REQUEST, "kv_transfer_params": {**base, "remote_host": "192.0.2.1"}},
        )
        assert "127.0.0.0/8" in assert_vllm_error(resp, 400)["message"]
        # A loopback source is allowed: the pull happens (finds nothing) and falls back.
        host, port = trap.getsockname()
        trap.close()  # refuse the connection at once: a failed pull, then a local prefill
        resp = httpx.post(
            srv.url + "/v1/completions",
            json={
                **REQUEST,
                "kv_transfer_params": {**base, "remote_host": host, "remote_port": port},
            },
        )
        assert resp.status_code == 200, resp.text
        assert fallbacks(srv.url, "pull_failed") == 1
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--allowed-remote-hosts", "not a host"], "--allowed-remote-hosts: 'not a host'"),
        (["--allowed-remote-hosts", ""], "--allowed-remote-hosts: the list is empty"),
        (
            ["--allowed-remote-hosts", "127.0.0.1", "--kv-transfer-config",
             NIXL % ("kv_consumer", ', "kv_connector_extra_config": '
                                    '{"allowed_remote_hosts": ["127.0.0.1"]}')],
            "both set",
        ),
    ],
)  # fmt: skip
def test_bad_allowed_remote_hosts_are_refused_at_start(extra: list[str], message: str) -> None:
    """A bad --allowed-remote-hosts, or the list given both as the flag and in the connector config,
    stops the engine at start with the flag named, not at its first hand-off."""
    with pytest.raises(ConfigError, match=message):
        BackgroundServer.from_argv([*COMMON, *extra])
