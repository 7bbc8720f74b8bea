"""What API keys and per-tenant limits cost at the router: the same requests through a router
without auth and one checking a key (``routing.auth``) and taking from the tenant's request and
token buckets, in front of the same echo engine, in one run.

The keyed router holds 64 tenants of 2 keys each (a rotation under way for every tenant), so
each request's key is compared with 128 stored digests, every one visited (constant time); each
tenant has request and token limits high enough never to refuse.
Both routers run on CPU 0 (``os.sched_setaffinity``), the echo engine and this load generator
on CPU 1. Concurrency 1, plain and streamed (5 SSE chunks); the arms alternate over several
rounds so a drift of the machine falls on both. Reported per arm: p50/p99 latency and the
time to the first streamed chunk; and what auth adds at p50 (goal: <= 0.1 ms).

Run: .venv/bin/python bench/router_auth_overhead.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from router_overhead import router_config, router_process
from router_support import echo_process, free_port, load, machine, pin, raise_fd_limit, save

TENANTS = 64
KEYS_PER_TENANT = 2
ROUNDS = 5
DURATION_S = 2.0
BODY = {"model": "bench", "prompt": "Say hello in one short sentence.", "max_tokens": 16}


def request_with_key(body: dict[str, Any], key: str | None) -> bytes:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def keyed_config(echo_port: int, keys_dir: Path) -> dict[str, Any]:
    tenants = []
    for t in range(TENANTS):
        path = keys_dir / f"tenant-{t}"
        path.write_text(
            "".join(f"sk-bench-{t:03d}-{k}-{'x' * 24}\n" for k in range(KEYS_PER_TENANT))
        )
        # Limits high enough never to refuse: the buckets' cost, not their refusals.
        tenants.append(
            {
                "name": f"tenant-{t}",
                "keyFiles": [str(path)],
                "requestsPerMinute": 10_000_000,
                "tokensPerMinute": 10_000_000_000,
            }
        )
    return {**router_config(echo_port), "auth": {"tenants": tenants}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    raise_fd_limit()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    router_cpus = {0} if len(cpus) > 1 else set()
    client_cpus = pin({1}) if len(cpus) > 1 else cpus
    # The last tenant's second key: the comparison visits every digest whichever matches.
    key = f"sk-bench-{TENANTS - 1:03d}-{KEYS_PER_TENANT - 1}-{'x' * 24}"
    echo_port, open_port, keyed_port = free_port(), free_port(), free_port()
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"plain_p50": [], "plain_p99": [], "first_chunk_p50": []} for arm in ("open", "keyed")
    }
    errors = {"open": 0, "keyed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        open_config, keyed_path = Path(tmp) / "open.yaml", Path(tmp) / "keyed.yaml"
        open_config.write_text(yaml.safe_dump(router_config(echo_port)))
        keyed_path.write_text(yaml.safe_dump(keyed_config(echo_port, Path(tmp))))
        with (
            echo_process(echo_port, client_cpus),
            router_process(open_config, open_port, router_cpus),
            router_process(keyed_path, keyed_port, router_cpus),
        ):
            for _ in range(args.rounds):
                for arm, port, arm_key in (("open", open_port, None), ("keyed", keyed_port, key)):
                    plain = asyncio.run(
                        load(port, request_with_key(BODY, arm_key), 1, DURATION_S)
                    ).summary()
                    streamed = asyncio.run(
                        load(
                            port, request_with_key({**BODY, "stream": True}, arm_key), 1, DURATION_S
                        )
                    ).summary()
                    samples[arm]["plain_p50"].append(plain["p50_ms"])
                    samples[arm]["plain_p99"].append(plain["p99_ms"])
                    samples[arm]["first_chunk_p50"].append(streamed["first_chunk_p50_ms"])
                    errors[arm] += plain["errors"] + streamed["errors"]
    median = {arm: {k: statistics.median(v) for k, v in s.items()} for arm, s in samples.items()}
    added = {k: median["keyed"][k] - median["open"][k] for k in median["open"]}
    print(f"{'':22} {'no auth':>10} {'API keys':>10} {'added':>10}")
    for k, label in (
        ("plain_p50", "p50 (ms)"),
        ("plain_p99", "p99 (ms)"),
        ("first_chunk_p50", "1st chunk p50 (ms)"),
    ):
        print(
            f"{label:22} {median['open'][k]:>10.3f} {median['keyed'][k]:>10.3f} {added[k]:>+10.3f}"
        )
    per_round = [
        k - o
        for k, o in zip(samples["keyed"]["plain_p50"], samples["open"]["plain_p50"], strict=True)
    ]
    print(f"added p50 by round (ms): {', '.join(f'{d:+.3f}' for d in per_round)}; errors {errors}")
    path = save(
        "router_auth_overhead",
        {
            "benchmark": "router_auth_overhead",
            "machine": machine(),
            "tenants": TENANTS,
            "keys_per_tenant": KEYS_PER_TENANT,
            "rounds": args.rounds,
            "duration_s": DURATION_S,
            "samples": samples,
            "median": median,
            "added_ms": added,
            "errors": errors,
        },
    )
    print(f"wrote {path}")
    sys.exit(0 if not any(errors.values()) else 1)


if __name__ == "__main__":
    main()
