"""Which pooled upstream client for the router: aiohttp.ClientSession or httpx.AsyncClient.

The same echo engine (its own process, pinned to CPU 1) is called by each client from this
process (pinned to CPU 0) at concurrency 1, 32 and 256, non-streaming and streaming (5 SSE
chunks read chunk by chunk, as the router relays them). Reported: requests/s and p50/p99
latency per client. Prints a table and writes bench/results/router_client.json.

Run: .venv/bin/python bench/router_client.py
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import httpx
from router_support import echo_process, free_port, machine, percentile, pin, save

CONCURRENCY = [1, 32, 256]
DURATION_S = 3.0
BODY = {"model": "echo", "prompt": "hello", "max_tokens": 8}


async def drive(call: Callable[[], Awaitable[None]], concurrency: int) -> dict[str, float]:
    latencies: list[float] = []
    warm_until = time.perf_counter() + 0.5
    stop = warm_until + DURATION_S

    async def worker() -> None:
        while (sent := time.perf_counter()) < stop:
            await call()
            if sent >= warm_until:
                latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "req_per_s": len(latencies) / DURATION_S,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


async def with_aiohttp(url: str, stream: bool, concurrency: int) -> dict[str, float]:
    data = json.dumps({**BODY, "stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def call() -> None:
            async with session.post(url, data=data, headers=headers) as resp:
                if stream:
                    while await resp.content.readany():
                        pass
                else:
                    await resp.read()

        return await drive(call, concurrency)


async def with_httpx(url: str, stream: bool, concurrency: int) -> dict[str, float]:
    data = json.dumps({**BODY, "stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def call() -> None:
            if stream:
                async with client.stream("POST", url, content=data, headers=headers) as resp:
                    async for _ in resp.aiter_raw():
                        pass
            else:
                resp = await client.post(url, content=data, headers=headers)
                resp.read()

        return await drive(call, concurrency)


def main() -> None:
    pinned = pin({0})
    port = free_port()
    rows: list[dict[str, Any]] = []
    with echo_process(port, {1}):
        url = f"http://127.0.0.1:{port}/v1/completions"
        for stream in (False, True):
            for concurrency in CONCURRENCY:
                for name, fn in (("aiohttp", with_aiohttp), ("httpx", with_httpx)):
                    result = asyncio.run(fn(url, stream, concurrency))
                    rows.append(
                        {"client": name, "stream": stream, "concurrency": concurrency, **result}
                    )
    print(f"{'client':8} {'stream':6} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for r in rows:
        print(
            f"{r['client']:8} {r['stream']!s:6} {r['concurrency']:>5} {r['req_per_s']:>9.0f} "
            f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f}"
        )
    ratio = {
        f"{'stream' if s else 'plain'}_c{c}": next(
            r["req_per_s"]
            for r in rows
            if (r["client"], r["stream"], r["concurrency"]) == ("aiohttp", s, c)
        )
        / next(
            r["req_per_s"]
            for r in rows
            if (r["client"], r["stream"], r["concurrency"]) == ("httpx", s, c)
        )
        for s in (False, True)
        for c in CONCURRENCY
    }
    print("aiohttp/httpx throughput ratio:", {k: round(v, 2) for k, v in ratio.items()})
    path = save(
        "router_client",
        {
            "benchmark": "router_client",
            "machine": machine(),
            "client_cpus": sorted(pinned),
            "duration_s": DURATION_S,
            "rows": rows,
            "aiohttp_over_httpx_throughput": ratio,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
