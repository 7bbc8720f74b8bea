"""``make demo``: a two-tier fleet on this machine, routed, loaded, scaled, then nothing left.

1. reference engines per tier behind the router: a tier chosen by request complexity, a
   replica by prefix affinity, prefix-cache hits on a shared system prompt;
2. a load step (``fleetpilot bench``, closed loop) breaks the small tier's TTFT objective and
   the autoscaler adds an engine, saying why; when the load stops, the tier shrinks back after
   its scale-down window;
3. everything stops, and the demo checks that no process is left.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from fleetpilot.api import load_services
from fleetpilot.loadgen import cli as loadgen
from fleetpilot.runtime.autoscale import LocalAutoscaler
from fleetpilot.runtime.local import LocalFleet, format_status
from fleetpilot.runtime.processes import free_port

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


def load_step(fleet: LocalFleet, model: str) -> None:
    """Drive load, let the autoscaler scale up, stop the load, let it scale back down."""
    autoscaler = LocalAutoscaler(fleet, max_replicas_per_role=2, say=lambda t: print(f"   {t}"))
    bench = [
        "--url", fleet.endpoint, "--model", model, "--workload", "shared-prefix",
        "--concurrency", "8", "--duration", str(LOAD_S), "--max-tokens", "16", "--ignore-eos",
    ]  # fmt: skip
    print(f"\n== load step: fleetpilot bench {' '.join(bench[4:])}")
    # The load runs in a thread; the autoscaler stays on this thread, which started the fleet:
    # engines it adds die with the thread that started them (parent-death signal).
    load = threading.Thread(target=loadgen.main, args=(bench,))
    load.start()
    try:
        while load.is_alive():
            autoscaler.step()
            time.sleep(0.25)
        print("\n== load stopped; waiting for the scale-down window")
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while time.monotonic() < deadline and len(fleet.serving_addresses("small", "unified")) > 1:
            autoscaler.step()
            time.sleep(0.25)
        print()
        print(format_status(fleet.status_rows()))
    finally:
        autoscaler.close()


def main() -> int:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else EXAMPLE
    (service,) = load_services(path)
    with tempfile.TemporaryDirectory(prefix="fleetpilot-demo-") as workdir:
        port = free_port()
        print(f"== starting {path.name} on 127.0.0.1:{port} (reference engines on the CPU)")
        started = time.monotonic()
        with LocalFleet(service, Path(workdir), port) as fleet:
            print(f"   up in {time.monotonic() - started:.1f}s; endpoint {fleet.endpoint}\n")
            print(format_status(fleet.status_rows()), "\n")
            with httpx.Client(base_url=fleet.endpoint, timeout=60) as client:
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
                metrics = client.get(fleet.endpoint.removesuffix("/v1") + "/metrics").text
            routed = [line for line in metrics.splitlines() if "requests_total{" in line]
            print("== router metrics (requests by tier):")
            print("\n".join(f"   {line}" for line in routed[:8]) or "   (none)")
            load_step(fleet, service.name)
        print(f"\n== stopped; processes left behind: {json.dumps(fleet.leftovers())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
