"""An engine dies or freezes under streaming load: how many of the streams it was serving reach
their client whole, with the router continuing them on another replica
(``routing.streamResumes: 1``, the default) and without (``0``: an error event), in one run.

The fleet is what ``fleetpilot up`` runs: CPU reference engines behind the real router, here 3
replicas of one tier, each sleeping ``--step-delay`` after every busy step so a stream lasts
seconds. ``--clients`` closed-loop clients each stream chat answers of ``--max-tokens`` tokens
back to back. ``--fault-at`` seconds in, one engine is SIGKILLed (``kill``: its connections
reset) or SIGSTOPped (``freeze``: silent; the router notices after ``firstByteTimeout`` without a
byte and a failed /health probe); the clients go on until ``--duration``.

A stream counts as hit when it started (its first event arrived) before the fault and ended
after it; it is whole when the client read it to ``[DONE]`` with no error event. The goal: every
hit stream whole where another replica exists. Streams of the two live engines are hit too
(they finish normally), so "without" is not 0%: about two thirds of the hit streams were never
on the faulty engine.

Run: .venv/bin/python bench/router_stream_failover.py [--duration 30] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from router_support import machine, save

from fleetpilot.api import InferenceService, load_services
from fleetpilot.runtime.local import LocalFleet

MODEL = "failover-model"

SERVICE = """\
apiVersion: fleetpilot.dev/v1alpha1
kind: InferenceService
metadata:
  name: failover
  namespace: default
spec:
  tiers:
    - name: main
      model:
        name: Qwen/Qwen2.5-0.5B-Instruct
        servedName: {model}
        maxModelLen: 2048
      engine:
        maxNumSeqs: 16
      serving:
        replicas: {{min: 3, max: 3}}
      autoscaling:
        mode: disabled
  routing:
    replicas: 1
    requestTimeout: 120s
    streamResumes: {resumes}
"""


@dataclass
class Stream:
    started: float
    first_event: float | None = None
    ended: float = 0.0
    whole: bool = False
    error: str | None = None


def service_for(resumes: int, folder: Path) -> InferenceService:
    path = folder / f"service-{resumes}.yaml"
    path.write_text(SERVICE.format(model=MODEL, resumes=resumes))
    (service,) = load_services(path)
    return service


async def one_stream(session: aiohttp.ClientSession, url: str, n: int, max_tokens: int) -> Stream:
    record = Stream(started=time.monotonic())
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Stream {n}: say something long."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"http {resp.status}"
                return record
            buffer = b""
            done = False
            async for chunk in resp.content.iter_any():
                if record.first_event is None:
                    record.first_event = time.monotonic()
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    data = event.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        done = True
                    elif b'"error"' in data and "error" in json.loads(data):
                        record.error = "error event"
            record.whole = done and record.error is None
            if not done and record.error is None:
                record.error = "no [DONE]"
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = type(exc).__name__
    finally:
        record.ended = time.monotonic()
    return record


async def load(url: str, args: argparse.Namespace, stop_at: float) -> list[Stream]:
    records: list[Stream] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client(c: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                records.append(await one_stream(session, url, c * 100_000 + n, args.max_tokens))
                n += 1

        await asyncio.gather(*(client(c) for c in range(args.clients)))
    return records


def resumes_by_outcome(metrics_address: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"http://{metrics_address}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fleetpilot_router_stream_resumes_total":
                outcome = sample.labels["outcome"]
                out[outcome] = out.get(outcome, 0.0) + sample.value
    return out


def run_arm(fault: str, resumes: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    workdir = folder / f"{fault}-{resumes}"
    workdir.mkdir()
    fleet = LocalFleet(
        service_for(resumes, folder),
        workdir,
        0,
        max_replicas_per_role=3,
        step_delay_s=args.step_delay,
    )
    fleet.start()
    victim = fleet.replicas[0].child
    assert victim is not None
    base = fleet.endpoint.removesuffix("/v1")
    try:
        started = time.monotonic()
        stop_at = started + args.duration
        fault_at = started + args.fault_at
        records: list[Stream] = []

        def run_load() -> None:
            records.extend(asyncio.run(load(base, args, stop_at)))

        thread = threading.Thread(target=run_load)
        thread.start()
        time.sleep(max(0.0, fault_at - time.monotonic()))
        faulted = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        thread.join()
        outcomes = resumes_by_outcome(fleet.router_metrics_address)
    finally:
        if fault == "freeze":
            os.killpg(victim.pid, signal.SIGCONT)
        fleet.stop()
    hit = [r for r in records if r.first_event is not None and r.first_event < faulted < r.ended]
    errors: dict[str, int] = {}
    for r in hit:
        if not r.whole:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "fault": fault,
        "stream_resumes": resumes,
        "streams": len(records),
        "whole": sum(r.whole for r in records),
        "hit": len(hit),
        "hit_whole": sum(r.whole for r in hit),
        "hit_errors": errors,
        "resumes_by_outcome": outcomes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--fault-at", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-delay", type=float, default=0.02)
    parser.add_argument("--faults", default="kill,freeze")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fault in args.faults.split(","):
            for resumes in (0, 1):
                results.append(run_arm(fault, resumes, args, Path(tmp)))
                print(f"done: {fault}, streamResumes {resumes}", flush=True)
    print(
        f"\n3 engines, {args.clients} streaming clients, {args.max_tokens} tokens a stream, "
        f"one engine faulted {args.fault_at:g} s into {args.duration:g} s"
    )
    print(f"{'fault':7} {'resumes':>7} {'streams':>8} {'hit':>5} {'hit whole':>10}  resumed")
    for r in results:
        share = r["hit_whole"] / r["hit"] if r["hit"] else float("nan")
        print(
            f"{r['fault']:7} {r['stream_resumes']:>7} {r['streams']:>8} {r['hit']:>5} "
            f"{share:>10.0%}  {r['resumes_by_outcome']} {r['hit_errors']}"
        )
    if args.save:
        path = save(
            "router_stream_failover",
            {
                "benchmark": "router_stream_failover",
                "machine": machine(),
                "args": vars(args),
                "results": results,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
