"""Slow request bodies against the router (issue 41, probe 1): does a flood of clients sending
their bodies a byte at a time lock legitimate clients out?

A real router process in front of a real reference-engine process. ``--connections`` flood
connections (one asyncio process, raw sockets) each send a request's headers with
``Content-Length: 100000`` and then one body byte every ``--byte-every`` seconds, from 127.0.0.x
source addresses (x = 2, 3, ...; Linux loopback accepts any 127/8 source), reconnecting
whenever the router answers or closes, so the flood stays at its size. Meanwhile a legitimate
closed-loop client (from 127.0.0.1, keep-alive, ``--clients`` connections) sends small
completions, first unloaded, then under the flood; its p50/p99 latency and errors are compared.

Each router variant runs in the same run against the same engine: ``ours`` (this checkout) and,
with ``--old-rev REV``, the router of that git revision (extracted with ``git archive``), e.g.
the commit before the body rule, where a request counted against ``maxInFlight`` (8,192) before
its body was read. The goal: under 10,000 slow bodies, p99 within 2x of unloaded, 0 errors.

The bench raises its open-file limit (it runs as root on the test machines; otherwise up to the
hard limit) before starting the processes, which inherit it; each server sizes its connection
budget from it (``httpserver.connection_budget``).

Run: .venv/bin/python bench/router_slow_bodies.py --connections 10000 --old-rev 31d7fa5 --save
     .venv/bin/python bench/router_slow_bodies.py --quick      (300 connections, short phases)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from router_support import (
    ROOT,
    free_port,
    load,
    machine,
    percentile,
    process_memory_mib,
    request_bytes,
    save,
    wait_healthy,
)

from fleetpilot.api.router_config import EndpointGroup, RouterConfig, RouterTier

MODEL = "slow-model"
LEGIT_BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
FLOOD_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n{"
)
# Open files for the bench and its children: the flood's sockets, the router's two per
# connection (httpserver.connection_budget halves what it has), headroom.
WANTED_FDS = 262_144
TICK_S = 0.1  # the flood's clock: each tick sends the bytes of a slice of its connections


def raise_open_files(wanted: int = WANTED_FDS) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (max(wanted, hard), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
            return target
        except (ValueError, OSError):
            continue
    return soft


# -- the flood (its own process) -------------------------------------------------------------


class _Slow(asyncio.Protocol):
    """One flood connection: headers sent at once, then the body a byte at a time."""

    def __init__(self, flood: Flood, slot: int) -> None:
        self.flood = flood
        self.slot = slot  # which tick of the byte cycle sends its byte
        self.transport: asyncio.Transport | None = None
        self.answer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(FLOOD_HEAD)
        self.flood.open.add(self)
        self.flood.by_tick[self.slot % self.flood.ticks_per_byte].add(self)

    def data_received(self, data: bytes) -> None:
        if not self.answer:
            status = data[9:12].decode("ascii", "replace")
            self.flood.answers[status] = self.flood.answers.get(status, 0) + 1
        self.answer += data[:16]
        if self.transport is not None:
            self.transport.close()  # answered: make room for a fresh one

    def connection_lost(self, exc: Exception | None) -> None:
        self.flood.open.discard(self)
        self.flood.by_tick[self.slot % self.flood.ticks_per_byte].discard(self)
        if not self.answer:
            self.flood.closed_unanswered += 1
        self.transport = None


class Flood:
    def __init__(self, port: int, connections: int, byte_every_s: float, first_source: int):
        self.port = port
        self.connections = connections
        self.byte_every_s = byte_every_s
        self.first_source = first_source
        self.open: set[_Slow] = set()
        # The open connections by the tick of the byte cycle that sends their byte.
        self.ticks_per_byte = max(1, round(byte_every_s / TICK_S))
        self.by_tick: list[set[_Slow]] = [set() for _ in range(self.ticks_per_byte)]
        self.answers: dict[str, int] = {}
        self.closed_unanswered = 0
        self.connect_errors = 0
        self.opened = 0
        self._next = 0

    def _source(self) -> str:
        # ~100 connections per address, as many addresses as that takes (127.0.0.2 and up).
        index = self.first_source + (self._next // 100) % 250
        self._next += 1
        return f"127.0.0.{index}" if index < 255 else f"127.0.1.{index - 254}"

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        slot, source = self._next, self._source()
        try:
            await loop.create_connection(
                lambda: _Slow(self, slot), "127.0.0.1", self.port, local_addr=(source, 0)
            )
            self.opened += 1
        except OSError:
            self.connect_errors += 1

    async def run(self, status: Path, ramp_per_s: float) -> None:
        loop = asyncio.get_running_loop()
        tick_s = TICK_S
        tick = 0
        last_status = 0.0
        while True:
            started = loop.time()
            # Top up towards the target size, at most ramp_per_s a second (the listen
            # backlog is small: a burst of SYNs would only be retried).
            missing = self.connections - len(self.open)
            if missing > 0:
                batch = min(missing, max(1, int(ramp_per_s * tick_s)))
                await asyncio.gather(*(self._connect() for _ in range(batch)))
            # One byte to a 1/ticks_per_byte slice of the connections each tick: every one
            # gets a byte every byte_every_s.
            for conn in list(self.by_tick[tick % self.ticks_per_byte]):
                if conn.transport is not None:
                    conn.transport.write(b" ")
            tick += 1
            now = loop.time()
            if now - last_status >= 1.0:
                last_status = now
                status.write_text(json.dumps(self.report()))
            await asyncio.sleep(max(0.0, tick_s - (loop.time() - started)))

    def report(self) -> dict[str, Any]:
        return {
            "open": len(self.open),
            "opened": self.opened,
            "answers": self.answers,
            "closed_unanswered": self.closed_unanswered,
            "connect_errors": self.connect_errors,
        }


def flood_main(args: argparse.Namespace) -> None:
    raise_open_files()
    flood = Flood(args.port, args.connections, args.byte_every, first_source=2)
    asyncio.run(flood.run(Path(args.status), args.ramp))


# -- the run ---------------------------------------------------------------------------------


@contextlib.contextmanager
def child(
    argv: list[str], cwd: Path, env: dict[str, str], log: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running until the block ends; its stderr into ``log`` (printed when the block
    fails: a server that never listened says why there)."""
    with contextlib.ExitStack() as stack:
        stderr = stack.enter_context(log.open("wb")) if log is not None else subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            yield proc
        except BaseException:
            if log is not None:
                print(f"{argv[2:5]} stderr (last 3,000 chars):", file=sys.stderr)
                print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def router_config(engine: str) -> dict[str, Any]:
    group = EndpointGroup(role="unified", service="svc", selector={}, port=8000,
                          max_num_seqs=16, addresses=[engine])  # fmt: skip
    tier = RouterTier(name="main", model=MODEL, up_to=1.0, mode="unified", endpoints=[group])
    # Every other field at its default (maxInFlight 8,192; the body rule's defaults).
    config = RouterConfig(service="bench", namespace="default", tiers=[tier])
    # Without the defaults: an older router (--old-rev) refuses fields it does not know.
    return config.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)


def legit(port: int, clients: int, duration_s: float) -> dict[str, Any]:
    payload = request_bytes("/v1/completions", LEGIT_BODY)
    stats = asyncio.run(load(port, payload, clients, duration_s, warmup_s=1.0))
    return {
        "requests": len(stats.latencies),
        "errors": stats.errors,
        "statuses": {str(k): v for k, v in stats.statuses.items()},
        "p50_ms": _ms(percentile(stats.latencies, 0.50)),
        "p99_ms": _ms(percentile(stats.latencies, 0.99)),
    }


def _ms(seconds: float) -> float | None:
    """Milliseconds, or None where no request succeeded (JSON has no NaN)."""
    return None if math.isnan(seconds) else round(seconds * 1e3, 1)


def run_variant(
    name: str, code: Path, engine: str, args: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    config = folder / f"router-{name}.yaml"
    config.write_text(yaml.safe_dump(router_config(engine)))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "fleetpilot", "router", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(port), "--discovery", "static"]  # fmt: skip
    result: dict[str, Any] = {"router": name}
    with child(argv, code, env, folder / f"router-{name}.log") as router:
        wait_healthy(port, 120)
        result["unloaded"] = legit(port, args.clients, args.phase)
        print(f"{name}: unloaded {result['unloaded']}", flush=True)
        status = folder / f"flood-{name}.json"
        # The attacker's CPU is not the router's in a cluster; here the flood generator shares
        # the machine, so it runs at the niceness given (default 19: it takes what the router,
        # the engine and the legitimate client leave). It still holds every connection open
        # (flood_open_at_start, the flood's own counts) and each answer is counted.
        flood_argv = ["nice", "-n", str(args.flood_nice), sys.executable,
                      str(Path(__file__).resolve()), "flood",
                      "--port", str(port), "--connections", str(args.connections),
                      "--byte-every", str(args.byte_every), "--ramp", str(args.ramp),
                      "--status", str(status)]  # fmt: skip
        with child(flood_argv, ROOT, {**os.environ, "PYTHONPATH": str(ROOT)}):
            deadline = time.monotonic() + args.connections / args.ramp + 60
            reached = 0
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError, ValueError):
                    reached = json.loads(status.read_text())["open"]
                if reached >= args.connections * 0.98:
                    break
                time.sleep(0.5)
            result["flood_open_at_start"] = reached
            print(f"{name}: flood at {reached} connections", flush=True)
            result["flooded"] = legit(port, args.clients, args.phase)
            result["router_rss_mib_flooded"] = None
            with contextlib.suppress(OSError):
                rss, _ = process_memory_mib(router.pid)
                result["router_rss_mib_flooded"] = round(rss, 1)
            # The control: the same client straight to the engine, the flood still on. What
            # this costs too is the machine's CPU (flood generator, router and engine share
            # it), not the router's handling of the flood.
            engine_port = int(engine.rsplit(":", 1)[1])
            result["flooded_engine_direct"] = legit(engine_port, args.clients, args.phase / 2)
            with contextlib.suppress(OSError, ValueError):
                result["flood"] = json.loads(status.read_text())
        print(f"{name}: flooded {result['flooded']}  flood {result.get('flood')}", flush=True)
    unloaded, flooded = result["unloaded"], result["flooded"]
    both = flooded["p99_ms"] is not None and unloaded["p99_ms"]
    result["p99_ratio"] = round(flooded["p99_ms"] / unloaded["p99_ms"], 2) if both else None
    return result


def old_checkout(rev: str, folder: Path) -> Path:
    """The tree of ``rev`` (git archive) in ``folder``: the old router's code."""
    target = folder / f"old-{rev}"
    target.mkdir()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "fleetpilot"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    flood = sub.add_parser("flood")
    flood.add_argument("--port", type=int, required=True)
    flood.add_argument("--connections", type=int, required=True)
    flood.add_argument("--byte-every", type=float, required=True)
    flood.add_argument("--ramp", type=float, required=True)
    flood.add_argument("--status", required=True)
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--byte-every", type=float, default=4.0, help="seconds between bytes")
    parser.add_argument("--ramp", type=float, default=1000.0, help="new connections a second")
    parser.add_argument("--clients", type=int, default=2, help="legitimate connections")
    parser.add_argument("--phase", type=float, default=40.0, help="seconds of each measurement")
    parser.add_argument("--old-rev", default="", help="also run the router of this revision")
    parser.add_argument("--flood-nice", type=int, default=19,
                        help="the flood generator's niceness (0: an equal)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="runs of this router")
    parser.add_argument("--quick", action="store_true", help="300 connections, 10 s phases")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    if args.cmd == "flood":
        flood_main(args)
        return
    if args.quick:
        args.connections, args.phase = 300, 10.0
    fds = raise_open_files()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        engine_port = free_port()
        engine_argv = [sys.executable, "-m", "fleetpilot", "engine", "--backend", "reference",
                       "--host", "127.0.0.1", "--port", str(engine_port), "--model-config",
                       "tiny", "--served-model-name", MODEL, "--max-model-len", "512"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        # Ours is repeated (--rounds; each round a fresh router and flood) to show the spread;
        # the old router is run once: it refuses everything under the flood every time.
        variants = [(f"ours #{n + 1}" if args.rounds > 1 else "ours", ROOT)
                    for n in range(args.rounds)]  # fmt: skip
        if args.old_rev:
            variants.append((f"old {args.old_rev}", old_checkout(args.old_rev, folder)))
        results = []
        with child(engine_argv, ROOT, env):
            wait_healthy(engine_port, 180)
            direct = legit(engine_port, args.clients, args.phase / 2)
            print(f"engine direct, unloaded: {direct}", flush=True)
            for name, code in variants:
                results.append(run_variant(name, code, f"127.0.0.1:{engine_port}", args, folder))
    print(
        f"\n{args.connections} slow-body connections (Content-Length 100000, a byte every "
        f"{args.byte_every:g} s); legitimate client: {args.clients} keep-alive connections, "
        f"{args.phase:g} s a phase"
    )
    print(f"engine direct, unloaded: p50 {direct['p50_ms']} ms, p99 {direct['p99_ms']} ms")
    print(f"{'router':16} {'p50 ms':>14} {'p99 ms':>16} {'p99 x':>6} {'errors':>12}  flood answers")
    for r in results:
        u, f = r["unloaded"], r["flooded"]
        print(
            f"{r['router']:16} {u['p50_ms']!s:>6} -> {f['p50_ms']!s:<6} {u['p99_ms']!s:>7} -> "
            f"{f['p99_ms']!s:<7} {r['p99_ratio']!s:>6} {u['errors']:>4} -> {f['errors']:<5}  "
            f"{r.get('flood', {}).get('answers')}"
        )
        control = r["flooded_engine_direct"]
        print(f"{'':16} engine direct under the flood: p50 {control['p50_ms']}, p99 "
              f"{control['p99_ms']} ms, errors {control['errors']}; router RSS "
              f"{r.get('router_rss_mib_flooded')} MiB at the flood's end")  # fmt: skip
    if args.save:
        path = save(
            "router_slow_bodies",
            {
                "benchmark": "router_slow_bodies",
                "commit": git("rev-parse", "HEAD"),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": {**machine(), "open_files": fds},
                "args": {k: v for k, v in vars(args).items() if k != "cmd"},
                "engine_direct_unloaded": direct,
                "results": results,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
