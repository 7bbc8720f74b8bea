"""Prefix-cache affinity: four reference-engine replicas behind the router, a multi-tenant
chat workload, five replica-choice policies compared in one run.

Workload: 12 tenants, each with its own ~1 kB system prompt; 6 users per tenant, each holding a
3-turn conversation (every turn resends the whole history, as chat clients do). 8 conversations
run at once, interleaved across tenants in a seeded order. Each replica's KV cache (512 blocks of
16 byte-tokens) holds about three tenants' prompts plus the running requests, so the 12 tenants
fit in the fleet's cache only if each replica specialises.

Policies (the same router process and the same requests; only the replica-choice plugins
change, through ``Router.use_policies``; engines are restarted between policies so every one
starts cold):

- round-robin;
- least-loaded: the router's load scorer alone;
- CHWBL: consistent hashing of the prompt's first 64 characters with bounded loads (c = 1.25),
  KubeAI's prefix-hash policy;
- fleetpilot-0.1: the router before issue 14, prefix-match scorer (weight 3) + load scorer
  (weight 1) behind the bounded-load cap;
- fleetpilot: the router's defaults (prefill-cost scorer + load behind the headroom filter);
- oracle: every tenant pinned to one replica, three tenants each - the policy that knows what
  each cache holds because it decides it, and the hit-rate ceiling for this workload.

Reported per policy: prefix-cache hit rate (the engines' vllm:prefix_cache_hits / queries, in
tokens), client-observed TTFT p50/p95 (first streamed chunk), requests/s.

Run: .venv/bin/python bench/router_affinity.py
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from router_support import ROOT, free_ports, machine, percentile, save, serving

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.kv_events import kv_events_config
from fleetpilot.routing.app import ROUTER_APP, build_app
from fleetpilot.routing.endpoints import StaticSource
from fleetpilot.routing.policies.load import LoadScorer
from fleetpilot.routing.policies.picker import (
    BoundedLoadFilter,
    CapacityFilter,
    HealthFilter,
    WeightedScorer,
)
from fleetpilot.routing.policies.prefix import PrefixScorer, block_hashes
from fleetpilot.routing.policies.types import PickRequest, ReplicaView
from fleetpilot.simulate.baselines import RoundRobin

REPLICAS = 4
TENANTS = 12
USERS_PER_TENANT = 6
TURNS = 3
CONCURRENT = 8
KV_BLOCKS = 512
ENGINE_BLOCK = 16
BLOCK_CHARS = 64
MODEL = "affinity-model"
MAX_TOKENS = 8


# -- baseline policies (bench-only plugins) --------------------------------------------------


class HashRing:
    """Consistent hashing: replicas in ring order from the key's position, scored 1 down to
    near 0; with the bounded-load filter in front, the first replica under the cap wins."""

    name = "chwbl"

    def __init__(self, vnodes: int = 100) -> None:
        self.vnodes = vnodes

    @staticmethod
    def _h(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        ids = sorted(v.id for v in replicas)
        ring = sorted((self._h(f"{rid}#{i}"), rid) for rid in ids for i in range(self.vnodes))
        key = self._h(str(request.hashes[0])) if request.hashes else 0
        start = bisect.bisect(ring, (key, ""))
        order: list[str] = []
        for k in range(len(ring)):
            rid = ring[(start + k) % len(ring)][1]
            if rid not in order:
                order.append(rid)
        return {rid: 1.0 - rank / len(order) for rank, rid in enumerate(order)}


class TenantPartition:
    """The oracle: a tenant's first prompt block decides its replica (a balanced partition)."""

    name = "oracle"

    def __init__(self, first_block_to_index: dict[int, int]) -> None:
        self.assign = first_block_to_index

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        ids = sorted(v.id for v in replicas)
        index = self.assign.get(request.hashes[0], 0) if request.hashes else 0
        return {rid: float(i == index % len(ids)) for i, rid in enumerate(ids)}


# -- workload --------------------------------------------------------------------------------


def system_prompt(tenant: int) -> str:
    rng = random.Random(tenant)
    words = ["orders", "refunds", "invoices", "shipping", "accounts", "warranty", "billing"]
    body = " ".join(rng.choice(words) for _ in range(150))
    return f"Tenant {tenant:02d} support assistant. Policy: {body}."[:1000]


def conversations() -> list[tuple[int, int]]:
    order = [(t, u) for t in range(TENANTS) for u in range(USERS_PER_TENANT)]
    random.Random(7).shuffle(order)
    return order


@contextlib.contextmanager
def engines(
    kv_blocks: int = KV_BLOCKS,
    kv_ports: Sequence[tuple[int, int]] | None = None,
    ports: Sequence[int] | None = None,
    max_model_len: int = 2048,
) -> Iterator[list[str]]:
    """``REPLICAS`` reference engines (on ``ports``, else free ones); with ``kv_ports``
    (publisher, replay) per engine, each publishes vLLM KV events there."""
    ports = list(ports) if ports is not None else free_ports(REPLICAS)

    def events(i: int) -> list[str]:
        if kv_ports is None:
            return []
        pub, replay = kv_ports[i]
        config = kv_events_config(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        return ["--kv-events-config", json.dumps(config)]

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetpilot.engine.reference.server",
                "--host",
                "127.0.0.1",
                "--port",
                str(p),
                "--model-config",
                "small",
                "--max-model-len",
                str(max_model_len),
                "--served-model-name",
                MODEL,
                "--max-num-seqs",
                "4",
                "--num-gpu-blocks-override",
                str(kv_blocks),
                "--max-num-batched-tokens",
                str(max_model_len),
                "--log-level",
                "warning",
                *events(i),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, p in enumerate(ports)
    ]
    with serving(procs, ports, 120) as addresses:
        yield addresses


def config(addresses: list[str]) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "service": "bench",
            "namespace": "bench",
            "tiers": [
                {
                    "name": "only",
                    "model": MODEL,
                    "upTo": 1.0,
                    "mode": "unified",
                    "endpoints": [
                        {"role": "unified", "service": "e", "selector": {}, "port": 1,
                         "maxNumSeqs": 4, "addresses": addresses}
                    ],
                }
            ],
            "affinity": {"blockChars": BLOCK_CHARS, "weight": 3.0},
            # Sized like each engine's KV cache (KV_BLOCKS * ENGINE_BLOCK tokens).
            "prefixIndexBlocks": KV_BLOCKS * ENGINE_BLOCK // BLOCK_CHARS,
            "scrape": {"interval": "250ms"},
            "requestTimeout": "120s",
        }
    )  # fmt: skip


async def engine_counters(session: aiohttp.ClientSession, address: str) -> tuple[float, float]:
    async with session.get(f"http://{address}/metrics") as resp:
        text = await resp.text()
    hits = queries = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def start_router(cfg: RouterConfig) -> tuple[web.AppRunner, web.Application, str]:
    """The router in this process on a free port; its chat URL (the caller cleans up)."""
    app = build_app(cfg, StaticSource(cfg), seed=0)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, app, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"


async def stream_ttft(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
) -> tuple[int, float | None, str]:
    """One streamed chat request: its status, TTFT (the first token's chunk, not a role-only
    chunk some servers send at once) and the answer's text (an error's body)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    ttft, answer = None, []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return resp.status, None, (await resp.read()).decode(errors="replace")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = "".join(c.get("delta", {}).get("content") or "" for c in chunk["choices"])
            if ttft is None and text:  # the first token, not a role-only chunk
                ttft = time.perf_counter() - sent
            answer.append(text)
    return 200, ttft, "".join(answer)


async def run_policy(policy: str, addresses: list[str]) -> dict[str, Any]:
    cfg = config(addresses)
    runner, app, url = await start_router(cfg)
    router = app[ROUTER_APP].router
    load = LoadScorer(cfg.spillover.queue_threshold)
    health, capacity = HealthFilter(), CapacityFilter(cfg.backpressure.max_waiting_per_replica)
    if policy == "round-robin":
        router.use_policies(filters=[health, capacity], scorers=[WeightedScorer(RoundRobin(), 1)])
    elif policy == "least-loaded":
        router.use_policies(filters=[health, capacity], scorers=[WeightedScorer(load, 1)])
    elif policy == "chwbl":
        router.use_policies(
            filters=[health, capacity, BoundedLoadFilter(1.25)],
            scorers=[WeightedScorer(HashRing(), 1)],
        )
    elif policy == "fleetpilot-0.1":
        # The router's defaults before issue 14: prefix share + load behind the bounded-load cap.
        router.use_policies(
            filters=[health, capacity, BoundedLoadFilter(1.25)],
            scorers=[
                WeightedScorer(PrefixScorer(router.prefix_index), 3.0),
                WeightedScorer(load, 1.0),
            ],
        )
    elif policy == "oracle":
        # "system: " precedes the prompt in the router's chat text; hash what it hashes.
        first = {
            block_hashes(f"system: {system_prompt(t)}", MODEL, BLOCK_CHARS)[0]: t % REPLICAS
            for t in range(TENANTS)
        }
        router.use_policies(filters=[health], scorers=[WeightedScorer(TenantPartition(first), 1)])
    ttfts: list[float] = []
    statuses: dict[int, int] = {}
    queue = list(conversations())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        before = [await engine_counters(session, a) for a in addresses]

        async def converse(tenant: int, user: int) -> None:
            messages = [{"role": "system", "content": system_prompt(tenant)}]
            for turn in range(TURNS):
                messages.append(
                    {"role": "user", "content": f"User {user} asks question {turn} about order "
                     f"{tenant * 100 + user}: where is it now?"}
                )  # fmt: skip
                status, ttft, answer = await stream_ttft(session, url, messages)
                statuses[status] = statuses.get(status, 0) + 1
                if ttft is not None:
                    ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer if status == 200 else ""})

        async def worker() -> None:
            while queue:
                tenant, user = queue.pop(0)
                await converse(tenant, user)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENT)))
        wall = time.perf_counter() - started
        after = [await engine_counters(session, a) for a in addresses]
    per_replica_requests = {
        r.id: 0 for r in router.replicas()
    }  # filled from the router's own metrics below
    registry = app[ROUTER_APP].metrics.registry
    for rid in per_replica_requests:
        per_replica_requests[rid] = int(
            registry.get_sample_value(
                "fleetpilot_router_requests_total",
                {"tier": "only", "replica": rid, "status": "200"},
            )
            or 0
        )
    errors = {
        f"{s.labels['replica']}:{s.labels['cause']}": s.value
        for metric in registry.collect()
        if metric.name == "fleetpilot_router_upstream_errors"
        for s in metric.samples
        if s.name.endswith("_total")
    }
    await runner.cleanup()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    n = TENANTS * USERS_PER_TENANT * TURNS
    return {
        "policy": policy,
        "requests": n,
        "statuses": {str(k): v for k, v in statuses.items()},
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
        "ttft_p95_ms": percentile(ttfts, 0.95) * 1e3,
        "req_per_s": n / wall,
        "wall_s": wall,
        "requests_per_replica": sorted(per_replica_requests.values()),
        "upstream_errors": errors,
    }


POLICIES = ["round-robin", "least-loaded", "chwbl", "fleetpilot-0.1", "fleetpilot", "oracle"]


def main() -> None:
    started = time.monotonic()
    rows = []
    for policy in POLICIES:
        with engines() as addresses:
            rows.append(asyncio.run(run_policy(policy, addresses)))
        print(f"  {policy}: done", file=sys.stderr)
    print(
        f"{'policy':13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>6} "
        f"{'per replica':>18}"
    )
    for r in rows:
        print(
            f"{r['policy']:13} {r['hit_rate']:>8.3f} {r['ttft_p50_ms']:>7.0f}ms "
            f"{r['ttft_p95_ms']:>7.0f}ms {r['req_per_s']:>6.2f} {r['requests_per_replica']!s:>18}"
        )
    by = {r["policy"]: r for r in rows}
    summary = {
        "hit_rate_vs_oracle": by["fleetpilot"]["hit_rate"] / by["oracle"]["hit_rate"],
        "ttft_p50_speedup_vs_round_robin": by["round-robin"]["ttft_p50_ms"]
        / by["fleetpilot"]["ttft_p50_ms"],
        "throughput_vs_least_loaded": by["fleetpilot"]["req_per_s"]
        / by["least-loaded"]["req_per_s"],
    }
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    path = save(
        "router_affinity",
        {
            "benchmark": "router_affinity",
            "machine": machine(),
            "workload": {
                "replicas": REPLICAS,
                "tenants": TENANTS,
                "users_per_tenant": USERS_PER_TENANT,
                "turns": TURNS,
                "concurrent_conversations": CONCURRENT,
                "kv_blocks_per_replica": KV_BLOCKS,
                "engine_block_tokens": ENGINE_BLOCK,
                "router_block_chars": BLOCK_CHARS,
                "max_tokens": MAX_TOKENS,
                "engine": "reference server, model preset 'small', max-num-seqs 4",
            },
            "rows": rows,
            "summary": summary,
            "wall_s": time.monotonic() - started,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
