"""Does the simulator predict the local fleet? ``fleetpilot simulate`` against ``fleetpilot up`` +
``fleetpilot bench`` on the same service, workload, rate, duration and seed.

The simulated engines run on a profile measured here (``fleetpilot simulate calibrate``: the
reference engine's step costs, KV pool and tokenizer), so the question is whether the engine
model (continuous batching, chunked prefill, prefix cache) and the fleet around it (the real
router and its prefix choice) reproduce what the real processes do. Both sides run the service
at fixed replicas (``--no-autoscale``) and decode every request's ``max_tokens``
(``--ignore-eos``). Compared: TTFT p50, p95 and mean (the client's first content chunk in the
bench and in the simulation, whose engines add the served path of a first token:
``prefill_base_s`` and ``first_token_per_stream_s``) and the prefix hit rate (cached over prompt
tokens, from the engines' usage in the bench). The issue asks for each within 25%. The engine
model alone is held against the engines' own ``vllm:time_to_first_token_seconds`` (arrival to
first token) by a second simulation on the profile without the served path. For the workloads
the router sends wholly to the small tier, the bench also runs against that engine directly
(``engine direct``): the part of the local fleet's TTFT that is the router's.

What the simulation leaves out and the local fleet has: the router's cost beyond a lone
request's hop (``router_s``, measured on an idle router), and the engines sharing this
machine's cores with each other, the router and the load generator (the profile times one
engine alone).

Run: .venv/bin/python bench/simulate_validation.py [--profile profile.json] [--duration 60]
     [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from router_support import machine, save

from fleetpilot.simulate.calibrate_http import ttft_totals

ROOT = Path(__file__).parents[1]
SERVICE = ROOT / "examples" / "local-two-tier.yaml"
SERVICE_NAME = "local"
ENGINES = 2  # one replica of each of its two tiers
SMALL_MODEL = "small-model"  # the small tier's served name
# Workloads every request of which the router sends to the small tier (low complexity).
SMALL_ONLY = ("shared-prefix", "multi-turn")
# (workload, rate req/s): a light and a busier load of each shape the local fleet can hold.
CASES = (("shared-prefix", 2.0), ("shared-prefix", 6.0), ("mixed", 4.0), ("multi-turn", 4.0))
FLEETPILOT = [sys.executable, "-m", "fleetpilot"]


def calibrate(path: Path) -> None:
    subprocess.run([*FLEETPILOT, "simulate", "calibrate", "--out", str(path)], check=True)


def wait_for(url: str, endpoints: int, timeout_s: float = 180.0) -> None:
    """Until the router at ``url`` routes to ``endpoints`` ready engines."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(url, timeout=2.0)
            if resp.status_code == 200 and resp.json().get("endpoints", 0) >= endpoints:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not report {endpoints} engines within {timeout_s} s")


def local_run(
    workload: str, rate: float, duration: float, seed: int, port: int, direct: bool = False
) -> dict[str, Any]:
    """``fleetpilot up`` (fixed replicas) and ``fleetpilot bench`` against its router, or with
    ``direct`` against the small tier's engine itself (every request of the workload goes
    there through the router: its complexity is low), to tell the router's share apart."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        up = subprocess.Popen(
            [
                *FLEETPILOT,
                *("up", "-f", str(SERVICE), "--port", str(port), "--no-autoscale"),
                *("--no-prometheus", "--workdir", tmp, "--status-interval", "3600"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(f"http://127.0.0.1:{port}/health", ENGINES)
            # fleetpilot up puts the engines on the ports after the router's, in tier order.
            url, model = (
                (f"http://127.0.0.1:{port + 1}/v1", SMALL_MODEL)
                if direct
                else (f"http://127.0.0.1:{port}/v1", SERVICE_NAME)
            )
            subprocess.run(
                [
                    *FLEETPILOT,
                    *("bench", "--url", url, "--model", model),
                    *("--workload", workload, "--rate", str(rate), "--duration", str(duration)),
                    *("--seed", str(seed), "--ignore-eos", "--out", str(out)),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            engines = [engine_ttft(port + 1 + i) for i in range(ENGINES)]
        finally:
            up.terminate()
            up.wait(timeout=60)
        doc = json.loads(out.read_text())
    summary = doc["summary"]
    ttfts = [r["ttft_s"] for r in doc["requests"] if r.get("ttft_s") is not None]
    engine_sum = sum(total for total, _ in engines)
    engine_count = sum(count for _, count in engines)
    return {
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p95_s": summary["ttft_s"]["p95"],
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        # The engines' own vllm:time_to_first_token_seconds (arrival to first token, as vLLM
        # counts it), over every request they served: what the client's TTFT has beyond it is
        # HTTP, SSE, the router and held-back bytes.
        "engine_ttft_mean_s": engine_sum / engine_count if engine_count else None,
        "hit_rate": summary["prefix_hit_rate"],
        "requests": summary["requests"],
        "errors": summary["errors"],
    }


def engine_ttft(port: int) -> tuple[float, float]:
    """Sum and count of an engine's ``vllm:time_to_first_token_seconds`` histogram."""
    return ttft_totals(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0).text)


def simulated(
    workload: str, rate: float, duration: float, seed: int, profile: Path
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        subprocess.run(
            [
                *FLEETPILOT,
                *("simulate", "-f", str(SERVICE), "--profile", str(profile), "--no-autoscale"),
                *("--workload", workload, "--rate", str(rate), "--duration", str(duration)),
                *("--seed", str(seed), "--json", str(out), "--quiet"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        report = json.loads(out.read_text())
    return {
        "ttft_p50_s": report["ttft_s"]["p50"],
        "ttft_p95_s": report["ttft_s"]["p95"],
        "ttft_mean_s": report["ttft_s"]["mean"],
        "hit_rate": report["prefix_hit_rate"],
        "requests": report["requests"],
        "errors": report["errors"],
    }


def engine_only(profile: Path, into: Path) -> Path:
    """``profile`` without the served path of a first token (``prefill_base_s`` and
    ``first_token_per_stream_s`` at 0): the simulated engines' own TTFT, to hold against the
    engines' ``vllm:time_to_first_token_seconds``, which starts after the template and the
    tokenizer and stops before the SSE write."""
    doc = json.loads(profile.read_text())
    doc["costs"].update(prefill_base_s=0.0, first_token_per_stream_s=0.0)
    into.write_text(json.dumps(doc))
    return into


def error(sim: float | None, real: float | None) -> float | None:
    if sim is None or not real:
        return None
    return (sim - real) / real


def pair(row: dict[str, Any], key: str, scale: float) -> str:
    real, sim = row["local"][key], row["simulated"][key]
    return f"{(real or 0) * scale:.1f} / {(sim or 0) * scale:.1f}"


def pct(row: dict[str, Any], key: str) -> str:
    e = row.get(f"{key}_error")
    return "-" if e is None else f"{e:+.0%}"


def direct(row: dict[str, Any]) -> str:
    """The TTFT p50 / p95 (ms) the bench saw from the small tier's engine directly."""
    found = row.get("engine_direct")
    if found is None:
        return "-"
    return f"{found['ttft_p50_s'] * 1000:.1f} / {found['ttft_p95_s'] * 1000:.1f}"


def means(real: dict[str, Any], sim: dict[str, Any], engines: dict[str, Any]) -> str:
    """Mean TTFT (ms): the client's, the simulation's, the engines' own, the simulated
    engines' own."""
    values = (
        real["ttft_mean_s"],
        sim["ttft_mean_s"],
        real["engine_ttft_mean_s"],
        engines["ttft_mean_s"],
    )
    return " / ".join("-" if v is None else f"{v * 1000:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", type=Path, help="a measured profile (default: calibrate)")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    profile = args.profile
    if profile is None:
        profile = Path(tempfile.mkdtemp()) / "profile.json"
        calibrate(profile)
    rows = []
    print(
        f"{'workload':14} {'req/s':>5}  {'TTFT p50 real/sim (ms)':>24} {'err':>6}  "
        f"{'TTFT p95 real/sim (ms)':>24} {'err':>6}  {'hit rate real/sim':>18} {'err':>6}  "
        f"{'engine direct':>14}  {'TTFT mean client/sim engines/sim':>33} {'err':>6} {'err':>6}"
    )
    engines_profile = engine_only(profile, Path(tempfile.mkdtemp()) / "engine-only.json")
    for workload, rate in CASES:
        real = local_run(workload, rate, args.duration, args.seed, args.port)
        sim = simulated(workload, rate, args.duration, args.seed, profile)
        engines = simulated(workload, rate, args.duration, args.seed, engines_profile)
        row: dict[str, Any] = {
            "workload": workload,
            "rate": rate,
            "local": real,
            "simulated": sim,
            "simulated_engines": engines,
        }
        if workload in SMALL_ONLY:
            row["engine_direct"] = local_run(
                workload, rate, args.duration, args.seed, args.port, direct=True
            )
        for key in ("ttft_p50_s", "ttft_p95_s", "hit_rate"):
            row[f"{key}_error"] = error(sim[key], real[key])
        row["ttft_mean_error"] = error(sim["ttft_mean_s"], real["ttft_mean_s"])
        # The engine model alone against the engines' own TTFT (arrival to first token).
        row["engine_ttft_mean_error"] = error(engines["ttft_mean_s"], real["engine_ttft_mean_s"])
        rows.append(row)

        print(
            f"{workload:14} {rate:>5.1f}  {pair(row, 'ttft_p50_s', 1000):>24} "
            f"{pct(row, 'ttft_p50_s'):>6}  {pair(row, 'ttft_p95_s', 1000):>24} "
            f"{pct(row, 'ttft_p95_s'):>6}  {pair(row, 'hit_rate', 1):>18} "
            f"{pct(row, 'hit_rate'):>6}  {direct(row):>14}  {means(real, sim, engines):>33} "
            f"{pct(row, 'ttft_mean'):>6} {pct(row, 'engine_ttft_mean'):>6}",
            flush=True,
        )
    if args.save:
        doc = {"machine": machine(), "args": {**vars(args), "profile": str(profile)}, "rows": rows}
        doc["profile"] = json.loads(profile.read_text())
        print(f"saved {save('simulate_validation', doc)}")


if __name__ == "__main__":
    main()
