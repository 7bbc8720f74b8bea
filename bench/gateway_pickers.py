"""Endpoint pickers behind one gateway: fleetpilot's against the Gateway API Inference
Extension's own (issue 45, part 4).

Every arm runs on 4 freshly started reference engines (preset 'small', max-num-seqs 4,
16-token blocks, 512 KV blocks, publishing vLLM KV events) behind the same Go gateway
(``e2e/gateway``: Envoy's side of ext_proc for an InferencePool), each component its own
process. The client plays a trace open loop against the gateway and reads TTFT (the first
content chunk); the engines' own counters give the prefix-cache hit rate.

Arms (``xN``: N picker replicas, the gateway opening each request's stream on the next in
turn, as Envoy balances over a picker Service's endpoints; the replicas share nothing but
what each reads from the engines):
- ``fleetpilot EPP xN``: ``fleetpilot router`` with ``eppPort`` (its defaults: the reference
  tokenizer, the engines' KV events, the prefill-cost scorer);
- ``GIE default xN``: GIE v1.3.0's EPP (``e2e/gie-epp``, standalone mode against a real
  kube-apiserver, the engines as one Ready pod at 127.0.0.1 with their 4 ports as target
  ports) with its InferencePool chart's scheduling profile: queue, KV-utilization and
  prefix-cache scorers weighted 2, 2, 3;
- ``GIE prefix xN``: the same EPP with the prefix-cache scorer alone;
- ``round-robin``: the gateway alone, each request to the next engine;
- ``fleetpilot hop x1``: the router as the HTTP hop, no gateway, for reference.

Workloads (``router_prefix_workloads``): ``zipf-2``/``zipf-8``: multi-tenant chat, tenants
drawn by Zipf, each with its own system prompt, at 2 and 8 conversations a second;
``shared-4``/``shared-8``: one shared system prompt, 64 users arriving at 4 and 8 a second.

Per arm: hit rate, TTFT p50/p95 (and the p95's range over rounds), errors, and the pickers'
CPU seconds a request (every replica's user + system time over the trace, from /proc) and
peak resident memory (VmHWM). The machine has 2 shared cores: compare arms within one run.

Run: .venv/bin/python bench/gateway_pickers.py [--rounds N] [--arms a,b] [--scenarios ...]
     [--seed N] [--name FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from router_affinity import MODEL, REPLICAS, engines
from router_fleet import cpu_seconds, engine_successes, fleetpilot_routers
from router_kv_events import by_arm as kv_events_by_arm
from router_kv_events import kv_config
from router_prefix_workloads import (
    Conversation,
    drive,
    multi_tenant_trace,
    shared_prompt_trace,
    summary,
)
from router_support import commit, free_ports, machine, save

from fleetpilot.kube.client import MERGE_CONTENT_TYPE, Kube
from fleetpilot.testing.controlplane import ControlPlane
from fleetpilot.testing.gateway import Gateway
from fleetpilot.testing.gie_epp import GieEpp

ARMS = (
    "fleetpilot EPP x1",
    "fleetpilot EPP x2",
    "GIE default x1",
    "GIE default x2",
    "GIE prefix x1",
    "GIE prefix x2",
    "round-robin",
    "fleetpilot hop x1",
)
NAMESPACE = "bench"
NODE = "bench-node"
ENGINE_LABELS = {"app": "bench-engines"}
# Users of the shared-prompt trace: enough that the few cold first prefills of the shared
# prompt cannot alone make the p95 (router_kv_events' shared-long scenarios).
SHARED_USERS = 64


@dataclass(frozen=True)
class Scenario:
    key: str
    name: str
    trace: list[Conversation]


def scenarios(seed: int) -> list[Scenario]:
    return [
        *(
            Scenario(f"zipf-{rate}", f"multi-tenant Zipf chat, {rate} conversations/s",
                     multi_tenant_trace(float(rate), 48, seed))
            for rate in (2, 8)
        ),
        *(
            Scenario(f"shared-{rate}", f"one shared prompt, {SHARED_USERS} users at {rate}/s",
                     shared_prompt_trace(float(rate), seed, SHARED_USERS))
            for rate in (4, 8)
        ),
    ]  # fmt: skip


# -- the API server GIE's EPP watches ---------------------------------------------------------


@contextlib.contextmanager
def control_plane(workdir: Path) -> Iterator[ControlPlane]:
    """The test control plane, with one node and one Ready pod at 127.0.0.1 standing for the
    engines (GIE makes an endpoint of each of its target ports). No kubelet: the pod's status
    is written here; it tolerates every taint, so the node going NotReady without heartbeats
    never evicts it during a long run."""
    plane = ControlPlane(workdir / "controlplane")
    plane.start()
    try:
        with plane.api_client() as api:
            kube = Kube(api)
            kube.request("POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
            kube.request("POST", "/api/v1/nodes", body={"metadata": {"name": NODE}, "spec": {}})
            pod = {
                "metadata": {"name": "engines", "namespace": NAMESPACE, "labels": ENGINE_LABELS},
                "spec": {
                    "nodeName": NODE,
                    "containers": [{"name": "engine", "image": "reference-engine"}],
                    "tolerations": [{"operator": "Exists"}],
                },
            }
            path = f"/api/v1/namespaces/{NAMESPACE}/pods"
            kube.request("POST", path, body=pod)
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status = {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [
                    {"type": kind, "status": "True", "lastTransitionTime": now}
                    for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
            }
            kube.request(
                "PATCH",
                f"{path}/engines/status",
                body={"status": status},
                content_type=MERGE_CONTENT_TYPE,
            )
        yield plane
    finally:
        plane.stop()


# -- one arm ----------------------------------------------------------------------------------


@dataclass
class Pickers:
    """What an arm put in front of the engines: the URLs the client sends to and the picker
    processes whose CPU and memory count."""

    urls: list[str]
    pids: list[int] = field(default_factory=list)


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


@contextlib.contextmanager
def behind_gateway(pickers: Sequence[str], endpoints: Sequence[str] = ()) -> Iterator[str]:
    with Gateway(list(pickers), endpoints=endpoints) as gateway:
        yield gateway.url + "/v1/chat/completions"


@contextlib.contextmanager
def arm_pickers(
    arm: str,
    addresses: list[str],
    kv_ports: Sequence[tuple[int, int]],
    workdir: Path,
    plane: ControlPlane | None,
) -> Iterator[Pickers]:
    policy, _, replicas = arm.partition(" x")
    count = int(replicas or 1)
    if policy == "round-robin":
        with behind_gateway([], addresses) as url:
            yield Pickers([url])
        return
    if policy.startswith("GIE"):
        assert plane is not None
        profile = policy.split()[1]
        ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
        with contextlib.ExitStack() as stack:
            started = [
                stack.enter_context(
                    GieEpp(plane.kubeconfig, NAMESPACE, ENGINE_LABELS, ports, profile=profile,
                           name=f"gie-{i}")
                )
                for i in range(count)
            ]  # fmt: skip
            for picker in started:
                wait_for_endpoints(picker, len(ports))
            pids = [p.pid for p in started if p.pid is not None]
            with behind_gateway([p.address for p in started]) as url:
                yield Pickers([url], pids)
        return
    endpoints = workdir / "endpoints.yaml"
    listed = [
        {"tier": "only", "address": a, "kvEventsPort": pub, "kvReplayPort": replay}
        for a, (pub, replay) in zip(addresses, kv_ports, strict=True)
    ]
    endpoints.write_text(yaml.safe_dump({"endpoints": listed}))
    epp = policy == "fleetpilot EPP"
    epp_ports = free_ports(count) if epp else None
    with fleetpilot_routers(
        "events",
        count,
        kv_config(tokenizer=True),
        endpoints,
        workdir,
        replicas=REPLICAS,
        events=True,
        epp_ports=epp_ports,
    ) as routers:
        pids = [r.pid for r in routers]
        if epp_ports is None:
            yield Pickers([r.url for r in routers], pids)
            return
        with behind_gateway([f"127.0.0.1:{p}" for p in epp_ports]) as url:
            yield Pickers([url], pids)


def wait_for_endpoints(picker: GieEpp, wanted: int, timeout_s: float = 30.0) -> None:
    """Until GIE's EPP has scraped every endpoint it picks among (its per-endpoint queue
    gauges), so its first picks see the engines' metrics."""
    deadline = time.monotonic() + timeout_s
    while len(picker.queue_sizes()) < wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"GIE's EPP never saw {wanted} endpoints:\n{picker.log()}")
        time.sleep(0.2)


def play_arm(
    scenario: Scenario, arm: str, workdir: Path, plane: ControlPlane | None, seed: int
) -> dict[str, Any]:
    ports = free_ports(3 * REPLICAS)
    kv_ports = list(zip(ports[REPLICAS::2], ports[REPLICAS + 1 :: 2], strict=True))
    with (
        engines(kv_ports=kv_ports, ports=ports[:REPLICAS]) as addresses,
        arm_pickers(arm, addresses, kv_ports, workdir, plane) as pickers,
    ):
        cpu_before = [cpu_seconds(pid) for pid in pickers.pids]
        driven = asyncio.run(drive(scenario.trace, pickers.urls, addresses, "alternate", seed))
        cpu = sum(cpu_seconds(pid) for pid in pickers.pids) - sum(cpu_before)
        row = summary(arm, driven, sorted(engine_successes(a) for a in addresses))
        answered = max(1, row["statuses"].get("200", 0))
        row["picker_cpu_ms_per_request"] = cpu * 1e3 / answered if pickers.pids else None
        row["picker_peak_rss_mib"] = [round(peak_rss_mib(pid), 1) for pid in pickers.pids]
    return row


def by_arm(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each arm over its rounds (``router_kv_events.by_arm``: medians, the range of the
    rounds' p95s), with the pickers' median CPU a request and their highest peak memory."""
    merged = kv_events_by_arm(rows)
    for arm in merged:
        runs = [r for r in rows if r["arm"] == arm["arm"]]
        cpus = [r["picker_cpu_ms_per_request"] for r in runs if r["picker_cpu_ms_per_request"]]
        rss = [max(r["picker_peak_rss_mib"]) for r in runs if r["picker_peak_rss_mib"]]
        arm["picker_cpu_ms_per_request"] = statistics.median(cpus) if cpus else None
        arm["picker_peak_rss_mib"] = max(rss) if rss else None
    return merged


def print_by_arm(merged: Sequence[dict[str, Any]]) -> None:
    print(f"{'arm':20} {'rounds':>6} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'p95 range':>13} {'errors':>6} {'CPU ms/req':>10} {'peak MiB':>8}")  # fmt: skip
    for m in merged:
        low, high = m["ttft_p95_range_ms"] or (0.0, 0.0)
        cpu = m["picker_cpu_ms_per_request"]
        rss = m["picker_peak_rss_mib"]
        print(
            f"{m['arm']:20} {m['rounds']:>6} {m['hit_rate']:>8.3f} "
            f"{m['ttft_p50_ms'] or 0:>7.0f}ms {m['ttft_p95_ms'] or 0:>7.0f}ms "
            f"{f'{low:.0f}-{high:.0f}ms':>13} {m['errors']:>6} "
            f"{f'{cpu:.2f}' if cpu else '-':>10} {f'{rss:.0f}' if rss else '-':>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arms", help="comma-separated subset of: " + ", ".join(ARMS))
    parser.add_argument(
        "--scenarios", help="comma-separated subset of zipf-2,zipf-8,shared-4,shared-8"
    )
    parser.add_argument("--name", default="gateway_pickers", help="the results file's name")
    args = parser.parse_args()
    arms = [a for a in ARMS if not args.arms or a in args.arms.split(",")]
    unknown = set(args.arms.split(",")) - set(ARMS) if args.arms else set()
    if unknown:
        parser.error(f"unknown arms: {sorted(unknown)}")
    only = set(args.scenarios.split(",")) if args.scenarios else None
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        needs_kube = any(a.startswith("GIE") for a in arms)
        with control_plane(workdir) if needs_kube else contextlib.nullcontext() as plane:
            for scenario in scenarios(args.seed):
                if only is not None and scenario.key not in only:
                    continue
                rows = []
                for round_ in range(args.rounds):
                    # Each round starts one arm later: a drift in the machine's speed over
                    # the run falls on every arm alike.
                    shift = round_ % len(arms)
                    for arm in arms[shift:] + arms[:shift]:
                        row = play_arm(scenario, arm, workdir, plane, args.seed)
                        rows.append({**row, "round": round_})
                        print(f"  {scenario.key}: {arm} round {round_ + 1}: hit "
                              f"{row['hit_rate']:.3f}, p95 {row['ttft_p95_ms'] or 0:.0f} ms",
                              file=sys.stderr)  # fmt: skip
                results.append(
                    {"scenario": scenario.name, "key": scenario.key, "rows": rows,
                     "by_arm": by_arm(rows)}
                )  # fmt: skip
                path = save(
                    args.name,
                    {
                        "benchmark": "gateway_pickers",
                        "commit": commit(),
                        "machine": machine(),
                        "seed": args.seed,
                        "rounds": args.rounds,
                        "engines": f"{REPLICAS} reference engines, preset 'small', "
                        "max-num-seqs 4, 16-token blocks, 512 KV blocks, KV events",
                        "gateway": "e2e/gateway (Envoy's side of ext_proc), one process",
                        "model": MODEL,
                        "results": results,
                        "wall_s": time.monotonic() - started,
                    },
                )
    for result in results:
        print(f"\n{result['scenario']}")
        print_by_arm(result["by_arm"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
