"""The reference engine's GIL switch interval: TTFT and throughput of one engine serving HTTP.

The engine steps on a thread of the process whose event loop serves HTTP (``runner.py``), so
the two take turns on the GIL, and a thread that wants it waits up to the switch interval for
the other to let go (Python's default: 5 ms). Each arm starts one engine with the local
fleet's command line (``reference_argv``: the tiny model, 16 sequences, prefix caching and KV
events), run through a wrapper that first sets the arm's ``sys.setswitchinterval``, and runs
``fleetpilot bench`` against it twice: open loop (Poisson arrivals, the validation's
shared-prefix load) for TTFT - the client's, and the engine's own
``vllm:time_to_first_token_seconds`` mean - and closed loop (16 clients, a full batch) for
throughput. Arms alternate over rounds, in rotated order, because a shared machine's speed
drifts; medians over rounds are reported.

Run: .venv/bin/python bench/engine_switch_interval.py [--rounds 3] [--duration 30] [--save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from router_support import machine, save, wait_healthy
from simulate_validation import engine_ttft

from fleetpilot.engine.reference_launch import CPU_MAX_NUM_SEQS, reference_argv
from fleetpilot.engine.vllm_args import EngineLaunch

HOST = "127.0.0.1"
MODEL = "m"
INTERVALS_S = (0.005, 0.001, 0.0005)
OPEN_LOOP = ("shared-prefix", 4.0)  # workload, req/s: a validation case
CLOSED_LOOP_CLIENTS = CPU_MAX_NUM_SEQS


def start_engine(port: int, interval_s: float) -> subprocess.Popen[bytes]:
    launch = EngineLaunch(
        model=MODEL,
        served_name=MODEL,
        port=port,
        max_num_seqs=CPU_MAX_NUM_SEQS,
        kv_events_port=port + 1,
        kv_replay_port=port + 2,
    )
    python, dash_m, module, *args = reference_argv(launch, HOST)
    if (dash_m, module) != ("-m", "fleetpilot"):
        raise RuntimeError(f"reference_argv no longer runs python -m fleetpilot: {module}")
    wrapper = (
        f"import runpy, sys; sys.setswitchinterval({interval_s!r}); "
        f"sys.argv = ['fleetpilot', *sys.argv[1:]]; "
        "runpy.run_module('fleetpilot', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [python, "-c", wrapper, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_healthy(port)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def bench(port: int, load: list[str], duration: float, seed: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run(
            [
                *(sys.executable, "-m", "fleetpilot", "bench"),
                *("--url", f"http://{HOST}:{port}/v1", "--model", MODEL, *load),
                *("--duration", str(duration), "--seed", str(seed), "--ignore-eos"),
                *("--out", str(out)),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return dict(json.loads(out.read_text())["summary"])


def arm(interval_s: float, duration: float, seed: int, port: int) -> dict[str, Any]:
    workload, rate = OPEN_LOOP
    proc = start_engine(port, interval_s)
    try:
        latency = bench(port, ["--workload", workload, "--rate", str(rate)], duration, seed)
        total, count = engine_ttft(port)
        load = ["--workload", workload, "--concurrency", str(CLOSED_LOOP_CLIENTS)]
        throughput = bench(port, load, duration, seed)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "interval_s": interval_s,
        "ttft_p50_s": latency["ttft_s"]["p50"],
        "ttft_p95_s": latency["ttft_s"]["p95"],
        "engine_ttft_mean_s": total / count if count else None,
        "tpot_p50_s": latency["tpot_s"]["p50"],
        "closed_loop_output_tokens_per_s": throughput["output_tokens_per_s"],
        "closed_loop_tpot_p50_s": throughput["tpot_s"]["p50"],
        "errors": {**latency["errors"], **throughput["errors"]},
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=18600)
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = INTERVALS_S[round_ % len(INTERVALS_S) :] + INTERVALS_S[: round_ % len(INTERVALS_S)]
        for interval in order:
            run = arm(interval, args.duration, args.seed + round_, args.port)
            run["round"] = round_
            runs.append(run)
            print(json.dumps(run), flush=True)
    print(
        f"\n{'interval':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'engine mean':>12} "
        f"{'TPOT p50':>9} {'16 clients tok/s':>17} {'TPOT p50':>9}"
    )
    summary = []
    for interval in INTERVALS_S:
        mine = [r for r in runs if r["interval_s"] == interval]
        row = {
            "interval_s": interval,
            **{
                key: median_of(mine, key)
                for key in (
                    "ttft_p50_s",
                    "ttft_p95_s",
                    "engine_ttft_mean_s",
                    "tpot_p50_s",
                    "closed_loop_output_tokens_per_s",
                    "closed_loop_tpot_p50_s",
                )
            },
        }
        summary.append(row)
        print(
            f"{interval * 1000:>7.1f}ms {row['ttft_p50_s'] * 1000:>7.1f}ms "
            f"{row['ttft_p95_s'] * 1000:>7.1f}ms {row['engine_ttft_mean_s'] * 1000:>10.1f}ms "
            f"{row['tpot_p50_s'] * 1000:>7.1f}ms {row['closed_loop_output_tokens_per_s']:>17.0f} "
            f"{row['closed_loop_tpot_p50_s'] * 1000:>7.1f}ms"
        )
    if args.save:
        save(
            "engine_switch_interval",
            {"machine": machine(), "rounds": args.rounds, "summary": summary, "runs": runs},
        )


if __name__ == "__main__":
    main()
