"""How long a cold long prompt stalls the router's event loop while it relays other streams
(issue 14: tokenizing off the loop), with the body parsed, its features read and its keys
computed in the router's worker threads (``off-loop``, as shipped) against forced inline
(``inline``: ``PARSE_OFF_LOOP_BYTES`` and ``OFF_LOOP_TOKENIZE_CHARS`` set out of reach, the
path before the change).

One process, one event loop, as the router runs: the router app (one tier with the reference
engine's byte tokenizer, its replica's KV events taken as live so every prompt is tokenized),
a fake engine streaming ``--streams`` short chats a chunk every 5 ms, and the clients. While
they stream, ``--prompts`` cold chat prompts of ``--chars`` characters (each unseen, so the
tokenizer's cache has nothing of it) are sent one after another. A ticker coroutine sleeps 1 ms
at a time and records how late it wakes: the loop's stall. Also reported: the longest gap
between two chunks any short stream saw, and the long prompts' end-to-end latency.

What stays on the loop in both modes is the rest of the request's handling of a 100k-character
body: reading it, the guessed index's block hashes, the decision and the relay.

Run: .venv/bin/python bench/router_loop_stall.py [--streams 8] [--prompts 6] [--chars 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import aiohttp
from aiohttp import web
from router_support import machine, percentile, save

import fleetpilot.routing.affinity as affinity_module
import fleetpilot.routing.proxy as proxy_module
from fleetpilot.api.router_config import EndpointGroup, RouterConfig, RouterTier
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.app import ROUTER_APP, build_app
from fleetpilot.routing.endpoints import StaticSource

CHUNK_INTERVAL_S = 0.005
TICK_S = 0.001
WORDS = ["fleet", "route", "token", "cache", "queue", "engine", "prefix", "stream", "replica"]


async def engine(request: web.Request) -> web.StreamResponse:
    """A chat engine: a streamed request gets ``chunks`` deltas 5 ms apart, others one JSON."""
    body = await request.json()
    if not body.get("stream"):
        message = {"role": "assistant", "content": "ok"}
        return web.json_response({"choices": [{"index": 0, "message": message}]})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(body.get("max_tokens", 100)):
        delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
        await out.write(f"data: {json.dumps(delta)}\n\n".encode())
        await asyncio.sleep(CHUNK_INTERVAL_S)
    await out.write(b"data: [DONE]\n\n")
    return out


def config(address: str) -> RouterConfig:
    group = EndpointGroup(
        role="unified", service="s", selector={}, port=8000, max_num_seqs=256,
        addresses=[address], kv_events_port=5557, kv_replay_port=5559,
    )  # fmt: skip
    tier = RouterTier(name="small", model="m", up_to=1.0, mode="unified", endpoints=[group],
                      tokenizer=str(REFERENCE_TOKENIZER))  # fmt: skip
    return RouterConfig.model_validate(
        {"service": "chat", "namespace": "bench", "tiers": [tier], "requestTimeout": "120s"}
    )


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def run(mode: str, streams: int, prompts: int, chars: int, seed: int) -> dict[str, Any]:
    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", engine)
    engine_runner, engine_port = await serve(engine_app)
    router_config = config(f"127.0.0.1:{engine_port}")
    app = build_app(router_config, StaticSource(router_config), seed=0)
    router_runner, port = await serve(app)
    state = app[ROUTER_APP]
    while "small" not in state.router.tokenizers:
        await asyncio.sleep(0.05)
    state.router.affinity.kv_live = lambda _stream: True
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    rng = random.Random(seed)

    lags: list[tuple[float, float]] = []  # (when, how late)
    stop = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            lags.append((loop.time(), loop.time() - due))

    gaps: list[float] = []

    async def short_stream(session: aiohttp.ClientSession, n: int, chunks: int) -> None:
        body = {"model": "m", "stream": True, "max_tokens": chunks,
                "messages": [{"role": "user", "content": f"short question {n}"}]}  # fmt: skip
        async with session.post(url, json=body) as response:
            last = time.perf_counter()
            async for _ in response.content.iter_any():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

    windows: list[tuple[float, float]] = []
    latencies: list[float] = []

    async def long_prompts(session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        for _ in range(prompts):
            text = " ".join(rng.choice(WORDS) for _ in range(chars // 6))[:chars]
            body = {"model": "m", "messages": [{"role": "user", "content": text}]}
            start = loop.time()
            async with session.post(url, json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            windows.append((start, loop.time()))
            latencies.append(loop.time() - start)
            await asyncio.sleep(0.2)

    # Long enough to cover every long prompt (~0.1-0.5 s each) and the pauses between them.
    chunks = int((0.6 + prompts * 0.8) / CHUNK_INTERVAL_S)
    saved = affinity_module.OFF_LOOP_TOKENIZE_CHARS, proxy_module.PARSE_OFF_LOOP_BYTES
    if mode == "inline":
        affinity_module.OFF_LOOP_TOKENIZE_CHARS = 1 << 62
        proxy_module.PARSE_OFF_LOOP_BYTES = 1 << 62
    tick = asyncio.create_task(ticker())
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(
                *(short_stream(session, n, chunks) for n in range(streams)),
                long_prompts(session),
            )
    finally:
        affinity_module.OFF_LOOP_TOKENIZE_CHARS, proxy_module.PARSE_OFF_LOOP_BYTES = saved
        stop.set()
        await tick
        await router_runner.cleanup()
        await engine_runner.cleanup()
    per_prompt = [max((lag for at, lag in lags if a <= at <= b), default=0.0) for a, b in windows]
    return {
        "mode": mode,
        "streams": streams,
        "prompt_chars": chars,
        "prompts": prompts,
        "max_loop_lag_ms": round(max(lag for _, lag in lags) * 1e3, 2),
        "per_prompt_max_lag_p50_ms": round(percentile(per_prompt, 0.5) * 1e3, 2),
        "max_stream_chunk_gap_ms": round(max(gaps) * 1e3, 2),
        "long_prompt_latency_p50_ms": round(percentile(latencies, 0.5) * 1e3, 2),
    }


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for round_ in range(args.rounds):  # the modes take turns: this VM's speed drifts
        for mode in ("inline", "off-loop"):
            rows.append(await run(mode, args.streams, args.prompts, args.chars, seed=round_))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--chars", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    header = ("mode", "max lag ms", "p50 per-prompt max lag", "max chunk gap ms", "p50 latency")
    print("{:<9} {:>11} {:>23} {:>17} {:>12}".format(*header))
    for r in rows:
        print(
            f"{r['mode']:<9} {r['max_loop_lag_ms']:>11.2f} {r['per_prompt_max_lag_p50_ms']:>23.2f}"
            f" {r['max_stream_chunk_gap_ms']:>17.2f} {r['long_prompt_latency_p50_ms']:>12.2f}"
        )
    path = save(
        "router_loop_stall",
        {
            "benchmark": "router_loop_stall",
            "machine": machine(),
            "tokenizer": "reference (byte)",
            "chunk_interval_ms": CHUNK_INTERVAL_S * 1e3,
            "off_loop_tokenize_chars": affinity_module.OFF_LOOP_TOKENIZE_CHARS,
            "parse_off_loop_bytes": proxy_module.PARSE_OFF_LOOP_BYTES,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
