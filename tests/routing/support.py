"""Real HTTP test doubles for the router: fake engines (aiohttp servers on loopback ports) that
speak enough of vLLM's OpenAI API, /metrics and P/D protocol to observe what the router does,
and builders for router configs and running routers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import zmq
import zmq.asyncio
from aiohttp import web

from fleetpilot.api.router_config import EndpointGroup, RouterConfig, RouterTier
from fleetpilot.kv_events import END_SEQ, EventBatch, encode_batch, seq_bytes, seq_of
from fleetpilot.openai_errors import error_type
from fleetpilot.routing.app import ROUTER_APP, RouterApp, build_app
from fleetpilot.routing.endpoints import EndpointSource, StaticSource
from fleetpilot.routing.policies.pd import PREFILL_KV_PARAMS
from fleetpilot.runtime.processes import Child, Supervisor, free_port
from fleetpilot.testing.polling import eventually, eventually_async


@dataclass
class FakeEngine:
    """An OpenAI-compatible engine double with knobs for every failure the router handles."""

    name: str
    role: str = "unified"
    chunks: int = 5
    chunk_delay_s: float = 0.0
    delay_s: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    fail_next: int = 0  # answer this many requests with fail_status
    fail_status: int = 500
    health_status: int = 200
    gate: asyncio.Event | None = None  # non-None: block (after the first chunk if streaming)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0
    last_chunk_sent_at: float = 0.0
    port: int = 0
    host: str = "127.0.0.1"
    _runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        return app

    async def start(self, port: int = 0) -> FakeEngine:
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port or self.port or 0)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """Kill: the listening socket and every open connection close."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {self.kv_usage}\n'
        )
        return web.Response(text=text)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response(
                {"error": {"message": f"{self.name} failed", "type": "server_error"}},
                status=self.fail_status,
            )
        try:
            if self.role == "prefill":
                return await self._prefill(body)
            if self.role == "decode":
                params = body.get("kv_transfer_params")
                if params is not None and not (
                    params.get("do_remote_prefill") is True and params.get("remote_engine_id")
                ):
                    return web.json_response({"error": {"message": "bad kv params"}}, status=400)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if body.get("stream"):
                return await self._stream(request, body)
            if self.gate is not None:
                await self.gate.wait()
            self.completed += 1
            return web.json_response(self._answer(request, body))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def _answer(self, request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
        text = f"from {self.name}"
        if request.path.endswith("/chat/completions"):
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "stop"}
            obj = "text_completion"
        return {
            "id": "cmpl-1",
            "object": obj,
            "created": 0,
            "model": body.get("model"),
            "served_by": self.name,
            "kv_transfer_params_seen": body.get("kv_transfer_params"),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    async def _prefill(self, body: dict[str, Any]) -> web.Response:
        ok = (
            body.get("kv_transfer_params") == PREFILL_KV_PARAMS
            and body.get("max_tokens") == 1
            and body.get("stream") is False
            and "stream_options" not in body
        )
        if not ok:
            return web.json_response({"error": {"message": "not a prefill request"}}, status=400)
        self.completed += 1
        return web.json_response(
            {
                "id": "cmpl-p",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.name,
                    "remote_block_ids": [[1, 2, 3]],
                    "remote_host": "127.0.0.1",
                    "remote_port": self.port,
                },
            }
        )

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(self.chunks):
            if chat:
                delta: dict[str, Any] = {"delta": {"content": f"{self.name}-{i} "}}
                obj = "chat.completion.chunk"
            else:
                delta = {"text": f"{self.name}-{i} "}
                obj = "text_completion"
            chunk = {
                "id": "cmpl-s",
                "object": obj,
                "created": 0,
                "model": body.get("model"),
                "choices": [{"index": 0, **delta, "finish_reason": None}],
            }
            await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0 and self.gate is not None:
                await self.gate.wait()
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        await out.write(b"data: [DONE]\n\n")
        self.last_chunk_sent_at = time.monotonic()
        self.completed += 1
        await out.write_eof()
        return out


def group(
    engines: list[FakeEngine], role: str = "unified", max_num_seqs: int = 8, service: str = "svc"
) -> EndpointGroup:
    return EndpointGroup(
        role=role,
        service=service,
        selector={"app": service},
        port=8000,
        max_num_seqs=max_num_seqs,
        addresses=[e.address for e in engines],
    )


def tier(
    name: str,
    up_to: float,
    engines: list[FakeEngine] | None = None,
    *,
    groups: list[EndpointGroup] | None = None,
    max_num_seqs: int = 8,
    mode: str = "unified",
) -> RouterTier:
    return RouterTier(
        name=name,
        model=f"{name}-model",
        up_to=up_to,
        mode=mode,
        endpoints=groups
        if groups is not None
        else [group(engines or [], max_num_seqs=max_num_seqs, service=f"chat-{name}")],
    )


def make_config(tiers: list[RouterTier], **overrides: Any) -> RouterConfig:
    """A RouterConfig with test-speed loops: 50 ms scrapes and probes, short timeouts."""
    data: dict[str, Any] = {
        "service": "chat",
        "namespace": "test",
        "tiers": tiers,
        "scrape": {"interval": "50ms", "timeout": "500ms", "staleAfter": "2s"},
        "ejection": {"failures": 3, "window": "30s", "probeInterval": "50ms"},
        "connectTimeout": "1s",
        "requestTimeout": "20s",
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return RouterConfig.model_validate(data)


@dataclass
class RunningRouter:
    url: str
    app: web.Application
    runner: web.AppRunner

    @property
    def state(self) -> RouterApp:
        return self.app[ROUTER_APP]

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def running_router(
    config: RouterConfig, source: EndpointSource | None = None, **kwargs: Any
) -> AsyncIterator[RunningRouter]:
    app = build_app(config, source or StaticSource(config), seed=0, **kwargs)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield RunningRouter(f"http://127.0.0.1:{port}", app, runner)
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def engines(*items: FakeEngine) -> AsyncIterator[list[FakeEngine]]:
    started = [await e.start() for e in items]
    try:
        yield started
    finally:
        for e in started:
            await e.stop()


async def wait_for(predicate: Any, timeout_s: float = 5.0, interval_s: float = 0.02) -> None:
    """Until ``predicate()`` holds (``eventually_async``, yielding to the loop)."""
    await eventually_async(
        "the condition", lambda: True if predicate() else None, timeout_s, interval=interval_s
    )


ROUTER_COMMAND = ("-m", "fleetpilot", "router")


@contextlib.contextmanager
def router_process(
    config_path: Path,
    *,
    command: Sequence[str] = ROUTER_COMMAND,
    wait_s: float = 60.0,
    extra: Sequence[str] = (),
    port: int | None = None,
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The router as its own process on ``port`` (else a free loopback port), once its
    /health answers 200; killed at the end if still running. Its stderr (the JSON log) is a
    pipe: read it with :func:`stop_and_read_log`."""
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
    proc = subprocess.Popen(
        [sys.executable, *command, "--config", str(config_path),
         "--host", "127.0.0.1", "--port", str(port), "--discovery", "static", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:

        def healthy() -> int | None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            status = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code
            return status if status == 200 else None

        eventually(
            "the router's /health", healthy, wait_s, interval=0.1, ignoring=(httpx.TransportError,)
        )
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def stop_and_read_log(proc: subprocess.Popen[str], timeout_s: float) -> list[dict[str, Any]]:
    """SIGTERM the router process; it must exit 0. Its JSON log lines."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout_s) == 0
    assert proc.stderr is not None
    return [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]


# -- KV events -------------------------------------------------------------------------------


class KVEventPublisher:
    """vLLM's KV-event publisher, in the test, from ``fleetpilot.kv_events``: batches on a PUB
    socket as ``[topic, seq, payload]`` and a ROUTER replay socket answering ``[b"", start]``
    with every buffered batch from ``start`` and the end marker. XPUB rather than PUB (the
    same wire) so a test can wait until a subscriber is really subscribed.

    Knobs: ``publish(send=False)`` buffers a batch without sending it (a gap); ``stop`` and
    ``start`` take the publisher down and back on the same ports (a dropped connection), and
    ``start(fresh=True)`` also restarts its sequence and buffer (a restarted engine);
    ``answer_replays = False`` leaves replay requests unanswered.
    """

    def __init__(self, topic: bytes = b"", buffer_steps: int = 10_000) -> None:
        self.topic = topic
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        self.answer_replays = True
        self.replay_requests: list[int] = []
        self.subscriptions = 0
        self.endpoint = ""
        self.replay_endpoint = ""
        self._ctx = zmq.asyncio.Context()
        self._pub: Any = None
        self._router: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, *, fresh: bool = False) -> KVEventPublisher:
        if fresh:
            self.seq = 0
            self.buffer.clear()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = await self._bind(self._pub, self.endpoint)
        self.replay_endpoint = await self._bind(self._router, self.replay_endpoint)
        self._tasks = [
            asyncio.create_task(self._serve_subscriptions()),
            asyncio.create_task(self._serve_replays()),
        ]
        return self

    @staticmethod
    async def _bind(sock: Any, endpoint: str, timeout_s: float = 5.0) -> str:
        """Bind (the same port again after ``stop``: ZMQ frees it asynchronously, so retry)."""

        def bound() -> str:
            sock.bind(endpoint or "tcp://127.0.0.1:0")
            return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

        return await eventually_async(
            f"a bind of {endpoint or 'a free port'}",
            bound,
            timeout_s,
            interval=0.02,
            ignoring=(zmq.ZMQError,),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    async def close(self) -> None:
        await self.stop()
        self._ctx.destroy(linger=0)

    @property
    def endpoints(self) -> tuple[str, str]:
        return self.endpoint, self.replay_endpoint

    async def publish(self, *events: Any, send: bool = True) -> int:
        """One batch of ``events`` under the next sequence number; that number."""
        return await self.publish_payload(encode_batch(EventBatch(time.time(), list(events))), send)

    async def publish_payload(self, payload: bytes, send: bool = True) -> int:
        """Raw bytes as the next batch (garbage for the malformed-payload tests)."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send and self._pub is not None:
            await self._pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    async def send_frames(self, frames: Sequence[bytes]) -> None:
        """Frames as they are, outside the sequence (a malformed message)."""
        await self._pub.send_multipart(list(frames))

    async def wait_subscribed(self, count: int = 1, timeout_s: float = 5.0) -> None:
        await wait_for(lambda: self.subscriptions >= count, timeout_s)

    async def _serve_subscriptions(self) -> None:
        while True:
            frame = await self._pub.recv()
            if frame[:1] == b"\x01":
                self.subscriptions += 1

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self._router.recv_multipart()
            self.replay_requests.append(seq_of(start))
            if not self.answer_replays:
                continue
            for seq, payload in list(self.buffer):
                if seq >= seq_of(start):
                    await self._router.send_multipart(
                        [client, b"", self.topic, seq_bytes(seq), payload]
                    )
            await self._router.send_multipart([client, b"", b"", END_SEQ, b""])


# -- reference engines as processes (to freeze with SIGSTOP, or kill) ----------------------


def engine_argv(port: int, model: str, kv_role: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "fleetpilot", "engine", "--backend", "reference",
            "--host", "127.0.0.1", "--port", str(port), "--model-config", "tiny",
            "--served-model-name", model, "--max-model-len", "512"]  # fmt: skip
    if kv_role is not None:
        config = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_ip": "127.0.0.1"}
        argv += ["--kv-transfer-config", json.dumps(config)]
    return argv


class Engines:
    """Reference engines as supervised processes, by name."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.children: dict[str, Child] = {}
        self.addresses: dict[str, str] = {}

    def start(self, name: str, model: str, kv_role: str | None = None) -> None:
        port = free_port()
        self.addresses[name] = f"127.0.0.1:{port}"
        self.children[name] = self.supervisor.start(
            name,
            engine_argv(port, model, kv_role),
            health_url=f"http://127.0.0.1:{port}/health",
            env={"PYTHONUNBUFFERED": "1"},
        )

    def wait(self) -> None:
        for child in self.children.values():
            self.supervisor.wait_healthy(child, 180.0)


@contextlib.contextmanager
def frozen(child: Child) -> Iterator[None]:
    """SIGSTOP the engine's process group; always SIGCONT it again."""
    os.killpg(child.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(child.pid, signal.SIGCONT)


# -- what the in-process router tests send and check --------------------------------------
SHORT = {"model": "chat", "prompt": "hi"}
HARD = {
    "model": "chat",
    "prompt": "Prove the theorem step by step and derive the integral. " * 60,
    "max_tokens": 2000,
}


async def post(
    router: RunningRouter,
    body: Any,
    path: str = "/v1/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        # A JSON client's Content-Type unless the test says otherwise (the router answers 415
        # to anything else).
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with session.post(router.url + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = text
            return resp.status, payload, resp.headers


def route_of(headers: Any) -> dict[str, str]:
    """The ``x-fleetpilot-route`` header's parts; none on a refusal before any routing."""
    value = headers.get("x-fleetpilot-route")
    return dict(part.split("=", 1) for part in value.split("; ")) if value else {}


def assert_openai_error(status: int, payload: Any, expected: int) -> None:
    """vLLM's error shape: the integer status as ``code`` and vLLM's type name for it."""
    assert status == expected, payload
    assert set(payload) == {"error"}, payload
    assert set(payload["error"]) == {"message", "type", "code", "param"}
    assert payload["error"]["code"] == expected
    assert payload["error"]["type"] == error_type(expected)
