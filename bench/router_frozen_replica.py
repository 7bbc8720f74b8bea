"""A frozen engine (SIGSTOP) under closed-loop load: what a tier keeps serving while it is frozen,
with the router's rules before issue 41 ("old": panic mode kept an all-ejected prefill role and
every all-ejected group; nothing before ejection) and now ("new": a prefill role with no sound
replica is skipped, and a replica silent with a request waiting is suspect: passed over, its
waiting requests moved), in one run on the same engines.

Every component is its own process: CPU reference engines (``fleetpilot engine --backend
reference``), the router (``fleetpilot router``, the old rules run from the commit before them,
extracted with ``git archive``), and the clients in this process. The router runs its defaults
(5 s first-byte budget, 1 s scrapes with an 800 ms timeout, 3 failures eject, 2 s probes).

(a) P/D: 1 prefill + 1 decode engine, ``--pd-clients`` closed-loop clients; the prefill engine
    is frozen for ``--freeze`` seconds. Tier throughput (req/s) before, during the freeze and
    after it, and the prefill hops by outcome. Goal: during >= 90% of before.
(b) unified: 2 engines, 1, 2 and 4 closed-loop clients on a shared system prompt (the prefix
    draws requests to the replica that caches it), that replica frozen for ``--freeze``
    seconds. Completions per second, and the seconds of the freeze with none (goal: none while
    the other replica is healthy).

Run: .venv/bin/python bench/router_frozen_replica.py [--quick] [--rounds N] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from router_support import ROOT, free_ports, machine, save, wait_healthy

MODEL = "frozen-model"
# A shared system prompt of ~420 characters (7 of the router's 64-character prefix blocks): the
# prefix-affinity scorer keeps every request on the replica that caches it while it has room,
# as a fleet serving one application's system prompt does.
SHARED_PROMPT = (
    "You are the support assistant of a small bicycle shop in a hilly town. Answer briefly "
    "and politely, in plain words, and never promise a repair date: the workshop decides. "
    "Opening hours are nine to six on weekdays and ten to four on Saturdays; the shop is "
    "closed on Sundays and public holidays. Rentals need an identity card and a deposit. "
    "Never give medical or legal advice, and hand any complaint to the manager by email. "
)
# The first commit with the new rules; the old arm runs its parent.
NEW_RULES_FILE = "fleetpilot/routing/policies/suspicion.py"


@dataclass
class Done:
    """One finished request."""

    ended: float
    status: int
    latency_s: float


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def old_rules_ref() -> str:
    first = git("log", "--reverse", "--format=%H", "--", NEW_RULES_FILE).splitlines()[0]
    return first + "^"


def extract(ref: str, into: Path) -> Path:
    """The ``fleetpilot`` package as of ``ref``, unpacked under ``into`` (for PYTHONPATH)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "old.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", ref, "fleetpilot"], cwd=ROOT, check=True, stdout=out)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def engine_argv(port: int, kv_role: str | None) -> list[str]:
    argv = [sys.executable, "-m", "fleetpilot", "engine", "--backend", "reference",
            "--host", "127.0.0.1", "--port", str(port), "--model-config", "tiny",
            "--served-model-name", MODEL, "--max-model-len", "512", "--num-threads", "1",
            "--log-level", "warning"]  # fmt: skip
    if kv_role is not None:
        kv = f'{{"kv_connector":"NixlConnector","kv_role":"{kv_role}","kv_ip":"127.0.0.1"}}'
        argv += ["--kv-transfer-config", kv]
    return argv


@contextlib.contextmanager
def processes(
    argvs: Sequence[list[str]], env: dict[str, str], cwd: Path = ROOT
) -> Iterator[list[int]]:
    """Each argv its own process (its own process group, to freeze whole); their pids."""
    procs = [
        subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for argv in argvs
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def router_config(groups: dict[str, list[str]]) -> dict[str, Any]:
    mode = "disaggregated" if "prefill" in groups else "unified"
    return {
        "apiVersion": "fleetpilot.dev/v1alpha1",
        "kind": "RouterConfig",
        "service": "bench",
        "namespace": "bench",
        "tiers": [
            {
                "name": "main",
                "model": MODEL,
                "upTo": 1.0,
                "mode": mode,
                "endpoints": [
                    {
                        "role": role,
                        "service": role,
                        "selector": {},
                        "port": 8000,
                        "maxNumSeqs": 16,
                        "addresses": addresses,
                    }
                    for role, addresses in groups.items()
                ],
            }
        ],
    }


@contextlib.contextmanager
def router(config: dict[str, Any], rules: str, old_tree: Path, folder: Path) -> Iterator[str]:
    path = folder / f"router-{rules}.yaml"
    path.write_text(yaml.safe_dump(config))
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "fleetpilot", "router", "--config", str(path),
            "--host", "127.0.0.1", "--port", str(port), "--discovery", "static",
            "--seed", "0", "--log-level", "error"]  # fmt: skip
    code = old_tree if rules == "old" else ROOT
    env = {**os.environ, "PYTHONPATH": str(code)}
    # Run from the code's own tree: ``python -m`` puts the working directory first on the path.
    with processes([argv], env, cwd=code):
        wait_healthy(port, 60)
        yield f"http://127.0.0.1:{port}"


async def closed_loop(url: str, clients: int, stop_at: float) -> list[Done]:
    """``clients`` clients, each sending its next request when its last one ends, until
    ``stop_at``; every finished request."""
    done: list[Done] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client(c: int) -> None:
            n = 0
            while time.monotonic() < stop_at:
                body = {
                    "model": MODEL,
                    "prompt": f"{SHARED_PROMPT}Customer {c}, question {n}: open?",
                    "max_tokens": 8,
                    "temperature": 0,
                }
                started = time.monotonic()
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                ended = time.monotonic()
                done.append(Done(ended, status, ended - started))
                n += 1

        await asyncio.gather(*(client(c) for c in range(clients)))
    return done


def metric_sums(url: str, name: str, label: str) -> dict[str, float]:
    import httpx

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def run_freeze(
    url: str,
    clients: int,
    victim: dict[str, int] | int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Closed-loop load through a warm-up and ``args.before`` seconds, then the victim frozen
    for ``args.freeze`` seconds, then ``args.after`` seconds more. ``victim``: the pid to
    freeze, or (unified) the pid of each replica address, the busiest before the freeze
    frozen."""
    start = time.monotonic()
    freeze_at = start + args.warmup + args.before
    thaw_at = freeze_at + args.freeze
    stop_at = thaw_at + args.after
    result: dict[str, Any] = {}

    async def main() -> list[Done]:
        load = asyncio.create_task(closed_loop(url, clients, stop_at))
        await asyncio.sleep(freeze_at - time.monotonic())
        if isinstance(victim, int):
            pid = victim
        else:
            served = {address: _served(url, address) for address in victim}
            busiest = max(served, key=lambda address: served[address])
            pid = victim[busiest]
            result["victim"] = busiest
            result["served_before"] = served
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(thaw_at - time.monotonic())
        finally:
            os.killpg(pid, signal.SIGCONT)
        return await load

    done = asyncio.run(main())
    ok = [d for d in done if d.status == 200]

    def rate(a: float, b: float) -> float:
        return sum(a <= d.ended < b for d in ok) / (b - a)

    seconds = int(args.before + args.freeze + args.after)
    timeline = [
        sum(freeze_at - args.before + s <= d.ended < freeze_at - args.before + s + 1 for d in ok)
        for s in range(seconds)
    ]
    frozen = timeline[int(args.before) : int(args.before + args.freeze)]
    during = [d.latency_s for d in ok if freeze_at <= d.ended < thaw_at]
    result.update(
        {
            "clients": clients,
            "req_per_s": {
                "before": rate(freeze_at - args.before, freeze_at),
                "during": rate(freeze_at, thaw_at),
                "after": rate(thaw_at, stop_at),
            },
            "errors": sum(d.status != 200 for d in done if d.ended >= freeze_at - args.before),
            "zero_seconds_during": sum(n == 0 for n in frozen),
            "latency_p99_during_s": _p99(during),
            # Requests that waited a second or more: those a frozen engine held (the machine's
            # noise moves req/s, rarely a request by a whole second).
            "held_1s_or_more": sum(
                d.latency_s >= 1.0 for d in done if freeze_at <= d.ended < thaw_at + 5.0
            ),
            "completions_per_s": timeline,
        }
    )
    result["during_over_before"] = (
        result["req_per_s"]["during"] / result["req_per_s"]["before"]
        if result["req_per_s"]["before"]
        else float("nan")
    )
    return result


def _served(url: str, address: str) -> float:
    """Requests the router counted for ``address`` so far: the shared prompt draws them to the
    replica that caches it, the one whose freeze costs most."""
    return metric_sums(url, "fleetpilot_router_requests_total", "replica").get(address, 0.0)


def _p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def pd_part(args: argparse.Namespace, old_tree: Path, folder: Path, rounds: int) -> list[Any]:
    prefill_port, decode_port = free_ports(2)
    argvs = [engine_argv(prefill_port, "kv_producer"), engine_argv(decode_port, "kv_consumer")]
    out = []
    with processes(argvs, {**os.environ, "PYTHONPATH": str(ROOT)}) as (prefill_pid, _):
        wait_healthy(prefill_port, 180)
        wait_healthy(decode_port, 180)
        groups = {
            "prefill": [f"127.0.0.1:{prefill_port}"],
            "decode": [f"127.0.0.1:{decode_port}"],
        }
        for r in range(rounds):
            for rules in args.rules if r % 2 == 0 else args.rules[::-1]:
                with router(router_config(groups), rules, old_tree, folder) as url:
                    row = run_freeze(url, args.pd_clients, prefill_pid, args)
                    row["prefill_hops"] = metric_sums(
                        url, "fleetpilot_router_pd_fallbacks_total", "cause"
                    )
                row.update(rules=rules, round=r)
                out.append(row)
                print(
                    f"P/D round {r} {rules}: {row['req_per_s']} "
                    f"({row['during_over_before']:.0%} of before), hops {row['prefill_hops']}, "
                    f"timeline {row['completions_per_s']}",
                    flush=True,
                )
    return out


def unified_part(args: argparse.Namespace, old_tree: Path, folder: Path, rounds: int) -> list[Any]:
    ports = free_ports(2)
    out = []
    with processes(
        [engine_argv(p, None) for p in ports], {**os.environ, "PYTHONPATH": str(ROOT)}
    ) as pids:
        for p in ports:
            wait_healthy(p, 180)
        addresses = [f"127.0.0.1:{p}" for p in ports]
        victims = dict(zip(addresses, pids, strict=True))
        for r in range(rounds):
            for clients in args.clients:
                for rules in args.rules if (r + clients) % 2 == 0 else args.rules[::-1]:
                    with router(
                        router_config({"unified": addresses}), rules, old_tree, folder
                    ) as url:
                        row = run_freeze(url, clients, victims, args)
                        row["first_byte_timeouts"] = sum(
                            v
                            for k, v in metric_sums(
                                url, "fleetpilot_router_upstream_errors_total", "cause"
                            ).items()
                            if k == "first-byte-timeout"
                        )
                    row.update(rules=rules, round=r)
                    out.append(row)
                    print(
                        f"unified round {r} {clients} clients {rules}: victim {row.get('victim')} "
                        f"first-byte timeouts {row['first_byte_timeouts']:g}, zero seconds "
                        f"{row['zero_seconds_during']}, {row['req_per_s']}, "
                        f"timeline {row['completions_per_s']}",
                        flush=True,
                    )
    return out


def spread(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one round, 8 s freeze")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--before", type=float, default=5.0)
    parser.add_argument("--freeze", type=float, default=15.0)
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--pd-clients", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--parts", default="pd,unified")
    parser.add_argument("--rules", nargs="+", default=["old", "new"], choices=["old", "new"])
    parser.add_argument("--old-ref", default=None, help="the old rules' commit")
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.freeze, args.before, args.after = 1, 8.0, 4.0, 3.0
    old_ref = args.old_ref or old_rules_ref()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        old_tree = extract(old_ref, folder / "old")
        if "pd" in args.parts:
            results["pd"] = pd_part(args, old_tree, folder, args.rounds)
        if "unified" in args.parts:
            results["unified"] = unified_part(args, old_tree, folder, args.rounds)
    summary: dict[str, Any] = {}
    print(f"\nfrozen for {args.freeze:g} s; router defaults; old rules = {old_ref}")
    if "pd" in results:
        print(f"(a) P/D 1 prefill + 1 decode, {args.pd_clients} clients: req/s")
        print(
            f"{'rules':5} {'before':>8} {'during':>8} {'after':>8} {'during/before':>14} "
            f"{'held >=1s':>10}"
        )
        for rules in args.rules:
            rows = [r for r in results["pd"] if r["rules"] == rules]
            for key in ("before", "during", "after"):
                for r in rows:
                    r[key] = r["req_per_s"][key]
            summary[f"pd_{rules}"] = {
                k: spread(rows, k)
                for k in ("before", "during", "after", "during_over_before", "held_1s_or_more")
            }
            s = summary[f"pd_{rules}"]
            print(
                f"{rules:5} {s['before']['mean']:8.1f} {s['during']['mean']:8.1f} "
                f"{s['after']['mean']:8.1f} {s['during_over_before']['mean']:>9.0%} "
                f"({s['during_over_before']['min']:.0%}-{s['during_over_before']['max']:.0%}) "
                f"{s['held_1s_or_more']['mean']:10.1f}"
            )
    if "unified" in results:
        print("(b) unified, 2 replicas, the busier frozen: seconds of the freeze with none done")
        print(
            f"{'clients':>7} {'rules':5} {'zero s':>7} {'req/s before':>13} {'during':>8} "
            f"{'held >=1s':>10}"
        )
        for clients in args.clients:
            for rules in args.rules:
                rows = [
                    r for r in results["unified"] if r["rules"] == rules and r["clients"] == clients
                ]
                for r in rows:
                    r["before"], r["during"] = r["req_per_s"]["before"], r["req_per_s"]["during"]
                s = {
                    k: spread(rows, k)
                    for k in ("zero_seconds_during", "before", "during", "held_1s_or_more")
                }
                summary[f"unified_{clients}_{rules}"] = s
                print(
                    f"{clients:>7} {rules:5} {s['zero_seconds_during']['mean']:7.1f} "
                    f"{s['before']['mean']:13.1f} {s['during']['mean']:8.1f} "
                    f"{s['held_1s_or_more']['mean']:10.1f}  "
                    f"(zero s per round: {[r['zero_seconds_during'] for r in rows]})"
                )
    if args.save:
        path = save(
            "router_frozen_replica",
            {
                "benchmark": "router_frozen_replica",
                "commit": git("rev-parse", "HEAD"),
                "old_rules_commit": git("rev-parse", old_ref),
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": machine(),
                "args": vars(args),
                "summary": summary,
                "results": results,
            },
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
