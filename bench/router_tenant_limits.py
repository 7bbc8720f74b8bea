"""A tenant's request limit through one and two router processes (issue 44): does a tenant
limited to 600 requests a minute get 600 when a Service spreads it over two routers?

Setup: an echo engine (``router_support``, answers at once) behind ``fleetpilot router``
processes (``router_fleet``) with API keys; one tenant limited to ``--limit`` requests a minute.
The tenant first spends its bucket (a minute's worth is allowed at once), then sends at 1.5x
its limit, open loop (arrivals at a constant pace), for ``--settle`` seconds and then for
``--window`` seconds; what the routers admit in that window is the measure (the goal: the
limit, within 1%). Also reported: what the whole run admitted against a minute's worth plus
the limit's pace over its length.

Arms:
- ``one router``;
- ``two routers, shared``: the routers exchange what they admit (``routing.peers``);
- ``two routers, each its share``: no exchange, each admits ``ceil(limit / 2)``, as before;
each two-router arm with the requests alternating between the routers, spread at random, and
all on one router (a client holding one keep-alive connection).

Run: .venv/bin/python bench/router_tenant_limits.py [--limit 600] [--window 60] [--settle 30]
     [--rounds 1]
     [--arms TEXT] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from router_fleet import fleetpilot_routers
from router_prefix_workloads import spreader
from router_support import commit, echo_process, free_port, machine, save

from fleetpilot.api.router_config import RouterConfig

KEY = "sk-limited-tenant-0123456789"
MODEL = "echo"
# (name, routers, peers, spread)
ARMS = (
    ("one router", 1, False, "alternate"),
    ("two routers, shared, alternating", 2, True, "alternate"),
    ("two routers, shared, random", 2, True, "random"),
    ("two routers, shared, one connection", 2, True, "one"),
    ("two routers, each its share, alternating", 2, False, "alternate"),
    ("two routers, each its share, random", 2, False, "random"),
    ("two routers, each its share, one connection", 2, False, "one"),
)


def router_config(engine: str, keys: Path, limit: int, routers: int) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "service": "bench",
            "namespace": "bench",
            "tiers": [
                {"name": "only", "model": MODEL, "upTo": 1.0, "mode": "unified",
                 "endpoints": [{"role": "unified", "service": "e", "selector": {}, "port": 1,
                                "maxNumSeqs": 256, "addresses": [engine]}]}
            ],
            "auth": {
                "tenants": [{"name": "t", "keyFiles": [str(keys)], "requestsPerMinute": limit}],
                "routerReplicas": routers,
            },
        }
    )  # fmt: skip


async def play(
    urls: list[str], spread: str, limit: int, window_s: float, settle_s: float, seed: int
) -> tuple[int, int, float]:
    """Spend the bucket, send at 1.5x the limit for ``settle_s`` (a burst through several
    routers over-admits until they hear of each other, and the debt is paid back at the
    limit's pace), then for ``window_s``: the 200s in the window; and all the 200s of the run
    with its length, for the run as a whole (a minute's worth at once, then the limit's pace)."""
    targets = urls[:1] if spread == "one" else urls
    route = spreader(targets, "random" if spread == "random" else "alternate", seed)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    connector = aiohttp.TCPConnector(limit=1 if spread == "one" else 0)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def send(i: int) -> int:
            async with session.post(route(i), data=body) as resp:
                await resp.read()
                return resp.status

        sent = admitted = 0
        began = time.perf_counter()
        # Spend what the bucket holds, and what the routers would refill meanwhile.
        while True:
            statuses = await asyncio.gather(*(send(sent + i) for i in range(50)))
            sent += 50
            admitted += statuses.count(200)
            if statuses.count(429) >= 25:
                break
        pace = 1.5 * limit / 60.0

        async def steady(seconds: float) -> int:
            nonlocal sent
            started = time.perf_counter()
            tasks = []
            n = 0
            while (at := n / pace) < seconds:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - started)))
                tasks.append(asyncio.create_task(send(sent + n)))
                n += 1
            sent += n
            return (await asyncio.gather(*tasks)).count(200)

        admitted += await steady(settle_s)
        window = await steady(window_s)
        admitted += window
    return window, admitted, time.perf_counter() - began


def run_arm(name: str, routers: int, peers: bool, spread: str, args: argparse.Namespace,
            workdir: Path) -> dict[str, Any]:  # fmt: skip
    engine_port = free_port()
    keys = workdir / "keys"
    keys.write_text(KEY + "\n")
    with echo_process(engine_port, None):
        engine = f"127.0.0.1:{engine_port}"
        endpoints = workdir / "endpoints.yaml"
        endpoints.write_text(yaml.safe_dump({"endpoints": [{"tier": "only", "address": engine}]}))
        cfg = router_config(engine, keys, args.limit, routers)
        with fleetpilot_routers(
            "guessed", routers, cfg, endpoints, workdir, replicas=1, events=False, peers=peers
        ) as procs:
            urls = [p.url.replace("/chat/completions", "/completions") for p in procs]
            admitted, total, run_s = asyncio.run(
                play(urls, spread, args.limit, args.window, args.settle, args.seed)
            )
    expected = args.limit * args.window / 60.0
    # A full bucket at the start (a minute's worth), then the limit's pace.
    expected_total = args.limit + args.limit * run_s / 60.0
    return {
        "arm": name,
        "admitted": admitted,
        "expected": expected,
        "error_pct": 100.0 * (admitted - expected) / expected,
        "run_admitted": total,
        "run_s": run_s,
        "run_expected": expected_total,
        "run_error_pct": 100.0 * (total - expected_total) / expected_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=600, help="requests a minute")
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds at 1.5x before")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", help="only the arms whose names contain this text")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, routers, peers, spread in ARMS:
                if args.arms and args.arms not in name:
                    continue
                workdir = Path(tmp) / f"{round_}-{len(rows)}"
                workdir.mkdir()
                row = run_arm(name, routers, peers, spread, args, workdir)
                rows.append({**row, "round": round_})
                print(f"  {name}: {row['admitted']} admitted ({row['error_pct']:+.1f}%); "
                      f"whole run {row['run_admitted']} ({row['run_error_pct']:+.1f}%)",
                      file=sys.stderr)  # fmt: skip
    print(f"\n{args.limit} requests a minute, {args.window:g} s at 1.5x: "
          f"expected {args.limit * args.window / 60:.0f}")  # fmt: skip
    for name in dict.fromkeys(r["arm"] for r in rows):
        errors = [r["error_pct"] for r in rows if r["arm"] == name]
        admitted = [r["admitted"] for r in rows if r["arm"] == name]
        whole = [r["run_error_pct"] for r in rows if r["arm"] == name]
        print(f"{name:45} admitted {statistics.median(admitted):>6.0f}  "
              f"error {min(errors):+.1f}% .. {max(errors):+.1f}%  "
              f"whole run {min(whole):+.1f}% .. {max(whole):+.1f}%")  # fmt: skip
    if args.save:
        path = save(
            "router_tenant_limits",
            {"benchmark": "router_tenant_limits", "commit": commit(), "machine": machine(),
             "limit": args.limit, "window_s": args.window, "rounds": args.rounds, "rows": rows},
        )  # fmt: skip
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
