"""Router CPU per request against production-stack's router, open loop, in one run (issue 44,
item 4: at most a quarter of production-stack's, with the KV-event tokenizer on).

Every router is its own process pinned to CPU 0; the echo engine and this load generator share
CPU 1. The echo engine answers chat completions at once (whole, or 5 SSE chunks and
``[DONE]``), serves vLLM's gauges on /metrics and, like a vLLM engine run with
``--kv-events-config``, publishes a ``BlockStored`` batch on its ZMQ socket for each request
(one block per 16 tokens of the prompt, as the engine caches it), so the router subscribes,
decodes and indexes events as in a cluster.

Load: chat completions with a system prompt of one of 12 tenants (150-600 words) and a user
message (20-80 words), a thousand distinct bodies in turn, sent open loop at ``--rate``
req/s (Poisson) for ``--duration`` seconds after a warm-up, over a pool of keep-alive
connections. The router's CPU time (user + system, every thread) over the measured window,
divided by the requests answered in it, is its CPU per request.

Arms:
- ``fleetpilot``: ``fleetpilot router`` with the tier's tokenizer (a byte-level BPE of ~32k
  tokens trained here, ChatML: ``router_tokenize.train_bpe_files``) and the engine's KV events:
  each request is rendered, tokenized (prefix-cached), keyed and looked up in the event index;
- ``fleetpilot, guessed``: the same router without a tokenizer (its guessed text index);
- ``fleetpilot, EPP``: the first arm's router as a Gateway API Inference Extension endpoint
  picker (``eppPort``), behind the test gateway (``e2e/gateway``, Envoy's side of ext_proc,
  on CPU 1 with the client): the load goes to the gateway, and the router's CPU is what it
  spends picking and watching each answer pass through the ext_proc stream (issue 45);
- ``GIE, EPP``: the Gateway API Inference Extension's own EPP (v1.3.0, ``e2e/gie-epp``, its
  InferencePool chart's default profile) behind the same gateway, the echo engine its one
  endpoint (a Ready pod object at 127.0.0.1 on the test control plane, which it watches; the
  control plane runs unpinned): the CPU a Go picker spends on the same requests;
- ``python ext_proc floor``: ``bench/epp_floor.py`` behind the same gateway, a grpc.aio
  servicer on uvloop that speaks the protocol as fleetpilot's picker does but decides nothing:
  what Python's gRPC alone costs a request, under any Python picker's decisions;
- ``prodstack-rr`` / ``prodstack-prefix``: production-stack's router (``prodstack_router``,
  skipped when not installed) with ``roundrobin`` / ``prefixaware``.

``--breakdown`` times, in this process on the same bodies (``time.process_time``), the parts
of the tokenizer arm's work a request: its features, its KV-index keys (the chat template, the
cut scan, prefix digests, encoding what is new, chaining block keys), remembering the reply for
the next turn, and decoding and indexing one engine event batch of its blocks.

Run: .venv/bin/python bench/router_cpu.py [--rate 500] [--duration 20] [--rounds 1] [--save]
     .venv/bin/python bench/router_cpu.py --breakdown
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import prodstack_router
import router_overhead
import yaml
from gateway_pickers import ENGINE_LABELS, NAMESPACE, control_plane, wait_for_endpoints
from router_fleet import cpu_seconds, fleetpilot_routers
from router_support import (
    _OK_HEAD,
    _STREAM_HEAD,
    EchoProtocol,
    _Client,
    _http_chunk,
    commit,
    free_port,
    machine,
    percentile,
    pin,
    process,
    raise_fd_limit,
    request_bytes,
    save,
)
from router_tokenize import Text, train_bpe_files

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.engine.reference.kv_publisher import KVEventPublisher, KVEventsConfig
from fleetpilot.kv_events import BlockStored, EventBatch, decode_batch, encode_batch
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.policies.kv_index import KVIndex
from fleetpilot.routing.tokenizer.request import load_tokenizer
from fleetpilot.testing.controlplane import ControlPlane
from fleetpilot.testing.gateway import Gateway
from fleetpilot.testing.gie_epp import GieEpp

MODEL = "bench"
BLOCK_SIZE = 16
BODIES = 1000
TENANTS = 12
WARMUP_S = 3.0
CONNECTIONS = 128
ARMS = (
    "fleetpilot",
    "fleetpilot, guessed",
    "fleetpilot, EPP",
    "GIE, EPP",
    "python ext_proc floor",
    "prodstack-rr",
    "prodstack-prefix",
)

_CHAT = json.dumps(
    {
        "id": "chatcmpl-echo",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello from the echo engine"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 6, "total_tokens": 306},
    }
).encode()
_CHAT_CHUNK = (
    b'data: {"id":"chatcmpl-echo","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "},"finish_reason":null}]}\n\n'
)


# -- the echo engine with KV events -----------------------------------------------------------


class KVEchoProtocol(EchoProtocol):
    """The echo engine's connection answering chat completions; each one publishes its blocks."""

    publisher: KVEventPublisher
    rng = random.Random(0)

    def _answer(self, head: bytes, body: bytes) -> None:
        if head.startswith(b"get "):
            super()._answer(head, body)
            return
        t = self.transport
        assert t is not None
        self._publish(len(body) // 4)  # ~4 characters a token
        if b'"stream": true' in body or b'"stream":true' in body:
            t.write(_STREAM_HEAD)
            for _ in range(5):
                t.write(_http_chunk(_CHAT_CHUNK))
            t.write(_http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            t.write(_OK_HEAD % len(_CHAT) + _CHAT)

    def _publish(self, tokens: int) -> None:
        blocks = max(1, tokens // BLOCK_SIZE)
        hashes: list[bytes | int] = [self.rng.getrandbits(63) for _ in range(blocks)]
        stored = BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[0] * (blocks * BLOCK_SIZE),
            block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        self.publisher.publish(EventBatch(ts=time.time(), events=[stored]))


async def serve_kv_echo(port: int, events_port: int, replay_port: int) -> None:
    KVEchoProtocol.publisher = KVEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://127.0.0.1:{events_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        )
    )
    loop = asyncio.get_running_loop()
    server = await loop.create_server(KVEchoProtocol, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


# -- load ---------------------------------------------------------------------------------------


def bodies(seed: int, stream: bool) -> list[bytes]:
    """The requests, in turn: each tenant's system prompt and a user message of its own."""
    text = Text(seed)
    rng = random.Random(seed)
    systems = [text.paragraph(rng.randint(150, 600)) for _ in range(TENANTS)]
    out = []
    for i in range(BODIES):
        messages = [
            {"role": "system", "content": systems[i % TENANTS]},
            {"role": "user", "content": text.paragraph(rng.randint(20, 80))},
        ]
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream}
        out.append(request_bytes("/v1/chat/completions", body))
    return out


async def open_loop(
    port: int,
    payloads: Sequence[bytes],
    rate: float,
    duration_s: float,
    seed: int,
    probe: Callable[[], float],
) -> dict[str, Any]:
    """Poisson arrivals at ``rate`` for ``WARMUP_S + duration_s`` over up to ``CONNECTIONS``
    keep-alive connections (a request that finds none idle is dropped and counted); the
    latencies and answers of those sent after the warm-up, and what ``probe`` read at the
    measured window's start and end (``probe_from``, ``probe_to``)."""
    loop = asyncio.get_running_loop()
    # First in, first out: every connection is used in turn, so none sits idle past a server's
    # keep-alive timeout (uvicorn's is 5 s) and is found closed.
    idle: collections.deque[_Client] = collections.deque()
    for _ in range(CONNECTIONS):
        _, client = await loop.create_connection(_Client, "127.0.0.1", port)
        idle.append(client)
    rng = random.Random(seed)
    start = time.perf_counter()
    measure_from, stop_at = start + WARMUP_S, start + WARMUP_S + duration_s
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    dropped = errors = 0
    tasks: set[asyncio.Task[None]] = set()
    probed: dict[str, float] = {}

    async def probe_at(name: str, when: float) -> None:
        await asyncio.sleep(max(0.0, when - time.perf_counter()))
        probed[name] = probe()

    probes = [loop.create_task(probe_at("probe_from", measure_from)),
              loop.create_task(probe_at("probe_to", stop_at))]  # fmt: skip

    async def send(client: _Client, payload: bytes, sent: float) -> None:
        nonlocal errors
        try:
            status, _ = await asyncio.wait_for(client.send(payload), 30)
        except (ConnectionError, TimeoutError):
            errors += sent >= measure_from
            return
        done = time.perf_counter()
        if not client.closed:
            idle.append(client)
        if sent >= measure_from:
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                latencies.append(done - sent)

    at = start
    index = 0
    while True:
        at += rng.expovariate(rate)
        if at >= stop_at:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if not idle:
            dropped += at >= measure_from
            continue
        task = loop.create_task(send(idle.popleft(), payloads[index % len(payloads)], at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        index += 1
    await asyncio.gather(*probes)
    if tasks:
        await asyncio.wait(tasks, timeout=30)
    for client in idle:
        if client.transport is not None:
            client.transport.close()
    return {
        **probed,
        "answered": len(latencies),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "dropped": dropped,
        "errors": errors,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


def measured(
    pid: int, port: int, payloads: Sequence[bytes], args: argparse.Namespace
) -> dict[str, Any]:
    """One load run against the router ``pid`` serving on ``port``: its latencies and its CPU
    per answered request over the measured window."""
    result = asyncio.run(
        open_loop(port, payloads, args.rate, args.duration, args.seed, lambda: cpu_seconds(pid))
    )
    spent = result.pop("probe_to") - result.pop("probe_from")
    result["cpu_s"] = spent
    result["cpu_ms_per_request"] = spent / result["answered"] * 1e3 if result["answered"] else None
    return result


# -- the routers ------------------------------------------------------------------------------


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


def router_config(tokenizer: Path | None) -> RouterConfig:
    """``router_overhead``'s config over the echo engine, serving ``MODEL`` with the tier's
    ``tokenizer`` (or none), its address in the endpoints file with its KV-event ports."""
    data = router_overhead.router_config(8000)
    tier = data["tiers"][0]
    tier["model"] = MODEL
    tier["tokenizer"] = str(tokenizer) if tokenizer is not None else None
    del tier["endpoints"][0]["addresses"]
    tier["endpoints"][0]["blockSize"] = BLOCK_SIZE
    return RouterConfig.model_validate(data)


@contextlib.contextmanager
def arm_router(
    arm: str,
    echo: str,
    kv_ports: tuple[int, int],
    tokenizer: Path,
    workdir: Path,
    plane: ControlPlane | None = None,
) -> Iterator[tuple[int, int]]:
    """The arm's router process over the echo engine, pinned to CPU 0: (pid, port)."""
    if arm == "GIE, EPP":
        assert plane is not None
        port = int(echo.rsplit(":", 1)[1])
        with GieEpp(plane.kubeconfig, NAMESPACE, ENGINE_LABELS, [port]) as gie:
            assert gie.pid is not None
            pin_threads(gie.pid, {0})
            wait_for_endpoints(gie, 1)
            with gateway_in_front(gie.address) as gateway_port:
                yield gie.pid, gateway_port
        return
    if arm == "python ext_proc floor":
        port = free_port()
        argv = [sys.executable, str(Path(__file__).parent / "epp_floor.py"), "--port",
                str(port), "--endpoint", echo]  # fmt: skip
        with process(argv, {0}, port) as floor, gateway_in_front(f"127.0.0.1:{port}") as gp:
            yield floor.pid, gp
        return
    if arm.startswith("prodstack"):
        with prodstack_router.routers(arm, 1, [echo], MODEL, workdir) as urls:
            port = _port_of(urls[0])
            pid = _listener_pid(port)
            pin_threads(pid, {0})
            yield pid, port
        return
    endpoints = workdir / "endpoints.yaml"
    events, replay = kv_ports
    item = {"tier": "echo", "address": echo, "kvEventsPort": events, "kvReplayPort": replay}
    endpoints.write_text(yaml.safe_dump({"endpoints": [item]}))
    guessed = arm.endswith("guessed")
    cfg = router_config(None if guessed else tokenizer)
    picker = arm.endswith("EPP")
    if picker:
        cfg = cfg.model_copy(update={"epp_port": free_port()})
    with fleetpilot_routers(
        "guessed" if guessed else "events",
        1,
        cfg,
        endpoints,
        workdir,
        replicas=1,
        events=not guessed,
    ) as (router,):
        pin_threads(router.pid, {0})
        if not picker:
            yield router.pid, _port_of(router.url)
            return
        with gateway_in_front(f"127.0.0.1:{cfg.epp_port}") as gateway_port:
            yield router.pid, gateway_port


@contextlib.contextmanager
def gateway_in_front(picker: str) -> Iterator[int]:
    """The test gateway in front of ``picker``, pinned to CPU 1 with the client: its port."""
    with Gateway(picker) as gateway:
        assert gateway.pid is not None
        pin_threads(gateway.pid, {1})
        yield _port_of(gateway.url)


def _port_of(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    assert port is not None
    return port


def _listener_pid(port: int) -> int:
    """The pid of the process listening on ``port`` (production-stack's router: its console
    script may exec or fork)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":
            inode = fields[9]
    if inode is None:
        raise RuntimeError(f"nothing listens on port {port}")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == f"socket:[{inode}]":
                    return int(proc.name)
    raise RuntimeError(f"no process holds the listener on port {port}")


def breakdown(tokenizer_dir: Path, seed: int) -> dict[str, float]:
    """Microseconds of CPU a request for each part of the tokenizer arm's work (the second
    pass over the bodies: the prefix cache and the needle sets as a running router has them)."""
    raw = [b.split(b"\r\n\r\n", 1)[1] for b in bodies(seed, stream=False)]
    payloads = [json.loads(r) for r in raw]
    tokenizer = load_tokenizer(str(tokenizer_dir))
    index = KVIndex(max_blocks=1 << 20)
    rng = random.Random(seed)
    batches = []
    for body in raw:
        blocks = max(1, len(body) // 4 // BLOCK_SIZE)
        stored = BlockStored(
            block_hashes=[rng.getrandbits(63) for _ in range(blocks)], parent_block_hash=None,
            token_ids=[0] * (blocks * BLOCK_SIZE), block_size=BLOCK_SIZE, lora_id=None,
            medium="GPU", lora_name=None,
        )  # fmt: skip
        batches.append(encode_batch(EventBatch(ts=0.0, events=[stored])))
    parts: dict[str, Callable[[int], object]] = {
        "json": lambda i: json.loads(raw[i]),
        "features": lambda i: extract_features(payloads[i], "chat"),
        "keys": lambda i: tokenizer.keys("chat", payloads[i], BLOCK_SIZE),
        "remember reply": lambda i: tokenizer.remember_reply(payloads[i], "hello from the echo"),
        "event batch": lambda i: index.apply("echo", decode_batch(batches[i]).events),
    }
    out = {}
    for name, part in parts.items():
        for _ in range(2):
            started = time.process_time()
            for i in range(len(raw)):
                part(i)
            out[name] = (time.process_time() - started) / len(raw) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    echo = sub.add_parser("echo", help="run the echo engine with KV events")
    echo.add_argument("--port", type=int, required=True)
    echo.add_argument("--events-port", type=int, required=True)
    echo.add_argument("--replay-port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--stream", nargs="+", default=["plain", "stream"])
    parser.add_argument("--breakdown", action="store_true", help="the tokenizer arm's parts")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--name", default="router_cpu", help="the results file's name")
    args = parser.parse_args()
    if args.command == "echo":
        asyncio.run(serve_kv_echo(args.port, args.events_port, args.replay_port))
        return
    if args.breakdown:
        with tempfile.TemporaryDirectory() as tmp:
            parts = breakdown(train_bpe_files(Text(args.seed), Path(tmp) / "bpe32k"), args.seed)
        for name, us in parts.items():
            print(f"{name:16} {us:7.1f} us CPU a request")
        if args.save:
            data = {"benchmark": "router_cpu --breakdown", "us_per_request": parts}
            print(f"wrote {save('router_cpu_breakdown', data)}")
        return
    raise_fd_limit()
    arms = [a for a in args.arms if not a.startswith("prodstack") or prodstack_router.available()]
    if len(arms) < len(args.arms):
        print(f"skipped production-stack: {prodstack_router.MISSING}", file=sys.stderr)
    client_cpus = pin({1})
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = train_bpe_files(Text(args.seed), folder / "bpe32k")
        echo_port, events_port, replay_port = free_port(), free_port(), free_port()
        argv = [sys.executable, str(Path(__file__)), "echo", "--port", str(echo_port),
                "--events-port", str(events_port), "--replay-port", str(replay_port)]  # fmt: skip
        needs_kube = "GIE, EPP" in arms
        with (
            process(argv, client_cpus, echo_port),
            control_plane(folder) if needs_kube else contextlib.nullcontext() as plane,
        ):
            for round_ in range(args.rounds):
                for mode in args.stream:
                    payloads = bodies(args.seed, stream=mode == "stream")
                    # Rotated per round, so no arm always runs first (or last) on a warm machine.
                    order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
                    for arm in order:
                        workdir = folder / f"{arm.replace(', ', '-')}-{mode}-{round_}"
                        workdir.mkdir()
                        with arm_router(
                            arm, f"127.0.0.1:{echo_port}", (events_port, replay_port),
                            tokenizer, workdir, plane,
                        ) as (pid, port):  # fmt: skip
                            result = measured(pid, port, payloads, args)
                        row = {"arm": arm, "mode": mode, "round": round_, **result}
                        rows.append(row)
                        print(
                            f"{arm:22} {mode:6} round {round_}: {row['cpu_ms_per_request']:.3f} "
                            f"CPU ms/request, {row['answered']} answered, p50 {row['p50_ms']:.2f}"
                            f" ms, p99 {row['p99_ms']:.2f} ms, dropped {row['dropped']}, "
                            f"errors {row['errors']}, statuses {row['statuses']}",
                            flush=True,
                        )
    summary = summarize(rows)
    for line in summary["lines"]:
        print(line)
    if args.save:
        path = save(
            args.name,
            {
                "benchmark": "router_cpu",
                "commit": commit(),
                "machine": machine(),
                "args": {k: v for k, v in vars(args).items() if k not in ("command", "name")},
                "rows": rows,
                "medians": summary["medians"],
            },
        )
        print(f"wrote {path}")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and arm, the median CPU per request over the rounds (and its range), and how
    many times cheaper than production-stack's round robin each arm is."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        arms = medians[mode] = {}
        for arm in dict.fromkeys(r["arm"] for r in rows if r["mode"] == mode):
            values = sorted(
                r["cpu_ms_per_request"] for r in rows if r["mode"] == mode and r["arm"] == arm
            )
            arms[arm] = {"median": values[len(values) // 2], "min": values[0], "max": values[-1]}
    lines = []
    for mode, arms in medians.items():
        base = arms.get("prodstack-rr", {}).get("median")
        for arm, m in arms.items():
            ratio = f", {base / m['median']:.2f}x cheaper than prodstack-rr" if base else ""
            lines.append(
                f"{mode:6} {arm:22} {m['median']:.3f} CPU ms/request "
                f"({m['min']:.3f}-{m['max']:.3f}){ratio}"
            )
    return {"medians": medians, "lines": lines}


if __name__ == "__main__":
    main()
