"""Slow request bodies lock no client out (issue 41, probe 1), and a body that is not JSON starts
nothing (probe 5): a real router process in front of a real reference-engine process, raw
sockets sending headers and then a body byte at a time, from distinct 127.0.0.x addresses
(Linux loopback accepts any 127/8 source).

Regression: the header timeout did not cover the body, a request counted against maxInFlight
before its body was read, and a tenant's limits were checked only after it - so slow bodies
held every in-flight slot (every other client got 429), a free key limited to 30 requests a
minute held all of them, and router and engine held each slow body until the request timeout.
JSON sent as text/plain or a form type was served by both.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fleetpilot.api.router_config import EndpointGroup, RouterTier, TenantKeys
from fleetpilot.runtime.processes import Supervisor, free_port
from fleetpilot.testing.polling import eventually
from tests.routing.support import Engines, make_config, router_process

# Generous bounds: the machine running the suite may be busy.
WAIT_S = 60.0
MODEL = "small-model"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One reference engine process; its address."""
    supervisor = Supervisor(Path(tmp_path_factory.mktemp("slow-bodies")))
    engines = Engines(supervisor)
    try:
        engines.start("e0", MODEL)
        engines.wait()
        yield engines.addresses["e0"]
    finally:
        supervisor.stop_all()


def write_config(tmp_path: Path, engine: str, **overrides: Any) -> Path:
    group = EndpointGroup(role="unified", service="svc", selector={}, port=8000,
                          max_num_seqs=16, addresses=[engine])  # fmt: skip
    tier = RouterTier(name="small", model=MODEL, up_to=1.0, mode="unified", endpoints=[group])
    # Scrapes of a generous timeout: on a busy machine the engine may take longer than the
    # test default to answer /metrics, and three misses would eject it as frozen (503s that
    # have nothing to do with slow bodies).
    overrides = {"scrape": {"timeout": "5s"}, **overrides}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier], **overrides).to_wire()))
    return path


def tenants(tmp_path: Path, **limits: dict[str, Any]) -> dict[str, Any]:
    """An auth section with one tenant per keyword (its key is ``sk-<name>-0123456789abcdef``)."""
    specs = []
    for name, extra in limits.items():
        key_file = tmp_path / f"{name}.keys"
        key_file.write_text(f"sk-{name}-0123456789abcdef\n")
        specs.append(TenantKeys(name=name, key_files=[str(key_file)], **extra))
    return {"tenants": [spec.to_wire() for spec in specs]}


def slow_body(
    port: int, source: str, path: str = "/v1/completions", **headers: str
) -> socket.socket:
    """A connection from ``source`` that sends a request's headers (Content-Length 100000)
    and one byte of its body, and then nothing (the body rule cuts it after 10 s)."""
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", port))
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json",
             "Content-Length: 100000", *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n{").encode())
    return sock


def answer_of(sock: socket.socket, wait_s: float) -> bytes | None:
    """What the server answered on ``sock`` within ``wait_s`` (b"" closed without an answer),
    or None: nothing yet."""
    sock.settimeout(wait_s)
    try:
        data = sock.recv(65536)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""
    sock.settimeout(1.0)
    while True:  # the rest of a short answer
        try:
            more = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not more:
            break
        data += more
    return data


def error_code(answer: bytes | None) -> int | None:
    """The ``code`` of the OpenAI-shaped error body of a raw answer."""
    body = (answer or b"").partition(b"\r\n\r\n")[2]
    return int(json.loads(body)["error"]["code"]) if body else None


def status_of(answer: bytes | None) -> int | None:
    if not answer:
        return None
    return int(answer.split(b" ", 2)[1])


def metric(port: int, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S).text
    selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = (
        rf"^{re.escape(name)}{{{re.escape(selector)}}} (\S+)$" if labels else rf"^{name} (\S+)$"
    )
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def poll(predicate: Any, what: str) -> None:
    eventually(what, lambda: True if predicate() else None, WAIT_S, interval=0.05)


def post(port: int, source: str = "127.0.0.1", **headers: str) -> httpx.Response:
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=WAIT_S) as client:
        url = f"http://127.0.0.1:{port}/v1/completions"
        return client.post(url, json=BODY, headers=headers)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_slow_bodies_hold_no_in_flight_slot_and_are_cut_with_408(
    tmp_path: Path, engine: str
) -> None:
    """Twice maxInFlight clients sending bodies a byte at a time: a legitimate request is still
    served (it got 429 while they held every slot), and the router cuts each slow body with 408
    once the body rule's 20 s are over (it held them for the request timeout)."""
    path = write_config(tmp_path, engine, backpressure={"maxInFlight": 4})
    with router_process(path, wait_s=WAIT_S) as (_, port):
        slow = [slow_body(port, f"127.0.0.{10 + i}") for i in range(8)]
        try:
            poll(
                lambda: (
                    metric(port, "fleetpilot_router_unfinished_requests") >= 8
                    or metric(port, "fleetpilot_router_in_flight_requests") >= 4
                ),
                "the router sees the slow requests",
            )
            response = post(port)
            assert response.status_code == 200, response.text
            answers = [answer_of(sock, WAIT_S) for sock in slow]
        finally:
            close_all(slow)
    assert [status_of(answer) for answer in answers] == [408] * 8, answers
    assert [error_code(answer) for answer in answers] == [408] * 8


def test_a_key_at_its_request_limit_cannot_hold_more_slow_bodies(
    tmp_path: Path, engine: str
) -> None:
    """A free key limited to 3 requests a minute opening 10 slow-body requests holds at most 3 of
    them: the rest get 429 with Retry-After from their headers, before any body (it held as many
    as the in-flight cap allowed, each counted against it); another tenant is served
    meanwhile."""
    auth = tenants(tmp_path, free={"requests_per_minute": 3}, paid={})
    # With keys on, /metrics is served on the metrics port only.
    metrics_port = free_port()
    path = write_config(
        tmp_path, engine, auth=auth, backpressure={"maxInFlight": 64}, metricsPort=metrics_port
    )
    with router_process(path, wait_s=WAIT_S) as (_, port):
        slow = [
            slow_body(port, "127.0.0.20", Authorization="Bearer sk-free-0123456789abcdef")
            for _ in range(10)
        ]
        try:
            poll(
                lambda: (
                    metric(metrics_port, "fleetpilot_router_tenant_requests_total", tenant="free")
                    >= 10
                ),
                "the router sees the free key's requests",
            )
            answers: dict[int, bytes] = {}

            def refused_enough() -> bool:
                for i, sock in enumerate(slow):
                    if i not in answers and (answer := answer_of(sock, 0.01)) is not None:
                        answers[i] = answer
                return len(answers) >= 7

            poll(refused_enough, "7 of the free key's 10 slow requests refused")
            # On a busy machine the body rule's 10 s without a byte may be over by now: the
            # three admitted requests are then cut with 408 (admitted, then cut), never 429.
            statuses = sorted(status_of(a) or 0 for a in answers.values())
            assert statuses == [408] * (len(answers) - 7) + [429] * 7, statuses
            refused = [a for a in answers.values() if status_of(a) == 429]
            assert all(b"Retry-After" in a or b"retry-after" in a for a in refused)
            response = post(port, "127.0.0.30", Authorization="Bearer sk-paid-0123456789abcdef")
            assert response.status_code == 200, response.text
            held = [sock for i, sock in enumerate(slow) if i not in answers]
            assert all(status_of(answer_of(sock, 0.5)) in (None, 408) for sock in held)
        finally:
            close_all(slow)


def test_one_client_cannot_open_more_than_its_share_of_unfinished_requests(
    tmp_path: Path, engine: str
) -> None:
    """Without keys, a source address may have maxInFlight / 4 unfinished requests (bodies still
    arriving included): past it, 429 with Retry-After before its body is read, while another
    address is served."""
    path = write_config(tmp_path, engine, backpressure={"maxInFlight": 8})  # 2 per client
    with router_process(path, wait_s=WAIT_S) as (_, port):
        slow = [slow_body(port, "127.0.0.40") for _ in range(2)]
        try:
            poll(
                lambda: (
                    metric(port, "fleetpilot_router_unfinished_requests") >= 2
                    or metric(port, "fleetpilot_router_in_flight_requests") >= 2
                ),
                "the router sees the slow requests",
            )
            refused = post(port, "127.0.0.40")
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == 429
            assert refused.headers["x-fleetpilot-error"] == "client_overloaded"
            served = post(port, "127.0.0.41")
            assert served.status_code == 200, served.text
        finally:
            close_all(slow)


def test_the_engine_cuts_a_trickled_body_with_408(engine: str) -> None:
    """The reference engine's listener holds a body sent a byte a second to the body rule (it held
    it until the client gave up): 408 OpenAI-shaped, then it serves the next request."""
    port = int(engine.rsplit(":", 1)[1])
    sock = slow_body(port, "127.0.0.50")
    try:

        def trickled() -> bytes | None:
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
            return answer_of(sock, 1.0)

        answer = eventually("the engine's answer to a trickled body", trickled, WAIT_S, interval=0)
    finally:
        sock.close()
    assert status_of(answer) == 408, answer
    assert error_code(answer) == 408
    response = httpx.post(f"http://{engine}/v1/completions", json=BODY, timeout=WAIT_S)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("server", ["router", "engine"])
def test_only_json_content_types_start_generations(
    tmp_path: Path, engine: str, server: str
) -> None:
    """A body that is not declared JSON (text/plain, a form type, none: what a web page may send
    cross-site without a CORS preflight) gets 415 OpenAI-shaped from the router and the engine
    (both served it, 200); application/json with a charset parameter is served."""
    path = write_config(tmp_path, engine)
    with router_process(path, wait_s=WAIT_S) as (_, port):
        url = f"http://127.0.0.1:{port}" if server == "router" else f"http://{engine}"
        data = httpx.Request("POST", "http://x", json=BODY).content
        for content_type in ("text/plain", "application/x-www-form-urlencoded",
                             "multipart/form-data; boundary=x", None):  # fmt: skip
            headers = {} if content_type is None else {"Content-Type": content_type}
            response = httpx.post(url + "/v1/completions", content=data, headers=headers,
                                  timeout=WAIT_S)  # fmt: skip
            assert response.status_code == 415, (content_type, response.text)
            error = response.json()["error"]
            assert error["code"] == 415
            assert "application/json" in error["message"]
        for content_type in ("application/json; charset=utf-8", "Application/JSON"):
            headers = {"Content-Type": content_type}
            response = httpx.post(url + "/v1/completions", content=data, headers=headers,
                                  timeout=WAIT_S)  # fmt: skip
            assert response.status_code == 200, (content_type, response.text)
