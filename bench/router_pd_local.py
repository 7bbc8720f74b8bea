"""P/D: a decode replica that holds the prompt computes the rest itself, vs always the hop.

Issue 14, P/D: the router reads the decode role's KV events too. When the decode replica it
picks holds all but a few tokens of a prompt (``router.PD_LOCAL_PREFILL_TOKENS``, 64: vLLM's
own NIXL recompute threshold), the request skips the prefill hop and its KV pull. This plays
multi-turn chats through one P/D tier (one prefill and two decode reference engines, kv_both
NIXL, KV events, the router in this process) and compares, on fresh engines per arm:

- ``hop always``: every request takes the prefill hop (the threshold set below zero);
- ``local <= 64``: the router's default.

Two traces: the shared-system-prompt chat of ``router_prefix_workloads`` (a long first turn,
then short follow-ups: "Round 1: and then?") and its multi-tenant chat (every turn a ~80
character question: with the reference byte tokenizer, one token a character, over the
threshold, so nearly every turn still hops). Reported: client TTFT (first content chunk), the
share of requests the decode replica prefilled itself, and the decode engines' KV pulls.

The 2 cores of this machine are shared by all three engines: compare arms within one run.

Run: .venv/bin/python bench/router_pd_local.py [--seed N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from router_affinity import MODEL
from router_prefix_workloads import (
    Conversation,
    drive,
    multi_tenant_trace,
    shared_prompt_trace,
)
from router_support import machine, process, save, wait_healthy

import fleetpilot.routing.router as router_module
from fleetpilot.api import parse_service
from fleetpilot.routing.app import ROUTER_APP, build_app
from fleetpilot.routing.discovery import FileSource
from fleetpilot.runtime.engines import ReferenceBackend
from fleetpilot.runtime.local import LocalFleet

TIER = "only"
ARMS = {"hop always": -1, "local <= 64": router_module.PD_LOCAL_PREFILL_TOKENS}


def service_manifest() -> dict[str, Any]:
    """One P/D tier: a prefill and two decode engines, NIXL, 16-token blocks."""
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "pd-bench", "namespace": "bench"},
        "spec": {
            "tiers": [
                {
                    "name": TIER,
                    "model": {"name": "bench/pd", "servedName": MODEL, "maxModelLen": 2048},
                    "engine": {"maxNumSeqs": 4, "kvCache": {"blockSize": 16}},
                    "serving": {
                        "mode": "disaggregated",
                        "prefill": {"replicas": {"min": 1, "max": 1}},
                        "decode": {"replicas": {"min": 2, "max": 2}},
                        "kvTransfer": {"connector": "NixlConnector"},
                    },
                }
            ]
        },
    }


@contextlib.contextmanager
def engines(workdir: Path) -> Iterator[LocalFleet]:
    """The tier's engines as the local fleet plans them (reference engines, preset 'small',
    publishing KV events), started here; the router is this process's."""
    fleet = LocalFleet(
        parse_service(service_manifest()),
        workdir,
        0,
        backend=ReferenceBackend(sys.executable, "small"),
    )
    with contextlib.ExitStack() as stack:
        for replica in fleet.replicas:
            stack.enter_context(process(replica.argv, None, replica.port))
        for replica in fleet.replicas:
            wait_healthy(replica.port)
            replica.serving = True
        fleet.write_router_config()
        yield fleet


async def start_router(fleet: LocalFleet) -> tuple[web.AppRunner, web.Application, str]:
    """The router on the fleet's config and endpoints file, once it heard every engine's KV
    events and loaded the tokenizer."""
    app = build_app(fleet.router_config(), FileSource(fleet.endpoints_path), seed=0)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    state = app[ROUTER_APP]
    deadline = time.monotonic() + 60
    while not (
        state.kv_events is not None
        and state.router.replicas()
        and all(state.kv_events.has_events(r.id) for r in state.router.replicas())
        and TIER in state.router.tokenizers
    ):
        if time.monotonic() > deadline:
            await runner.cleanup()
            raise RuntimeError("the router did not hear every engine's KV events")
        await asyncio.sleep(0.05)
    return runner, app, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"


async def decode_pulls(addresses: Sequence[str]) -> float:
    """KV pulls the decode engines made (each a prefill hop's hand-off)."""
    total = 0.0
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.get(f"http://{address}/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("fleetpilot_kv_transfer_pulls_total"):
                        total += float(line.rsplit(" ", 1)[1])
    return total


async def run_arm(arm: str, trace: Sequence[Conversation], fleet: LocalFleet) -> dict[str, Any]:
    router_module.PD_LOCAL_PREFILL_TOKENS = ARMS[arm]
    runner, app, url = await start_router(fleet)
    decoders = [r.address for r in fleet.replicas if r.role == "decode"]
    pulls_before = await decode_pulls(decoders)
    driven = await drive(trace, [url], [r.address for r in fleet.replicas])
    pulls = await decode_pulls(decoders) - pulls_before
    registry = app[ROUTER_APP].metrics.registry
    local = registry.get_sample_value("fleetpilot_router_pd_local_prefills_total", {"tier": TIER})
    await runner.cleanup()
    requests = sum(driven.statuses.values())
    ttfts = sorted(driven.ttfts)
    return {
        "arm": arm,
        "requests": requests,
        "statuses": {str(k): v for k, v in driven.statuses.items()},
        "local_share": (local or 0.0) / max(1, requests),
        "decode_kv_pulls": pulls,
        "ttft_p50_ms": ttfts[len(ttfts) // 2] * 1e3 if ttfts else None,
        "ttft_p95_ms": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] * 1e3 if ttfts else None,
        "hit_rate": driven.hits / driven.queries if driven.queries else 0.0,
        **({"errors": {str(k): v for k, v in driven.errors.items()}} if driven.errors else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    args = parser.parse_args()
    traces = {
        "shared prompt, short follow-ups": shared_prompt_trace(2.0, args.seed),
        "multi-tenant, ~80-character turns": multi_tenant_trace(
            2.0, 12 if args.quick else 24, args.seed
        ),
    }
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace in traces.items():
            rows: list[dict[str, Any]] = []
            for arm in ARMS:
                with engines(Path(tmp) / f"{len(results)}-{len(rows)}") as fleet:
                    rows.append(asyncio.run(run_arm(arm, trace, fleet)))
                print(f"  {name}: {arm} done", file=sys.stderr)
            results.append({"trace": name, "rows": rows})
    path = save(
        "router_pd_local" if args.seed == 11 else f"router_pd_local_seed{args.seed}",
        {
            "benchmark": "router_pd_local",
            "machine": machine(),
            "seed": args.seed,
            "engines": "1 prefill + 2 decode reference engines, preset 'small', max-num-seqs 4, "
            "16-token blocks, kv_both NIXL, publishing KV events",
            "results": results,
            "wall_s": time.monotonic() - started,
        },
    )
    for result in results:
        print(f"\n{result['trace']}")
        print(f"{'arm':14} {'requests':>8} {'local':>6} {'pulls':>6} {'TTFT p50':>9} {'p95':>9}")
        for r in result["rows"]:
            p50 = f"{r['ttft_p50_ms']:.0f}ms" if r["ttft_p50_ms"] is not None else "-"
            p95 = f"{r['ttft_p95_ms']:.0f}ms" if r["ttft_p95_ms"] is not None else "-"
            print(f"{r['arm']:14} {r['requests']:>8} {r['local_share']:>6.2f} "
                  f"{r['decode_kv_pulls']:>6.0f} {p50:>9} {p95:>9}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
