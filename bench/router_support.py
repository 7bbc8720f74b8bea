"""Shared pieces of the router benchmarks: a fast echo engine, a lean HTTP/1.1 load generator,
and helpers to run processes pinned to CPU cores.

Both the echo engine and the load generator are raw asyncio protocols rather than aiohttp: the
benchmarks measure the router, so everything around it must cost as little as possible. The
echo engine answers ``/v1/completions`` and ``/v1/chat/completions`` with a fixed JSON body, or,
when the body asks for ``"stream": true``, with five SSE chunks and ``[DONE]`` (each chunk its
own HTTP chunk, as an engine writes them).

Run the echo engine alone: ``python bench/router_support.py echo --port 9001``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetpilot.runtime.processes import http_ok

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

_COMPLETION = json.dumps(
    {
        "id": "cmpl-echo",
        "object": "text_completion",
        "created": 0,
        "model": "echo",
        "choices": [{"index": 0, "text": "hello from the echo engine", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
    }
).encode()
_CHUNK = (
    b'data: {"id":"cmpl-echo","object":"text_completion","created":0,"model":"echo",'
    b'"choices":[{"index":0,"text":"tok ","finish_reason":null}]}\n\n'
)
STREAM_CHUNKS = 5


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
_METRICS = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"


class EchoProtocol(asyncio.Protocol):
    """One keep-alive connection of the echo engine."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(
                    head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]
                )
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = bytes(self.buf[end + 4 : total])
            del self.buf[:total]
            self._answer(head, body)

    def _answer(self, head: bytes, body: bytes) -> None:
        t = self.transport
        assert t is not None
        if head.startswith(b"get /metrics"):
            t.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(_METRICS), _METRICS))
        elif head.startswith(b"get "):
            t.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        elif b'"stream":true' in body or b'"stream": true' in body:
            t.write(_STREAM_HEAD)
            for _ in range(STREAM_CHUNKS):
                t.write(_http_chunk(_CHUNK))
            t.write(_http_chunk(b"data: [DONE]\n\n"))
            t.write(b"0\r\n\r\n")
        else:
            t.write(_OK_HEAD % len(_COMPLETION) + _COMPLETION)


async def serve_echo(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoProtocol, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# -- load generator --------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """A keep-alive HTTP/1.1 client connection that times each response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, float]] | None = None
        self.first_body: float = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def send(self, payload: bytes) -> asyncio.Future[tuple[int, float]]:
        self.buf.clear()
        self.first_body = 0.0
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(payload)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None or self.waiter.done():
            return
        body = end + 4
        if len(self.buf) > body and not self.first_body:
            self.first_body = time.perf_counter()
        head = bytes(self.buf[:end]).lower()
        status = int(head[9:12])
        i = head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j > 0 else None])
            if len(self.buf) - body >= length:
                self.waiter.set_result((status, self.first_body))
            return
        if (
            b"chunked" in head
            and self.buf.endswith(b"0\r\n\r\n")
            and _chunked_complete(self.buf, body)
        ):
            self.waiter.set_result((status, self.first_body))


def _chunked_complete(buf: bytearray, pos: int) -> bool:
    while True:
        line = buf.find(b"\r\n", pos)
        if line < 0:
            return False
        size = int(bytes(buf[pos:line]).split(b";")[0], 16)
        if size == 0:
            return len(buf) >= line + 4
        pos = line + 2 + size + 2
        if pos > len(buf):
            return False


@dataclass
class RunStats:
    """Latencies (s) of one load run."""

    latencies: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (second, completions)

    def summary(self) -> dict[str, Any]:
        n = len(self.latencies)
        return {
            "requests": n,
            "errors": self.errors,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "req_per_s": n / self.elapsed_s if self.elapsed_s else 0.0,
            "p50_ms": percentile(self.latencies, 0.50) * 1e3,
            "p99_ms": percentile(self.latencies, 0.99) * 1e3,
            "first_chunk_p50_ms": percentile(self.first_chunk, 0.50) * 1e3,
            "first_chunk_p99_ms": percentile(self.first_chunk, 0.99) * 1e3,
        }


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def request_bytes(path: str, body: dict[str, Any], host: str = "127.0.0.1") -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def load(
    port: int,
    payload: bytes,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.5,
    timeline: bool = False,
) -> RunStats:
    """``concurrency`` connections each sending back-to-back requests for ``duration_s``
    (after ``warmup_s`` whose results are dropped)."""
    loop = asyncio.get_running_loop()
    stats = RunStats()
    clients: list[_Client] = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Client, "127.0.0.1", port)
        clients.append(proto)
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + duration_s
    buckets: dict[int, int] = {}

    async def worker(client: _Client) -> None:
        while True:
            sent = time.perf_counter()
            if sent >= stop_at:
                return
            try:
                status, first = await asyncio.wait_for(client.send(payload), 30)
            except (ConnectionError, TimeoutError):
                if sent >= measure_from:
                    stats.errors += 1
                return
            done = time.perf_counter()
            if sent >= measure_from:
                stats.statuses[status] = stats.statuses.get(status, 0) + 1
                if status != 200:
                    stats.errors += 1
                    continue
                stats.latencies.append(done - sent)
                if first:
                    stats.first_chunk.append(first - sent)
                if timeline:
                    second = int(done - measure_from)
                    buckets[second] = buckets.get(second, 0) + 1

    await asyncio.gather(*(worker(c) for c in clients))
    # Requests count when *sent* inside the window, so the window is the denominator.
    stats.elapsed_s = duration_s
    for c in clients:
        if c.transport is not None:
            c.transport.close()
    stats.timeline = sorted(buckets.items())
    return stats


# -- processes -------------------------------------------------------------------------------


def raise_fd_limit() -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def pin(cpus: set[int]) -> set[int]:
    """Pin this process to ``cpus`` where the platform allows; returns the set in force."""
    available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    wanted = cpus & available if available else set()
    if wanted and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, wanted)
        return wanted
    return available


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, all held open while they are chosen (picked one
    at a time, the OS may hand the same port out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def wait_healthy(port: int, timeout_s: float = 120.0) -> None:
    """Until the server on ``port`` answers ``/health`` with 200: an engine listens before
    its model is loaded, and answers 503 ("starting") until then."""
    deadline = time.monotonic() + timeout_s
    wait_port(port, timeout_s)
    while time.monotonic() < deadline:
        if http_ok(f"http://127.0.0.1:{port}/health", timeout_s=2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the server on port {port} did not become healthy")


@contextlib.contextmanager
def process(argv: list[str], cpus: set[int] | None, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """A child process pinned to ``cpus``, waited for on ``port``, killed afterwards."""

    def setup() -> None:
        if cpus and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cpus)
        raise_fd_limit()

    proc = subprocess.Popen(argv, preexec_fn=setup, stdout=subprocess.DEVNULL, cwd=ROOT)
    try:
        wait_port(port)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def serving(
    procs: Sequence[subprocess.Popen[bytes]], ports: Sequence[int], timeout_s: float
) -> Iterator[list[str]]:
    """Servers started as ``procs`` on ``ports``: their addresses once every one is healthy,
    each stopped afterwards (killed if it does not end within 15 s)."""
    try:
        for port in ports:
            wait_healthy(port, timeout_s)
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        stop_all(procs, 15.0)


def stop_all(procs: Sequence[subprocess.Popen[Any]], timeout_s: float = 10.0) -> None:
    """SIGTERM every process, then wait for each; one still running after ``timeout_s`` is
    killed."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def echo_process(port: int, cpus: set[int] | None) -> contextlib.AbstractContextManager[Any]:
    return process([sys.executable, str(Path(__file__)), "echo", "--port", str(port)], cpus, port)


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """Another process spinning on one core for the duration: the engines run slower than
    the trace's arrivals, so replicas queue (a fleet at its limit, or a noisy neighbour)."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait(10)


def process_memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) memory of process ``pid`` in MiB, from /proc (Linux); OSError
    once the process is gone."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def commit() -> str:
    """The checkout's commit, marked ``-dirty`` when fleetpilot/ has uncommitted changes: the
    code a results file measured."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "fleetpilot"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return head.stdout.strip() + ("-dirty" if dirty else "")


def measured_at() -> str:
    """Now, as results files record the day and time they were measured (UTC)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def save(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json``, stamped with the commit, the UTC date and the
    machine it was measured on (``bench/tables.py`` quotes them under each table) unless the
    benchmark recorded its own (``bench/compare_trees.py`` measures two commits)."""
    stamp: dict[str, Any] = {
        "date": measured_at(),
        "machine": machine(),
    }
    if not ("base" in data and "head" in data):
        stamp["commit"] = commit()
    data = {**stamp, **data}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def cpu_model() -> str | None:
    """The processor's name (Linux), so a results file says what kind of machine it ran on."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "loadavg_at_start": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    echo = sub.add_parser("echo")
    echo.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if args.cmd == "echo":
        raise_fd_limit()
        asyncio.run(serve_echo(args.port))


if __name__ == "__main__":
    main()
