"""Routing on the engines' KV events vs the router's guess, with one and two router replicas.

Issue 14: a router that guesses each engine's cache from its own record of what it sent where
is wrong when two router replicas each see half the traffic, and when an engine evicts. This
benchmark plays the traces of ``router_prefix_workloads`` (multi-tenant Zipf chat at a low and a
high rate; one shared system prompt) and the high-rate multi-tenant trace again on engines
whose KV pool is too small for the working set (evictions), each arm on freshly started
engines that publish vLLM KV events, and reports the engines' own prefix hit rate and client
TTFT (first content chunk).

Arms (router replicas in this process; with two, the client alternates request by request):
- ``events xN``: the router's defaults, with the reference engine's tokenizer: the prefill-cost
  scorer reads the KV index built from the engines' events (``prefix-source=events``);
- ``events-once xN``: the same, but an uncached block priced once (its own prefill), as
  before the scorer counted the requests behind it too;
- ``guessed xN``: the same router without a tokenizer, so it falls back to its guessed index
  (what it sent where), as before issue 14's part 2;
- ``longest-prefix xN``: pure longest-prefix match on the guessed index, least load only to
  break ties (production-stack's ``prefixaware`` idea);
- ``round-robin``; ``oracle`` (multi-tenant): each tenant pinned to one replica;
- ``vllm-router-cache xN`` and ``vllm-router-kv xN``: the vLLM project's own router
  (``bench/vllm_router.py``, ``make baselines``) with its defaults, ``cache_aware`` (an
  approximate prefix tree of the text it sent where, SGLang's policy) and ``kv_aware`` (the
  same engines' KV events and each engine's ``/tokenize``): the established routers.

Engines: 4 reference engines (preset 'small', max-num-seqs 4, 16-token blocks), 512 KV blocks
each, or 128 in the eviction scenario (two tenants' system prompts). The machine has 2 shared
cores: compare arms within one run, not across runs.

``--busy``: the same with another process spinning on one of the two cores, so the engines
fall behind the arrivals and queue: where the choice between a replica's queue and a cold
prefill elsewhere matters most. Saved apart (``router_kv_events_busy*.json``).

Run: .venv/bin/python bench/router_kv_events.py [--quick] [--seed N] [--arms a,b] [--busy]
     [--scenarios low,high,shared,evicting] [--repeat N] [--name FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm_router
import yaml
from aiohttp import web
from router_affinity import KV_BLOCKS, MODEL, REPLICAS, config, engines
from router_prefix_workloads import (
    Conversation,
    drive,
    multi_tenant_trace,
    oracle_hit_rate,
    print_rows,
    served_per_replica,
    shared_prompt_trace,
    summary,
    use_arm,
)
from router_support import busy_core, free_ports, machine, save

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.app import ROUTER_APP, build_app
from fleetpilot.routing.discovery import FileSource

EVICTION_KV_BLOCKS = 128


def kv_config(tokenizer: bool) -> RouterConfig:
    """The benchmark's router config without addresses (the endpoints file lists them), with
    or without the reference engine's tokenizer."""
    data = config([]).to_wire()
    data["tiers"][0]["tokenizer"] = str(REFERENCE_TOKENIZER) if tokenizer else None
    return RouterConfig.model_validate(data)


async def start_routers(
    cfg: RouterConfig, endpoints: Path, count: int, events: bool
) -> list[tuple[web.AppRunner, web.Application, str]]:
    """``count`` router replicas on free ports; with ``events``, each has heard every engine's
    publisher and loaded its tokenizer before the trace starts."""
    started = []
    for i in range(count):
        app = build_app(cfg, FileSource(endpoints), seed=i)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        started.append((runner, app, url))
    if events:
        deadline = time.monotonic() + 60
        for _, app, _ in started:
            state = app[ROUTER_APP]
            while not (
                state.kv_events is not None
                and all(state.kv_events.has_events(r.id) for r in state.router.replicas())
                and "only" in state.router.tokenizers
            ):
                if time.monotonic() > deadline:
                    for runner, _, _ in started:
                        await runner.cleanup()
                    raise RuntimeError("routers did not hear every engine's KV events")
                await asyncio.sleep(0.05)
    return started


def engine_successes(address: str) -> int:
    """Requests the engine at ``address`` finished (its ``vllm:request_success_total``)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    )


async def run_external_arm(
    arm: str,
    trace: Sequence[Conversation],
    addresses: list[str],
    kv_ports: Sequence[tuple[int, int]],
    workdir: Path,
) -> dict[str, Any]:
    """An arm played through the vLLM project's router (``bench/vllm_router.py``) over the
    same fresh engines; requests per replica from the engines' own counters."""
    policy, _, replicas = arm.partition(" x")
    with vllm_router.routers(
        policy, int(replicas or 1), addresses, kv_ports, MODEL, workdir
    ) as urls:
        driven = await drive(trace, urls, addresses)
    return summary(arm, driven, sorted(engine_successes(a) for a in addresses))


async def run_arm(
    arm: str, trace: Sequence[Conversation], addresses: list[str], endpoints: Path
) -> dict[str, Any]:
    policy, _, replicas = arm.partition(" x")
    count = int(replicas or 1)
    events = policy in ("events", "events-once")
    cfg = kv_config(tokenizer=events)
    routers = await start_routers(cfg, endpoints, count, events)
    for _, app, _ in routers:
        if policy == "events-once":
            use_arm("prefill-cost-once", app[ROUTER_APP].router, cfg)
        elif policy not in ("events", "guessed"):
            use_arm(policy, app[ROUTER_APP].router, cfg)
    apps = [app for _, app, _ in routers]
    driven = await drive(trace, [url for _, _, url in routers], addresses)
    ids = [r.id for r in apps[0][ROUTER_APP].router.replicas()]
    row = summary(arm, driven, served_per_replica(apps, ids))
    decided = {
        source: sum(
            app[ROUTER_APP].metrics.registry.get_sample_value(
                "fleetpilot_router_prefix_source_total", {"tier": "only", "source": source}
            )
            or 0
            for app in apps
        )
        for source in ("events", "guessed")
    }
    row["decided_by_events"] = decided["events"] / max(1.0, sum(decided.values()))
    for runner, _, _ in routers:
        await runner.cleanup()
    return row


@dataclass(frozen=True)
class Scenario:
    key: str  # what --scenarios names
    name: str
    trace: list[Conversation]
    arms: tuple[str, ...]
    kv_blocks: int = KV_BLOCKS


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    n = 24 if quick else 48
    base = ("events x1", "events x2", "events-once x1", "guessed x1", "guessed x2",
            "longest-prefix x1", "longest-prefix x2", "round-robin",
            "vllm-router-cache x1", "vllm-router-cache x2",
            "vllm-router-kv x1", "vllm-router-kv x2")  # fmt: skip
    high = multi_tenant_trace(8.0, n, seed)
    return [
        Scenario(
            "low", "multi-tenant, low rate", multi_tenant_trace(2.0, n, seed), (*base, "oracle")
        ),
        Scenario("high", "multi-tenant, high rate", high, (*base, "oracle")),
        Scenario("shared", "shared-prompt", shared_prompt_trace(4.0, seed), base),
        Scenario(
            "evicting",
            "multi-tenant, high rate, evicting",
            high,
            (*base, "oracle"),
            EVICTION_KV_BLOCKS,
        ),
    ]


def run_scenario(
    scenario: Scenario, wanted: set[str] | None, workdir: Path, repeat: int
) -> list[Any]:
    """Every wanted arm on fresh engines, ``repeat`` rounds; each round starts one arm later
    in the list, so a drift in the machine's speed over the run falls on every arm alike."""
    arms = [a for a in scenario.arms if wanted is None or a in wanted]
    rows = []
    for round_ in range(repeat):
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            rows.append({**play_arm(scenario, arm, workdir), "round": round_})
            print(f"  {scenario.name}: {arm} done (round {round_ + 1}/{repeat})", file=sys.stderr)
    return rows


def play_arm(scenario: Scenario, arm: str, workdir: Path) -> dict[str, Any]:
    ports = free_ports(3 * REPLICAS)
    kv_ports = list(zip(ports[REPLICAS::2], ports[REPLICAS + 1 :: 2], strict=True))
    with engines(scenario.kv_blocks, kv_ports, ports[:REPLICAS]) as addresses:
        endpoints = workdir / "endpoints.yaml"
        listed = [
            {"tier": "only", "address": a, "kvEventsPort": pub, "kvReplayPort": replay}
            for a, (pub, replay) in zip(addresses, kv_ports, strict=True)
        ]
        endpoints.write_text(yaml.safe_dump({"endpoints": listed}))
        if arm.partition(" x")[0] in vllm_router.POLICIES:
            played = run_external_arm(arm, scenario.trace, addresses, kv_ports, workdir)
        else:
            played = run_arm(arm, scenario.trace, addresses, endpoints)
        return asyncio.run(played)


def by_arm(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm over its rounds: the median of the rounds' hit rates and TTFT percentiles,
    and the range of their p95s (what one round's spread is)."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        arms.setdefault(row["arm"], []).append(row)
    merged = []
    for arm, runs in arms.items():
        p95s = [r["ttft_p95_ms"] for r in runs if r["ttft_p95_ms"] is not None]
        p50s = [r["ttft_p50_ms"] for r in runs if r["ttft_p50_ms"] is not None]
        merged.append(
            {
                "arm": arm,
                "rounds": len(runs),
                "hit_rate": statistics.median(r["hit_rate"] for r in runs),
                "ttft_p50_ms": statistics.median(p50s) if p50s else None,
                "ttft_p95_ms": statistics.median(p95s) if p95s else None,
                "ttft_p95_range_ms": [min(p95s), max(p95s)] if p95s else None,
                "errors": sum(r["requests"] - r["statuses"].get("200", 0) for r in runs),
            }
        )
    return merged


def print_by_arm(merged: Sequence[dict[str, Any]]) -> None:
    print(f"{'arm':20} {'rounds':>6} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'p95 range':>15} {'errors':>6}")  # fmt: skip
    for m in merged:
        p50 = f"{m['ttft_p50_ms']:.0f}ms" if m["ttft_p50_ms"] is not None else "-"
        p95 = f"{m['ttft_p95_ms']:.0f}ms" if m["ttft_p95_ms"] is not None else "-"
        low, high = m["ttft_p95_range_ms"] or (0.0, 0.0)
        print(f"{m['arm']:20} {m['rounds']:>6} {m['hit_rate']:>8.3f} {p50:>9} {p95:>9} "
              f"{f'{low:.0f}-{high:.0f}ms':>15} {m['errors']:>6}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the conversations")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--arms", help="comma-separated subset of arms")
    parser.add_argument("--scenarios", help="comma-separated subset of low,high,shared,evicting")
    parser.add_argument("--busy", action="store_true", help="another process spins on a core")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every arm (medians)")
    parser.add_argument("--name", help="the results file's name (default by seed and --busy)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    wanted = set(args.arms.split(",")) if args.arms else None
    only = set(args.scenarios.split(",")) if args.scenarios else None
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    path = None
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in scenarios(args.quick, args.seed):
            if only is not None and scenario.key not in only:
                continue
            with busy_core() if args.busy else contextlib.nullcontext():
                rows = run_scenario(scenario, wanted, Path(tmp), args.repeat)
            results.append(
                {
                    "scenario": scenario.name,
                    "kv_blocks": scenario.kv_blocks,
                    "unbounded_cache_hit_rate": oracle_hit_rate(scenario.trace),
                    "rows": rows,
                    **({"by_arm": by_arm(rows)} if args.repeat > 1 else {}),
                }
            )
            path = save_results(args, results, time.monotonic() - started)
    for result in results:
        ceiling = result["unbounded_cache_hit_rate"]
        print(f"\n{result['scenario']} ({result['kv_blocks']} KV blocks an engine; "
              f"one unbounded cache: {ceiling:.3f})")  # fmt: skip
        if "by_arm" in result:
            print_by_arm(result["by_arm"])
        else:
            print_rows(result["rows"], "events", "decided_by_events", 20)
    print(f"wrote {path}")


def save_results(args: argparse.Namespace, results: list[Any], wall_s: float) -> Path:
    """Written after every scenario, so a run cut short keeps what it measured."""
    name = "router_kv_events_busy" if args.busy else "router_kv_events"
    return save(
        args.name or (name if args.seed == 11 else f"{name}_seed{args.seed}"),
        {
            "benchmark": "router_kv_events",
            "machine": machine(),
            "busy_core": args.busy,
            "seed": args.seed,
            "repeat": args.repeat,
            "engines": f"{REPLICAS} reference engines, preset 'small', max-num-seqs 4, "
            "16-token KV blocks, publishing vLLM KV events",
            "results": results,
            "wall_s": wall_s,
        },
    )


if __name__ == "__main__":
    main()
