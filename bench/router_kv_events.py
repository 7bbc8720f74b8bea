"""Routing on the engines' KV events vs the router's guess, with one and two router replicas.

Issue 14: a router that guesses each engine's cache from its own record of what it sent where
is wrong when two router replicas each see half the traffic, and when an engine evicts. This
benchmark plays the traces of ``router_prefix_workloads`` (multi-tenant Zipf chat at a low and a
high rate; one shared system prompt, at 4 and 8 req/s) and the high-rate multi-tenant trace
again on engines whose KV pool is too small for the working set (evictions), each arm on
freshly started engines that publish vLLM KV events, and reports the engines' own prefix hit
rate and client TTFT (first content chunk).

Arms (every router replica its own process, ``bench/router_fleet.py``, as a cluster runs
them; with two, the client spreads requests over them as a Service does: ``--spread
alternate`` or ``random``):
- ``events xN``: the router's defaults, with the reference engine's tokenizer: the prefill-cost
  scorer reads the KV index built from the engines' events (``prefix-source=events``);
- ``events+peers xN``, ``guessed+peers xN``: the same, the routers sharing their in-flight
  and pending-prefill counts per engine (``routing.peers``, every 100 ms);
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
  same engines' KV events and each engine's ``/tokenize``): the established routers;
- ``prodstack-prefix xN`` and ``prodstack-rr``: production-stack's own router
  (``bench/prodstack_router.py``; installed by hand, skipped when missing) with
  ``--routing-logic prefixaware`` (longest match of 128-character chunks of the prompt text
  on a trie of what it sent where, a random replica on no match) and ``roundrobin``.

Engines: 4 reference engines (preset 'small', max-num-seqs 4, 16-token blocks), 512 KV blocks
each, or 128 in the eviction scenario (two tenants' system prompts). The machine has 2 shared
cores: compare arms within one run, not across runs.

``shared-long-4`` and ``shared-long-8``: the shared-prompt trace with 64 users instead of 16
(256 requests), so the few first prefills of the shared prompt on each engine (one per engine
a router uses) cannot alone make the p95; the rows also report the conversations' first turns
apart (``first_turn_ttft_*``) and the slowest requests.

``cluster-6`` and ``cluster-12`` (issue 44's held-out shape, ``router_fleet.cluster_trace``):
12 tenants with 150-600-word system prompts, 30 users each, chats of 1-9 turns, at 6 and 12
requests a second; engines with 1,024 KV blocks and a 4,096-token context.

``--busy``: the same with another process spinning on one of the two cores, so the engines
fall behind the arrivals and queue: where the choice between a replica's queue and a cold
prefill elsewhere matters most. Saved apart (``router_kv_events_busy*.json``).

Run: .venv/bin/python bench/router_kv_events.py [--quick] [--seed N] [--arms a,b] [--busy]
     [--scenarios low,high,shared,shared-high,shared-long-4,shared-long-8,evicting,cluster-6,
     cluster-12] [--repeat N]
     [--spread alternate|random] [--name FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prodstack_router
import vllm_router
import yaml
from router_affinity import BLOCK_CHARS, ENGINE_BLOCK, KV_BLOCKS, MODEL, REPLICAS, config, engines
from router_fleet import (
    RouterProcess,
    cluster_trace,
    cpu_seconds,
    engine_successes,
    fleetpilot_routers,
    metric_values,
)
from router_prefix_workloads import (
    SPREADS,
    Conversation,
    drive,
    multi_tenant_trace,
    oracle_hit_rate,
    print_rows,
    shared_prompt_trace,
    summary,
)
from router_support import busy_core, commit, free_ports, machine, save

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER

EVICTION_KV_BLOCKS = 128


def kv_config(tokenizer: bool, kv_blocks: int = KV_BLOCKS) -> RouterConfig:
    """The benchmark's router config without addresses (the endpoints file lists them), with
    or without the reference engine's tokenizer; its guessed index sized like an engine's KV
    cache."""
    data = config([]).to_wire()
    data["tiers"][0]["tokenizer"] = str(REFERENCE_TOKENIZER) if tokenizer else None
    data["prefixIndexBlocks"] = kv_blocks * ENGINE_BLOCK // BLOCK_CHARS
    return RouterConfig.model_validate(data)


@dataclass(frozen=True)
class Play:
    """How an arm is played: the client's spread over router replicas and its seed."""

    spread: str
    seed: int


def external_routers(
    arm: str,
    addresses: list[str],
    kv_ports: Sequence[tuple[int, int]],
    workdir: Path,
) -> contextlib.AbstractContextManager[list[str]]:
    """An established router's processes over the same fresh engines: the vLLM project's
    router (``bench/vllm_router.py``) or production-stack's (``bench/prodstack_router.py``)."""
    policy, _, replicas = arm.partition(" x")
    count = int(replicas or 1)
    if policy in vllm_router.POLICIES:
        return vllm_router.routers(policy, count, addresses, kv_ports, MODEL, workdir)
    return prodstack_router.routers(policy, count, addresses, MODEL, workdir)


async def run_external_arm(
    arm: str,
    trace: Sequence[Conversation],
    addresses: list[str],
    kv_ports: Sequence[tuple[int, int]],
    workdir: Path,
    play: Play,
) -> dict[str, Any]:
    """An arm played through an established router; requests per replica from the engines'
    own counters."""
    with external_routers(arm, addresses, kv_ports, workdir) as urls:
        driven = await drive(trace, urls, addresses, play.spread, play.seed)
    return summary(arm, driven, sorted(engine_successes(a) for a in addresses))


def decided_by_events(routers: Sequence[RouterProcess]) -> float:
    """The share of decisions the engines' KV events judged, over every router replica."""
    decided = dict.fromkeys(("events", "guessed"), 0.0)
    for router in routers:
        samples = metric_values(router.metrics_url, "fleetpilot_router_prefix_source_total")
        for labels, value in samples.items():
            source = dict(labels).get("source", "")
            if source in decided:
                decided[source] += value
    return decided["events"] / max(1.0, sum(decided.values()))


async def run_arm(
    arm: str,
    scenario: Scenario,
    addresses: list[str],
    endpoints: Path,
    workdir: Path,
    play: Play,
) -> dict[str, Any]:
    """A fleetpilot arm: each router replica its own process (``router_fleet``)."""
    policy, _, replicas = arm.partition(" x")
    events = policy.partition("+")[0] in ("events", "events-once")
    cfg = kv_config(tokenizer=events, kv_blocks=scenario.kv_blocks)
    with fleetpilot_routers(
        "prefill-cost-once" if policy == "events-once" else policy,
        int(replicas or 1),
        cfg,
        endpoints,
        workdir,
        replicas=REPLICAS,
        events=events,
        peers=policy.endswith("+peers"),
    ) as routers:
        cpu_before = [cpu_seconds(r.pid) for r in routers]
        driven = await drive(
            scenario.trace, [r.url for r in routers], addresses, play.spread, play.seed
        )
        cpu = sum(cpu_seconds(r.pid) for r in routers) - sum(cpu_before)
        row = summary(arm, driven, sorted(engine_successes(a) for a in addresses))
        row["decided_by_events"] = decided_by_events(routers)
        row["peers_live"] = [
            sum(v for labels, v in metric_values(r.metrics_url, "fleetpilot_router_peers").items()
                if ("state", "live") in labels)
            for r in routers
        ]  # fmt: skip
        row["router_cpu_ms_per_request"] = cpu * 1e3 / max(1, row["requests"])
    return row


@dataclass(frozen=True)
class Scenario:
    key: str  # what --scenarios names
    name: str
    trace: list[Conversation]
    arms: tuple[str, ...]
    kv_blocks: int = KV_BLOCKS
    max_model_len: int = 2048


CLUSTER_KV_BLOCKS = 1024  # ~4 tenants' prompts an engine: the fleet holds 12 if it specialises
CLUSTER_MAX_MODEL_LEN = 4096


# Four times the shared-prompt trace's users: its engines' first (cold) prefills of the shared
# prompt are then under 5% of the requests, so they alone cannot make the p95.
LONG_SHARED_USERS = 64


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    n = 24 if quick else 48
    requests = 150 if quick else 300
    base = ("events x1", "events x2", "events+peers x2", "events-once x1",
            "guessed x1", "guessed x2",
            "longest-prefix x1", "longest-prefix x2", "round-robin",
            "vllm-router-cache x1", "vllm-router-cache x2",
            "vllm-router-kv x1", "vllm-router-kv x2",
            "prodstack-prefix x1", "prodstack-prefix x2", "prodstack-rr x1")  # fmt: skip
    high = multi_tenant_trace(8.0, n, seed)
    return [
        Scenario(
            "low", "multi-tenant, low rate", multi_tenant_trace(2.0, n, seed), (*base, "oracle")
        ),
        Scenario("high", "multi-tenant, high rate", high, (*base, "oracle")),
        Scenario("shared", "shared-prompt", shared_prompt_trace(4.0, seed), base),
        Scenario("shared-high", "shared-prompt, high rate", shared_prompt_trace(8.0, seed), base),
        *(
            Scenario(
                f"shared-long-{rate}",
                f"shared-prompt, {LONG_SHARED_USERS} users arriving at {rate}/s",
                shared_prompt_trace(float(rate), seed, LONG_SHARED_USERS),
                base,
            )
            for rate in (4, 8)
        ),
        Scenario(
            "evicting",
            "multi-tenant, high rate, evicting",
            high,
            (*base, "oracle"),
            EVICTION_KV_BLOCKS,
        ),
        *(
            Scenario(
                f"cluster-{rate}",
                f"cluster trace (150-600-word prompts, 1-9 turns), {rate} req/s",
                cluster_trace(rate, requests, seed),
                base,
                CLUSTER_KV_BLOCKS,
                CLUSTER_MAX_MODEL_LEN,
            )
            for rate in (6, 12)
        ),
    ]


def run_scenario(
    scenario: Scenario, wanted: set[str] | None, workdir: Path, repeat: int, play: Play
) -> list[Any]:
    """Every wanted arm on fresh engines, ``repeat`` rounds; each round starts one arm later
    in the list, so a drift in the machine's speed over the run falls on every arm alike."""
    arms = [a for a in scenario.arms if wanted is None or a in wanted]
    missing = [a for a in arms if a.startswith("prodstack") and not prodstack_router.available()]
    if missing:
        print(f"  skipping {', '.join(missing)}: {prodstack_router.MISSING}", file=sys.stderr)
        arms = [a for a in arms if a not in missing]
    rows = []
    for round_ in range(repeat):
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            rows.append({**play_arm(scenario, arm, workdir, play), "round": round_})
            print(f"  {scenario.name}: {arm} done (round {round_ + 1}/{repeat})", file=sys.stderr)
    return rows


def play_arm(scenario: Scenario, arm: str, workdir: Path, play: Play) -> dict[str, Any]:
    ports = free_ports(3 * REPLICAS)
    kv_ports = list(zip(ports[REPLICAS::2], ports[REPLICAS + 1 :: 2], strict=True))
    with engines(
        scenario.kv_blocks, kv_ports, ports[:REPLICAS], scenario.max_model_len
    ) as addresses:
        endpoints = workdir / "endpoints.yaml"
        listed = [
            {"tier": "only", "address": a, "kvEventsPort": pub, "kvReplayPort": replay}
            for a, (pub, replay) in zip(addresses, kv_ports, strict=True)
        ]
        endpoints.write_text(yaml.safe_dump({"endpoints": listed}))
        policy = arm.partition(" x")[0]
        if policy in vllm_router.POLICIES or policy in prodstack_router.POLICIES:
            played = run_external_arm(arm, scenario.trace, addresses, kv_ports, workdir, play)
        else:
            played = run_arm(arm, scenario, addresses, endpoints, workdir, play)
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
        firsts = [r["first_turn_ttft_p95_ms"] for r in runs if r.get("first_turn_ttft_p95_ms")]
        laters = [r["later_turn_ttft_p95_ms"] for r in runs if r.get("later_turn_ttft_p95_ms")]
        merged.append(
            {
                "arm": arm,
                "rounds": len(runs),
                "hit_rate": statistics.median(r["hit_rate"] for r in runs),
                "ttft_p50_ms": statistics.median(p50s) if p50s else None,
                "ttft_p95_ms": statistics.median(p95s) if p95s else None,
                "ttft_p95_range_ms": [min(p95s), max(p95s)] if p95s else None,
                "first_turn_ttft_p95_ms": statistics.median(firsts) if firsts else None,
                "later_turn_ttft_p95_ms": statistics.median(laters) if laters else None,
                "errors": sum(r["requests"] - r["statuses"].get("200", 0) for r in runs),
            }
        )
    return merged


def print_by_arm(merged: Sequence[dict[str, Any]]) -> None:
    print(f"{'arm':20} {'rounds':>6} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'p95 range':>15} {'errors':>6} {'p95 1st/later turns':>20}")  # fmt: skip
    for m in merged:
        p50 = f"{m['ttft_p50_ms']:.0f}ms" if m["ttft_p50_ms"] is not None else "-"
        p95 = f"{m['ttft_p95_ms']:.0f}ms" if m["ttft_p95_ms"] is not None else "-"
        low, high = m["ttft_p95_range_ms"] or (0.0, 0.0)
        turns = "/".join(
            f"{m[key]:.0f}" if m.get(key) is not None else "-"
            for key in ("first_turn_ttft_p95_ms", "later_turn_ttft_p95_ms")
        )
        print(f"{m['arm']:20} {m['rounds']:>6} {m['hit_rate']:>8.3f} {p50:>9} {p95:>9} "
              f"{f'{low:.0f}-{high:.0f}ms':>15} {m['errors']:>6} {turns + 'ms':>20}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the conversations")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--arms", help="comma-separated subset of arms")
    parser.add_argument(
        "--scenarios",
        help="comma-separated subset of low,high,shared,shared-high,shared-long-4,"
        "shared-long-8,evicting,cluster-6,cluster-12",
    )
    parser.add_argument(
        "--spread",
        choices=SPREADS,
        default="alternate",
        help="how the client spreads requests over router replicas",
    )
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
                play = Play(args.spread, args.seed)
                rows = run_scenario(scenario, wanted, Path(tmp), args.repeat, play)
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
            "commit": commit(),
            "machine": machine(),
            "busy_core": args.busy,
            "seed": args.seed,
            "repeat": args.repeat,
            "spread": args.spread,
            "routers": "every router its own process (bench/router_fleet.py)",
            "engines": f"{REPLICAS} reference engines, preset 'small', max-num-seqs 4, "
            "16-token KV blocks, publishing vLLM KV events",
            "results": results,
            "wall_s": wall_s,
        },
    )


if __name__ == "__main__":
    main()
