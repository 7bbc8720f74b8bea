"""Issue 46: a second tier of KV cache in host memory, on a workload that outgrows the device.

Multi-tenant chat with long system prompts (``fleetpilot bench --workload shared-prefix``:
16 tenants of 1,400-character system prompts, Zipf-popular at skew 0.8, a 120-character
question each) on 4 reference engines (preset tiny, as ``fleetpilot simulate calibrate``
measures it), each with a device pool of 128 KV blocks (2,048 tokens: one prompt of the model's
full context). A prompt is ~1,600 tokens (~100 blocks), so one replica's device cache holds one
tenant's prompt; prefix routing gives each replica ~4 tenants, a working set of ~3x its device
cache (the fleet's: ~12x one replica's). With offload every engine also keeps 1,024 blocks in
host memory (``--kv-offloading-size``, 12 MiB: the tenants it serves with room to spare), whose
copies back are paced at 0.25 GB/s: ~325k tokens/s against the tiny model's ~35k tokens/s of
prefill at 1k tokens of context, the same ~10x an H100 has between PCIe and prefilling an 8B
model (profile.py), so a host block costs about a tenth of computing it.

Arms, each on fresh engines, every component its own process (engines, one router, the load
generator ``fleetpilot bench``):

- ``no offload``: device pools only, the router's defaults (prefix-cost routing on the
  engines' KV events);
- ``offload, host ignored``: host tiers, and a router whose index drops the host tier's events
  (``kvIndex.hostBlocks: ignored``): fleetpilot before this issue;
- ``offload, medium-blind``: host tiers, the index counting host blocks as device hits
  (``asDevice``): a tiered engine behind a router that cannot tell the tiers apart;
- ``offload, tiered``: host tiers, the defaults (``tiered``: a host block priced at
  ``hostHitCost`` 0.1 of a prefill);
- ``prodstack-prefix, offload``: production-stack's router (``--routing-logic prefixaware``,
  installed by hand, skipped when missing) over the offloading engines.

Figures: the engines' own counters split the prompt tokens into device hits
(``vllm:prefix_cache_hits``), host hits (``vllm:external_prefix_cache_hits``) and computed;
the client's TTFT p50/p95 and throughput. Each run lasts 60 s of which the first 15 warm the
caches: the figures are of the requests that arrive after it (the engines' counters are
sampled twice a second and read at that mark), the steady state a long-running fleet is in,
not the first prefill of every tenant on every replica. Rates 4 and 8 requests/s,
``--rounds`` seeds each (the spread is reported).

The simulator's prediction (``--simulate``): each round's ``no offload`` and ``offload,
tiered`` runs are replayed by ``fleetpilot simulate --trace`` on the reference engine's
calibrated profile (``fleetpilot simulate calibrate``, or ``--profile``) with the bench's pool,
batch limits and link, and the predicted gain (no-offload TTFT p95 over tiered) is set
against the measured one (both past the warm-up: ``--warmup``); the issue asks for within
25%.

Variants (``--name`` keeps their results apart): ``--replicas 2`` (an engine a core, for the
simulator's replay), ``--link 0.05 --host-hit-cost 0.5`` (a copy back at about half a
prefill, and the tiered index told so), ``--tenant-skew 1.5`` (a hot tenant that load spreads).

Run: .venv/bin/python bench/kv_offload.py [--quick] [--rounds N] [--rates 4,8] [--arms a;b]
     [--simulate] [--profile FILE] [--replicas N] [--link GB/s] [--host-hit-cost C]
     [--tenant-skew S] [--name NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prodstack_router
import yaml
from router_fleet import fleetpilot_routers
from router_support import ROOT, commit, free_ports, machine, save, serving

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.kv_events import kv_events_config
from fleetpilot.loadgen.report import percentiles

REPLICAS = 4
MODEL = "offload-model"
PRESET = "tiny"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 8
BLOCK = 16
DEVICE_BLOCKS = 128
HOST_BLOCKS = 1024
KV_BYTES_PER_TOKEN = 768  # tiny: K and V x 3 layers x 2 KV heads x 16 dims x 4 bytes
HOST_GIB = HOST_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN / 2**30
LINK_GB_PER_S = 0.25
TENANTS = 16
SYSTEM_CHARS = 1400
TENANT_SKEW = 0.8
MAX_TOKENS = 16
WARMUP_S = 15.0

ARMS = (
    "no offload",
    "offload, host ignored",
    "offload, medium-blind",
    "offload, tiered",
    "prodstack-prefix, offload",
)
HOST_BLOCKS_MODE = {
    "no offload": "tiered",
    "offload, host ignored": "ignored",
    "offload, medium-blind": "asDevice",
    "offload, tiered": "tiered",
}
SIMULATED = ("no offload", "offload, tiered")


@dataclass(frozen=True)
class Setup:
    """What a run may vary from the defaults above: the fleet's size, the host link's speed and
    the price the tiered index puts on a host block (``kvIndex.hostHitCost``)."""

    replicas: int = REPLICAS
    link_gb_per_s: float = LINK_GB_PER_S
    host_hit_cost: float = 0.1
    tenant_skew: float = TENANT_SKEW


def engine_argv(port: int, pub: int, replay: int, offload: bool, setup: Setup) -> list[str]:
    events = kv_events_config(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    argv = [
        sys.executable, "-m", "fleetpilot.engine.reference.server",
        "--host", "127.0.0.1", "--port", str(port), "--model-config", PRESET,
        "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS), "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
        "--kv-events-config", json.dumps(events), "--log-level", "warning",
    ]  # fmt: skip
    if offload:
        extra = {"kv_connector_extra_config": {"self_describing_kv_events": True}}
        argv += [
            "--kv-offloading-size", repr(HOST_GIB), "--kv-offloading-backend", "native",
            "--kv-transfer-config", json.dumps(extra),
            "--kv-offload-gb-per-second", str(setup.link_gb_per_s),
        ]  # fmt: skip
    return argv


@contextlib.contextmanager
def engines(offload: bool, setup: Setup) -> Iterator[tuple[list[str], list[tuple[int, int]]]]:
    """``setup.replicas`` fresh engines publishing KV events: their addresses and event ports."""
    n = setup.replicas
    ports = free_ports(3 * n)
    kv_ports = list(zip(ports[n::2], ports[n + 1 :: 2], strict=True))
    procs = [
        subprocess.Popen(
            engine_argv(port, pub, replay, offload, setup),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port, (pub, replay) in zip(ports[:n], kv_ports, strict=True)
    ]
    with serving(procs, ports[:n], 120) as addresses:
        yield addresses, kv_ports


def router_config(host_blocks: str, host_hit_cost: float) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "service": "bench",
            "namespace": "bench",
            "tiers": [
                {
                    "name": "only",
                    "model": MODEL,
                    "upTo": 1.0,
                    "mode": "unified",
                    "tokenizer": str(REFERENCE_TOKENIZER),
                    "endpoints": [
                        {"role": "unified", "service": "e", "selector": {}, "port": 1,
                         "maxNumSeqs": MAX_NUM_SEQS, "addresses": []}
                    ],
                }
            ],
            "kvIndex": {"hostBlocks": host_blocks, "hostHitCost": host_hit_cost},
            "scrape": {"interval": "250ms"},
            "requestTimeout": "120s",
        }
    )  # fmt: skip


COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "device": "vllm:prefix_cache_hits_total",
    "host": "vllm:external_prefix_cache_hits_total",
}


def engine_counters(address: str) -> dict[str, float]:
    """The engine's prefix-cache counters (tokens), summed over label sets."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    found = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            if line.startswith((name + "{", name + " ")):
                found[key] += float(line.rsplit(" ", 1)[1])
    return found


class CounterSampler:
    """The engines' counters, sampled twice a second in the background with the wall time."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = addresses
        self.samples: list[tuple[float, list[dict[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            self.samples.append((now, [engine_counters(a) for a in self.addresses]))
            self._stop.wait(0.5)

    def __enter__(self) -> CounterSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.time(), [engine_counters(a) for a in self.addresses]))

    def moved_since(self, wall: float) -> dict[str, float]:
        """What the counters moved from the last sample at or before ``wall`` to the end."""
        start = max((s for s in self.samples if s[0] <= wall), key=lambda s: s[0])[1]
        end = self.samples[-1][1]
        return {
            key: sum(e[key] - b[key] for e, b in zip(end, start, strict=True)) for key in COUNTERS
        }


def steady(records: Sequence[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    """The client's figures over the requests sent after the warm-up."""
    late = [r for r in records if r["start_s"] >= WARMUP_S]
    ok = [r for r in late if r["error"] is None]
    ttft = percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None], (50, 95))
    return {
        "requests": len(late),
        "succeeded": len(ok),
        "errors": sorted({r["error"] for r in late if r["error"] is not None}),
        "ttft_p50_ms": ttft["p50"] * 1e3 if ttft["p50"] is not None else None,
        "ttft_p95_ms": ttft["p95"] * 1e3 if ttft["p95"] is not None else None,
        "throughput_rps": len(ok) / max(1e-9, elapsed_s - WARMUP_S),
    }


def load(
    url: str, rate: float, duration: float, seed: int, skew: float, out: Path
) -> dict[str, Any]:
    """``fleetpilot bench`` as its own process against ``url`` (a chat-completions base); its
    ``--out`` document."""
    argv = [
        sys.executable, "-m", "fleetpilot", "bench", "--url", url, "--model", MODEL,
        "--rate", str(rate), "--duration", str(duration), "--seed", str(seed),
        "--workload", "shared-prefix", "--tenants", str(TENANTS),
        "--system-chars", str(SYSTEM_CHARS), "--tenant-skew", str(skew),
        "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--timeout", "120", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if run.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"fleetpilot bench failed ({run.returncode}):\n{run.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


@dataclass(frozen=True)
class Case:
    rate: float
    duration: float
    seed: int


def play(arm: str, case: Case, setup: Setup, workdir: Path) -> dict[str, Any]:
    """One arm on fresh engines: the client's summary and the engines' counters."""
    offload = arm != "no offload"
    out = workdir / f"{arm.replace(', ', '-').replace(' ', '-')}-{case.rate}-{case.seed}.json"
    with engines(offload, setup) as (addresses, kv_ports), contextlib.ExitStack() as stack:
        if arm.startswith("prodstack"):
            urls = stack.enter_context(
                prodstack_router.routers("prodstack-prefix", 1, addresses, MODEL, workdir)
            )
            base = urls[0].removesuffix("/chat/completions")
        else:
            endpoints = workdir / "endpoints.yaml"
            listed = [
                {"tier": "only", "address": a, "kvEventsPort": pub, "kvReplayPort": replay}
                for a, (pub, replay) in zip(addresses, kv_ports, strict=True)
            ]
            endpoints.write_text(yaml.safe_dump({"endpoints": listed}))
            cfg = router_config(HOST_BLOCKS_MODE[arm], setup.host_hit_cost)
            routers = stack.enter_context(
                fleetpilot_routers(
                    "events", 1, cfg, endpoints, workdir, replicas=setup.replicas, events=True
                )
            )
            base = routers[0].url.removesuffix("/chat/completions")
        with CounterSampler(addresses) as sampler:
            doc = load(base, case.rate, case.duration, case.seed, setup.tenant_skew, out)
    records = doc["requests"]
    t0_wall = records[0]["timestamp"] - records[0]["start_s"]
    moved = sampler.moved_since(t0_wall + WARMUP_S)
    queries = moved["queries"] or float("nan")
    return {
        "arm": arm,
        "rate": case.rate,
        "seed": case.seed,
        **steady(records, doc["summary"]["elapsed_s"]),
        "device_hit_rate": moved["device"] / queries,
        "host_hit_rate": moved["host"] / queries,
        "computed_rate": 1 - (moved["device"] + moved["host"]) / queries,
        "trace": str(out),
    }


# -- the simulator's prediction --------------------------------------------------------------


def service_yaml(offload: bool, replicas: int) -> str:
    engine: dict[str, Any] = {
        "backend": "reference",
        "referenceModel": PRESET,
        "maxNumSeqs": MAX_NUM_SEQS,
    }
    if offload:
        engine["kvOffload"] = {"size": str(HOST_BLOCKS * BLOCK * KV_BYTES_PER_TOKEN)}
    return yaml.safe_dump(
        {
            "apiVersion": "fleetpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "offload", "namespace": "bench"},
            "spec": {
                "tiers": [
                    {
                        "name": "only",
                        "model": {"name": MODEL, "maxModelLen": MAX_MODEL_LEN},
                        "engine": engine,
                        "serving": {"replicas": {"min": replicas, "max": replicas}},
                    }
                ]
            },
        }
    )


def bench_profile(calibrated: Path, out: Path, link_gb_per_s: float) -> None:
    """The calibrated reference engine, with the bench's pool, batch limit and link."""
    data = json.loads(calibrated.read_text())
    data["shape"]["kv_tokens"] = DEVICE_BLOCKS * BLOCK
    data["shape"]["max_num_seqs"] = MAX_NUM_SEQS
    data["kv_bytes_per_token"] = KV_BYTES_PER_TOKEN
    data["costs"]["host_load_per_token_s"] = KV_BYTES_PER_TOKEN / (link_gb_per_s * 1e9)
    out.write_text(json.dumps(data))


def simulate(
    trace: str, offload: bool, replicas: int, profile: Path, workdir: Path
) -> dict[str, Any]:
    """What ``fleetpilot simulate`` predicts for a recorded run past the warm-up: TTFT p95
    (ms) and the hit rates."""
    service = workdir / f"service-{offload}.yaml"
    service.write_text(service_yaml(offload, replicas))
    report = workdir / "sim.json"
    argv = [
        sys.executable, "-m", "fleetpilot", "simulate", "-f", str(service), "--trace", trace,
        "--profile", str(profile), "--no-autoscale", "--json", str(report), "--quiet",
        "--warmup", f"{WARMUP_S:g}s",
    ]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"fleetpilot simulate failed:\n{run.stderr[-2000:]}")
    doc = json.loads(report.read_text())
    ttft = doc["ttft_s"]
    return {
        "ttft_p50_ms": ttft["p50"] * 1e3 if ttft["p50"] is not None else None,
        "ttft_p95_ms": ttft["p95"] * 1e3 if ttft["p95"] is not None else None,
        "hit_rate": doc["prefix_hit_rate"],
        "host_hit_rate": doc["host_hit_rate"],
    }


def predictions(
    rows: Sequence[dict[str, Any]], replicas: int, profile: Path, workdir: Path
) -> list[Any]:
    """Per rate and seed: the measured and predicted gain of ``offload, tiered``."""
    out = []
    by_key = {(r["arm"], r["rate"], r["seed"]): r for r in rows}
    for (arm, rate, seed), base in sorted(by_key.items()):
        tiered = by_key.get(("offload, tiered", rate, seed))
        if arm != "no offload" or tiered is None:
            continue
        sims = [
            simulate(r["trace"], r is tiered, replicas, profile, workdir) for r in (base, tiered)
        ]
        predicted = [s["ttft_p95_ms"] for s in sims]
        measured = [base["ttft_p95_ms"], tiered["ttft_p95_ms"]]
        gain = measured[0] / measured[1] if all(measured) else None
        sim_gain = predicted[0] / predicted[1] if all(predicted) else None
        p50s = [[r["ttft_p50_ms"] for r in (base, tiered)], [s["ttft_p50_ms"] for s in sims]]
        out.append(
            {
                "rate": rate,
                "seed": seed,
                "measured_p50_ms": p50s[0],
                "simulated_p50_ms": p50s[1],
                "measured_p50_gain": p50s[0][0] / p50s[0][1] if all(p50s[0]) else None,
                "simulated_p50_gain": p50s[1][0] / p50s[1][1] if all(p50s[1]) else None,
                "measured_p95_ms": measured,
                "simulated_p95_ms": predicted,
                "measured_hit_rates": [
                    {"device": r["device_hit_rate"], "host": r["host_hit_rate"]}
                    for r in (base, tiered)
                ],
                "simulated_hit_rates": [
                    {"all": s["hit_rate"], "host": s["host_hit_rate"]} for s in sims
                ],
                "measured_gain": gain,
                "simulated_gain": sim_gain,
                "gain_error": sim_gain / gain - 1 if gain and sim_gain else None,
            }
        )
    return out


# -- the run -----------------------------------------------------------------------------------


def merged(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (rate, arm) over its rounds: medians, and the range of the p95s."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["rate"], row["arm"]), []).append(row)
    out = []
    for (rate, arm), runs in groups.items():
        p95s = [r["ttft_p95_ms"] for r in runs if r["ttft_p95_ms"] is not None]

        def median(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in runs if r[key] is not None))

        out.append(
            {
                "rate": rate,
                "arm": arm,
                "rounds": len(runs),
                "device_hit_rate": median("device_hit_rate"),
                "host_hit_rate": median("host_hit_rate"),
                "computed_rate": median("computed_rate"),
                "ttft_p50_ms": median("ttft_p50_ms"),
                "ttft_p95_ms": median("ttft_p95_ms"),
                "ttft_p95_range_ms": [min(p95s), max(p95s)] if p95s else None,
                "throughput_rps": median("throughput_rps"),
                "failed": sum(r["requests"] - r["succeeded"] for r in runs),
            }
        )
    return out


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(f"{'rate':>4} {'arm':27} {'device':>6} {'host':>6} {'computed':>8} {'TTFT p50':>9} "
          f"{'p95':>7} {'p95 range':>13} {'req/s':>6} {'failed':>6}")  # fmt: skip
    for m in rows:
        low, high = m["ttft_p95_range_ms"] or (0.0, 0.0)
        print(f"{m['rate']:>4g} {m['arm']:27} {m['device_hit_rate']:>6.3f} "
              f"{m['host_hit_rate']:>6.3f} {m['computed_rate']:>8.3f} {m['ttft_p50_ms']:>7.0f}ms "
              f"{m['ttft_p95_ms']:>5.0f}ms {f'{low:.0f}-{high:.0f}ms':>13} "
              f"{m['throughput_rps']:>6.2f} {m['failed']:>6}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 s a run instead of 60")
    parser.add_argument("--rounds", type=int, default=2, help="seeds of every arm and rate")
    parser.add_argument("--rates", default="4,8", help="comma-separated requests a second")
    parser.add_argument("--arms", help="comma-separated subset of: " + "; ".join(ARMS))
    parser.add_argument("--simulate", action="store_true", help="the simulator's prediction")
    parser.add_argument("--profile", type=Path, help="a calibrated profile (default: calibrate)")
    parser.add_argument("--name", default="kv_offload", help="the results file's name")
    parser.add_argument("--replicas", type=int, default=REPLICAS, help="engines in the fleet")
    parser.add_argument(
        "--link", type=float, default=LINK_GB_PER_S, help="host-to-device copy speed, GB/s"
    )
    parser.add_argument(
        "--host-hit-cost", type=float, default=0.1, help="the tiered index's kvIndex.hostHitCost"
    )
    parser.add_argument(
        "--tenant-skew", type=float, default=TENANT_SKEW, help="Zipf skew of the tenants"
    )
    args = parser.parse_args()
    setup = Setup(args.replicas, args.link, args.host_hit_cost, args.tenant_skew)
    arms = [a for a in ARMS if args.arms is None or a in args.arms.split(";")]
    if "prodstack-prefix, offload" in arms and not prodstack_router.available():
        print(f"skipping prodstack-prefix: {prodstack_router.MISSING}", file=sys.stderr)
        arms.remove("prodstack-prefix, offload")
    duration = 30.0 if args.quick else 60.0
    rates = [float(r) for r in args.rates.split(",")]
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for round_ in range(args.rounds):
            seed = 100 + round_
            for rate in rates:
                # Each round starts one arm later, so drift falls on every arm alike.
                shift = round_ % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    rows.append(play(arm, Case(rate, duration, seed), setup, workdir))
                    print(f"  {arm} at {rate:g}/s, seed {seed}: done", file=sys.stderr)
        table = merged(rows)
        predicted: list[Any] = []
        profiled: dict[str, Any] | None = None
        if args.simulate:
            profile = args.profile
            if profile is None:
                profile = workdir / "calibrated.json"
                subprocess.run(
                    [sys.executable, "-m", "fleetpilot", "simulate", "calibrate", "--out",
                     str(profile)], cwd=ROOT, check=True
                )  # fmt: skip
            adapted = workdir / "profile.json"
            bench_profile(profile, adapted, setup.link_gb_per_s)
            profiled = json.loads(adapted.read_text())
            predicted = predictions(rows, setup.replicas, adapted, workdir)
        for row in rows:
            row.pop("trace")
        path = save(
            args.name,
            {
                "benchmark": "kv_offload",
                "commit": commit(),
                "machine": machine(),
                "engines": f"{setup.replicas} reference engines, preset {PRESET}, "
                f"{DEVICE_BLOCKS} device KV blocks of {BLOCK}, max-num-seqs {MAX_NUM_SEQS}; "
                f"offload: {HOST_BLOCKS} host blocks ({HOST_GIB:.4f} GiB) at "
                f"{setup.link_gb_per_s:g} GB/s; tiered hostHitCost {setup.host_hit_cost:g}",
                "workload": f"shared-prefix, {TENANTS} tenants, {SYSTEM_CHARS}-char system "
                f"prompts, skew {setup.tenant_skew:g}, {MAX_TOKENS} output tokens, "
                f"{duration:.0f} s a run",
                "rounds": args.rounds,
                "rows": rows,
                "by_arm": table,
                "simulator": predicted,
                "simulator_profile": profiled,
                "wall_s": time.monotonic() - started,
            },
        )
    print_table(table)
    for p in predicted:
        print(f"rate {p['rate']:g} seed {p['seed']}: measured gain {p['measured_gain']:.2f}, "
              f"simulated {p['simulated_gain']:.2f} ({p['gain_error']:+.0%})")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
