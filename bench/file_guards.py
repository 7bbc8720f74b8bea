"""What the file guards (fleetpilot.files) cost and what they save, in one run.

Probes: each file an attacker or a mistake could hand an entry point, given to the real CLI
(``fleetpilot router --config FILE``, ``fleetpilot engine --model-config FILE``) and to the
loading the router and engine did before the guards (``read_bytes`` + ``yaml.safe_load`` +
``RouterConfig.model_validate``; ``read_text`` + ``json.loads``), each in its own process with
its address space capped at 4 GiB (torch's libraries need more than 2 to load) and a
deadline. Reported per arm: wall time, peak RSS, exit
status, stderr lines and whether a traceback was printed.

Cost: parsing valid router configs (the planner's ConfigMap for an example service, and one
of ~900 KiB with many static addresses) with the guarded loader and with plain
``yaml.safe_load``, alternating, medians.

Run: .venv/bin/python bench/file_guards.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from router_support import commit, machine, save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetpilot.api import load_services  # noqa: E402
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig  # noqa: E402
from fleetpilot.operator.plan_types import PlanOptions  # noqa: E402
from fleetpilot.operator.planner import plan  # noqa: E402
from fleetpilot.routing.config import parse_config  # noqa: E402

MEMORY_CAP = 4 << 30

# The router's load_config and parse_config before the guards, message included: a schema
# error lists each field's location and message, never the (maybe huge) input.
OLD_ROUTER_LOAD = """
import sys, yaml
from pathlib import Path
from pydantic import ValidationError
from fleetpilot.api.router_config import RouterConfig
data = yaml.safe_load(Path(sys.argv[1]).read_bytes())
try:
    RouterConfig.model_validate(data)
except ValidationError as exc:
    print("; ".join(f"{e['loc']}: {e['msg']}" for e in exc.errors()), file=sys.stderr)
    sys.exit(2)
"""

OLD_ENGINE_LOAD = """
import json, sys
from pathlib import Path
json.loads(Path(sys.argv[1]).read_text())
"""

# What an alias bomb costs any consumer that walks the loaded data (a model_dump of free-form
# fields, a json.dumps for a log or an API): yaml.safe_load itself shares the aliased nodes.
WALKING_CONSUMER = """
import json, sys, yaml
from pathlib import Path
json.dumps(yaml.safe_load(Path(sys.argv[1]).read_bytes()))
"""


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run_capped(argv: list[str], deadline_s: float) -> dict[str, Any]:
    """One process: wall time, peak RSS (MiB), exit status, stderr lines, traceback?"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_cap, env=env
        )
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > deadline_s:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.01)
        wall = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    lines = stderr.strip().splitlines()
    return {
        "wall_s": round(wall, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "exit": proc.returncode,
        "timed_out": timed_out,
        "stderr_lines": len(lines),
        "traceback": "Traceback" in stderr,
        "last_line": lines[-1][:200] if lines else "",
    }


def laughs() -> str:
    lines = [f"  lol0: &lol0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"  lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]" for i in range(1, 10)]
    return "x:\n" + "\n".join(lines) + "\nservice: chat\nnamespace: ml\ntiers: *lol9\n"


def probes(work: Path) -> dict[str, tuple[str, Path]]:
    """name -> (which entry point, file)."""
    deep_yaml = work / "deep.yaml"
    deep_yaml.write_text("service: " + "[" * 5000 + "]" * 5000 + "\n")
    latin1 = work / "latin1.yaml"
    latin1.write_bytes(b"service: caf\xe9\n")
    bomb = work / "laughs.yaml"
    bomb.write_text(laughs())
    deep_json = work / "deep.json"
    deep_json.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    latin1_json = work / "latin1.json"
    latin1_json.write_bytes(b'{"name": "caf\xe9"}')
    return {
        "router --config /dev/zero": ("router", Path("/dev/zero")),
        "router --config 5,000-deep YAML": ("router", deep_yaml),
        "router --config non-UTF-8": ("router", latin1),
        "router --config billion laughs": ("router", bomb),
        "engine --model-config 100k-deep JSON": ("engine", deep_json),
        "engine --model-config non-UTF-8": ("engine", latin1_json),
    }


def measure_probes(work: Path, deadline_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (entry, path) in probes(work).items():
        if entry == "router":
            ours = [sys.executable, "-m", "fleetpilot", "router", "--config", str(path)]
            old = [sys.executable, "-c", OLD_ROUTER_LOAD, str(path)]
        else:
            ours = [sys.executable, "-m", "fleetpilot", "engine", "--backend", "reference",
                    "--model-config", str(path)]  # fmt: skip
            old = [sys.executable, "-c", OLD_ENGINE_LOAD, str(path)]
        row = {"guarded": run_capped(ours, deadline_s), "unguarded": run_capped(old, deadline_s)}
        if "laughs" in name:
            row["walking_consumer"] = run_capped(
                [sys.executable, "-c", WALKING_CONSUMER, str(path)], deadline_s
            )
        out[name] = row
        for arm, r in row.items():
            print(
                f"{name:38} {arm:17} {r['wall_s']:>7.2f} s {r['peak_rss_mib']:>8.1f} MiB "
                f"exit {r['exit']:>4} lines {r['stderr_lines']:>3} "
                f"{'TRACEBACK' if r['traceback'] else ''}{' TIMEOUT' if r['timed_out'] else ''}"
            )
    return out


def example_config() -> str:
    (service, *_) = load_services(ROOT / "examples" / "disaggregated.yaml")
    (config_map,) = [
        o
        for o in plan(service, PlanOptions())
        if o["kind"] == "ConfigMap" and ROUTER_CONFIG_FILE in o.get("data", {})
    ]
    return str(config_map["data"][ROUTER_CONFIG_FILE])


def big_config(text: str, target_bytes: int) -> str:
    """The example config with static addresses added until it is ``target_bytes`` long."""
    data = yaml.safe_load(text)
    group = data["tiers"][0]["endpoints"][0]
    addresses: list[str] = []
    group["addresses"] = addresses
    while len(text) < target_bytes:
        addresses.extend(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:8000"
                         for i in range(len(addresses), len(addresses) + 2000))  # fmt: skip
        text = yaml.safe_dump(data)
    return text


def measure_cost(rounds: int) -> dict[str, Any]:
    small = example_config()
    large = big_config(small, 900 << 10)
    out: dict[str, Any] = {}
    for name, text in (("example ConfigMap", small), ("~900 KiB config", large)):
        times: dict[str, list[float]] = {"guarded": [], "yaml.safe_load": []}
        for _ in range(rounds):
            start = time.perf_counter()
            parse_config(text, "bench")
            times["guarded"].append(time.perf_counter() - start)
            start = time.perf_counter()
            RouterConfig.model_validate(yaml.safe_load(text))
            times["yaml.safe_load"].append(time.perf_counter() - start)
        median = {arm: statistics.median(t) * 1000 for arm, t in times.items()}
        out[name] = {"bytes": len(text.encode()), "median_ms": median, "samples_ms": {
            arm: [round(t * 1000, 3) for t in ts] for arm, ts in times.items()}}  # fmt: skip
        added = median["guarded"] / median["yaml.safe_load"] - 1
        print(
            f"{name:20} {len(text.encode()):>8} B  guarded {median['guarded']:>8.2f} ms  "
            f"safe_load {median['yaml.safe_load']:>8.2f} ms  ({added:+.0%})"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter deadline")
    args = parser.parse_args()
    rounds, deadline_s = (3, 20.0) if args.quick else (15, 60.0)
    with tempfile.TemporaryDirectory() as work:
        probe_results = measure_probes(Path(work), deadline_s)
    cost = measure_cost(rounds)
    path = save(
        "file_guards",
        {
            "benchmark": "file_guards",
            "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "memory_cap_bytes": MEMORY_CAP,
            "deadline_s": deadline_s,
            "rounds": rounds,
            "probes": probe_results,
            "parse_cost": cost,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
