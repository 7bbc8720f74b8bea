"""The router of ``fleetpilot up`` frozen (SIGSTOP) under load: how long the fleet serves
nothing, with ``up``'s liveness probe (the defaults) and without it (the old behaviour: only
exits were watched), in one run.

Each arm runs a real ``fleetpilot up`` (one CPU reference engine, the router; no Prometheus,
no autoscaler) as its own process, and ``--clients`` closed-loop clients sending short
completions through its endpoint. ``--warmup`` seconds in, the router is SIGSTOPped; it gets
SIGCONT ``--freeze`` seconds later if it still exists (the probe of issue 41: 25 s). Measured:
when ``up`` reported the freeze (the first line naming the router's pid), and the outage - the
longest stretch with no completion from the freeze on (a request already answered when the
signal lands completes just after it, so the first completion after the freeze is not the
end of the outage). Without liveness nothing is reported and the outage is the whole freeze;
with it, the router is killed and restarted after the probe's detection time (``period x
failures + timeout`` at most, 8 s with the defaults).

Run: .venv/bin/python bench/up_frozen_router.py [--rounds 2] [--quick] [--save]
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from router_support import commit, machine, save

ROOT = Path(__file__).resolve().parents[1]
MODEL = "frozen-router-model"
SERVICE = f"""\
apiVersion: fleetpilot.dev/v1alpha1
kind: InferenceService
metadata:
  name: frozen-router
  namespace: default
spec:
  tiers:
    - name: main
      model:
        name: Qwen/Qwen2.5-0.5B-Instruct
        servedName: {MODEL}
        maxModelLen: 512
      serving:
        replicas: {{min: 1, max: 1}}
      autoscaling:
        mode: disabled
"""
# The old behaviour: the first probe passes and the next is due in a day, so no freeze is ever
# judged - only exits are watched, as before liveness probes.
WITHOUT = ("--liveness-period", "86400")
START_TIMEOUT_S = 300.0


def completes(endpoint: str) -> bool:
    body = f'{{"model": "{MODEL}", "prompt": "hello there", "max_tokens": 4}}'.encode()
    request = urllib.request.Request(
        f"{endpoint}/completions", body, {"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def printed(path: Path, prefix: str) -> str | None:
    lines = path.read_text(errors="replace").splitlines()
    return next((line for line in lines if line.startswith(prefix)), None)


def run_arm(liveness: bool, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    service = folder / "service.yaml"
    service.write_text(SERVICE)
    workdir = folder / "fleet"
    stdout = folder / "stdout"
    argv = [sys.executable, "-m", "fleetpilot", "up", "-f", str(service), "--port", "0",
            "--workdir", str(workdir), "--no-prometheus", "--no-autoscale",
            "--status-interval", "3600", *(() if liveness else WITHOUT)]  # fmt: skip
    with stdout.open("wb") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (line := printed(stdout, "fleet is up; OpenAI endpoint: ")) is None:
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fleetpilot up did not start:\n{stdout.read_text()}")
            time.sleep(0.2)
        endpoint = line.rsplit(" ", 1)[1]
        done: list[float] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                if completes(endpoint):
                    done.append(time.monotonic())
                else:
                    time.sleep(0.05)  # refused while the router restarts: do not spin

        clients = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in clients:
            thread.start()
        time.sleep(args.warmup)
        (router,) = pids_mentioning(str(workdir / "router.yaml"))
        frozen_at = time.monotonic()
        os.kill(router, signal.SIGSTOP)
        reported_at = None
        report = f"router (pid {router}) stopped answering "
        while time.monotonic() < frozen_at + args.freeze:
            if reported_at is None and printed(stdout, report) is not None:
                reported_at = time.monotonic()
            time.sleep(0.1)
        if router in pids_mentioning(str(workdir / "router.yaml")):
            os.kill(router, signal.SIGCONT)
        time.sleep(args.after)
        stop.set()
        stopped_at = time.monotonic()
        for thread in clients:
            thread.join()
        after = sorted(t for t in done if t > frozen_at)
        return {
            "liveness": liveness,
            "reported_s": None if reported_at is None else reported_at - frozen_at,
            "outage_s": outage(frozen_at, after, stopped_at),
            "completions_in_freeze": sum(t < frozen_at + args.freeze for t in after),
            "completions_before": sum(t <= frozen_at for t in done),
        }
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()


def outage(start: float, completions: list[float], end: float) -> float | None:
    """The longest stretch with no completion between ``start`` and ``end`` (``completions``
    sorted, all after ``start``); None when that stretch runs to ``end``: serving never
    resumed, so a completion just after ``start`` cannot pass for a short outage."""
    gaps = [later - earlier for earlier, later in itertools.pairwise([start, *completions, end])]
    longest = max(gaps)
    return None if gaps[-1] == longest else longest


def spread(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "never"
    if len(known) < len(values):
        return f"{statistics.median(known):.1f} s ({len(values) - len(known)} never)"
    return f"{statistics.median(known):.1f} s [{min(known):.1f}-{max(known):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--freeze", type=float, default=25.0)
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 1
    results = []
    for round_ in range(args.rounds):
        for liveness in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                result = run_arm(liveness, args, Path(tmp))
            results.append({"round": round_, **result})
            print(f"round {round_}, liveness {'on' if liveness else 'off'}: {result}", flush=True)
    print(
        f"\nrouter SIGSTOPped for {args.freeze:g} s under {args.clients} closed-loop clients, "
        f"{args.rounds} round(s): median [min-max]"
    )
    print(f"{'liveness':<24} {'reported after':<22} {'outage':<22} completions in the freeze")
    for liveness, label in ((False, "off (exits only, old)"), (True, "on (2 s, 2 s, 3)")):
        arm = [r for r in results if r["liveness"] is liveness]
        print(
            f"{label:<24} {spread([r['reported_s'] for r in arm]):<22} "
            f"{spread([r['outage_s'] for r in arm]):<22} "
            f"{[r['completions_in_freeze'] for r in arm]}"
        )
    if args.save:
        path = save(
            "up_frozen_router",
            {
                "benchmark": "up_frozen_router",
                "commit": commit(),
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": machine(),
                "args": vars(args),
                "results": results,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
