"""LoRA adapters behind the router: how often engines swap adapters, and what it costs in TTFT,
by replica-choice policy, in one run.

Four reference engines (preset 'small', `--max-loras 4`, vLLM's default `--max-cpu-loras` of the
same 4, `--max-num-seqs 8`) serve 16 seeded rank-8 adapters of their model, loaded at start
from PEFT folders this script writes. Each request names one adapter by a Zipf popularity
(``fleetpilot bench --adapters``: the k-th weighs 1/k^skew), open loop, the `mixed` workload's
chats answered in 16 tokens. An engine runs at most 4 adapters at once: a request for a fifth
waits until one of the running ones has no request left, then the engine activates it (on a
GPU a host-to-device copy; here nothing), reading it from its folder again if it was evicted
from the 4 it keeps loaded.

Policies (the same router process; only the replica-choice plugins change, through
``Router.use_policies``; engines restarted for every arm, so each starts with the same adapters
loaded):
- ``fleetpilot``: the router's defaults - prefix cost, load, and the adapter scorer (a replica
  whose scraped ``vllm:lora_requests_info`` names the adapter, or that this router sent one of
  its last 4 adapters);
- ``scores-only``: the same without the holder filter (an adapter's request kept on a replica
  that holds it while one has room, within a bound): the adapter scorer weighed against load
  and prefix cost alone (the router before the filter);
- ``no-adapter-affinity``: without the filter and the adapter scorer (the router before both);
- ``adapter-hash``: consistent hashing of the adapter's name with bounded loads (c = 1.25) -
  each adapter's home replica, spilling to the next on the ring when it is over its share:
  the strongest simple baseline (KubeAI's and AIBrix's LoRA routing are variants of it);
- ``round-robin`` and ``random``.

Reported per policy: adapter activations (swaps into a running slot) and loads (reads from a
folder) per 1,000 requests, from the engines' own counters; TTFT p50/p95 (first content chunk);
completed requests per second and errors.

The machine has 2 shared cores: compare arms within one run, not across runs.

Run: .venv/bin/python bench/router_lora.py [--rate 6] [--duration 60] [--skew 1.0]
     [--seeds 0,1] [--arms a,b] [--save [--name FILE]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from router_affinity import HashRing
from router_support import ROOT, free_ports, machine, save, serving

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.engine.reference.lora import random_adapter, save_adapter
from fleetpilot.engine.reference.settings import MODEL_PRESETS
from fleetpilot.loadgen import report
from fleetpilot.loadgen.runner import RunConfig, Runner, Schedule
from fleetpilot.loadgen.workloads import ModelMix, make_workload
from fleetpilot.routing.app import ROUTER_APP
from fleetpilot.routing.policies.picker import (
    BoundedLoadFilter,
    CapacityFilter,
    HealthFilter,
    WeightedScorer,
)
from fleetpilot.routing.policies.types import PickRequest, ReplicaView
from fleetpilot.simulate.baselines import RoundRobin

REPLICAS = 4
ADAPTERS = 16
MAX_LORAS = 4
MAX_NUM_SEQS = 8
RANK = 8
MODEL = "lora-base"
PRESET = "small"
ARMS = (
    "fleetpilot",
    "scores-only",
    "no-adapter-affinity",
    "adapter-hash",
    "round-robin",
    "random",
)


def adapter_names() -> list[str]:
    return [f"adapter-{k:02d}" for k in range(ADAPTERS)]


def write_adapters(folder: Path) -> dict[str, Path]:
    """The 16 adapters as PEFT folders, seeded by their rank in the list."""
    paths = {}
    for k, name in enumerate(adapter_names()):
        config, tensors = random_adapter(MODEL_PRESETS[PRESET], RANK, 2.0 * RANK, seed=1000 + k)
        paths[name] = save_adapter(folder / name, config, tensors)
    return paths


@contextlib.contextmanager
def engines(adapters: dict[str, Path]) -> Iterator[list[str]]:
    """``REPLICAS`` reference engines serving the adapters; their addresses."""
    ports = free_ports(REPLICAS)
    modules = [f"{name}={path}" for name, path in adapters.items()]
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "fleetpilot.engine.reference.server"),
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--model-config", PRESET, "--served-model-name", MODEL),
                *("--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS)),
                *("--enable-lora", "--max-loras", str(MAX_LORAS), "--max-lora-rank", "16"),
                *("--lora-modules", *modules),
                *("--log-level", "warning"),
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    with serving(procs, ports, 180) as addresses:
        yield addresses


def router_config(addresses: list[str]) -> RouterConfig:
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
                    "adapters": adapter_names(),
                    "maxLoras": MAX_LORAS,
                    "endpoints": [
                        {"role": "unified", "service": "e", "selector": {}, "port": 1,
                         "maxNumSeqs": MAX_NUM_SEQS, "addresses": addresses}
                    ],
                }
            ],
            "scrape": {"interval": "250ms"},
            "requestTimeout": "120s",
        }
    )  # fmt: skip


class AdapterRing(HashRing):
    """Consistent hashing of the request's adapter: its home replica first, then the ring."""

    name = "adapter-hash"

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        ids = sorted(v.id for v in replicas)
        ring = sorted((self._h(f"{rid}#{i}"), rid) for rid in ids for i in range(self.vnodes))
        key = self._h(request.adapter or "")
        start = next((i for i, (h, _) in enumerate(ring) if h >= key), 0)
        order: list[str] = []
        for k in range(len(ring)):
            rid = ring[(start + k) % len(ring)][1]
            if rid not in order:
                order.append(rid)
        return {rid: 1.0 - rank / len(order) for rank, rid in enumerate(order)}


class Uniform:
    """Every replica alike: the picker then chooses at random among them."""

    name = "random"

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        return dict.fromkeys((v.id for v in replicas), 0.0)


def use_arm(router: Any, arm: str, cfg: RouterConfig) -> None:
    health = HealthFilter()
    capacity = CapacityFilter(cfg.backpressure.max_waiting_per_replica)
    if arm == "no-adapter-affinity":
        scorers = [s for s in router.affinity_scorers() if s.scorer.name != "adapter"]
        router.use_policies(filters=[health, capacity], scorers=scorers)
    elif arm == "scores-only":
        router.use_policies(filters=[health, capacity])
    elif arm == "adapter-hash":
        router.use_policies(
            filters=[health, capacity, BoundedLoadFilter(1.25)],
            scorers=[WeightedScorer(AdapterRing(), 1.0)],
        )
    elif arm == "round-robin":
        router.use_policies(filters=[health, capacity], scorers=[WeightedScorer(RoundRobin(), 1)])
    elif arm == "random":
        router.use_policies(filters=[health, capacity], scorers=[WeightedScorer(Uniform(), 1)])
    elif arm != "fleetpilot":
        raise ValueError(f"unknown arm {arm!r}")


def engine_counters(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    counts = {"loads": 0.0, "activations": 0.0}
    for line in text.splitlines():
        for key in counts:
            if line.startswith(f"fleetpilot_lora_adapter_{key}"):
                counts[key] += float(line.rsplit(" ", 1)[1])
    return counts


async def run_arm(
    arm: str, adapters: dict[str, Path], rate: float, duration: float, skew: float, seed: int
) -> dict[str, Any]:
    from aiohttp import web

    from fleetpilot.routing.app import build_app
    from fleetpilot.routing.endpoints import StaticSource

    with engines(adapters) as addresses:
        cfg = router_config(addresses)
        app = build_app(cfg, StaticSource(cfg), seed=seed)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            use_arm(app[ROUTER_APP].router, arm, cfg)
            before = [engine_counters(a) for a in addresses]
            run = RunConfig(
                base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                model=MODEL,
                schedule=Schedule.constant(rate),
                duration_s=duration,
                timeout_s=120.0,
                seed=seed,
                ignore_eos=True,
                model_mix=ModelMix(tuple(adapter_names()), skew, seed),
            )
            workload = make_workload("mixed", seed, easy_max_tokens=16, hard_max_tokens=16)
            result = await Runner(run, workload).run()
            after = [engine_counters(a) for a in addresses]
        finally:
            await runner.cleanup()
    summary = report.summarize(result.records, result.elapsed_s)
    done = [r for r in result.records if r.ok]
    per_k = 1000.0 / max(1, len(result.records))
    return {
        "arm": arm,
        "seed": seed,
        "requests": len(result.records),
        "errors": len(result.records) - len(done),
        "activations_per_1k": sum(a["activations"] - b["activations"]
                                  for a, b in zip(after, before, strict=True)) * per_k,
        "loads_per_1k": sum(a["loads"] - b["loads"]
                            for a, b in zip(after, before, strict=True)) * per_k,
        "ttft_p50_ms": _ms(summary.ttft_s.get("p50")),
        "ttft_p95_ms": _ms(summary.ttft_s.get("p95")),
        "throughput_rps": summary.throughput_rps,
    }  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=6.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--name", default="router_lora", help="results file name (--save)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    started = time.time()
    print(
        f"{'seed':>4} {'arm':>20} {'requests':>8} {'errors':>6} {'swaps/1k':>9} "
        f"{'loads/1k':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>6}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(Path(tmp))
        for seed in seeds:
            # Arms in a seeded rotation: none always runs first, on the coolest machine.
            order = arms[:]
            random.Random(seed).shuffle(order)
            for arm in order:
                row = asyncio.run(run_arm(arm, adapters, args.rate, args.duration, args.skew, seed))
                rows.append(row)
                print(
                    f"{seed:>4} {arm:>20} {row['requests']:>8} {row['errors']:>6} "
                    f"{row['activations_per_1k']:>9.0f} {row['loads_per_1k']:>9.0f} "
                    f"{row['ttft_p50_ms'] or 0:>8.0f}ms {row['ttft_p95_ms'] or 0:>8.0f}ms "
                    f"{row['throughput_rps']:>6.2f}",
                    flush=True,
                )
    if args.save:
        path = save(
            args.name,
            {"machine": machine(), "args": vars(args), "wall_s": time.time() - started,
             "rows": rows},
        )  # fmt: skip
        print(f"saved {path}")


if __name__ == "__main__":
    main()
