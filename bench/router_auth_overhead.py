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
import contextlib
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


def keyed_config(echo_port: int, keys_dir: Path, limits: bool) -> dict[str, Any]:
    tenants = []
    for t in range(TENANTS):
        path = keys_dir / f"tenant-{t}"
        path.write_text(
            "".join(f"sk-bench-{t:03d}-{k}-{'x' * 24}\n" for k in range(KEYS_PER_TENANT))
        )
        tenant: dict[str, Any] = {"name": f"tenant-{t}", "keyFiles": [str(path)]}
        if limits:
            # High enough never to refuse: the buckets' cost, not their refusals.
            tenant |= {"requestsPerMinute": 10_000_000, "tokensPerMinute": 10_000_000_000}
        tenants.append(tenant)
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
    echo_port = free_port()
    arms = ("open", "keys", "keys+limits")
    ports = {arm: free_port() for arm in arms}
    samples: dict[str, dict[str, list[float]]] = {
        arm: {"plain_p50": [], "plain_p99": [], "first_chunk_p50": []} for arm in arms
    }
    errors = dict.fromkeys(arms, 0)
    with tempfile.TemporaryDirectory() as tmp:
        configs = {arm: Path(tmp) / f"{i}.yaml" for i, arm in enumerate(arms)}
        configs["open"].write_text(yaml.safe_dump(router_config(echo_port)))
        configs["keys"].write_text(yaml.safe_dump(keyed_config(echo_port, Path(tmp), False)))
        configs["keys+limits"].write_text(yaml.safe_dump(keyed_config(echo_port, Path(tmp), True)))
        with contextlib.ExitStack() as stack:
            stack.enter_context(echo_process(echo_port, client_cpus))
            for arm in arms:
                stack.enter_context(router_process(configs[arm], ports[arm], router_cpus))
            for _ in range(args.rounds):
                for arm in arms:
                    arm_key = None if arm == "open" else key
                    plain = asyncio.run(
                        load(ports[arm], request_with_key(BODY, arm_key), 1, DURATION_S)
                    ).summary()
                    body = {**BODY, "stream": True}
                    streamed = asyncio.run(
                        load(ports[arm], request_with_key(body, arm_key), 1, DURATION_S)
                    ).summary()
                    samples[arm]["plain_p50"].append(plain["p50_ms"])
                    samples[arm]["plain_p99"].append(plain["p99_ms"])
                    samples[arm]["first_chunk_p50"].append(streamed["first_chunk_p50_ms"])
                    errors[arm] += plain["errors"] + streamed["errors"]
    median = {arm: {k: statistics.median(v) for k, v in s.items()} for arm, s in samples.items()}
    added = {
        arm: {k: median[arm][k] - median["open"][k] for k in median["open"]} for arm in arms[1:]
    }
    print(f"{'':20} {'no auth':>9} {'keys':>9} {'added':>8} {'+limits':>9} {'added':>8}")
    for k, label in (
        ("plain_p50", "p50 (ms)"),
        ("plain_p99", "p99 (ms)"),
        ("first_chunk_p50", "1st chunk p50 (ms)"),
    ):
        print(
            f"{label:20} {median['open'][k]:>9.3f} {median['keys'][k]:>9.3f} "
            f"{added['keys'][k]:>+8.3f} {median['keys+limits'][k]:>9.3f} "
            f"{added['keys+limits'][k]:>+8.3f}"
        )
    for arm in arms[1:]:
        rounds = [
            a - o
            for a, o in zip(samples[arm]["plain_p50"], samples["open"]["plain_p50"], strict=True)
        ]
        print(f"{arm}: added p50 by round (ms): {', '.join(f'{d:+.3f}' for d in rounds)}")
    print(f"errors {errors}")
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
