"""How fast ``fleetpilot simulate`` runs, and how that scales with the fleet: simulated requests
per second of one core, by the number of replicas the router chooses among.

The fleet: one tier of Llama 3.1 8B on H100s (``examples/single-tier.yaml`` on the ``h100``
profile), ``--replicas`` fixed (no autoscaling), the ``shared-prefix`` workload with 12 tenants,
Poisson arrivals at ``--per-replica`` requests/s a replica (a busy but unsaturated fleet), the
routers on the engines' KV events (the planned setup). Each size simulates about ``--requests``
requests. Measured with ``time.process_time`` (this process's CPU, one core: the simulator is
single-threaded), best of ``--repeats``.

Per size over ``FULL_SCAN_MAX`` replicas, two arms: the router's pick among a few candidates
(``routing.policies.candidates``, the default) and a scan of every replica (as before it), with
the hit rate of each so the speed is not bought with worse routing.

Reported per size: requests simulated per CPU second, microseconds a request, simulated seconds
per CPU second, and the CPU time the issue's target run would take at that speed - 1,000 replicas
x 1 h x 2,000 req/s, 7.2 million requests - where the size is 1,000.

``--profile``: one more candidates run at the largest size under ``cProfile``, its own CPU
time (tottime) summed by where the code lives - the router's policies and index
(``fleetpilot.routing``), the simulator's engines and event loop (``fleetpilot.simulate``),
the workload (``fleetpilot.loadgen``), the rest (the standard library, builtins) - and the
functions that spend most: where a faster simulator has to cut.

Run: .venv/bin/python bench/simulate_speed.py [--sizes 10,100,1000] [--requests 6000]
     [--profile] [--save]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any

from router_support import commit, machine, save

from fleetpilot.api import InferenceService, load_services
from fleetpilot.loadgen.runner import Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.routing.policies.candidates import FULL_SCAN_MAX
from fleetpilot.simulate import report
from fleetpilot.simulate.fleet import Fleet, SimSettings
from fleetpilot.simulate.profile import H100

EXAMPLE = Path(__file__).parents[1] / "examples" / "single-tier.yaml"
TARGET_REQUESTS = 1000 * 3600 * 2  # 1,000 replicas at 2 req/s each for one hour


def make_fleet(
    service: InferenceService,
    replicas: int,
    per_replica: float,
    requests: int,
    seed: int,
    full_scan_max: int,
) -> tuple[Fleet, float]:
    rate = replicas * per_replica
    duration = max(requests / rate, 2.0)
    settings = SimSettings(
        Schedule.constant(rate),
        duration,
        seed=seed,
        autoscale=False,
        start_replicas=replicas,
        max_replicas=replicas,
        full_scan_max=full_scan_max,
    )
    return Fleet(
        service, H100, make_workload("shared-prefix", seed, tenants=12), settings
    ), duration


def run_once(
    replicas: int, per_replica: float, requests: int, seed: int, full_scan_max: int
) -> dict[str, float]:
    service = load_services(EXAMPLE)[0]
    fleet, duration = make_fleet(service, replicas, per_replica, requests, seed, full_scan_max)
    started = time.process_time()
    outcome = fleet.run()
    cpu = time.process_time() - started
    done = len(outcome.requests)
    return {
        "requests": done,
        "simulated_s": duration,
        "cpu_s": cpu,
        "requests_per_cpu_s": done / cpu,
        "us_per_request": cpu / done * 1e6,
        "simulated_s_per_cpu_s": duration / cpu,
        "refused": sum(r.error is not None for r in outcome.requests),
        "hit_rate": report.summarize(outcome, service).prefix_hit_rate or 0.0,
    }


AREAS = ("fleetpilot/routing", "fleetpilot/simulate", "fleetpilot/loadgen", "fleetpilot/")


def profile(replicas: int, per_replica: float, requests: int, seed: int) -> dict[str, Any]:
    """Where one run's CPU goes: own time by area of the code, and the top functions."""
    service = load_services(EXAMPLE)[0]
    fleet, _ = make_fleet(service, replicas, per_replica, requests, seed, FULL_SCAN_MAX)
    profiler = cProfile.Profile()
    profiler.runcall(fleet.run)
    stats = pstats.Stats(profiler)
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]]
    table = stats.stats  # type: ignore[attr-defined]  # pstats keeps it untyped
    total = sum(entry[2] for entry in table.values())
    areas: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, calls, own, _cumulative, _) in table.items():
        area = next((a.rstrip("/") for a in AREAS if a in filename), "other")
        areas[area] = areas.get(area, 0.0) + own
        short = filename.split("fleetpilot/", 1)[-1] if "fleetpilot/" in filename else filename
        functions.append((own, f"{short}:{line}({name})", calls))
    functions.sort(reverse=True)
    return {
        "replicas": replicas,
        "total_own_s": total,
        "areas": {a: {"own_s": t, "share": t / total} for a, t in sorted(areas.items())},
        "top": [
            {"function": f, "own_s": own, "share": own / total, "calls": calls}
            for own, f, calls in functions[:25]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--per-replica", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--candidates-only", action="store_true", help="skip the every-replica scans"
    )
    parser.add_argument("--profile", action="store_true", help="profile the largest size")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    print(
        f"{'replicas':>8} {'pick':>13} {'req/s':>8} {'requests':>9} {'req per CPU s':>14} "
        f"{'us/req':>8} {'sim s/CPU s':>12} {'hit rate':>9} {'target run':>11}"
    )
    arms = {"candidates": FULL_SCAN_MAX, "every replica": 1 << 30}
    for size in (int(s) for s in args.sizes.split(",")):
        for arm, full_scan_max in arms.items():
            if arm != "candidates" and (args.candidates_only or size <= FULL_SCAN_MAX):
                continue  # at or under the bound the two are the same code
            runs = [
                run_once(size, args.per_replica, args.requests, args.seed, full_scan_max)
                for _ in range(args.repeats)
            ]
            best = max(runs, key=lambda r: r["requests_per_cpu_s"])
            target_h = TARGET_REQUESTS / best["requests_per_cpu_s"] / 3600
            rows.append(
                {"replicas": size, "pick": arm, **best, "target_run_cpu_h_at_this_speed": target_h}
            )
            print(
                f"{size:>8} {arm:>13} {size * args.per_replica:>8.0f} {best['requests']:>9.0f} "
                f"{best['requests_per_cpu_s']:>14.0f} {best['us_per_request']:>8.0f} "
                f"{best['simulated_s_per_cpu_s']:>12.2f} {best['hit_rate']:>9.3f} "
                f"{target_h:>10.1f}h",
                flush=True,
            )
    print(
        "target run: 1,000 replicas x 1 h x 2,000 req/s (7.2M requests) at each row's speed; "
        "the issue asks for under 5 minutes"
    )
    profiled = None
    if args.profile:
        size = max(int(s) for s in args.sizes.split(","))
        profiled = profile(size, args.per_replica, args.requests, args.seed)
        print(f"\nprofile at {size} replicas (own CPU time, under cProfile's overhead):")
        for area, entry in profiled["areas"].items():
            print(f"  {area:22} {entry['own_s']:7.2f} s {entry['share']:6.1%}")
        for entry in profiled["top"][:15]:
            print(f"  {entry['share']:6.1%} {entry['calls']:>9} calls  {entry['function']}")
    if args.save:
        path = save(
            "simulate_speed",
            {
                "commit": commit(),
                "machine": machine(),
                "args": vars(args),
                "rows": rows,
                "profile": profiled,
            },
        )
        print(f"saved {path}")


if __name__ == "__main__":
    main()
