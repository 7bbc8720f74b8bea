"""The benchmark tables in docs/, rendered from their results files.

A table in a page sits between two markers naming its renderer and results file::

    <!-- table: kv_offload bench/results/kv_offload.json -->
    ...rendered Markdown...
    <!-- /table -->

A renderer in ``MULTI_RENDERERS`` reads several files, named comma-separated in the marker
(``<!-- table: engine bench/results/a.json,bench/results/b.json -->``), and captions each. A
marker indented inside a list item gets its table indented the same. A table whose numbers no
results file holds is not marked; the line above it says so ("Not generated: ...").

``python bench/tables.py`` rewrites every marked table from its file; ``--check`` exits 1
naming each one that disagrees (tests/bench/test_tables.py runs it), so a number in the docs
is always the one its results file holds, with the commit it was measured on. A rerun of a
benchmark is followed by ``python bench/tables.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# A marker may be indented (a table inside a list item): the table is indented as its marker.
BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?P<open><!-- table: (?P<renderer>[\w-]+) (?P<source>\S+) -->\n)"
    r"(?P<body>.*?)(?P<close>(?P=indent)<!-- /table -->)",
    re.DOTALL | re.MULTILINE,
)

Results = dict[str, Any]
Renderer = Callable[[Results], list[str]]
MultiRenderer = Callable[[list[Results]], list[str]]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _share(value: float, present: bool = True) -> str:
    return f"{value:.3f}" if present else "-"


def caption(doc: Results, source: str) -> str:
    """Where the numbers come from: the file, the commit (a ``-dirty`` one said so), the date
    and machine when the file records them."""
    if "commit" in doc:
        commit = str(doc["commit"])
        dirty = " with uncommitted changes" if commit.endswith("-dirty") else ""
        measured = f"commit {commit[:7]}{dirty}"
    elif "base" in doc and "head" in doc:  # bench/compare_trees.py: two commits, one run
        measured = f"commits {str(doc['base'])[:7]} (before) and {str(doc['head'])[:7]} (after)"
    else:
        measured = "commit not recorded"
    parts = [f"`{source}`", measured]
    if "date" in doc:
        parts.append(str(doc["date"]))
    machine = doc.get("machine") or {}
    if machine.get("cpu"):
        parts.append(f"{machine['cpu']} x {machine.get('cpus', '?')}")
    elif machine.get("cpus"):
        parts.append(f"{machine['cpus']} CPUs")
    if (doc.get("run_all") or {}).get("mode") == "quick":
        parts.append("a quick run (`make bench-quick`: fewer rounds, shorter runs)")
    return "Source: " + ", ".join(parts) + "."


def kv_offload(doc: Results) -> list[str]:
    """bench/kv_offload.py's arms: hit shares by tier, TTFT p50 and p95 (range over rounds)."""
    lines = [
        "| req/s | arm | device | host | computed | TTFT p50 | TTFT p95 (range) | req/s done |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(doc["by_arm"], key=lambda r: r["rate"]):
        arm = row["arm"].replace("prodstack-prefix", "production-stack prefixaware")
        offload = row["arm"] != "no offload"
        low, high = row["ttft_p95_range_ms"] or (None, None)
        p95 = f"{_ms(row['ttft_p95_ms'])} ({low:.0f}-{high:.0f})" if low is not None else "-"
        if row["arm"] == "offload, tiered":
            arm, p95 = f"**{arm}**", f"**{p95}**"
        lines.append(
            f"| {row['rate']:g} | {arm} | {_share(row['device_hit_rate'])} | "
            f"{_share(row['host_hit_rate'], offload)} | {_share(row['computed_rate'])} | "
            f"{_ms(row['ttft_p50_ms'])} | {p95} | {row['throughput_rps']:.2f} |"
        )
    return lines


def kv_offload_simulator(doc: Results) -> list[str]:
    """The simulator's replay of each round: the offload gain (no offload over tiered) at p50
    and p95, measured and predicted."""
    lines = [
        "| req/s | seed | TTFT p95 measured (no offload / tiered) | simulated | gain p50 "
        "measured / simulated | gain p95 measured / simulated | p95 gain error |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in doc["simulator"]:
        measured = " / ".join(f"{v:.0f}" for v in p["measured_p95_ms"])
        simulated = " / ".join(f"{v:.0f}" for v in p["simulated_p95_ms"])
        lines.append(
            f"| {p['rate']:g} | {p['seed']} | {measured} ms | {simulated} ms | "
            f"{p['measured_p50_gain']:.2f}x / {p['simulated_p50_gain']:.2f}x | "
            f"{p['measured_gain']:.2f}x / {p['simulated_gain']:.2f}x | {p['gain_error']:+.0%} |"
        )
    return lines


def _pct(value: float) -> str:
    return f"{value:.0%}"


def _signed(value: float) -> str:
    return f"{value:+.0%}"


def _duration_ms(ms: float) -> str:
    """``946 ms``, ``5,633 ms``: whole milliseconds with thousands separated."""
    return f"{ms:,.0f} ms"


def _times(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.2f}x"


def _us(us: float) -> str:
    return f"{us:.0f} us" if us < 1000 else f"{us / 1000:.1f} ms"


GATEWAY_SCENARIOS = {
    "zipf-2": "Zipf, 2/s",
    "zipf-8": "Zipf, 8/s",
    "shared-4": "shared, 4/s",
    "shared-8": "shared, 8/s",
}


def _gateway_arms(doc: Results) -> tuple[list[str], list[str], dict[tuple[str, str], Results]]:
    scenarios = [s["key"] for s in doc["results"]]
    cells = {(s["key"], a["arm"]): a for s in doc["results"] for a in s["by_arm"]}
    arms = list(dict.fromkeys(a["arm"] for s in doc["results"] for a in s["by_arm"]))
    return scenarios, arms, cells


def gateway_pickers(doc: Results) -> list[str]:
    """bench/gateway_pickers.py: engine prefix-hit rate / TTFT p95 in ms per arm and workload
    (median over rounds, the rounds' range), and the errors over all of them."""
    scenarios, arms, cells = _gateway_arms(doc)
    heads = [GATEWAY_SCENARIOS.get(k, k) for k in scenarios]
    lines = ["| arm | " + " | ".join(heads) + " | errors |", "|---" * (len(heads) + 2) + "|"]
    for arm in arms:
        row, errors = [], 0
        for key in scenarios:
            cell = cells.get((key, arm))
            if cell is None:
                row.append("-")
                continue
            low, high = cell["ttft_p95_range_ms"]
            errors += cell["errors"]
            row.append(f"{cell['hit_rate']:.3f} / {cell['ttft_p95_ms']:.0f} ({low:.0f}-{high:.0f})")
        lines.append(f"| {arm} | " + " | ".join(row) + f" | {errors} |")
    return lines


def gateway_pickers_cpu(doc: Results) -> list[str]:
    """bench/gateway_pickers.py: the pickers' CPU ms a request answered (median over rounds)
    and peak resident memory (the largest over the workloads; a replica's where there are
    several)."""
    scenarios, arms, cells = _gateway_arms(doc)
    heads = [GATEWAY_SCENARIOS.get(k, k) for k in scenarios]
    lines = ["| arm | " + " | ".join(heads) + " | peak RSS |", "|---" * (len(heads) + 2) + "|"]
    for arm in arms:
        found = [cells.get((key, arm)) for key in scenarios]
        cpu = [c["picker_cpu_ms_per_request"] if c else None for c in found]
        if all(v is None for v in cpu):
            continue
        rss = [c["picker_peak_rss_mib"] for c in found if c and c["picker_peak_rss_mib"]]
        each = " a replica" if re.search(r"x[2-9]\d*$", arm) else ""
        peak = f"{max(rss):.0f} MiB{each}" if rss else "-"
        row = ["-" if v is None else f"{v:.1f}" for v in cpu]
        lines.append(f"| {arm} | " + " | ".join(row) + f" | {peak} |")
    return lines


def router_cpu(doc: Results) -> list[str]:
    """bench/router_cpu.py: CPU ms a request for each arm, plain and streamed (median over
    rounds, the rounds' range), and what the open loop saw: the latency p50 (median over
    rounds) and the arrivals dropped (the rounds' range)."""
    modes = list(doc["medians"])
    names = {"plain": "plain", "stream": "streamed"}
    heads = [f"CPU a request, {names.get(m, m)}" for m in modes]
    heads += [f"p50 latency, {names.get(m, m)}" for m in modes]
    heads += [f"dropped, {names.get(m, m)}" for m in modes]
    lines = ["| arm | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for arm in doc["medians"][modes[0]]:
        cpu, p50, dropped = [], [], []
        for mode in modes:
            m = doc["medians"][mode][arm]
            cpu.append(f"{m['median']:.2f} ms ({m['min']:.2f}-{m['max']:.2f})")
            runs = [r for r in doc["rows"] if r["arm"] == arm and r["mode"] == mode]
            p50.append(f"{statistics.median(r['p50_ms'] for r in runs):,.1f} ms")
            shares = [r["dropped"] / (r["answered"] + r["dropped"]) for r in runs]
            dropped.append(_span([round(100 * x) for x in shares], "%"))
        lines.append(f"| {arm} | " + " | ".join(cpu + p50 + dropped) + " |")
    return lines


AUTH_ARMS = {
    "open": "no auth",
    "keys": "API keys",
    "keys+limits": "API keys and request/token limits",
}


def router_auth_overhead(doc: Results) -> list[str]:
    """bench/router_auth_overhead.py: the router without auth (medians over rounds), and what
    keys and limits add to it."""
    metrics = ["plain_p50", "plain_p99", "first_chunk_p50"]
    lines = [
        "| arm | p50 | p99 | first streamed chunk, p50 | errors |",
        "|---|---|---|---|---|",
    ]
    for arm, median in doc["median"].items():
        if arm in doc["added_ms"]:
            cells = [f"+{doc['added_ms'][arm][m]:.3f} ms" for m in metrics]
        else:
            cells = [f"{median[m]:.3f} ms" for m in metrics]
        name = AUTH_ARMS.get(arm, arm)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {doc['errors'][arm]} |")
    return lines


def router_noisy_neighbour(doc: Results) -> list[str]:
    """bench/router_noisy_neighbour.py: the light tenant B beside the flood of tenant A, per
    arm (B's requests answered, TTFT, how long B queued in the router, A's requests answered)."""
    alone = next(r for r in doc["results"] if "a" not in r["tenants"])
    alone_p95 = alone["tenants"]["b"]["ttft_p95_s"]
    lines = [
        "| arm | B ok | B TTFT p50 | B TTFT p95 | B p95 vs alone | B waited > 0.25 s in the "
        "router | A ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        b, a = r["tenants"]["b"], r["tenants"].get("a")
        wait = r["queue_waits"].get("b")
        waited = f"{wait['queued'] - wait['le_0.25']:.0f} of {b['requests']}" if wait else "-"
        lines.append(
            f"| {r['arm']} | {_pct(b['success_rate'])} | {_duration_ms(b['ttft_p50_s'] * 1000)} "
            f"| {_duration_ms(b['ttft_p95_s'] * 1000)} | {_times(b['ttft_p95_s'] / alone_p95)} "
            f"| {waited} | {_pct(a['success_rate']) if a else '-'} |"
        )
    return lines


FAULTS = {"kill": "SIGKILL", "freeze": "SIGSTOP"}


def router_stream_failover(doc: Results) -> list[str]:
    """bench/router_stream_failover.py: streams hit by the fault and how many ended whole."""
    lines = [
        "| fault | streamResumes | streams | hit | hit streams whole | continued |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        whole = _pct(r["hit_whole"] / r["hit"]) if r["hit"] else "-"
        errors = ", ".join(f"{n:.0f} {kind}s" for kind, n in r["hit_errors"].items())
        if errors:
            whole += f" ({errors})"
        resumed = r["resumes_by_outcome"].get("resumed")
        lines.append(
            f"| {FAULTS.get(r['fault'], r['fault'])} | {r['stream_resumes']} | {r['streams']} "
            f"| {r['hit']} | {whole} | {'-' if resumed is None else f'{resumed:.0f}'} |"
        )
    return lines


def router_slow_bodies(doc: Results) -> list[str]:
    """bench/router_slow_bodies.py: legitimate clients' latency before and under the flood of
    slow bodies, per round and router, and the engine reached directly under the flood."""
    lines = [
        "| router | legitimate p50 unloaded -> flooded | p99 unloaded -> flooded | errors under "
        "the flood | engine directly under the flood (control), p99 |",
        "|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        name = re.sub(r"^ours #(\d+)$", r"this router, round \1", r["router"])
        name = re.sub(r"^old (\w+)$", r"the earlier router (\1)", name)
        u, f = r["unloaded"], r["flooded"]
        lines.append(
            f"| {name} | {u['p50_ms']} -> {f['p50_ms']} ms | {u['p99_ms']} -> {f['p99_ms']} ms "
            f"({r['p99_ratio']:.2f}x) | {f['errors']} of {f['requests']:,} "
            f"| {r['flooded_engine_direct']['p99_ms']} ms |"
        )
    return lines


def simulate_validation(doc: Results) -> list[str]:
    """bench/simulate_validation.py: the local fleet against the simulation of it, per workload
    and rate (the simulation's error in brackets)."""
    lines = [
        "| workload | req/s | TTFT p50 local / simulated | TTFT p95 local / simulated | hit rate "
        "local / simulated | mean TTFT, client: local / simulated | mean TTFT, engines' own: "
        "local / simulated | TTFT p50 / p95 of the engine alone |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pair(local: float, simulated: float, error: float) -> str:
        return f"{local * 1000:.1f} / {simulated * 1000:.1f} ms ({_signed(error)})"

    for r in doc["rows"]:
        loc, sim, eng = r["local"], r["simulated"], r["simulated_engines"]
        alone = r.get("engine_direct")
        direct = (
            f"{alone['ttft_p50_s'] * 1000:.1f} / {alone['ttft_p95_s'] * 1000:.1f} ms"
            if alone
            else "-"
        )
        lines.append(
            f"| {r['workload']} | {r['rate']:g} "
            f"| {pair(loc['ttft_p50_s'], sim['ttft_p50_s'], r['ttft_p50_s_error'])} "
            f"| {pair(loc['ttft_p95_s'], sim['ttft_p95_s'], r['ttft_p95_s_error'])} "
            f"| {loc['hit_rate']:.3f} / {sim['hit_rate']:.3f} "
            f"| {pair(loc['ttft_mean_s'], sim['ttft_mean_s'], r['ttft_mean_error'])} "
            f"| {pair(loc['engine_ttft_mean_s'], eng['ttft_mean_s'], r['engine_ttft_mean_error'])} "
            f"| {direct} |"
        )
    return lines


def simulate_speed(doc: Results) -> list[str]:
    """bench/simulate_speed.py: the simulator's speed by fleet size and the router's pick."""
    per_replica = doc["args"]["per_replica"]
    lines = [
        "| replicas | req/s | router's pick | requests simulated per CPU second | CPU per request "
        "| simulated seconds per CPU second | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        pick = "every replica" if r["pick"] == "all" else r["pick"]
        sim = r["simulated_s_per_cpu_s"]
        lines.append(
            f"| {r['replicas']:,} | {r['replicas'] * per_replica:,.0f} | {pick} "
            f"| {r['requests_per_cpu_s']:,.0f} | {_us(r['us_per_request'])} "
            f"| {sim:.3g} | {r['hit_rate']:.3f} |"
        )
    return lines


def autoscale_ramp(doc: Results) -> list[str]:
    """bench/autoscale_ramp.py: per arm and seed, each ramp's share of 5 s buckets within the
    objective and its TTFT p95, then the whole run."""
    ramps = max(len(r["ramps"]) for r in doc["results"])
    heads = "".join(f" ramp {i} within SLO | ramp {i} p95 |" for i in range(1, ramps + 1))
    lines = [
        f"| arm | seed |{heads} requests within SLO | steady replicas (end) | replica-seconds "
        "| errors |",
        "|---" * (2 * ramps + 6) + "|",
    ]
    for r in doc["results"]:
        cells = "".join(
            f" {_pct(ramp['buckets_within_slo'])} | {_duration_ms(ramp['ttft_p95_ms'])} |"
            for ramp in r["ramps"]
        )
        lines.append(
            f"| {r['arm']} | {r['seed']} |{cells} {_pct(r['requests_within_slo'])} "
            f"| {r['steady_replicas_mean']:.1f} ({r['final_replicas']}) "
            f"| {r['replica_seconds']:,.0f} | {r['errors']} |"
        )
    return lines


def operator_scale(doc: Results) -> list[str]:
    """bench/operator_scale.py: the operator's settle time, memory, API requests and CPU per
    fleet size, the direct-writes floor in brackets, and a restart of the settled operator."""
    floors = {r["services"]: r for r in doc["runs"] if r["arm"] == "direct"}
    lines = [
        "| services | measured on | settled: every service has its Deployments and a status "
        "of its generation (floor) | operator memory when settled | API requests meanwhile, all "
        "clients (floor) | operator / API server CPU s meanwhile (floor: the bench's / API "
        "server's) | restart of a settled operator: every service reconciled again in | writes "
        "it made | its memory then (peak) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        if r["arm"] != "operator":
            continue
        floor = floors.get(r["services"])
        cpu = r["settle_cpu_s"]
        settled = f"{r['settle_s']} s"
        requests = f"{r['settle_api_requests_total']:,}"
        cpus = f"{cpu['operator']} / {cpu['kube-apiserver']}"
        if floor:
            fcpu = floor["settle_cpu_s"]
            settled += f" ({floor['settle_s']} s)"
            requests += f" ({floor['settle_api_requests_total']:,})"
            cpus += f" ({fcpu.get('bench (direct writes)', '-')} / {fcpu['kube-apiserver']})"
        writes = sum(r.get("resync_writes_operator_kinds", {}).values())
        lines.append(
            f"| {r['services']:,} | {str(r['commit'])[:7] if 'commit' in r else 'not recorded'} "
            f"| {settled} "
            f"| {r['operator_rss_mb']} MB | {requests} | {cpus} | {r['resync_s']} s | {writes} "
            f"| {r['resync_peak_rss_mb']} MB |"
        )
    return lines


def _engine_row(doc: Results) -> list[str]:
    """One engine benchmark as benchmark | baseline | fleetpilot | result."""
    name = doc["benchmark"]
    runs = doc["runs"]
    if name == "engine_paged_vs_contiguous":
        c, p = runs
        mean_ratio = p["mean_running"] / c["mean_running"]
        peak_ratio = p["peak_running"] / c["peak_running"]
        return [
            f"`{name}.py`: {doc['budget_tokens']:,}-token KV budget, {doc['num_requests']} "
            "mixed-length requests",
            f"contiguous max_model_len per request: {c['peak_running']} concurrent, "
            f"{_pct(c['mean_kv_slot_fill'])} KV filled",
            f"paged blocks: {p['peak_running']} concurrent, {_pct(p['mean_kv_slot_fill'])} KV "
            f"filled, {p['preemptions']} preemptions",
            f"{mean_ratio:.1f}x the mean concurrency, {peak_ratio:.1f}x the peak; "
            f"{doc['throughput_ratio']:.2f}x the output tokens/s",
        ]
    if name == "engine_prefix_cache":
        off, on = runs
        return [
            f"`{name}.py`: {doc['shared_tokens']:,} shared + {doc['unique_tokens']} unique "
            "prompt tokens",
            f"caching off: TTFT p50 {off['ttft_p50_s'] * 1000:.0f} ms",
            f"caching on: TTFT p50 {on['ttft_p50_s'] * 1000:.0f} ms, hit rate "
            f"{_pct(on['hit_rate'])}",
            f"{doc['ttft_speedup']:.1f}x lower mean TTFT",
        ]
    if name == "engine_decode_batch":
        first, last = runs[0], runs[-1]
        return [
            f"`{name}.py`: decode tokens/s vs batch",
            f"batch {first['batch']}: {first['tokens_per_s']:,.0f} tok/s",
            f"batch {last['batch']}: {last['tokens_per_s']:,.0f} tok/s",
            f"{last['tokens_per_s'] / first['tokens_per_s']:.1f}x",
        ]
    if name == "engine_speculative":
        base, spec = runs[0], runs[1:]
        first, last = spec[0], spec[-1]
        same = all(r["identical_to_k0"] for r in spec)
        speedups = [r["speedup_vs_k0"] for r in spec]
        return [
            f"`{name}.py`: greedy, draft = first {doc['draft_layers']} of "
            f"{doc['target_layers']} layers",
            f"k={base['k']}: {base['tokens_per_target_pass']:g} token per target pass, "
            f"{base['tokens_per_s']:.0f} tok/s",
            f"k={first['k']}..{last['k']}: acceptance {_pct(first['acceptance_rate'])}.."
            f"{_pct(last['acceptance_rate'])}, {first['tokens_per_target_pass']:.2f}.."
            f"{last['tokens_per_target_pass']:.2f} tokens per target pass, "
            f"{min(speedups):.2f}-{max(speedups):.2f}x the tokens/s",
            "outputs identical to k=0 for every k" if same else "outputs differ from k=0",
        ]
    raise KeyError(f"no engine row for {name!r}")


def engine(docs: list[Results]) -> list[str]:
    """The reference engine's benchmarks (bench/engine_*.py), a row for each results file."""
    lines = ["| benchmark | baseline | fleetpilot | result |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(_engine_row(doc)) + " |" for doc in docs]
    return lines


def _router_overhead_rows(rows: list[Results]) -> list[str]:
    lines = [
        "| mode | connections | added p50 | added p99 | added to the first chunk, p50 "
        "| router req/s | router errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        chunk = "-"
        if r["stream"]:
            added = r["router"]["first_chunk_p50_ms"] - r["direct"]["first_chunk_p50_ms"]
            chunk = f"+{added:.3f} ms"
        lines.append(
            f"| {'streamed' if r['stream'] else 'plain'} | {r['concurrency']:,} "
            f"| +{r['added_p50_ms']:.3f} ms | +{r['added_p99_ms']:.3f} ms | {chunk} "
            f"| {r['router']['req_per_s']:,.0f} | {r['router']['errors']} |"
        )
    return lines


def router_overhead(doc: Results) -> list[str]:
    """bench/router_overhead.py: what the router adds to an echo backend reached directly, per
    mode and connections; the quiet rerun of the same file when it holds one; the soak."""
    lines = []
    quiet = doc.get("quiet_rerun_quick")
    if quiet:
        lines += [f"Quiet rerun ({quiet.get('note', 'concurrency 1 and 32')}):", ""]
        lines += [*_router_overhead_rows(quiet["rows"]), "", "The first run, every level:", ""]
    lines += _router_overhead_rows(doc["rows"])
    soak = doc.get("soak")
    if soak:
        lines += [
            "",
            "| soak | connections | first minute | last minute | errors |",
            "|---|---|---|---|---|",
            f"| {soak['duration_s'] / 60:g} minutes | {soak['concurrency']} "
            f"| {soak['first_window_req_per_s']:,.0f} req/s "
            f"| {soak['last_window_req_per_s']:,.0f} req/s | {soak['errors']} |",
        ]
    return lines


def _spread(number: Results, digits: int) -> str:
    rounds = number["rounds"]
    return f"{number['median']:.{digits}f} [{min(rounds):.{digits}f}-{max(rounds):.{digits}f}]"


def compare_trees(doc: Results) -> list[str]:
    """bench/compare_trees.py: one benchmark on an earlier commit (before) and a later one
    (after), rounds alternating; the median of the rounds and their range in brackets."""
    base, head = str(doc["base"])[:7], str(doc["head"])[:7]
    numbers = doc["numbers"]
    script = Path(doc["command"][0]).stem
    if script == "router_overhead":
        levels = [1, 32] if "--quick" in doc["command"] else [1, 32, 256, 1024]
        lines = [
            f"| mode | connections | added p50 ms, {base} | {head} | added p99 ms, {base} "
            f"| {head} | router req/s, {base} | {head} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        count = len({k.split("]")[0] for k in numbers if k.startswith("rows[")})
        for i in range(count):
            row = f"rows[{i}]"
            mode = "plain" if i < count // 2 else "streamed"
            conn = int(numbers.get(f"{row}.concurrency", {}).get("head", {}).get("median", 0))
            conn = conn or levels[i % len(levels)]
            cells: list[str] = []
            for key, digits in (("added_p50_ms", 3), ("added_p99_ms", 3), ("router.req_per_s", 0)):
                n = numbers[f"{row}.{key}"]
                cells += [_spread(n["base"], digits), _spread(n["head"], digits)]
            lines.append(f"| {mode} | {conn:,} | " + " | ".join(cells) + " |")
        chunk = numbers["summary.added_first_chunk_p50_ms_c1"]
        lines.append(
            f"| streamed, first chunk | 1 | {_spread(chunk['base'], 3)} "
            f"| {_spread(chunk['head'], 3)} | - | - | - | - |"
        )
        return lines
    if script == "router_kv_events":
        path = re.compile(r"results\[(?P<scenario>[^\]]+)\]\.rows\[(?P<arm>[^\]]+)\]\.(?P<m>\w+)")
        metrics = [("hit_rate", 3), ("ttft_p50_ms", 1), ("ttft_p95_ms", 1)]
        found_by: dict[tuple[str, str], dict[str, Results]] = {}
        for key, number in numbers.items():
            match = path.fullmatch(key)
            if match and match["m"] in dict(metrics):
                found_by.setdefault((match["scenario"], match["arm"]), {})[match["m"]] = number
        lines = [
            f"| scenario | arm | hit rate, {base} | {head} | TTFT p50 ms, {base} | {head} "
            f"| TTFT p95 ms, {base} | {head} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (scenario, arm), found in found_by.items():
            spreads: list[str] = []
            for metric, digits in metrics:
                n = found[metric]
                spreads += [_spread(n["base"], digits), _spread(n["head"], digits)]
            lines.append(f"| {scenario} | {arm} | " + " | ".join(spreads) + " |")
        return lines
    raise KeyError(f"no compare_trees table for {script}")


def router_kv_events(doc: Results) -> list[str]:
    """bench/router_kv_events.py: per scenario and arm, the engines' prefix-hit rate and TTFT
    (median over rounds, the rounds' p95 range), and the errors over all rounds."""
    lines = [
        "| scenario | arm | rounds | hit rate | TTFT p50 | TTFT p95 (range) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in doc["results"]:
        for a in s["by_arm"]:
            low, high = a["ttft_p95_range_ms"] or (None, None)
            spread = f" ({low:,.0f}-{high:,.0f})" if low is not None else ""
            lines.append(
                f"| {s['scenario']} | {a['arm']} | {a['rounds']} | {a['hit_rate']:.3f} "
                f"| {_ms(a['ttft_p50_ms'])} | {_ms(a['ttft_p95_ms'])}{spread} | {a['errors']} |"
            )
    return lines


def _fine_ms(ms: float) -> str:
    return f"{ms:.3f} ms" if ms < 1 else f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"


def router_tokenize(doc: Results) -> list[str]:
    """bench/router_tokenize.py: the router's added cost to tokenize a chat and chain its KV
    keys, per tokenizer and case, at concurrency 1."""
    lines = [
        "| tokenizer | case | p50 | p95 | characters encoded (mean) | prompt tokens (p50) |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        chars = "-" if r["mean_encoded_chars"] is None else f"{r['mean_encoded_chars']:,}"
        lines.append(
            f"| {r['tokenizer']} | {r['scenario']} | {_fine_ms(r['p50_ms'])} "
            f"| {_fine_ms(r['p95_ms'])} | {chars} | {r['prompt_tokens_p50']:,} |"
        )
    return lines


def router_features(doc: Results) -> list[str]:
    """bench/router_features.py: the code / maths / reasoning markers of a request, the regexes
    as they were vs behind the literal prefilter, per workload (microseconds a request)."""
    lines = [
        "| workload | prompts | characters, p50 | flagged | before, p50 | after, p50 | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['workload']} | {r['requests']} | {r['chars_p50']:,} | {r['flagged']} "
            f"| {r['before_p50_us']:,.1f} us | {r['after_p50_us']:,.1f} us "
            f"| {r['speedup_p50']:.1f}x |"
        )
    return lines


def router_loop_stall(doc: Results) -> list[str]:
    """bench/router_loop_stall.py: the router's event loop while long prompts arrive beside
    relayed streams, parsed and tokenized on the loop or in worker threads, per round."""
    lines = [
        "| round | long prompts handled | event-loop stall per long prompt, p50 | longest stall "
        "| longest chunk gap on the other streams | the long prompt's latency, p50 |",
        "|---|---|---|---|---|---|",
    ]
    seen: dict[str, int] = {}
    for r in doc["rows"]:
        seen[r["mode"]] = seen.get(r["mode"], 0) + 1
        lines.append(
            f"| {seen[r['mode']]} | {r['mode']} | {r['per_prompt_max_lag_p50_ms']:.0f} ms "
            f"| {r['max_loop_lag_ms']:.0f} ms | {r['max_stream_chunk_gap_ms']:.0f} ms "
            f"| {r['long_prompt_latency_p50_ms']:.0f} ms |"
        )
    return lines


def _p50_p95(p50: float, p95: float) -> str:
    if math.isnan(p50) and math.isnan(p95):
        return "-"
    return " / ".join("-" if math.isnan(v) else f"{v:,.0f}" for v in (p50, p95)) + " ms"


def router_complexity(doc: Results) -> list[str]:
    """bench/router_complexity.py: the mixed load on both tiers by complexity against all on
    the large tier, then a burst and the calm after it."""
    lines = [
        "| phase | requests | req/s | on the small tier | simple on small | hard on small "
        "| simple TTFT p50 / p95 | hard TTFT p50 / p95 | spilled to large |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, r in doc["results"].items():
        if not isinstance(r, dict):
            continue
        lines.append(
            f"| {phase} | {r['requests']} | {r['req_per_s']:.1f} | {_pct(r['share']['small'])} "
            f"| {_pct(r['simple_on_small'])} | {_pct(r['hard_on_small'])} "
            f"| {_p50_p95(r['simple_ttft_p50_ms'], r['simple_ttft_p95_ms'])} "
            f"| {_p50_p95(r['hard_ttft_p50_ms'], r['hard_ttft_p95_ms'])} "
            f"| {r['spilled']} |"
        )
    return lines


def _span(values: list[float], unit: str = "") -> str:
    """``8.8-9.8 s`` over the rounds, or the one value when they agree."""
    low, high = min(values), max(values)
    text = f"{low:,g}" if low == high else f"{low:,g}-{high:,g}"
    return f"{text}{unit}"


def cluster_demo(doc: Results) -> list[str]:
    """bench/cluster_demo.py: what `make cluster-demo` printed, over its rounds (min-max)."""
    rounds = doc["rounds"]

    def span(key: str) -> str:
        return _span([r[key] for r in rounds], " s")

    count = f"{len(rounds)} round" + ("s" if len(rounds) != 1 else "")
    lines = [f"| step | figure ({count}) |", "|---|---|"]
    for chat in rounds[0]["chats"]:
        label = chat["label"]
        same = [c for r in rounds for c in r["chats"] if c["label"] == label]
        routes = sorted({c["route"] for c in same})
        cached = _span([c["cached_tokens"] for c in same])
        prompt = _span([c["prompt_tokens"] for c in same])
        lines.append(
            f"| chat: {label} | served by `{'`, `'.join(routes)}`; {prompt} prompt tokens, "
            f"{cached} from the prefix cache |"
        )
    lines += [
        f"| `kubectl apply` to the service's `Ready` condition | {span('apply_to_ready_s')} |",
        f"| `kubectl scale` to 2 small engines: the new pod Ready | {span('scale_ready_s')} |",
        f"| ... and serving its first chat | {span('scale_serving_s')} |",
        f"| the demo, start to end (binaries built) | {span('demo_s')} |",
        f"| processes left behind | {_span([r['leftover_processes'] for r in rounds])} |",
    ]
    return lines


def whole_loop(doc: Results) -> list[str]:
    """bench/whole_loop.py: each step of e2e/test_whole_loop.py with its figures over the
    rounds (min-max)."""
    rounds = doc["rounds"]

    def each(*path: str) -> list[float]:
        out = []
        for r in rounds:
            value: Any = r
            for key in path:
                value = value[key]
            out.append(value)
        return out

    def span(*path: str, unit: str = " s") -> str:
        return _span(each(*path), unit)

    rows = [
        (
            "`kubectl apply` to the service's `Ready` condition (operator pod starting at the "
            "same time)",
            span("apply_to_ready_s"),
        ),
        (
            "an engine's process killed (SIGKILL on the pid of its `process://` containerID)",
            f"restarted by the node after {span('killed_engine', 'restarted_s')} (restartCount "
            f"grows), back in the router's rotation after "
            f"{span('killed_engine', 'back_in_rotation_s')}; "
            f"{span('killed_engine', 'failed', unit='')} failed of "
            f"{span('killed_engine', 'sent', unit='')} chats meanwhile",
        ),
        (
            "a load step (12 concurrent chats): the operator's autoscaler reads Prometheus (a pod) "
            "and writes `/scale` 2 -> 3 (field manager `fleetpilot-autoscaler`, a `ScaledUp` "
            "Event)",
            f"decision {span('load_step', 'decision_s')} after the load began; **the new pod "
            f"Ready {span('load_step', 'decision_to_ready_s')} and serving its first request "
            f"{span('load_step', 'decision_to_served_s')} after the decision**; "
            f"{span('load_step', 'failed', unit='')} chats failed",
        ),
        (
            "a rolling update of the large tier (an engine setting changed: a new pod template; "
            "`maxSurge` 1, `maxUnavailable` 0) under 4 clients chatting without pause",
            f"rollout {span('rolling_update', 'rollout_s')} (two replicas); "
            f"**{span('rolling_update', 'failed', unit='')} of "
            f"{span('rolling_update', 'served', unit='')} chats failed**",
        ),
        (
            "a node drained as `kubectl drain` does (cordon; every controller-owned pod evicted "
            "through the Eviction API at once, each retried while a budget refuses) under 4 "
            "clients on both tiers, then every small engine evicted at once",
            f"drain of {span('drain', 'pods', unit='')} pods (routers, engines of both tiers, "
            f"once the operator): {span('drain', 'evictions_refused', unit='')} evictions "
            "refused by the engines' and routers' disruption budgets, every pod running on the "
            f"other node and ready after {span('drain', 'drain_s')}; the whole small tier "
            f"({span('drain', 'tier_pods', unit='')} pods): "
            f"{span('drain', 'tier_evictions_refused', unit='')} refused, back after "
            f"{span('drain', 'tier_s')}. No budget ever below its desired healthy pods, the "
            "service `Ready` in every sample (twice a second), "
            f"**{span('drain', 'failed', unit='')} of {span('drain', 'served', unit='')} chats "
            "failed**",
        ),
        (
            "scale to zero and back: the large tier given `replicas.min` 0 and a 4 s scale-down "
            "window, idle; then one streamed chat for it",
            f"zero pods {span('scale_from_zero', 'idle_to_zero_s')} after the apply; the chat "
            "held by the router, seen by the autoscaler as the router's pending request through "
            "Prometheus, scaled 0 -> 1: **first token "
            f"{span('scale_from_zero', 'held_ttft_s')} after it was sent**",
        ),
        (
            "a model-download Job: a second service whose reference tier reads a checkpoint (the "
            "engine's own `save_checkpoint`) from the tests' fake Hub running as a pod "
            "(`model.source.huggingface.endpoint`), through `spec.modelCache` (a claim the test "
            "binds)",
            "the operator's Job fetched it "
            f"{span('model_download', 'apply_to_job_complete_s')} after the apply (no engine "
            "Deployment before that), the service Ready "
            f"{span('model_download', 'apply_to_ready_s')} after; a chat answered",
        ),
    ]
    passed = sum(1 for r in rounds if r["exit"] == 0)
    plural = "s" if len(rounds) != 1 else ""
    lines = [
        f"| step | figure ({len(rounds)} round{plural}, {passed} passed) |",
        "|---|---|",
    ]
    lines += [f"| {step} | {figure} |" for step, figure in rows]
    return lines


def _whatif_row(arm: str, r: Results) -> str:
    peaks = ", ".join(f"{tier} {sum(roles.values())}" for tier, roles in r["peak_replicas"].items())
    refused = sum(r["errors"].values())
    cost = "-" if r["cost"] is None else f"${r['cost']:,.0f}"
    return (
        f"| {arm} | {r['requests']:,} | {refused:,} | {r['gpu_hours']:,.1f} | {cost} "
        f"| {r['slo_attainment']:.3f} | {r['ttft_p50_ms']:,.0f} ms | {r['ttft_p95_ms']:,.0f} ms "
        f"| {r['hit_rate']:.3f} | {peaks} |"
    )


def whatif_complexity(doc: Results) -> list[str]:
    """bench/simulate_whatifs.py ``complexity``: two tiers with complexity routing against
    everything on the large tier, both autoscaled."""
    lines = [
        "| arm | requests | refused (429) | GPU-hours | cost | SLO met | TTFT p50 | TTFT p95 "
        "| hit rate | peak replicas |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return lines + [_whatif_row(arm, r) for arm, r in doc["complexity"].items()]


def whatif_prefix(doc: Results) -> list[str]:
    """bench/simulate_whatifs.py ``prefix``: the replica choice at 100 fixed replicas."""
    lines = ["| routing | hit rate | TTFT p50 | TTFT p95 |", "|---|---|---|---|"]
    for arm, r in doc["prefix"].items():
        lines.append(
            f"| {arm} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.0f} ms "
            f"| {r['ttft_p95_ms']:.0f} ms |"
        )
    return lines


def whatif_candidates(doc: Results) -> list[str]:
    """bench/simulate_whatifs.py ``candidates``: the router's pick among candidates against
    scoring every replica, per case and seed: hit rate / TTFT p95 in ms."""
    cases: dict[tuple[str, int], dict[str, Results]] = {}
    for r in doc["candidates"]:
        if r["workload"] == "long-context":
            label = f"{r['documents']:,} documents, {r['rate']:,.0f} req/s"
        else:
            label = f"{r['tenants']:,} tenants, Zipf {r['tenant_skew']:g}, {r['rate']:,.0f} req/s"
        cases.setdefault((label, r["seed"]), {})[r["arm"]] = r
    arms = list(dict.fromkeys(r["arm"] for r in doc["candidates"]))
    lines = [
        "| case | seed | " + " | ".join(arms) + " |",
        "|---" * (len(arms) + 2) + "|",
    ]
    for (label, seed), found in cases.items():
        cells = [
            f"{found[a]['hit_rate']:.3f} / {found[a]['ttft_p95_ms']:,.0f}" if a in found else "-"
            for a in arms
        ]
        lines.append(f"| {label} | {seed} | " + " | ".join(cells) + " |")
    return lines


def whatif_hot_tenants(doc: Results) -> list[str]:
    """bench/simulate_whatifs.py ``hot-tenants``: TTFT p95 in ms (hit rate) per case and arm."""
    cases: dict[tuple[Any, ...], dict[str, Results]] = {}
    for r in doc["hot-tenants"]:
        key = (r["replicas"], r["rate"], r["tenants"], r["skew"], r["seed"])
        cases.setdefault(key, {})[r["arm"]] = r
    arms = list(dict.fromkeys(r["arm"] for r in doc["hot-tenants"]))
    lines = [
        "| replicas, req/s, tenants, skew | seed | " + " | ".join(arms) + " |",
        "|---" * (len(arms) + 2) + "|",
    ]
    for (replicas, rate, tenants, skew, seed), found in cases.items():
        cells = [
            f"{found[a]['ttft_p95_ms']:,.1f} ({found[a]['hit_rate']:.3f})" if a in found else "-"
            for a in arms
        ]
        lines.append(
            f"| {replicas}, {rate:,.0f}, {tenants:,}, {skew:g} | {seed} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def router_affinity(docs: list[Results]) -> list[str]:
    """bench/router_affinity.py, one column per run: each policy's hit rate, TTFT and
    throughput (closed loop)."""
    runs = [{r["policy"]: r for r in doc["rows"]} for doc in docs]
    policies = list(dict.fromkeys(p for run in runs for p in run))
    lines = [
        f"| policy | hit rate (run {' / '.join(str(i + 1) for i in range(len(docs)))}) "
        "| TTFT p50 | TTFT p95 | req/s |",
        "|---|---|---|---|---|",
    ]

    def per_run(policy: str, key: str, fmt: str) -> str:
        return " / ".join(format(run[policy][key], fmt) if policy in run else "-" for run in runs)

    for policy in policies:
        lines.append(
            f"| {policy} | {per_run(policy, 'hit_rate', '.3f')} "
            f"| {per_run(policy, 'ttft_p50_ms', '.0f')} ms "
            f"| {per_run(policy, 'ttft_p95_ms', '.0f')} ms "
            f"| {per_run(policy, 'req_per_s', '.1f')} |"
        )
    return lines


def _by_trace(
    docs: list[Results], key: str
) -> tuple[list[tuple[str, str]], list[dict[Any, Results]]]:
    found = [{(s[key], r["arm"]): r for s in doc["results"] for r in s["rows"]} for doc in docs]
    rows = list(dict.fromkeys(k for run in found for k in run))
    order = list(dict.fromkeys(trace for trace, _ in rows))
    return sorted(rows, key=lambda row: order.index(row[0])), found


def _per_seed(found: list[dict[Any, Results]], row: Any, key: str, fmt: str) -> str:
    """One row's ``key`` in every seed's run, "-" where a run lacks the row."""
    return " / ".join(format(run[row][key], fmt) if row in run else "-" for run in found)


def router_prefix_workloads(docs: list[Results]) -> list[str]:
    """bench/router_prefix_workloads.py, one value per seed (file): per scenario and arm, the
    engines' prefix-hit rate and TTFT."""
    rows, found = _by_trace(docs, "scenario")
    seeds = " / ".join(str(doc["seed"]) for doc in docs)
    lines = [
        f"| scenario | arm | req/s (seed {seeds}) | hit rate | TTFT p50 | TTFT p95 |",
        "|---|---|---|---|---|---|",
    ]

    for row in rows:
        cell = functools.partial(_per_seed, found, row)
        lines.append(
            f"| {row[0]} | {row[1]} | {cell('req_per_s', '.1f')} "
            f"| {cell('hit_rate', '.3f')} | {cell('ttft_p50_ms', '.0f')} ms "
            f"| {cell('ttft_p95_ms', '.0f')} ms |"
        )
    return lines


def router_pd_local(docs: list[Results]) -> list[str]:
    """bench/router_pd_local.py, one value per seed (file): per trace and arm, the share served
    by the decode replica alone, its KV pulls and the TTFT."""
    rows, found = _by_trace(docs, "trace")
    seeds = " / ".join(str(doc["seed"]) for doc in docs)
    lines = [
        f"| trace | arm | requests (seed {seeds}) | served by the decode replica alone "
        "| decode KV pulls | TTFT p50 | TTFT p95 | hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]

    for row in rows:
        cell = functools.partial(_per_seed, found, row)
        lines.append(
            f"| {row[0]} | {row[1]} | {cell('requests', 'd')} "
            f"| {cell('local_share', '.0%')} | {cell('decode_kv_pulls', '.0f')} "
            f"| {cell('ttft_p50_ms', '.0f')} ms "
            f"| {cell('ttft_p95_ms', '.0f')} ms | {cell('hit_rate', '.3f')} |"
        )
    return lines


# bench/router_lora.py's arms in the order the docs show them: the label of a row, and of a
# column where the arms are columns.
LORA_ARMS = {
    "fleetpilot": ("fleetpilot", "fleetpilot"),
    "scores-only": ("fleetpilot, scores only", "scores only"),
    "no-adapter-affinity": ("fleetpilot without adapter affinity", "without adapter affinity"),
    "adapter-hash": (
        "consistent hashing of the adapter, bounded loads (c = 1.25)",
        "adapter hashing",
    ),
    "round-robin": ("round-robin", "round-robin"),
    "random": ("random", "random"),
}


def _lora_seeds_of(doc: Results) -> list[int]:
    """A router_lora results file's seeds, ascending."""
    return sorted({r["seed"] for r in doc["rows"]})


def _lora_arms(docs: list[Results]) -> list[str]:
    """The arms the files hold: the known ones in the docs' order, then any other."""
    found = list(dict.fromkeys(r["arm"] for doc in docs for r in doc["rows"]))
    return [a for a in LORA_ARMS if a in found] + [a for a in found if a not in LORA_ARMS]


def _lora_cell(doc: Results, arm: str, key: str, unit: str = "") -> str:
    """An arm's ``key`` in each of the file's seeds, ascending ("-" for a seed it missed, and
    for all of them when the file lacks the arm)."""
    by_seed = [{r["arm"]: r for r in doc["rows"] if r["seed"] == s} for s in _lora_seeds_of(doc)]
    if not any(arm in run for run in by_seed):
        return "-"
    return _per_seed(by_seed, arm, key, ",.0f") + unit


def _lora_seeds(doc: Results) -> str:
    return " / ".join(str(s) for s in _lora_seeds_of(doc))


def router_lora(doc: Results) -> list[str]:
    """bench/router_lora.py, one value per seed: each arm's adapter swaps (activations) and
    reads from disk (loads) per 1,000 requests, and its TTFT; fleetpilot's swaps in bold."""
    lines = [
        f"| policy | swaps per 1,000 requests (seed {_lora_seeds(doc)}) "
        "| reads from disk per 1,000 | TTFT p50 | TTFT p95 |",
        "|---|---|---|---|---|",
    ]
    for arm in _lora_arms([doc]):
        name, swaps = LORA_ARMS.get(arm, (arm, arm))[0], _lora_cell(doc, arm, "activations_per_1k")
        if arm == "fleetpilot":
            name, swaps = f"**{name}**", f"**{swaps}**"
        lines.append(
            f"| {name} | {swaps} | {_lora_cell(doc, arm, 'loads_per_1k')} "
            f"| {_lora_cell(doc, arm, 'ttft_p50_ms', ' ms')} "
            f"| {_lora_cell(doc, arm, 'ttft_p95_ms', ' ms')} |"
        )
    return lines


def router_lora_skews(docs: list[Results]) -> list[str]:
    """bench/router_lora.py at other Zipf skews, a file each: per skew, each arm's swaps per
    1,000 requests and TTFT p95 (a value per seed); fleetpilot's swaps in bold. A skew below
    the default 1 is flatter, above it steeper."""
    arms = _lora_arms(docs)
    heads = [LORA_ARMS.get(a, (a, a))[1] for a in arms]
    lines = ["| Zipf skew (seed) | " + " | ".join(heads) + " |", "|---" * (len(arms) + 1) + "|"]
    for doc in docs:
        skew = doc["args"]["skew"]
        shape = ", flatter" if skew < 1 else ", steeper" if skew > 1 else ""
        swaps = [_lora_cell(doc, a, "activations_per_1k") for a in arms]
        swaps = [
            f"**{c}**" if a == "fleetpilot" and c != "-" else c
            for a, c in zip(arms, swaps, strict=True)
        ]
        p95 = [_lora_cell(doc, a, "ttft_p95_ms", " ms") for a in arms]
        lines.append(
            f"| {skew:g}{shape} ({_lora_seeds(doc)}): swaps per 1,000 | " + " | ".join(swaps) + " |"
        )
        lines.append(f"| {skew:g}: TTFT p95 | " + " | ".join(p95) + " |")
    return lines


RENDERERS: dict[str, Renderer] = {
    "kv_offload": kv_offload,
    "kv_offload_simulator": kv_offload_simulator,
    "gateway_pickers": gateway_pickers,
    "gateway_pickers_cpu": gateway_pickers_cpu,
    "router_cpu": router_cpu,
    "router_auth_overhead": router_auth_overhead,
    "router_noisy_neighbour": router_noisy_neighbour,
    "router_stream_failover": router_stream_failover,
    "router_slow_bodies": router_slow_bodies,
    "simulate_validation": simulate_validation,
    "simulate_speed": simulate_speed,
    "autoscale_ramp": autoscale_ramp,
    "operator_scale": operator_scale,
    "router_overhead": router_overhead,
    "compare_trees": compare_trees,
    "router_kv_events": router_kv_events,
    "router_tokenize": router_tokenize,
    "router_features": router_features,
    "router_loop_stall": router_loop_stall,
    "router_complexity": router_complexity,
    "router_lora": router_lora,
    "cluster_demo": cluster_demo,
    "whole_loop": whole_loop,
    "whatif_complexity": whatif_complexity,
    "whatif_prefix": whatif_prefix,
    "whatif_candidates": whatif_candidates,
    "whatif_hot_tenants": whatif_hot_tenants,
}
# Renderers of one table from several results files, named in the marker comma-separated:
# ``<!-- table: engine bench/results/a.json,bench/results/b.json -->``.
MULTI_RENDERERS: dict[str, MultiRenderer] = {
    "engine": engine,
    "router_affinity": router_affinity,
    "router_prefix_workloads": router_prefix_workloads,
    "router_pd_local": router_pd_local,
    "router_lora_skews": router_lora_skews,
}


# Renderers of one part of a results file that updates its parts apart (simulate_whatifs.py):
# captioned with the commit and date that part was measured on.
PART_OF = {
    "whatif_complexity": "complexity",
    "whatif_prefix": "prefix",
    "whatif_candidates": "candidates",
    "whatif_hot_tenants": "hot-tenants",
}


def part_view(doc: Results, part: str) -> Results:
    """What a caption says of one part: its own commit and date (none recorded: none), the
    file's machine, and the file's run mode only when the part is from that run."""
    measured = (doc.get("measured") or {}).get(part) or {}
    view: Results = {"machine": doc.get("machine"), **measured}
    if measured and measured.get("commit") == doc.get("commit"):
        view["run_all"] = doc.get("run_all")
    return view


def render(renderer: str, source: str) -> str:
    """The Markdown between a block's markers: a caption for each results file, the table."""
    sources = source.split(",")
    if renderer in MULTI_RENDERERS:
        docs = [json.loads((ROOT / s).read_text()) for s in sources]
        captions = [caption(d, s) for d, s in zip(docs, sources, strict=True)]
        lines = [" ".join(captions), "", *MULTI_RENDERERS[renderer](docs)]
    elif renderer in RENDERERS:
        if len(sources) != 1:
            raise ValueError(f"renderer {renderer!r} reads one results file, not {source!r}")
        doc = json.loads((ROOT / source).read_text())
        shown = part_view(doc, PART_OF[renderer]) if renderer in PART_OF else doc
        lines = [caption(shown, source), "", *RENDERERS[renderer](doc)]
    else:
        known = ", ".join(sorted([*RENDERERS, *MULTI_RENDERERS]))
        raise KeyError(f"no renderer {renderer!r} (known: {known})")
    return "\n".join(lines) + "\n"


def indented(body: str, indent: str) -> str:
    """``body`` with every line that has text indented by ``indent``."""
    return "".join(indent + line if line.strip() else line for line in body.splitlines(True))


def rewrite(text: str) -> str:
    """``text`` with every marked table rendered afresh."""

    def block(match: re.Match[str]) -> str:
        body = indented(render(match["renderer"], match["source"]), match["indent"])
        return match["indent"] + match["open"] + body + match["close"]

    return BLOCK.sub(block, text)


def stale(pages: list[Path]) -> list[str]:
    """``page: renderer source`` for each table that disagrees with its file."""
    out = []
    for page in pages:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match["body"] != indented(
                render(match["renderer"], match["source"]), match["indent"]
            ):
                out.append(f"{page.relative_to(ROOT)}: {match['renderer']} {match['source']}")
    return out


def pages() -> list[Path]:
    return sorted([ROOT / "README.md", *DOCS.glob("*.md")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is stale")
    args = parser.parse_args()
    if args.check:
        found = stale(pages())
        for line in found:
            print(f"stale: {line} (run python bench/tables.py)", file=sys.stderr)
        sys.exit(1 if found else 0)
    for page in pages():
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
