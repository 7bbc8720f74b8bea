"""Prefix routing on two opposite workloads, open loop, against the strongest simple baselines.

Issue 14 found that a policy tuned to one workload loses on another: on a multi-tenant chat
trace the router's bounded-load cap (no replica above 1.25x the group's mean in-flight) pushed a
hot tenant's second request off its cached replica, so plain longest-prefix match beat it; on a
shared-system-prompt workload pure longest-prefix match sends every user to the one engine that
first cached the shared prompt, which drowns. This benchmark runs both, each arm on the same
seeded trace and on freshly started engines (cold caches), and reports the engines' own prefix
hit rate (vllm:prefix_cache_hits / queries, in tokens) and client TTFT (first content chunk).

Workloads (open loop: arrivals do not wait for answers, as real users do not):
- ``multi-tenant``: 12 tenants, each with its own ~1,000-token system prompt; tenant popularity
  is Zipf (s = 1.1); conversations arrive as a Poisson process and run 3 turns, each resending
  the whole history after an exponential think time. Run at a low and a high rate.
- ``shared-prompt``: production-stack's multi-round QA shape, scaled to a CPU: every user shares
  one ~800-token system prompt and has ~700 tokens of private history; 16 users x 4 rounds.

Arms (each its own router process, ``bench/router_fleet.py``, as a pod runs it; only the
replica-choice plugins change):
- ``bounded-load``: the router before issue 14 - prefix (3) + load (1) scorers behind the
  bounded-load cap (c = 1.25);
- ``headroom``: the cap replaced by a filter that bites on what hurts a request (waiting
  requests, KV pressure, a batch at ``max_num_seqs``), the same prefix + load scorers;
- ``prefill-cost``: the router's defaults now - no filter beyond health and capacity, and
  instead of the prefix scorer one that weighs the blocks a replica would have to prefill (its
  uncached part of the prompt plus the work queued ahead there) against the others';
- ``longest-prefix``: pure longest-prefix match, least load only to break ties
  (production-stack's ``prefixaware`` idea, the strongest simple baseline);
- ``round-robin``;
- ``oracle`` (multi-tenant only): each tenant pinned to one replica, a balanced partition.

Engines: 4 reference engines (model preset 'small', max-num-seqs 4, 512 KV blocks of 16 tokens
each: about three tenants' prompts), so the fleet's cache holds the 12 tenants only if each
replica specialises. The machine has 2 shared cores: compare arms within one run, not across
runs.

Run: .venv/bin/python bench/router_prefix_workloads.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from router_affinity import (
    BLOCK_CHARS,
    KV_BLOCKS,
    MAX_TOKENS,
    MODEL,
    REPLICAS,
    TenantPartition,
    config,
    engine_counters,
    engines,
    stream_ttft,
    system_prompt,
)
from router_support import machine, percentile, save

from fleetpilot.routing.policies.load import LoadScorer
from fleetpilot.routing.policies.picker import (
    BoundedLoadFilter,
    CapacityFilter,
    HeadroomFilter,
    HealthFilter,
    WeightedScorer,
)
from fleetpilot.routing.policies.prefix import PrefixScorer, block_hashes
from fleetpilot.simulate.baselines import RoundRobin

TENANTS = 12
ZIPF_S = 1.1
TURNS = 3
THINK_MEAN_S = 1.0
SHARED_USERS = 16
SHARED_ROUNDS = 4


# -- traces ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    """One user's conversation: when it starts, its system prompt and its questions."""

    start_s: float
    tenant: int
    system: str
    questions: tuple[str, ...]
    think_s: tuple[float, ...]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


def multi_tenant_trace(rate_per_s: float, conversations: int, seed: int) -> list[Conversation]:
    """Conversations starting as a Poisson process; tenants by Zipf popularity."""
    rng = random.Random(seed)
    weights = zipf_weights(TENANTS, ZIPF_S)
    order = list(range(TENANTS))
    rng.shuffle(order)  # which tenant is hot is part of the seed, not always tenant 0
    trace, t = [], 0.0
    for i in range(conversations):
        t += rng.expovariate(rate_per_s)
        tenant = order[rng.choices(range(TENANTS), weights)[0]]
        questions = tuple(
            f"User {i} asks question {turn} about order {tenant * 1000 + i}: where is it now?"
            for turn in range(TURNS)
        )
        think = tuple(rng.expovariate(1.0 / THINK_MEAN_S) for _ in range(TURNS))
        trace.append(Conversation(t, tenant, system_prompt(tenant), questions, think))
    return trace


def shared_prompt_trace(
    rate_per_s: float, seed: int, users: int = SHARED_USERS
) -> list[Conversation]:
    """Every user shares one system prompt, then a long private history, several rounds;
    ``rate_per_s`` is the users' arrival rate."""
    rng = random.Random(seed)
    shared = ("You are the help desk of one company; answer briefly and cite the manual. " * 11)[
        :800
    ]
    words = ["ticket", "laptop", "vpn", "printer", "badge", "mailbox", "license", "monitor"]
    trace, t = [], 0.0
    for user in range(users):
        t += rng.expovariate(rate_per_s)
        history = f"User {user} history: " + " ".join(rng.choice(words) for _ in range(110))
        questions = tuple(
            (history[:700] + f"\nRound {r}: what next?") if r == 0 else f"Round {r}: and then?"
            for r in range(SHARED_ROUNDS)
        )
        think = tuple(rng.expovariate(1.0 / THINK_MEAN_S) for _ in range(SHARED_ROUNDS))
        trace.append(Conversation(t, -1, shared, questions, think))
    return trace


# -- arms ------------------------------------------------------------------------------------


def use_arm(arm: str, router: Any, cfg: Any) -> None:
    load = LoadScorer(cfg.spillover.queue_threshold)
    health, capacity = HealthFilter(), CapacityFilter(cfg.backpressure.max_waiting_per_replica)
    prefix = PrefixScorer(router.prefix_index)
    if arm == "prefill-cost":
        return  # the router's defaults
    if arm == "prefill-cost-once":
        # The defaults before an uncached block was priced twice (its own wait and the wait
        # of the requests behind it): for comparison.
        router.use_policies(scorers=router.affinity_scorers(block_cost=1.0))
        return
    if arm == "headroom":
        router.use_policies(
            filters=[health, capacity, HeadroomFilter()],
            scorers=[WeightedScorer(prefix, 3.0), WeightedScorer(load, 1.0)],
        )
    elif arm == "bounded-load":
        router.use_policies(
            filters=[health, capacity, BoundedLoadFilter(1.25)],
            scorers=[WeightedScorer(prefix, 3.0), WeightedScorer(load, 1.0)],
        )
    elif arm == "longest-prefix":
        router.use_policies(
            filters=[health, capacity],
            scorers=[WeightedScorer(prefix, 1.0), WeightedScorer(load, 1e-3)],
        )
    elif arm == "round-robin":
        router.use_policies(filters=[health, capacity], scorers=[WeightedScorer(RoundRobin(), 1)])
    elif arm == "oracle":
        first = {
            block_hashes(f"system: {system_prompt(t)}", MODEL, BLOCK_CHARS)[0]: t % REPLICAS
            for t in range(TENANTS)
        }
        router.use_policies(filters=[health], scorers=[WeightedScorer(TenantPartition(first), 1)])
    else:
        raise ValueError(f"unknown arm {arm}")


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Driven:
    """What the client saw of one trace."""

    ttfts: list[float]
    first_turn_ttfts: list[float]  # the conversations' first requests: no history cached yet
    statuses: dict[int, int]
    wall_s: float
    hits: float  # the engines' prefix-cache hits and queries over the trace, in tokens
    queries: float
    errors: dict[int, str]  # the first error body per status, to say what failed


SPREADS = ("alternate", "random")


def spreader(urls: Sequence[str], spread: str, seed: int) -> Callable[[int], str]:
    """Which router request ``i`` goes to, as a Service spreads a client's requests over
    router replicas: alternating, or at random (seeded)."""
    if spread == "alternate":
        return lambda i: urls[i % len(urls)]
    if spread == "random":
        rng = random.Random(f"spread-{seed}")
        return lambda _: rng.choice(urls)
    raise ValueError(f"unknown spread {spread!r}; one of {SPREADS}")


async def drive(
    trace: Sequence[Conversation],
    urls: Sequence[str],
    addresses: list[str],
    spread: str = "alternate",
    seed: int = 0,
) -> Driven:
    """Play the trace open loop, spreading requests over ``urls`` (``spreader``)."""
    route = spreader(urls, spread, seed)
    ttfts: list[float] = []
    first_turn_ttfts: list[float] = []
    statuses: dict[int, int] = {}
    errors: dict[int, str] = {}
    sent = 0
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = [await engine_counters(session, a) for a in addresses]
        started = time.perf_counter()

        async def converse(c: Conversation) -> None:
            nonlocal sent
            await asyncio.sleep(max(0.0, c.start_s - (time.perf_counter() - started)))
            messages = [{"role": "system", "content": c.system}]
            for turn, (question, think) in enumerate(zip(c.questions, c.think_s, strict=True)):
                messages.append({"role": "user", "content": question})
                url = route(sent)
                sent += 1
                status, ttft, answer = await stream_ttft(session, url, messages)
                statuses[status] = statuses.get(status, 0) + 1
                if status != 200:
                    errors.setdefault(status, answer[:300])
                    answer = ""
                if ttft is not None:
                    ttfts.append(ttft)
                    if turn == 0:
                        first_turn_ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer})
                await asyncio.sleep(think)

        await asyncio.gather(*(converse(c) for c in trace))
        wall = time.perf_counter() - started
        after = [await engine_counters(session, a) for a in addresses]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return Driven(ttfts, first_turn_ttfts, statuses, wall, hits, queries, errors)


def summary(arm: str, driven: Driven, per_replica: list[int]) -> dict[str, Any]:
    requests = sum(driven.statuses.values())
    ttfts, firsts = driven.ttfts, driven.first_turn_ttfts
    later = list(ttfts)
    for first in firsts:
        later.remove(first)
    return {
        "arm": arm,
        "requests": requests,
        "statuses": {str(k): v for k, v in driven.statuses.items()},
        "hit_rate": driven.hits / driven.queries if driven.queries else 0.0,
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3 if ttfts else None,
        "ttft_p95_ms": percentile(ttfts, 0.95) * 1e3 if ttfts else None,
        "ttft_slowest_ms": sorted((t * 1e3 for t in ttfts), reverse=True)[:8],
        "first_turn_ttft_p50_ms": percentile(firsts, 0.5) * 1e3 if firsts else None,
        "first_turn_ttft_p95_ms": percentile(firsts, 0.95) * 1e3 if firsts else None,
        "later_turn_ttft_p95_ms": percentile(later, 0.95) * 1e3 if later else None,
        "req_per_s": requests / driven.wall_s,
        "requests_per_replica": per_replica,
        **({"errors": {str(k): v for k, v in driven.errors.items()}} if driven.errors else {}),
    }


async def run_arm(arm: str, trace: Sequence[Conversation], addresses: list[str]) -> dict[str, Any]:
    """One arm through a router process of its own (``router_fleet``), as a pod runs it."""
    from router_fleet import engine_successes, fleetpilot_routers  # it imports this module

    with tempfile.TemporaryDirectory() as tmp:
        endpoints = Path(tmp) / "endpoints.yaml"
        listed = [{"tier": "only", "address": a} for a in addresses]
        endpoints.write_text(yaml.safe_dump({"endpoints": listed}))
        with fleetpilot_routers(
            arm, 1, config([]), endpoints, Path(tmp), replicas=REPLICAS, events=False
        ) as routers:
            driven = await drive(trace, [r.url for r in routers], addresses)
    return summary(arm, driven, sorted(engine_successes(a) for a in addresses))


def print_rows(rows: Sequence[dict[str, Any]], extra: str, key: str, arm_width: int) -> None:
    """One scenario's arms as a table; ``extra`` heads the column of each row's ``key`` (a
    dash where a row has none)."""
    head = ("arm", "hit rate", "TTFT p50", "TTFT p95", extra, "per replica")
    print(f"{{:{arm_width}}} {{:>8}} {{:>9}} {{:>9}} {{:>6}} {{:>18}}".format(*head))
    for r in rows:
        p50 = f"{r['ttft_p50_ms']:.0f}ms" if r["ttft_p50_ms"] is not None else "-"
        p95 = f"{r['ttft_p95_ms']:.0f}ms" if r["ttft_p95_ms"] is not None else "-"
        value = f"{r[key]:.2f}" if r.get(key) is not None else "-"
        print(
            f"{r['arm']:{arm_width}} {r['hit_rate']:>8.3f} {p50:>9} {p95:>9} {value:>6} "
            f"{r['requests_per_replica']!s:>18}"
        )


def oracle_hit_rate(trace: Sequence[Conversation]) -> float:
    """The hit rate of one unbounded cache: every prompt block seen before is a hit."""
    seen: set[int] = set()
    hits = total = 0
    for c in trace:
        history = f"system: {c.system}"
        for question in c.questions:
            history += f"\nuser: {question}"
            blocks = block_hashes(history, MODEL, BLOCK_CHARS)
            for b in blocks:
                hits += b in seen
                seen.add(b)
            total += len(blocks)
            history += "\nassistant: " + "x" * MAX_TOKENS
    return hits / total if total else 0.0


# -- main ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    trace: list[Conversation]
    arms: tuple[str, ...]


def scenarios(quick: bool, seed: int) -> list[Scenario]:
    n = 24 if quick else 48
    base = ("bounded-load", "headroom", "prefill-cost", "longest-prefix", "round-robin")
    return [
        Scenario("multi-tenant, low rate", multi_tenant_trace(2.0, n, seed), (*base, "oracle")),
        Scenario("multi-tenant, high rate", multi_tenant_trace(8.0, n, seed), (*base, "oracle")),
        Scenario("shared-prompt", shared_prompt_trace(4.0, seed), base),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the conversations")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--arms", help="comma-separated subset of arms")
    args = parser.parse_args()
    wanted = set(args.arms.split(",")) if args.arms else None
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    for scenario in scenarios(args.quick, args.seed):
        rows = []
        for arm in scenario.arms:
            if wanted is not None and arm not in wanted:
                continue
            with engines() as addresses:
                rows.append(asyncio.run(run_arm(arm, scenario.trace, addresses)))
            print(f"  {scenario.name}: {arm} done", file=sys.stderr)
        results.append(
            {
                "scenario": scenario.name,
                "unbounded_cache_hit_rate": oracle_hit_rate(scenario.trace),
                "rows": rows,
            }
        )
    for result in results:
        ceiling = result["unbounded_cache_hit_rate"]
        print(f"\n{result['scenario']} (one unbounded cache: {ceiling:.3f})")
        print_rows(result["rows"], "req/s", "req_per_s", 15)
    path = save(
        "router_prefix_workloads",
        {
            "benchmark": "router_prefix_workloads",
            "machine": machine(),
            "seed": args.seed,
            "engines": f"{REPLICAS} reference engines, preset 'small', max-num-seqs 4, "
            f"{KV_BLOCKS} KV blocks of 16 tokens",
            "results": results,
            "wall_s": time.monotonic() - started,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
