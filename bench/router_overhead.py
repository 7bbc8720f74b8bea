"""What the router adds: the same load sent directly to a fast echo engine and through
``fleetpilot router`` in front of it, in one run.

Processes and cores: the router runs alone on CPU 0 (``os.sched_setaffinity``); the echo engine
and this load generator share CPU 1 in both arms, so the direct arm is the baseline of
everything except the router. Concurrency 1, 32, 256 and 1024 connections, each sending
back-to-back requests; non-streaming and streaming (5 SSE chunks). Reported per arm: p50/p99
latency, time to the first streamed chunk, requests/s; and the router's added p50/p99.

The requests name the service ("bench"), so the router does its full work: parse, features,
complexity score, tier and replica choice, model rewrite, relay.

Run: .venv/bin/python bench/router_overhead.py [--quick] [--soak SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from router_support import (
    echo_process,
    free_port,
    load,
    machine,
    pin,
    process,
    raise_fd_limit,
    request_bytes,
    save,
)

CONCURRENCY = [1, 32, 256, 1024]
DURATION_S = 2.5
BODY = {"model": "bench", "prompt": "Say hello in one short sentence.", "max_tokens": 16}


def router_config(echo_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "RouterConfig",
        "service": "bench",
        "namespace": "bench",
        "tiers": [
            {
                "name": "echo",
                "model": "echo",
                "upTo": 1.0,
                "mode": "unified",
                "endpoints": [
                    {
                        "role": "unified",
                        "service": "echo",
                        "selector": {},
                        "port": echo_port,
                        # The echo engine has no batch limit; nothing may look saturated.
                        "maxNumSeqs": 100_000,
                        "addresses": [f"127.0.0.1:{echo_port}"],
                    }
                ],
            }
        ],
    }


def router_process(config: Path, port: int, cpus: set[int]) -> Any:
    argv = [
        sys.executable, "-m", "fleetpilot.routing.cli", "--config", str(config),
        "--host", "127.0.0.1", "--port", str(port), "--discovery", "static",
        "--log-level", "warning", "--seed", "0",
    ]  # fmt: skip
    return process(argv, cpus, port)


def run_arm(port: int, stream: bool, concurrency: int, duration_s: float) -> dict[str, Any]:
    payload = request_bytes("/v1/completions", {**BODY, "stream": stream})
    stats = asyncio.run(load(port, payload, concurrency, duration_s))
    return stats.summary()


def table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'mode':6} {'conc':>5} | {'direct p50':>10} {'p99':>7} {'req/s':>7} | "
        f"{'router p50':>10} {'p99':>7} {'req/s':>7} {'err':>4} | {'+p50 ms':>8} {'+p99 ms':>8}"
        f" | {'1st chunk +ms':>13}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        d, t = r["direct"], r["router"]
        first = f"{t['first_chunk_p50_ms'] - d['first_chunk_p50_ms']:>13.3f}" if r["stream"] else ""
        print(
            f"{'stream' if r['stream'] else 'plain':6} {r['concurrency']:>5} | "
            f"{d['p50_ms']:>10.3f} {d['p99_ms']:>7.2f} {d['req_per_s']:>7.0f} | "
            f"{t['p50_ms']:>10.3f} {t['p99_ms']:>7.2f} {t['req_per_s']:>7.0f} "
            f"{t['errors']:>4} | {r['added_p50_ms']:>8.3f} {r['added_p99_ms']:>8.3f} | {first}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 32 only")
    parser.add_argument(
        "--soak", type=float, default=0.0, help="also run concurrency 256 for this many seconds"
    )
    args = parser.parse_args()
    raise_fd_limit()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    router_cpus = {0} if len(cpus) > 1 else None
    client_cpus = pin({1}) if len(cpus) > 1 else cpus
    levels = CONCURRENCY[:2] if args.quick else CONCURRENCY
    echo_port, router_port = free_port(), free_port()
    rows: list[dict[str, Any]] = []
    soak: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "router.yaml"
        config.write_text(yaml.safe_dump(router_config(echo_port)))
        with (
            echo_process(echo_port, client_cpus),
            router_process(config, router_port, router_cpus or set()),
        ):
            for stream in (False, True):
                for concurrency in levels:
                    direct = run_arm(echo_port, stream, concurrency, DURATION_S)
                    routed = run_arm(router_port, stream, concurrency, DURATION_S)
                    rows.append(
                        {
                            "stream": stream,
                            "concurrency": concurrency,
                            "direct": direct,
                            "router": routed,
                            "added_p50_ms": routed["p50_ms"] - direct["p50_ms"],
                            "added_p99_ms": routed["p99_ms"] - direct["p99_ms"],
                        }
                    )
            if args.soak:
                payload = request_bytes("/v1/completions", BODY)
                stats = asyncio.run(load(router_port, payload, 256, args.soak, timeline=True))
                per_s = [n for _, n in stats.timeline]
                window = max(1, min(60, len(per_s) // 5))
                first, last = per_s[:window], per_s[-window - 1 : -1] or per_s[-window:]
                soak = {
                    "concurrency": 256,
                    "duration_s": args.soak,
                    "window_s": window,
                    "first_window_req_per_s": sum(first) / len(first),
                    "last_window_req_per_s": sum(last) / len(last),
                    "errors": stats.errors,
                    "per_second": per_s,
                }
    table(rows)
    routed_max = max((r for r in rows if not r["stream"]), key=lambda r: r["router"]["req_per_s"])
    stream_max = max((r for r in rows if r["stream"]), key=lambda r: r["router"]["req_per_s"])
    summary = {
        "added_p50_ms_c1_plain": rows[0]["added_p50_ms"],
        "added_first_chunk_p50_ms_c1": next(
            r["router"]["first_chunk_p50_ms"] - r["direct"]["first_chunk_p50_ms"]
            for r in rows
            if r["stream"] and r["concurrency"] == 1
        ),
        "max_router_req_per_s_plain": routed_max["router"]["req_per_s"],
        "max_router_req_per_s_stream": stream_max["router"]["req_per_s"],
        "router_errors": sum(r["router"]["errors"] for r in rows),
    }
    print("summary:", {k: round(v, 3) for k, v in summary.items()})
    if soak:
        print(
            f"soak c=256 {args.soak:.0f}s: first {soak['window_s']}s "
            f"{soak['first_window_req_per_s']:.0f} req/s, last {soak['last_window_req_per_s']:.0f}"
            f" req/s, errors {soak['errors']}"
        )
    path = save(
        "router_overhead",
        {
            "benchmark": "router_overhead",
            "machine": machine(),
            "router_cpus": sorted(router_cpus or []),
            "client_and_echo_cpus": sorted(client_cpus),
            "duration_s": DURATION_S,
            "rows": rows,
            "summary": summary,
            "soak": soak,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
