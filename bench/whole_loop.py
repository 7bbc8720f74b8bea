"""The whole loop on Kubernetes, measured: the figures e2e/test_whole_loop.py takes, over rounds.

Each round runs the e2e module as its own pytest process (the real control plane, two process
nodes, the chart's operator, two routers and CPU reference engines as pods, Prometheus as a pod)
and reads the figures its tests record (``$FLEETPILOT_WHOLE_LOOP_FIGURES``):

- apply -> Ready: `kubectl apply` of the two-tier service to its Ready condition;
- killed engine: SIGKILL to restarted and back in the router's rotation, chats failed meanwhile;
- load step: to the autoscaler's decision, decision -> new pod Ready -> first request it served;
- rolling update of the large tier under 4 clients: rollout seconds, chats served and failed;
- node drain under 4 clients: evictions a disruption budget refused, seconds until every pod
  runs elsewhere; then every small engine evicted at once (refusals, seconds); chats served
  and failed throughout (the service must stay Ready);
- scale to zero and back: idle -> zero pods, then a held chat's time to first token;
- model download: apply -> the download Job complete -> the checkpoint service Ready.

``--hog N`` runs N busy loops beside it (a busy machine). Needs what the e2e module needs: root,
Go, `make controlplane processnode prometheus`.

Run: .venv/bin/python bench/whole_loop.py [--rounds 2] [--hog 0] [--save]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from router_support import ROOT, commit, machine, save

MODULE = "e2e/test_whole_loop.py"
FIGURES_ENV = "FLEETPILOT_WHOLE_LOOP_FIGURES"
#: The figures summarized across rounds: (label, path into a round's figures).
SUMMARY = [
    ("apply -> Ready s", ("apply_to_ready_s",)),
    ("killed engine: back in rotation s", ("killed_engine", "back_in_rotation_s")),
    ("killed engine: chats failed", ("killed_engine", "failed")),
    ("load step: decision -> new pod Ready s", ("load_step", "decision_to_ready_s")),
    ("load step: decision -> first served s", ("load_step", "decision_to_served_s")),
    ("rolling update: rollout s", ("rolling_update", "rollout_s")),
    ("rolling update: chats served", ("rolling_update", "served")),
    ("rolling update: chats failed", ("rolling_update", "failed")),
    ("drain: evictions refused by a budget", ("drain", "evictions_refused")),
    ("drain: pods back elsewhere s", ("drain", "drain_s")),
    ("whole tier evicted: evictions refused", ("drain", "tier_evictions_refused")),
    ("whole tier evicted: all back s", ("drain", "tier_s")),
    ("drain: chats served", ("drain", "served")),
    ("drain: chats failed", ("drain", "failed")),
    ("scale to zero: idle -> zero s", ("scale_from_zero", "idle_to_zero_s")),
    ("from zero: held chat's first token s", ("scale_from_zero", "held_ttft_s")),
    ("model download: apply -> Job complete s", ("model_download", "apply_to_job_complete_s")),
    ("model download: apply -> Ready s", ("model_download", "apply_to_ready_s")),
]


@contextlib.contextmanager
def hogs(count: int) -> Iterator[None]:
    """`count` processes spinning on a core each while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)


def one_round(number: int, hog: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="whole-loop-") as folder:
        figures = Path(folder) / "figures.json"
        env = {**os.environ, FIGURES_ENV: str(figures)}
        command = [sys.executable, "-m", "pytest", MODULE, "-q", "-s", "-p", "no:cacheprovider"]
        began = time.monotonic()
        with hogs(hog):
            result = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, check=False
            )
        wall_s = time.monotonic() - began
        lines = [line for line in result.stdout.splitlines() if "whole loop:" in line]
        tail = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else []
        print(f"round {number}: exit {result.returncode} in {wall_s:.0f}s; {' '.join(tail)}")
        for line in lines:
            print(f"  {line.strip()}")
        found = json.loads(figures.read_text()) if figures.exists() else {}
    return {"round": number, "exit": result.returncode, "wall_s": round(wall_s, 1), **found}


def value(figures: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = figures
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, int | float) else None


def summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for label, path in SUMMARY:
        values = [v for r in rounds if (v := value(r, path)) is not None]
        if values:
            out[label] = {
                "min": min(values),
                "median": statistics.median(values),
                "max": max(values),
                "n": len(values),
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hog", type=int, default=0, help="busy loops beside it")
    parser.add_argument("--save", action="store_true", help="write bench/results/whole_loop.json")
    parser.add_argument("--name", default="whole_loop", help="results file name (no .json)")
    args = parser.parse_args()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    rounds = [one_round(n + 1, args.hog) for n in range(args.rounds)]
    table = summary(rounds)
    print(f"\n{'figure':45} {'min':>8} {'median':>8} {'max':>8}  rounds")
    for label, stats in table.items():
        print(
            f"{label:45} {stats['min']:>8g} {stats['median']:>8g} {stats['max']:>8g}  "
            f"{stats['n']:g}"
        )
    failed = [r["round"] for r in rounds if r["exit"] != 0]
    if failed:
        print(f"rounds whose tests failed: {failed}")
    if args.save:
        path = save(
            args.name,
            {
                "benchmark": "whole_loop",
                "commit": commit(),
                "started": started,
                "command": " ".join(["bench/whole_loop.py", *sys.argv[1:]]),
                "machine": machine(),
                "hog": args.hog,
                "summary": table,
                "rounds": rounds,
            },
        )
        print(f"saved {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
