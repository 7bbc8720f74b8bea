"""A noisy neighbour on a saturated fleet: tenant A sends ten times its share, tenant B its
share, with the router's fair queue (``routing.flowControl``) and without it, in one run.

The fleet is what ``fleetpilot up`` runs: CPU reference engines behind the real router, here
2 replicas of one tier (no autoscaling), each running at most ``--max-num-seqs`` sequences and
sleeping ``--step-delay`` after every busy step, so its throughput is its pace, not its share
of this machine's 2 cores. Both tenants hold API keys (``routing.auth``, equal weights). Load:
``fleetpilot bench``'s open-loop runner, Poisson arrivals of ``shared-prefix`` chats answered
in ``--max-tokens`` tokens, one runner per tenant with its own key: B at ``--rate-b`` req/s
(its share: about half of what the fleet serves), A at ten times that.

Arms, each on a fresh fleet:

- **B alone**: B's load with nothing else: its unloaded TTFT.
- **first come, first served**: A and B without flow control - the router admits while the
  engines' queues have room (``backpressure.maxWaitingPerReplica``), so B's requests wait in
  the engines' queues behind A's.
- **fair queue, headroom H** (``--headroom``, default 0 and 2): A and B with ``flowControl``:
  the router keeps the engines' queues empty and hands each freed slot to the tenants in
  weighted-fair turns; A's excess waits in the router (up to ``maxWait``) or is refused. With
  headroom 0 every slot is filled (work-conserving), so B's request waits for the next slot to
  free; with H > 0 B keeps H slots free while it is active (within its share), so it starts at
  once and A has the other slots.

With ``--routers 1 2`` every loaded arm runs with one router and with two router replicas,
each its own process, peered as a cluster's are (``routing.peers``: they share each tier's
active tenants and their requests in flight, so the headroom holds across them), the clients
alternating requests between them as the router Service spreads connections.

Reported per arm and tenant: requests, success rate, TTFT p50/p95 of the successful ones, and
B's p95 against its unloaded value (the goal: within 1.5x with the fair queue, and no worse
with two routers than with one; A gets the rest and does not starve). The machine has 2
shared cores: compare arms within one run.

With ``--rounds N`` the loaded arms run N times, round r with seed ``--seed`` + r and the arms
in rotated order (so no arm always runs first on a cooler machine); B's p95 is reported per
round and over all rounds' requests pooled, since with ~80 requests a round its p95 is its 4th
slowest request and moves a lot between runs.

Run: .venv/bin/python bench/router_noisy_neighbour.py [--duration 60] [--seed 0]
     [--routers 1 2] [--rounds 1] [--save] [--name FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from router_support import commit, machine, save

from fleetpilot.api import InferenceService, load_services
from fleetpilot.loadgen.runner import RequestRecord, RunConfig, Runner, Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.runtime.local import LocalFleet

MODEL = "shared-model"
KEYS = {"a": "sk-noisy-tenant-a-0123456789", "b": "sk-quiet-tenant-b-0123456789"}

SERVICE = """\
apiVersion: fleetpilot.dev/v1alpha1
kind: InferenceService
metadata:
  name: noisy
  namespace: default
spec:
  tiers:
    - name: main
      model:
        name: Qwen/Qwen2.5-0.5B-Instruct
        servedName: {model}
        maxModelLen: 2048
      engine:
        maxNumSeqs: {max_num_seqs}
      serving:
        replicas: {{min: 2, max: 2}}
      autoscaling:
        mode: disabled
  routing:
    replicas: 1
    requestTimeout: 120s
    auth:
      tenants:
        - name: a
          keysSecretRef: {{name: keys, key: a}}
        - name: b
          keysSecretRef: {{name: keys, key: b}}
          weight: {weight_b:g}
{flow}"""


def service_for(
    flow: bool, headroom: int, args: argparse.Namespace, folder: Path
) -> InferenceService:
    path = folder / f"service-{flow}-{headroom}.yaml"
    flow_text = (
        f"    flowControl: {{maxWait: {args.max_wait:g}s, headroom: {headroom}}}\n" if flow else ""
    )
    path.write_text(
        SERVICE.format(
            model=MODEL, max_num_seqs=args.max_num_seqs, flow=flow_text, weight_b=args.weight_b
        )
    )
    (service,) = load_services(path)
    return service


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def tenant_summary(records: list[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "requests": len(records),
        "ok": len(ok),
        "success_rate": len(ok) / len(records) if records else None,
        "ttft_p50_s": p(ttfts, 0.5),
        "ttft_p95_s": p(ttfts, 0.95),
        "errors": errors,
        "ttfts_s": sorted(ttfts),
    }


def run_arm(
    name: str,
    flow: bool,
    headroom: int,
    rates: dict[str, float],
    args: argparse.Namespace,
    folder: Path,
    routers: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    keys = folder / "keys" / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    for tenant, key in KEYS.items():
        (keys / tenant).write_text(key)
    workdir = folder / f"{name.replace(' ', '-').replace(',', '')}-seed-{seed}"
    workdir.mkdir()
    fleet = LocalFleet(
        service_for(flow, headroom, args, folder),
        workdir,
        0,
        max_replicas_per_role=2,
        step_delay_s=args.step_delay,
        auth_dir=keys.parent,
        routers=routers,
    )
    records: dict[str, list[RequestRecord]] = {tenant: [] for tenant in rates}
    fleet.start()
    try:

        def load(tenant: str) -> None:
            urls = fleet.router_urls()
            config = RunConfig(
                base_url=urls[0],
                more_urls=tuple(urls[1:]),
                model=MODEL,
                schedule=Schedule.constant(rates[tenant]),
                duration_s=args.duration,
                timeout_s=120.0,
                max_in_flight=4096,
                seed=seed + (1 if tenant == "a" else 0),
                api_key=KEYS[tenant],
                ignore_eos=True,
            )
            workload = make_workload("shared-prefix", seed, max_tokens=args.max_tokens)
            records[tenant].extend(asyncio.run(Runner(config, workload).run()).records)

        threads = [threading.Thread(target=load, args=(tenant,)) for tenant in rates]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            fleet.supervise_once()
            for thread in threads:
                thread.join(0.2)
        waits = queue_waits([f"127.0.0.1:{port}" for port in fleet.router_metrics_ports])
    finally:
        fleet.stop()
    return {
        "arm": name,
        "routers": routers,
        "flow_control": flow,
        "headroom": headroom if flow else None,
        "seed": seed,
        "rates": rates,
        "tenants": {tenant: tenant_summary(recs) for tenant, recs in records.items()},
        "queue_waits": waits,
    }


def queue_waits(metrics_addresses: list[str]) -> dict[str, dict[str, float]]:
    """Per tenant, the routers' fair-queue wait histograms summed: how many requests waited
    for capacity, and how many of those longer than each bucket bound."""
    out: dict[str, dict[str, float]] = {}
    for address in metrics_addresses:
        text = httpx.get(f"http://{address}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            if family.name != "fleetpilot_router_queue_wait_seconds":
                continue
            for sample in family.samples:
                entry = out.setdefault(sample.labels.get("tenant", ""), {})
                if sample.name.endswith("_count"):
                    key = "queued"
                elif sample.name.endswith("_bucket"):
                    key = f"le_{sample.labels['le']}"
                else:
                    continue
                entry[key] = entry.get(key, 0.0) + sample.value
    return out


def pooled_b(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm, B's TTFTs of every round pooled (p50/p95 over all of them) and the spread of
    the rounds' own p95s."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_arm.setdefault(result["arm"], []).append(result["tenants"]["b"])
    out: dict[str, dict[str, Any]] = {}
    for name, rounds in by_arm.items():
        ttfts = [t for r in rounds for t in r["ttfts_s"]]
        p95s = sorted(r["ttft_p95_s"] for r in rounds if r["ttft_p95_s"] is not None)
        out[name] = {
            "rounds": len(rounds),
            "ok": len(ttfts),
            "ttft_p50_s": p(ttfts, 0.5),
            "ttft_p95_s": p(ttfts, 0.95),
            "round_p95_median_s": statistics.median(p95s) if p95s else None,
            "round_p95_min_s": p95s[0] if p95s else None,
            "round_p95_max_s": p95s[-1] if p95s else None,
        }
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rate-b", type=float, default=1.5)
    parser.add_argument("--noise", type=float, default=10.0, help="A's rate over B's")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--max-wait", type=float, default=30.0)
    parser.add_argument("--headroom", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--skip-fcfs", action="store_true", help="no first-come arm")
    parser.add_argument("--weight-b", type=float, default=1.0, help="B's flowControl weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--routers", type=int, nargs="+", default=[1], help="router replicas of the loaded arms"
    )
    parser.add_argument("--rounds", type=int, default=1, help="repeats of the loaded arms")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--name", help="the results file's name (default: by the options)")
    args = parser.parse_args()
    both = {"a": args.rate_b * args.noise, "b": args.rate_b}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results.append(run_arm("B alone", False, 0, {"b": args.rate_b}, args, folder, 1, args.seed))
        print("done: B alone", flush=True)
        arms: list[tuple[str, bool, int, dict[str, float], int]] = []
        for routers in args.routers:
            suffix = "" if args.routers == [1] else f", {routers} router{'s' * (routers > 1)}"
            if not args.skip_fcfs:
                arms.append((f"first come, first served{suffix}", False, 0, both, routers))
            arms += [
                (f"fair queue, headroom {h}{suffix}", True, h, both, routers) for h in args.headroom
            ]
        for round_ in range(args.rounds):
            seed = args.seed + round_
            shift = round_ % len(arms)
            for name, flow, headroom, rates, routers in arms[shift:] + arms[:shift]:
                results.append(run_arm(name, flow, headroom, rates, args, folder, routers, seed))
                print(f"done: {name}, seed {seed}", flush=True)
    unloaded = results[0]["tenants"]["b"]["ttft_p95_s"]
    print(
        f"\nA {both['a']:g} req/s, B {both['b']:g} req/s, {args.duration:g} s, 2 engines of "
        f"{args.max_num_seqs} sequences, {args.max_tokens} tokens each, seed {args.seed}, "
        f"B's weight {args.weight_b:g}"
    )
    print(
        f"{'arm':40} {'seed':>4} {'tenant':6} {'reqs':>5} {'ok':>6} {'TTFT p50':>10} "
        f"{'TTFT p95':>10}  vs alone"
    )
    for result in results:
        for tenant, s in result["tenants"].items():
            ratio = ""
            if tenant == "b" and unloaded and s["ttft_p95_s"]:
                ratio = f"{s['ttft_p95_s'] / unloaded:.2f}x"
            rate = s["success_rate"]
            print(
                f"{result['arm']:40} {result['seed']:>4} {tenant:6} {s['requests']:>5} "
                f"{(f'{rate:.0%}' if rate is not None else '-'):>6} "
                f"{_ms(s['ttft_p50_s']):>10} {_ms(s['ttft_p95_s']):>10}  {ratio}"
            )
    if args.rounds > 1:
        print(f"\nB over {args.rounds} rounds (seeds {args.seed}-{args.seed + args.rounds - 1}):")
        for name, pooled in pooled_b(results[1:]).items():
            print(
                f"  {name:40} p95 pooled {_ms(pooled['ttft_p95_s'])} over {pooled['ok']} "
                f"requests; per round median {_ms(pooled['round_p95_median_s'])} "
                f"({_ms(pooled['round_p95_min_s'])} - {_ms(pooled['round_p95_max_s'])})"
            )
    print("\nB's requests that waited in the router's fair queue (and longer than):")
    for result in results:
        b = result["queue_waits"].get("b")
        if b:
            queued = b.get("queued", 0.0)
            longer = {bound: queued - b.get(f"le_{bound}", 0.0) for bound in ("0.1", "0.25", "0.5")}
            print(
                f"  {result['arm']:40} {queued:4.0f} queued; "
                + ", ".join(f"{n:.0f} > {bound} s" for bound, n in longer.items())
            )
    if args.save:
        name = "router_noisy_neighbour"
        if args.weight_b != 1.0:
            name += f"_weight_b_{args.weight_b:g}"
        if args.routers != [1]:
            name += "_routers"
        if args.seed != 0:
            name += f"_seed_{args.seed}"
        name = args.name or name
        path = save(
            name,
            {
                "benchmark": "router_noisy_neighbour",
                "commit": commit(),
                "machine": machine(),
                "args": vars(args),
                "results": results,
                "pooled_b": pooled_b(results[1:]) if args.rounds > 1 else None,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
