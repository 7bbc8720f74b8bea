"""`make cluster-demo`, measured: its own printout read back over rounds.

Each round runs ``python -m fleetpilot.testing.cluster_demo`` as its own process (the real
control plane, two process nodes, the chart's operator, ``examples/cpu-two-tier.yaml``, chats
through a router pod, a scale-up, teardown) and reads from what it prints:

- apply -> Ready: the ``(Ready Xs after the apply)`` line;
- the chats: the tier that served each (the route header) and its prompt and cached tokens;
- the scale-up: the new small engine Ready and serving, seconds after ``kubectl scale``;
- the whole demo, start to end (binaries already built), and the processes it left behind.

A round that exits non-zero or prints something unreadable fails the run (nothing is saved).
Needs what the demo needs: root, Go, kubectl (`make controlplane processnode`).

Run: .venv/bin/python bench/cluster_demo.py [--rounds 2] [--save]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from router_support import save

ROOT = Path(__file__).resolve().parents[1]

READY = re.compile(r"\(Ready ([\d.]+)s after the apply\)")
CHAT = re.compile(
    r"^  (?P<label>.+?)\s+(?P<route>\S*)\s+prompt\s+(?P<prompt>\d+) tokens, "
    r"served from prefix cache (?P<cached>\d+)$",
    re.MULTILINE,
)
SCALED = re.compile(r"Ready ([\d.]+)s after the scale, serving after ([\d.]+)s \((\d+) chats\)")
TOOK = re.compile(r"\(the demo took (\d+)s\)")
LEFT = re.compile(r"processes left behind: \[(.*)\]")


def read_round(printout: str) -> dict[str, Any]:
    """The figures of one demo's printout; ValueError naming what is missing."""

    def one(pattern: re.Pattern[str], what: str) -> re.Match[str]:
        found = pattern.search(printout)
        if found is None:
            raise ValueError(f"the demo's printout has no {what}")
        return found

    chats = [
        {
            "label": m["label"].strip(),
            "route": m["route"],
            "prompt_tokens": int(m["prompt"]),
            "cached_tokens": int(m["cached"]),
        }
        for m in CHAT.finditer(printout)
    ]
    if not chats:
        raise ValueError("the demo's printout has no chats")
    scaled = one(SCALED, "scale-up line")
    left = one(LEFT, "leftover-process line")[1].strip()
    return {
        "apply_to_ready_s": float(one(READY, "Ready line")[1]),
        "chats": chats,
        "scale_ready_s": float(scaled[1]),
        "scale_serving_s": float(scaled[2]),
        "scale_chats": int(scaled[3]),
        "demo_s": int(one(TOOK, "total time")[1]),
        "leftover_processes": len(left.split(",")) if left else 0,
    }


def span(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--save", action="store_true", help="write bench/results/ too")
    args = parser.parse_args()
    rounds = []
    for n in range(1, args.rounds + 1):
        done = subprocess.run(
            [sys.executable, "-m", "fleetpilot.testing.cluster_demo"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            sys.stdout.write(done.stdout[-4000:])
            raise SystemExit(f"round {n}: the demo exited {done.returncode}: {done.stderr[-2000:]}")
        figures = read_round(done.stdout)
        rounds.append(figures)
        print(
            f"round {n}: Ready {figures['apply_to_ready_s']:.1f}s after the apply, new engine "
            f"Ready {figures['scale_ready_s']:.1f}s / serving {figures['scale_serving_s']:.1f}s "
            f"after the scale, demo {figures['demo_s']}s, "
            f"{figures['leftover_processes']} processes left",
            flush=True,
        )
    summary = {
        key: span([r[key] for r in rounds])
        for key in ("apply_to_ready_s", "scale_ready_s", "scale_serving_s", "demo_s")
    }
    if args.save:
        path = save(
            "cluster_demo",
            {"benchmark": "cluster_demo", "rounds": rounds, "summary": summary},
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
