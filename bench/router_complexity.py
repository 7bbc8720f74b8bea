"""Complexity routing over a small and a large tier of reference engines, and spill-over when
the small tier saturates.

Tiers: "small" = one reference engine with the tiny model preset (max-num-seqs 4, 5 ms added per
engine step to stand in for a slower accelerator); "large" = one engine with the 'small' preset
(a ~20x larger model, max-num-seqs 8). Router: small takes scores up to 0.4; spill-over when the
small tier's queue passes 2 per replica or its batch is full.

Phases, in one run:

1. mixed: 160 requests, 70% chit-chat (short, max_tokens 16) and 30% hard (a long prompt with
   code, maths and a reasoning instruction, max_tokens 64), 4 at a time - once with every
   request pinned to the large tier (the baseline: one big model for everything), once routed
   by complexity. Reported: share per tier, TTFT p50/p95 per class, requests/s.
2. burst: only chit-chat, 24 at a time for 6 s - the small tier saturates and requests spill
   to the large one (per-second share of spilled requests).
3. calm: only chit-chat, 1 at a time for 4 s - the spill stops.

Run: .venv/bin/python bench/router_complexity.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
from aiohttp import web
from router_support import ROOT, free_port, machine, percentile, save, wait_healthy

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.routing.app import ROUTER_APP, build_app
from fleetpilot.routing.endpoints import StaticSource

SIMPLE = [
    "Hi! What is the capital of France?",
    "Thanks, that helped. Have a nice day!",
    "What time zone is Lisbon in?",
    "Translate 'good morning' to Spanish.",
    "Is it going to rain tomorrow in Oslo?",
]
HARD = (
    "You are reviewing a pull request. Think step by step and analyze the trade-offs.\n"
    "```python\ndef integrate(f, a, b, n=1000):\n    h = (b - a) / n\n"
    "    return h * sum(f(a + (i + 0.5) * h) for i in range(n))\n```\n"
    "Prove that the midpoint rule's error is O(h^2) for twice differentiable f, derive the "
    "constant, and explain why the integral of x^2 from 0 to 1 is approximated within 1e-6. "
)


def workload(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.7:
            prompt = f"{rng.choice(SIMPLE)} (request {i})"
            out.append(("simple", {"messages": [{"role": "user", "content": prompt}],
                                   "max_tokens": 16}))  # fmt: skip
        else:
            # A distinct opening per request: no prefix-cache hits flatter the large tier.
            prompt = f"Case {i} of {rng.random():.6f}. " + HARD * 3
            out.append(("hard", {"messages": [{"role": "user", "content": prompt}],
                                 "max_tokens": 64}))  # fmt: skip
    return out


@contextlib.contextmanager
def engine(model: str, preset: str, *extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetpilot.engine.reference.server", "--host", "127.0.0.1",
         "--port", str(port), "--model-config", preset, "--max-model-len", "2048",
         "--served-model-name", model, "--log-level", "warning", *extra],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_healthy(port, 120)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def config(small: str, large: str) -> RouterConfig:
    def tier(name: str, up_to: float, address: str, seqs: int) -> dict[str, Any]:
        return {
            "name": name, "model": f"{name}-model", "upTo": up_to, "mode": "unified",
            "endpoints": [{"role": "unified", "service": name, "selector": {}, "port": 1,
                           "maxNumSeqs": seqs, "addresses": [address]}],
        }  # fmt: skip

    return RouterConfig.model_validate(
        {
            "service": "bench",
            "namespace": "bench",
            "tiers": [tier("small", 0.4, small, 4), tier("large", 1.0, large, 8)],
            "spillover": {"enabled": True, "queueThreshold": 2},
            "scrape": {"interval": "200ms"},
            "requestTimeout": "120s",
        }
    )


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url
        self.records: list[dict[str, Any]] = []

    async def send(self, kind: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        sent = time.perf_counter()
        ttft = None
        request = {"model": "bench", "stream": True, "temperature": 0, "ignore_eos": True, **body}
        async with self.session.post(self.url, json=request, headers=headers) as resp:
            route = dict(p.split("=", 1) for p in resp.headers["x-fleetpilot-route"].split("; "))
            async for raw in resp.content:
                line = raw.strip()
                if ttft is None and line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                        ttft = time.perf_counter() - sent
            status = resp.status
        self.records.append(
            {"kind": kind, "tier": route["tier"], "reason": route["reason"], "status": status,
             "ttft": ttft, "done_at": time.perf_counter()}
        )  # fmt: skip


async def closed_loop(
    client: Client,
    items: list[tuple[str, dict[str, Any]]] | None,
    concurrency: int,
    headers: dict[str, str],
    duration_s: float | None = None,
    seed: int = 0,
) -> float:
    rng = random.Random(seed)
    queue = list(items or [])
    stop = time.perf_counter() + duration_s if duration_s else None
    counter = [0]

    async def worker() -> None:
        while True:
            if stop is not None:
                if time.perf_counter() >= stop:
                    return
                counter[0] += 1
                kind, body = (
                    "simple",
                    {
                        "messages": [
                            {"role": "user", "content": f"{rng.choice(SIMPLE)} #{counter[0]}"}
                        ],
                        "max_tokens": 16,
                    },
                )
            elif queue:
                kind, body = queue.pop(0)
            else:
                return
            await client.send(kind, body, headers)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(records), "req_per_s": len(records) / wall}
    out["share"] = {
        t: sum(r["tier"] == t for r in records) / len(records) for t in ("small", "large")
    }
    out["statuses"] = sorted({r["status"] for r in records})
    for kind in ("simple", "hard"):
        ttfts = [r["ttft"] for r in records if r["kind"] == kind and r["ttft"] is not None]
        out[f"{kind}_ttft_p50_ms"] = percentile(ttfts, 0.5) * 1e3
        out[f"{kind}_ttft_p95_ms"] = percentile(ttfts, 0.95) * 1e3
        by_tier = [r["tier"] for r in records if r["kind"] == kind]
        out[f"{kind}_on_small"] = by_tier.count("small") / len(by_tier) if by_tier else 0.0
    out["spilled"] = sum(r["reason"] == "spillover" for r in records)
    return out


def timeline(records: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    seconds: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        seconds.setdefault(int(r["done_at"] - start), []).append(r)
    return [
        {"second": s, "requests": len(rs), "spilled": sum(r["reason"] == "spillover" for r in rs)}
        for s, rs in sorted(seconds.items())
    ]


async def run(small: str, large: str) -> dict[str, Any]:
    cfg = config(small, large)
    app = build_app(cfg, StaticSource(cfg), seed=0)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
    results: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        # Warm both engines (first-request costs are not the subject).
        warm = Client(session, url)
        await closed_loop(warm, workload(6, 99), 2, {})
        for arm, headers in (("all-large", {"x-fleetpilot-tier": "large"}), ("fleetpilot", {})):
            client = Client(session, url)
            wall = await closed_loop(client, workload(160, 1), 4, headers)
            results[f"mixed/{arm}"] = summarize(client.records, wall)
        for phase, concurrency, seconds in (("burst", 24, 6.0), ("calm", 1, 4.0)):
            client = Client(session, url)
            start = time.perf_counter()
            wall = await closed_loop(client, None, concurrency, {}, duration_s=seconds, seed=3)
            results[phase] = {
                **summarize(client.records, wall),
                "timeline": timeline(client.records, start),
            }
        spills = app[ROUTER_APP].metrics.registry.get_sample_value(
            "fleetpilot_router_spillovers_total", {"from_tier": "small", "to_tier": "large"}
        )
        results["spillovers_total"] = spills or 0.0
    await runner.cleanup()
    return results


def main() -> None:
    started = time.monotonic()
    with (
        engine("small-model", "tiny", "--max-num-seqs", "4", "--step-delay-seconds", "0.005") as s,
        engine("large-model", "small", "--max-num-seqs", "8") as large,
    ):
        results = asyncio.run(run(s, large))
    print(f"{'phase':22} {'req/s':>6} {'small':>6} {'spilled':>7} {'simple TTFT p50/p95':>20} "
          f"{'hard TTFT p50/p95':>18}")  # fmt: skip
    for name in ("mixed/all-large", "mixed/fleetpilot", "burst", "calm"):
        r = results[name]
        print(
            f"{name:22} {r['req_per_s']:>6.1f} {r['share']['small']:>6.2f} {r['spilled']:>7} "
            f"{r['simple_ttft_p50_ms']:>9.0f}/{r['simple_ttft_p95_ms']:<6.0f}ms "
            f"{r['hard_ttft_p50_ms']:>8.0f}/{r['hard_ttft_p95_ms']:<6.0f}ms"
        )
    burst = results["burst"]["timeline"]
    print("burst, per second (requests, spilled):", [(t["requests"], t["spilled"]) for t in burst])
    calm = results["calm"]["timeline"]
    print("calm, per second (requests, spilled): ", [(t["requests"], t["spilled"]) for t in calm])
    path = save(
        "router_complexity",
        {
            "benchmark": "router_complexity",
            "machine": machine(),
            "results": results,
            "wall_s": time.monotonic() - started,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
