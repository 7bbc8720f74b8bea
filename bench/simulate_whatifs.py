"""What-if questions answered with ``fleetpilot simulate`` (the real router and autoscaler over
simulated H100 engines): the numbers in docs/simulator.md.

- ``complexity``: complexity routing over two tiers (``examples/two-tier.yaml``: Qwen2.5-7B AWQ
  on one GPU, Qwen2.5-72B on four) against the same service with only its large tier, on the
  ``mixed`` workload (30% hard prompts), both autoscaled on their SLOs (replicas.max raised to
  ``--max-replicas`` so neither is capped): GPU-hours, cost and SLO attainment.
- ``prefix``: the replica choice over 100 replicas of Llama 3.1 8B (``examples/single-tier.yaml``
  on H100s, fixed replicas), on documents asked about repeatedly - ``long-context`` with
  ``--documents`` documents of 6,000 characters (~1,500 tokens): more than one replica's KV cache
  holds, far less than the fleet's - fleetpilot's choice on the engines' KV events, the same on
  the router's own guesses, longest-prefix match on the events, and round-robin.
- ``hot-tenants``: the replica choice where a few tenants are hot (``shared-prefix`` with
  ``--tenant-skew``: Zipf popularity, ~1,000-token system prompts) on a few H100 replicas of
  Llama 3.1 8B, fixed, over a sweep of fleet sizes, rates, tenant counts, skews and seeds:
  fleetpilot's choice against the same priced as before (an uncached block at its own
  prefill only), longest-prefix match (all on the KV events) and round-robin.
  The hottest tenant's traffic outgrows one replica: pure affinity piles it there, a load
  bound spreads it at the price of computing its prompt again elsewhere.
- ``candidates``: the router's pick in a group of 100 replicas, among a few candidates (the
  holders of the prompt's deepest cached blocks, its home on a consistent-hash ring, a random
  few more when those are busy: ``routing.policies.candidates``) against a scan of every
  replica, with longest-prefix match scanning every replica as the baseline; on the prefix
  what-if's documents and on hot tenants at the hot-tenants cases' load per replica, over
  several seeds. Speed aside (``bench/simulate_speed.py``), the bound must not cost hit rate
  or TTFT.
- ``step``: the autoscaler's reaction to a 10x load step (``--step-from`` to ten times that
  req/s of shared-prefix chats answered in ``--step-tokens`` tokens) at up to ``--step-max``
  replicas of Llama 3.1 70B on 4 x H100 each (``examples/disaggregated.yaml``'s tier, run
  unified); ``--step-from 160 --step-start 16 --step-max 500`` asks it of 500 replicas.

Run: .venv/bin/python bench/simulate_whatifs.py [complexity|prefix|hot-tenants|candidates|step ...]
[--save]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from router_support import commit, machine, measured_at, save

from fleetpilot.api import load_services
from fleetpilot.loadgen.runner import Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.routing.policies.candidates import FULL_SCAN_MAX
from fleetpilot.simulate import report
from fleetpilot.simulate.baselines import FLEETPILOT, LONGEST_PREFIX, ROUND_ROBIN
from fleetpilot.simulate.fleet import Fleet, SimSettings
from fleetpilot.simulate.profile import load_profile

ROOT = Path(__file__).parents[1]
SIMULATE = [sys.executable, "-m", "fleetpilot", "simulate"]
PRICE = 2.5  # $ per H100-hour: the relative cost is what matters


def simulate(service: Path, *args: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        started = time.monotonic()
        subprocess.run(
            [*SIMULATE, "-f", str(service), *args, "--json", str(out), "--quiet"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        doc: dict[str, Any] = json.loads(out.read_text())
        doc["wall_s"] = time.monotonic() - started
        return doc


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": doc["requests"],
        "errors": doc["errors"],
        "ttft_p50_ms": (doc["ttft_s"]["p50"] or 0) * 1000,
        "ttft_p95_ms": (doc["ttft_s"]["p95"] or 0) * 1000,
        "tpot_p95_ms": (doc["tpot_s"]["p95"] or 0) * 1000,
        "hit_rate": doc["prefix_hit_rate"],
        "slo_attainment": doc["slo_attainment"],
        "gpu_hours": doc["gpu_hours"],
        "cost": doc["cost"],
        "peak_replicas": {t: s["peak_replicas"] for t, s in doc["tiers"].items()},
        "wall_s": doc["wall_s"],
    }


def large_only(tmp: Path) -> Path:
    data = yaml.safe_load((ROOT / "examples/two-tier.yaml").read_text())
    data["spec"]["tiers"] = [t for t in data["spec"]["tiers"] if t["name"] == "large"]
    path = tmp / "large-only.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def complexity(args: argparse.Namespace) -> dict[str, Any]:
    load = [
        *("--workload", "mixed", "--rate", str(args.rate), "--duration", args.duration),
        *("--max-replicas", str(args.max_replicas), "--price-per-gpu-hour", str(PRICE)),
        *("--seed", str(args.seed)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        arms = {
            "two tiers, complexity routing": ROOT / "examples/two-tier.yaml",
            "large tier only": large_only(Path(tmp)),
        }
        rows = {name: summary(simulate(path, *load)) for name, path in arms.items()}
    print(f"\ncomplexity: mixed at {args.rate} req/s for {args.duration}, autoscaled")
    print(f"{'arm':30} {'GPU-h':>7} {'cost $':>8} {'SLO met':>8} {'TTFT p95':>9} {'peak':>24}")
    for name, r in rows.items():
        peak = ", ".join(f"{t} {sum(p.values())}" for t, p in r["peak_replicas"].items())
        print(
            f"{name:30} {r['gpu_hours']:>7.1f} {r['cost']:>8.0f} {r['slo_attainment']:>8.3f} "
            f"{r['ttft_p95_ms']:>8.0f}ms {peak:>24}"
        )
    return rows


def prefix(args: argparse.Namespace) -> dict[str, Any]:
    service = ROOT / "examples/single-tier.yaml"
    base = [
        *("--profile", "h100", "--workload", "long-context", "--rate", str(args.prefix_rate)),
        *("--duration", args.prefix_duration, "--replicas", "100", "--no-autoscale"),
        *("--documents", str(args.documents), "--seed", str(args.seed)),
    ]
    arms = {
        "fleetpilot, KV events": ["--prefix-source", "events"],
        "fleetpilot, guessed": ["--prefix-source", "guessed"],
        "longest-prefix, KV events": ["--routing", "longest-prefix"],
        "round-robin": ["--routing", "round-robin"],
    }
    rows = {name: summary(simulate(service, *base, *extra)) for name, extra in arms.items()}
    print(
        f"\nprefix: 100 replicas, long-context ({args.documents} documents) at "
        f"{args.prefix_rate} req/s for {args.prefix_duration}"
    )
    print(f"{'arm':28} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'errors':>8}")
    for name, r in rows.items():
        print(
            f"{name:28} {r['hit_rate']:>8.3f} {r['ttft_p50_ms']:>7.0f}ms "
            f"{r['ttft_p95_ms']:>7.0f}ms {sum(r['errors'].values()):>8}"
        )
    return rows


# (replicas, req/s, tenants, Zipf skew, seed): a few hot tenants whose prompts every replica
# can cache (12-48 tenants), then working sets that span the replicas' caches (200-1,000).
HOT_TENANT_CASES = (
    (4, 100.0, 12, 1.1, 5),
    (8, 200.0, 24, 1.1, 0),
    (8, 400.0, 12, 1.1, 2),
    (8, 400.0, 48, 0.8, 3),
    (16, 800.0, 48, 1.2, 4),
    (8, 400.0, 200, 1.2, 6),
    (8, 400.0, 400, 1.0, 0),
    (8, 300.0, 1000, 0.8, 7),
)
# fleetpilot's choice as it was before an uncached block cost its own prefill and the wait of
# the requests behind it (2): priced at its own prefill only.
ONCE = "fleetpilot, block cost 1"


def simulate_here(
    service: Path, settings: SimSettings, workload: Any, once: bool = False
) -> dict[str, Any]:
    """One run in this process, where a variant of the router's scorers can be installed."""
    spec = load_services(service)[0]
    fleet = Fleet(spec, load_profile("h100"), workload, settings)
    if once:
        for router in fleet.routers:
            router.use_policies(scorers=router.affinity_scorers(block_cost=1.0))
    started = time.monotonic()
    doc = report.summarize(fleet.run(), spec).to_json()
    doc["wall_s"] = time.monotonic() - started
    return doc


def hot_tenants(args: argparse.Namespace) -> list[dict[str, Any]]:
    service = ROOT / "examples/single-tier.yaml"
    arms = {"fleetpilot": FLEETPILOT, ONCE: FLEETPILOT, "longest-prefix": LONGEST_PREFIX}
    if not args.hot_skip_round_robin:
        arms["round-robin"] = ROUND_ROBIN
    duration = args.hot_duration_s
    rows = []
    print(f"\nhot tenants: shared-prefix, Zipf tenants, {duration:.0f} s a case")
    print(
        f"{'replicas':>8} {'req/s':>6} {'tenants':>7} {'skew':>5} {'seed':>4}  {'arm':26} "
        f"{'hit rate':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'p99':>9}"
    )
    for replicas, rate, tenants, skew, seed in HOT_TENANT_CASES:
        case = {"replicas": replicas, "rate": rate, "tenants": tenants, "skew": skew}
        for name, routing in arms.items():
            settings = SimSettings(
                Schedule.constant(rate),
                duration,
                seed=seed,
                autoscale=False,
                start_replicas=replicas,
                routing=routing,
            )
            workload = make_workload(
                "shared-prefix",
                seed,
                tenants=tenants,
                tenant_skew=skew,
                system_chars=4000,
                max_tokens=64,
            )
            doc = simulate_here(service, settings, workload, once=name == ONCE)
            row = case | {"seed": seed, "arm": name} | summary(doc)
            row["ttft_p99_ms"] = (doc["ttft_s"]["p99"] or 0) * 1000
            rows.append(row)
            print(
                f"{replicas:>8} {rate:>6.0f} {tenants:>7} {skew:>5} {seed:>4}  {name:26} "
                f"{row['hit_rate']:>8.3f} {row['ttft_p50_ms']:>7.1f}ms "
                f"{row['ttft_p95_ms']:>7.1f}ms {row['ttft_p99_ms']:>7.1f}ms",
                flush=True,
            )
    return rows


# (label, workload, its options, req/s, seed) over 100 replicas of Llama 3.1 8B on H100s.
CANDIDATE_CASES = (
    ("documents", "long-context", {"documents": 2000}, 300.0, 0),
    ("documents", "long-context", {"documents": 2000}, 300.0, 1),
    ("hot tenants", "shared-prefix", {"tenants": 200, "tenant_skew": 1.2}, 5000.0, 6),
    ("hot tenants", "shared-prefix", {"tenants": 200, "tenant_skew": 1.2}, 5000.0, 2),
    ("many tenants", "shared-prefix", {"tenants": 1000, "tenant_skew": 0.8}, 4000.0, 7),
    ("few hot tenants", "shared-prefix", {"tenants": 48, "tenant_skew": 1.1}, 5000.0, 3),
)
EVERY_REPLICA = 1 << 30  # a full_scan_max no group reaches


def candidates(args: argparse.Namespace) -> list[dict[str, Any]]:
    service = ROOT / "examples/single-tier.yaml"
    arms = {
        "fleetpilot, candidates": (FLEETPILOT, FULL_SCAN_MAX),
        "fleetpilot, every replica": (FLEETPILOT, EVERY_REPLICA),
        "longest-prefix, every replica": (LONGEST_PREFIX, EVERY_REPLICA),
    }
    duration = args.candidates_duration_s
    rows = []
    print(f"\ncandidates: 100 replicas, {duration:.0f} s a case")
    print(
        f"{'case':16} {'req/s':>6} {'seed':>4}  {'arm':30} {'hit rate':>8} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'p99':>9} {'wall':>6}"
    )
    for label, name, options, rate, seed in CANDIDATE_CASES:
        shape = {"system_chars": 4000, "max_tokens": 64} if name == "shared-prefix" else {}
        for arm, (routing, full_scan_max) in arms.items():
            settings = SimSettings(
                Schedule.constant(rate),
                duration,
                seed=seed,
                autoscale=False,
                start_replicas=100,
                routing=routing,
                full_scan_max=full_scan_max,
            )
            workload = make_workload(name, seed, **options, **shape)
            doc = simulate_here(service, settings, workload)
            row = {"case": label, "workload": name, **options, "rate": rate, "seed": seed}
            row |= {"arm": arm} | summary(doc)
            row["ttft_p99_ms"] = (doc["ttft_s"]["p99"] or 0) * 1000
            rows.append(row)
            print(
                f"{label:16} {rate:>6.0f} {seed:>4}  {arm:30} {row['hit_rate']:>8.3f} "
                f"{row['ttft_p50_ms']:>7.1f}ms {row['ttft_p95_ms']:>7.1f}ms "
                f"{row['ttft_p99_ms']:>7.1f}ms {row['wall_s']:>5.0f}s",
                flush=True,
            )
    return rows


def step(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        data = yaml.safe_load((ROOT / "examples/disaggregated.yaml").read_text())
        tier = data["spec"]["tiers"][0]
        tier["serving"] = {"replicas": {"min": 1, "max": args.step_max}}
        path = Path(tmp) / "step.yaml"
        path.write_text(yaml.safe_dump(data))
        low, high = args.step_from, args.step_from * 10
        schedule = f"0:{low},{args.step_at}:{high}"
        doc = simulate(
            path,
            *("--workload", "shared-prefix", "--max-tokens", str(args.step_tokens)),
            *("--schedule", schedule),
            *("--duration", args.step_duration, "--replicas", str(args.step_start)),
            *("--seed", str(args.seed)),
        )
    print(f"\nstep: {low} -> {high} req/s at {args.step_at} s, up to {args.step_max} replicas")
    for sample in doc["replicas"][:: max(1, len(doc["replicas"]) // 30)]:
        counts = ", ".join(f"{k} {v}" for k, v in sample.items() if k != "t")
        print(f"  t={sample['t']:>6.0f} s  {counts}")
    return summary(doc) | {"replicas": doc["replicas"], "decisions": doc["decisions"]}


# The step what-if at a tenth of the scale's ceiling and ten times its load, kept beside it.
STEP_500 = {"step_max": 500, "step_from": 160.0, "step_start": 16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "which",
        nargs="*",
        help="what-ifs to run: complexity, prefix, hot-tenants, step (these four by default), "
        "candidates, step-500",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--duration", default="30m")
    parser.add_argument("--max-replicas", type=int, default=64)
    parser.add_argument("--prefix-rate", type=float, default=300.0)
    parser.add_argument("--prefix-duration", default="5m")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--hot-duration-s", type=float, default=40.0)
    parser.add_argument("--hot-skip-round-robin", action="store_true")
    parser.add_argument("--candidates-duration-s", type=float, default=20.0)
    parser.add_argument("--step-from", type=float, default=20.0)
    parser.add_argument("--step-at", type=float, default=300.0)
    parser.add_argument("--step-duration", default="20m")
    parser.add_argument("--step-start", type=int, default=2)
    parser.add_argument("--step-max", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    known = ("complexity", "prefix", "hot-tenants", "step", "candidates", "step-500")
    args.which = args.which or list(known[:4])
    unknown = [name for name in args.which if name not in known]
    if unknown:
        parser.error(f"no what-if {', '.join(unknown)} (known: {', '.join(known)})")
    results: dict[str, Any] = {}
    for name in args.which:
        if name == "step-500":
            results[name] = step(argparse.Namespace(**{**vars(args), **STEP_500}))
        else:
            # A step to another ceiling is kept beside the default one's.
            key = f"step-{args.step_max}" if name == "step" and args.step_max != 64 else name
            results[key] = globals()[name.replace("-", "_")](args)
    if args.save:
        # The what-ifs run apart (each is minutes): a run updates its own, keeps the others,
        # and says which commit and day each was measured on (bench/tables.py captions each
        # what-if's table with its own).
        path = ROOT / "bench/results/simulate_whatifs.json"
        doc = json.loads(path.read_text()) if path.is_file() else {}
        stamp = {"commit": commit(), "date": measured_at()}
        measured = {**doc.get("measured", {}), **dict.fromkeys(results, stamp)}
        doc.update({"machine": machine(), "args": vars(args), **results, "measured": measured})
        print(f"saved {save('simulate_whatifs', doc)}")


if __name__ == "__main__":
    main()
