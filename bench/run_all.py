"""Rerun every benchmark whose results file a docs table reads, then re-render the tables.

``python bench/run_all.py`` runs each entry of ``CATALOGUE`` one after another, each benchmark
its own process as it is written to be run, printing its command first; it stops at the first
failure with that exit code (``--keep-going`` runs the rest and exits with the first failure's
code), then runs ``python bench/tables.py``. ``--quick`` runs each with fewer rounds or shorter
durations (the script's own ``--quick`` where it has one; an entry whose script has no way to be
shorter runs in full). ``--only NAME ...`` picks entries by results file name (``kv_offload`` or
``bench/results/kv_offload.json``), ``--list`` lists them, ``--dry-run`` prints the commands and
runs nothing. A run takes the machine's whole CPU: run it on a quiet machine.

Most scripts write ``bench/results/<name>.json`` themselves. An entry with ``writes`` names the
file its script writes when that is not its own (a second run of one script kept under another
name): the runner moves it into place and puts back what the script overwrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Entry:
    results: str  # the results file it writes, bench/results/<results>.json
    script: str  # under bench/
    full: tuple[str, ...]
    quick: tuple[str, ...] | None  # None: the script has no way to be shorter; quick is full
    writes: str | None = None  # the name the script writes when not `results`
    cwd: str = "."  # "." (the repo root) or "bench"

    def args(self, quick: bool) -> tuple[str, ...]:
        return self.quick if quick and self.quick is not None else self.full


def shorter(full: tuple[str, ...], **flags: str | None) -> tuple[str, ...]:
    """The quick variant of a full argument list: each ``name=value`` (``--name value``, dashes
    for underscores) replaces that flag's value where ``full`` has it and is put in front where
    it has not; ``name=None`` appends the bare switch (``--quick``)."""
    args, front, back = list(full), [], []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            back.append(flag)
        elif flag in args:
            args[args.index(flag) + 1] = value
        else:
            front += [flag, value]
    return (*front, *args, *back)


def _compare(results: str, base: str, bench_results: str, rounds: int, *command: str) -> Entry:
    def args(n: int) -> tuple[str, ...]:
        return (
            "--base",
            base,
            "--results",
            bench_results,
            "--rounds",
            str(n),
            "--save",
            results,
            "--",
            *command,
        )

    return Entry(results, "compare_trees.py", args(rounds), args(1))


_KV_ALL = "events x1,events+peers x2,vllm-router-kv x1,prodstack-prefix x1"
_KV_ROUNDS_ARMS = (
    "events x1,events x2,guessed x1,longest-prefix x1,longest-prefix x2,oracle,round-robin,"
    "vllm-router-cache x1,vllm-router-cache x2,vllm-router-kv x1,vllm-router-kv x2"
)


def _kv_events(name: str, scenarios: str, arms: str) -> Entry:
    common = ("--scenarios", scenarios, "--arms", arms, "--name", name)
    return Entry(
        name,
        "router_kv_events.py",
        (*common, "--repeat", "3"),
        (*common, "--quick", "--repeat", "2"),
    )


def _kv_offload(name: str, *extra: str) -> Entry:
    return Entry(
        name,
        "kv_offload.py",
        ("--rounds", "2", "--rates", "4,8", *extra, "--name", name),
        ("--quick", "--rounds", "1", "--rates", "4", *extra, "--name", name),
        cwd="bench",
    )


_OFFLOAD_ARMS = "no offload;offload, medium-blind;offload, tiered"
_ROUTER_CPU_ARMS = ("fleetpilot", "fleetpilot, guessed", "prodstack-rr", "prodstack-prefix")
_GIE_ARMS = ("fleetpilot", "fleetpilot, EPP", "GIE, EPP", "python ext_proc floor")


_LORA_ARMS = "fleetpilot,scores-only,adapter-hash,round-robin,random"


def _noisy(name: str, *extra: str) -> Entry:
    """The noisy-neighbour runs with router replicas: headroom 2, no FCFS arm."""
    common = ("--headroom", "2", "--skip-fcfs", *extra, "--save", "--name", name)
    return Entry(name, "router_noisy_neighbour.py", common, shorter(common, duration="20"))


# Left out, no command reproduces them: router_frozen_replica_scrape_only,
# router_frozen_replica_uvloop and router_overhead_proxy_split_2 measured variants of the code
# (kept for the comparison in the prose), simulate_profile_reference is a profile written by
# `fleetpilot simulate calibrate`, simulate_two_tier_hour by `fleetpilot simulate` (its command is
# in the file and in docs/simulator.md), operator_scale_before_no_source_fix is operator_scale on
# the commit before the NoMetricsSource fix (quoted in the CHANGELOG).
CATALOGUE: tuple[Entry, ...] = (
    # The docs' tables.
    Entry(
        "autoscale_ramp",
        "autoscale_ramp.py",
        _RAMP := ("--seeds", "0,1", "--arms", "reactive,predictive", "--save"),
        shorter(_RAMP, seeds="0", ramps="1"),
    ),
    _compare(
        "compare_router_overhead",
        "1e5d35846265639aa25ce1a0565020393ba11e57",
        "router_overhead",
        3,
        "bench/router_overhead.py",
    ),
    _compare(
        "compare_router_overhead_uvloop",
        "6cfc3eceef0f8f55d4d08d60926a6245a2580dc5",
        "router_overhead",
        2,
        "bench/router_overhead.py",
        "--quick",
    ),
    _compare(
        "compare_router_kv_events",
        "1e5d35846265639aa25ce1a0565020393ba11e57",
        "router_kv_events_cmp",
        2,
        "bench/router_kv_events.py",
        "--quick",
        "--arms",
        "events x1,events x2",
        "--scenarios",
        "high,shared",
        "--name",
        "router_kv_events_cmp",
    ),
    Entry("engine_decode_batch", "engine_decode_batch.py", (), None),
    Entry("engine_paged_vs_contiguous", "engine_paged_vs_contiguous.py", (), None),
    Entry("engine_prefix_cache", "engine_prefix_cache.py", (), None),
    Entry("engine_speculative", "engine_speculative.py", (), None),
    Entry("gateway_pickers", "gateway_pickers.py", ("--rounds", "2"), ("--rounds", "1")),
    _kv_offload("kv_offload", "--simulate"),
    _kv_offload(
        "kv_offload_slow_link", "--link", "0.05", "--host-hit-cost", "0.5", "--arms", _OFFLOAD_ARMS
    ),
    _kv_offload(
        "kv_offload_hot_tenant",
        "--link",
        "0.05",
        "--host-hit-cost",
        "0.5",
        "--tenant-skew",
        "1.5",
        "--rates",
        "6,10",
        "--arms",
        "offload, medium-blind;offload, tiered",
    ),
    _kv_offload("kv_offload_simulator", "--arms", "no offload;offload, tiered", "--simulate"),
    _kv_offload(
        "kv_offload_simulator_2engines",
        "--replicas",
        "2",
        "--arms",
        "no offload;offload, tiered",
        "--simulate",
    ),
    Entry("operator_scale", "operator_scale.py", ("--save",), ("--services", "200", "--save")),
    Entry("router_affinity", "router_affinity.py", (), None),
    Entry("router_affinity_run2", "router_affinity.py", (), None, writes="router_affinity"),
    Entry("router_auth_overhead", "router_auth_overhead.py", ("--rounds", "5"), ("--rounds", "1")),
    Entry("router_complexity", "router_complexity.py", (), None),
    Entry(
        "router_cpu",
        "router_cpu.py",
        _CPU := ("--rounds", "2", "--duration", "15", "--arms", *_ROUTER_CPU_ARMS, "--save"),
        shorter(_CPU, rounds="1", duration="5"),
    ),
    Entry(
        "router_cpu_gie",
        "router_cpu.py",
        _GIE := (
            "--rounds",
            "2",
            "--duration",
            "15",
            "--arms",
            *_GIE_ARMS,
            "--save",
            "--name",
            "router_cpu_gie",
        ),
        shorter(_GIE, rounds="1", duration="5"),
    ),
    _kv_events(
        "router_kv_events_cluster",
        "cluster-6,cluster-12",
        "events x1,events x2,events+peers x2,vllm-router-kv x1,prodstack-prefix x1",
    ),
    _kv_events(
        "router_kv_events_cluster_share",
        "cluster-6,cluster-12",
        "events x1,events x2,events+peers x2,prodstack-prefix x1",
    ),
    _kv_events("router_kv_events_processes", "high,shared", _KV_ALL),
    _kv_events("router_kv_events_processes_rates", "low,shared-high", _KV_ALL),
    _kv_events("router_kv_events_rounds", "low,high,shared,evicting", _KV_ROUNDS_ARMS),
    _kv_events("router_kv_events_shared_long", "shared-long-4,shared-long-8", _KV_ALL),
    _kv_events("router_kv_events_shared_turns", "shared", "events x1,vllm-router-kv x1"),
    Entry(
        "router_features",
        "router_features.py",
        ("--save",),
        ("--requests", "60", "--repeats", "3", "--save"),
    ),
    Entry("router_loop_stall", "router_loop_stall.py", (), ("--rounds", "1")),
    Entry(
        "router_noisy_neighbour",
        "router_noisy_neighbour.py",
        _NOISY := ("--headroom", "0", "2", "4", "--save"),
        shorter(_NOISY, duration="20"),
    ),
    Entry("router_overhead", "router_overhead.py", (), ("--quick",)),
    Entry("router_pd_local", "router_pd_local.py", (), ("--quick",)),
    Entry(
        "router_pd_local_seed5", "router_pd_local.py", ("--seed", "5"), ("--seed", "5", "--quick")
    ),
    Entry(
        "router_prefix_workloads",
        "router_prefix_workloads.py",
        ("--seed", "5"),
        ("--seed", "5", "--quick"),
    ),
    Entry(
        "router_prefix_workloads_seed11",
        "router_prefix_workloads.py",
        ("--seed", "11"),
        ("--seed", "11", "--quick"),
        writes="router_prefix_workloads",
    ),
    Entry(
        "router_slow_bodies",
        "router_slow_bodies.py",
        ("--connections", "10000", "--old-rev", "6cfc3ec", "--rounds", "3", "--save"),
        ("--old-rev", "6cfc3ec", "--quick", "--save"),
    ),
    Entry(
        "router_stream_failover",
        "router_stream_failover.py",
        ("--save",),
        ("--duration", "12", "--fault-at", "4", "--save"),
    ),
    Entry("router_tokenize", "router_tokenize.py", (), ("--conversations", "60")),
    Entry(
        "router_tokenize_transformers",
        "router_tokenize.py",
        (),
        ("--conversations", "60"),
        writes="router_tokenize",
    ),
    Entry(
        "simulate_speed",
        "simulate_speed.py",
        _SPEED := (
            "--sizes",
            "10,100,1000",
            "--requests",
            "20000",
            "--candidates-only",
            "--profile",
            "--save",
        ),
        shorter(_SPEED, sizes="10,100", requests="2000"),
    ),
    Entry(
        "simulate_validation", "simulate_validation.py", ("--save",), ("--duration", "20", "--save")
    ),
    Entry(
        "simulate_whatifs",
        "simulate_whatifs.py",
        ("complexity", "prefix", "hot-tenants", "step", "candidates", "step-500", "--save"),
        # The four default what-ifs, shorter; the step comes at 60 s so a 5-minute run sees it.
        (
            "--duration",
            "5m",
            "--prefix-duration",
            "1m",
            "--step-duration",
            "5m",
            "--step-at",
            "60",
            "--save",
        ),
    ),
    Entry(
        "cluster_demo", "cluster_demo.py", ("--rounds", "3", "--save"), ("--rounds", "1", "--save")
    ),
    Entry("whole_loop", "whole_loop.py", ("--rounds", "3", "--save"), ("--rounds", "1", "--save")),
    # Results files no table reads (quoted in the prose).
    Entry(
        "whole_loop_busy",
        "whole_loop.py",
        ("--rounds", "1", "--hog", "2", "--name", "whole_loop_busy", "--save"),
        None,
    ),
    Entry("router_kv_events", "router_kv_events.py", (), ("--quick",)),
    Entry("router_kv_events_busy", "router_kv_events.py", ("--busy",), ("--busy", "--quick")),
    Entry(
        "router_kv_events_seed5", "router_kv_events.py", ("--seed", "5"), ("--seed", "5", "--quick")
    ),
    Entry(
        "router_lora",
        "router_lora.py",
        _LORA := ("--seeds", "0,1", "--save"),
        shorter(_LORA, seeds="0", duration="20"),
    ),
    Entry("router_client", "router_client.py", (), None),
    _compare(
        "compare_router_kv_events_share",
        "8a9afca01524f669c002cd2ff1c51914c57cbeaa",
        "scratch_shared",
        3,
        "bench/router_kv_events.py",
        "--scenarios",
        "shared,high",
        "--arms",
        "events x1,events+peers x2",
        "--name",
        "scratch_shared",
    ),
    Entry("router_cpu_breakdown", "router_cpu.py", ("--breakdown", "--save"), None),
    Entry(
        "router_cpu_epp",
        "router_cpu.py",
        _EPP := (
            "--rounds",
            "2",
            "--duration",
            "15",
            "--arms",
            "fleetpilot",
            "fleetpilot, EPP",
            "--save",
            "--name",
            "router_cpu_epp",
        ),
        shorter(_EPP, rounds="1", duration="5"),
    ),
    Entry("router_kv_index", "router_kv_index.py", ("--save",), ("--rounds", "1", "--save")),
    Entry("router_tenant_limits", "router_tenant_limits.py", ("--save",), None),
    Entry(
        "router_lora_saturated",
        "router_lora.py",
        _SAT := ("--rate", "12", "--seeds", "0", "--save", "--name", "router_lora_saturated"),
        shorter(_SAT, duration="20"),
    ),
    Entry(
        "router_lora_skew05",
        "router_lora.py",
        _SKEW05 := (
            "--skew",
            "0.5",
            "--seeds",
            "2",
            "--arms",
            _LORA_ARMS,
            "--save",
            "--name",
            "router_lora_skew05",
        ),
        shorter(_SKEW05, duration="20"),
    ),
    Entry(
        "router_lora_skew15",
        "router_lora.py",
        _SKEW15 := (
            "--skew",
            "1.5",
            "--seeds",
            "3",
            "--arms",
            _LORA_ARMS,
            "--save",
            "--name",
            "router_lora_skew15",
        ),
        shorter(_SKEW15, duration="20"),
    ),
    _noisy("router_noisy_neighbour_routers", "--routers", "1", "2"),
    _noisy("router_noisy_neighbour_routers_seed_1", "--routers", "1", "2", "--seed", "1"),
    _noisy("router_noisy_neighbour_routers_repeat_1", "--routers", "1", "2"),
    _noisy("router_noisy_neighbour_routers_repeat_2", "--routers", "1", "2"),
    _noisy("router_noisy_neighbour_routers_rounds", "--routers", "1", "2", "--rounds", "4"),
    Entry(
        "router_noisy_neighbour_weight_b_3",
        "router_noisy_neighbour.py",
        _WEIGHT := (
            "--headroom",
            "2",
            "4",
            "--skip-fcfs",
            "--weight-b",
            "3",
            "--save",
            "--name",
            "router_noisy_neighbour_weight_b_3",
        ),
        shorter(_WEIGHT, duration="20"),
    ),
    Entry("file_guards", "file_guards.py", (), ("--quick",)),
    Entry("up_frozen_router", "up_frozen_router.py", ("--save",), ("--quick", "--save")),
    Entry("router_frozen_replica", "router_frozen_replica.py", ("--save",), ("--quick", "--save")),
    Entry(
        "engine_switch_interval",
        "engine_switch_interval.py",
        ("--save",),
        ("--rounds", "1", "--duration", "10", "--save"),
    ),
)


def command(entry: Entry, quick: bool) -> tuple[list[str], Path]:
    """The command line and the folder it runs in."""
    where = ROOT / entry.cwd
    script = (ROOT / "bench" / entry.script).relative_to(where)
    return [sys.executable, str(script), *entry.args(quick)], where


def run(entry: Entry, quick: bool) -> int:
    argv, where = command(entry, quick)
    print(f"$ (cd {where.relative_to(ROOT)} && {shlex.join(argv)})", flush=True)
    kept: bytes | None = None
    written = RESULTS / f"{entry.writes}.json" if entry.writes else None
    if written is not None and written.exists():
        kept = written.read_bytes()
    started = time.monotonic()
    code = subprocess.run(argv, cwd=where, check=False).returncode
    took = time.monotonic() - started
    print(f"run_all.py: {entry.results} exit {code} in {took:.0f} s", flush=True)
    if written is not None:
        if code == 0 and written.exists():
            written.replace(RESULTS / f"{entry.results}.json")
        if kept is not None:
            written.write_bytes(kept)
    if code == 0:
        stamp(entry, quick)
    return code


def stamp(entry: Entry, quick: bool) -> None:
    """Record in the entry's results file how it was run (``run_all``: the mode and the
    command), so a table read from a ``--quick`` run says so under it (``bench/tables.py``)."""
    path = RESULTS / f"{entry.results}.json"
    if not path.exists():
        return
    data = json.loads(path.read_text())
    data["run_all"] = {
        "mode": "quick" if quick and entry.quick is not None else "full",
        "command": shlex.join(["python", f"bench/{entry.script}", *entry.args(quick)]),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def select(only: list[str] | None) -> list[Entry]:
    if not only:
        return list(CATALOGUE)
    by_name = {e.results: e for e in CATALOGUE}
    names = [Path(n).name.removesuffix(".json") for n in only]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"run_all.py: no catalogue entry for {', '.join(unknown)} (see --list)")
    return [by_name[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter runs")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these results files only")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--keep-going", action="store_true", help="run the rest after a failure")
    args = parser.parse_args(argv)
    entries = select(args.only)
    if args.list:
        listing = "".join(
            f"{e.results:36} bench/{e.script} {shlex.join(e.args(args.quick))}\n" for e in entries
        )
        try:
            sys.stdout.write(listing)
            sys.stdout.flush()
        except BrokenPipeError:  # `--list | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    first_failure = 0
    for entry in entries:
        if args.dry_run:
            argv_, where = command(entry, args.quick)
            print(f"$ (cd {where.relative_to(ROOT)} && {shlex.join(argv_)})")
            continue
        code = run(entry, args.quick)
        if code != 0:
            print(f"run_all.py: {entry.results} failed with exit code {code}", file=sys.stderr)
            if not args.keep_going:
                return code
            first_failure = first_failure or code
    tables = [sys.executable, "bench/tables.py"]
    print(f"$ {shlex.join(tables)}", flush=True)
    if not args.dry_run:
        code = subprocess.run(tables, cwd=ROOT, check=False).returncode
        first_failure = first_failure or code
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
