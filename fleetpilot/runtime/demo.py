"""``make demo``: a two-tier fleet on this machine, routed, loaded, scaled, then nothing left.

1. reference engines per tier behind the router: a tier chosen by request complexity, a
   replica by prefix affinity, prefix-cache hits on a shared system prompt;
2. a load step (``fleetpilot bench``, closed loop) breaks the small tier's TTFT objective and
   the autoscaler (``fleetpilot autoscaler``, its own process, reading the fleet's Prometheus
   when one is installed) adds an engine, saying why; when the load stops, the tier shrinks
   back after its scale-down window;
3. everything stops, and the demo checks that no process is left.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fleetpilot.api import RoleName, load_services
from fleetpilot.loadgen import cli as loadgen
from fleetpilot.runtime.stack import LocalStack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-two-tier.yaml"
SYSTEM = "You are a support assistant for an online bookshop. Answer briefly and politely. " * 4
REQUESTS = [
    ("easy, new prompt", [{"role": "user", "content": "Hi! Are you open today?"}]),
    ("easy, same system prompt", [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Where is my order?"}]),
    ("easy, same system prompt again", [{"role": "system", "content": SYSTEM},
                                        {"role": "user", "content": "Can I return a book?"}]),
    ("hard: code and maths", [{"role": "user", "content": (
        "Write a Python function that proves, step by step, that the sum of the first n odd "
        "numbers is n^2, then derive its complexity. ```python\ndef f(n):\n    ...\n```\n"
        "Explain the induction, the base case, and the integral bound in detail. " * 3)}]),
]  # fmt: skip


LOAD_S = 20.0
SETTLE_LIMIT_S = 60.0


def _indented(text: str) -> None:
    print(f"   {text}", flush=True)


def load_step(stack: LocalStack, model: str, plot: Path | None = None) -> None:
    """Drive load, let the autoscaler scale up, stop the load, let it scale back down."""
    bench = [
        "--url", stack.endpoint, "--model", model, "--workload", "shared-prefix",
        "--concurrency", "8", "--duration", str(LOAD_S), "--max-tokens", "16", "--ignore-eos",
    ]  # fmt: skip
    if plot is not None:
        bench += ["--plot", str(plot)]
    print(f"\n== load step: fleetpilot bench {' '.join(bench[4:])}")
    # The load runs in a thread; this thread, which started the fleet, keeps supervising it.
    load = threading.Thread(target=loadgen.main, args=(bench,))
    load.start()
    shown = False
    while load.is_alive():
        stack.step()
        if not shown and sum(r.healthy for r in stack.fleet.status_rows()) > 2:
            print(f"\n{stack.status_table()}\n")  # mid-step: both small engines serving
            shown = True
        time.sleep(0.25)
    print("\n== load stopped; waiting for the scale-down window")
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while time.monotonic() < deadline and _small_desired(stack) > 1:
        stack.step()
        time.sleep(0.25)
    print()
    print(stack.status_table())


def _small_desired(stack: LocalStack) -> int:
    """What the autoscaler last recorded for the small tier (the replicas while none)."""
    record = stack.actuator.roles.get(("small", RoleName.UNIFIED))
    return record.desired if record else len(stack.fleet.role_replicas("small", RoleName.UNIFIED))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetpilot.runtime.demo")
    parser.add_argument("file", nargs="?", type=Path, default=EXAMPLE, help="service to run")
    parser.add_argument("--plot", type=Path, help="also write the load step's PNG here")
    args = parser.parse_args(argv)
    path: Path = args.file
    (service,) = load_services(path)
    with tempfile.TemporaryDirectory(prefix="fleetpilot-demo-") as workdir:
        print(f"== starting {path.name} (reference engines on the CPU, free loopback ports)")
        started = time.monotonic()
        with LocalStack(service, Path(workdir), 0, say=_indented) as stack:
            print(f"   up in {time.monotonic() - started:.1f}s; endpoint {stack.endpoint}")
            source = (
                f"Prometheus at {stack.prometheus_url} (the engines' /metrics while it is down)"
                if stack.prometheus_url
                else ("the engines' /metrics (no Prometheus installed)")
            )
            print(f"   autoscaler: its own process, reading {source}\n")
            print(stack.status_table(), "\n")
            with httpx.Client(base_url=stack.endpoint, timeout=60) as client:
                for label, messages in REQUESTS:
                    body = {"model": service.name, "messages": messages, "max_tokens": 16}
                    response = client.post("/chat/completions", json=body)
                    response.raise_for_status()
                    usage = response.json()["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    print(f"-- {label}")
                    print(f"   route: {response.headers.get('x-fleetpilot-route')}")
                    print(
                        f"   prompt tokens {usage['prompt_tokens']}, served from prefix cache "
                        f"{cached}\n"
                    )
                metrics = client.get(f"http://{stack.fleet.router_metrics_address}/metrics").text
            routed = [line for line in metrics.splitlines() if "requests_total{" in line]
            print("== router metrics (requests by tier):")
            print("\n".join(f"   {line}" for line in routed[:8]) or "   (none)")
            load_step(stack, service.name, args.plot)
        print(f"\n== stopped; processes left behind: {json.dumps(stack.leftovers())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
