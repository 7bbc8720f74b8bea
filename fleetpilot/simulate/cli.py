"""``fleetpilot simulate``: run a service's real router and autoscaler policies over simulated
engines, and report; ``fleetpilot simulate calibrate``: measure the reference engine."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TextIO

from fleetpilot.api import InferenceService, InvalidManifestError, load_services
from fleetpilot.argtypes import positive_duration
from fleetpilot.loadgen.cli import _positive, _schedule, add_shape_arguments
from fleetpilot.loadgen.report import matplotlib_available, write_json
from fleetpilot.loadgen.runner import Schedule
from fleetpilot.loadgen.workloads import (
    SHAPE_OPTIONS,
    WORKLOADS,
    Workload,
    make_workload,
    workload_options,
)
from fleetpilot.routing.policies.candidates import FULL_SCAN_MAX
from fleetpilot.simulate import report
from fleetpilot.simulate.baselines import FLEETPILOT, ROUTING_POLICIES
from fleetpilot.simulate.fleet import PREFIX_SOURCES, Fleet, Progress, SimSettings
from fleetpilot.simulate.profile import AUTO, GPUS, ProfileError, load_profile
from fleetpilot.simulate.trace import Trace, load_trace

DEFAULT_WORKLOAD = "shared-prefix"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("-f", "--file", type=Path, required=True, help="InferenceService YAML file")
    a(
        "--workload",
        choices=sorted(WORKLOADS),
        help=f"what to send (default {DEFAULT_WORKLOAD}; a trace names its own)",
    )
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_positive(float), help="Poisson arrivals at this many req/s")
    load.add_argument(
        "--schedule", type=_schedule, help="a rate schedule, as fleetpilot bench's: '0:50,600:500'"
    )
    load.add_argument(
        "--trace",
        type=Path,
        help="replay a 'fleetpilot bench --out' file: its requests at their send times, each "
        "answer as long as it was",
    )
    a(
        "--duration",
        type=positive_duration,
        help="simulated time: '1h', '10m', '90s' (with --trace, default: the run's duration)",
    )
    a("--seed", type=int, default=0, help="seeds the workload, the arrivals and the routers")
    a(
        "--profile",
        default=AUTO,
        help=f"engine timing: {AUTO} (each tier's gpuProduct), a GPU "
        f"({', '.join(sorted(GPUS))}), or a profile file from 'fleetpilot simulate calibrate'",
    )
    a(
        "--prefix-source",
        choices=PREFIX_SOURCES,
        default="events",
        help="what the routers match prompts against: the engines' KV events (as planned), or "
        "their own record of what they sent where",
    )
    a(
        "--routing",
        choices=ROUTING_POLICIES,
        default=FLEETPILOT,
        help="the routers' replica choice: fleetpilot's, or a baseline to compare it with",
    )
    a(
        "--full-scan-max",
        type=_positive(int),
        default=FULL_SCAN_MAX,
        help="the largest group whose every replica a router scores; a larger one is picked "
        "among a few candidates (default: %(default)s)",
    )
    a("--no-autoscale", action="store_true", help="hold every role at its starting replicas")
    a("--replicas", type=_positive(int), help="replicas each role starts with (default: spec)")
    a("--max-replicas", type=_positive(int), help="replace every role's replicas.max")
    a("--max-tokens", type=_positive(int), help="override the workload's max_tokens")
    add_shape_arguments(parser)
    a(
        "--warmup",
        type=positive_duration,
        help="leave the requests that arrive before this out of the report (its figures are "
        "then the steady state, past the engines' cold caches); GPU-hours count the whole run",
    )
    a("--price-per-gpu-hour", type=_positive(float), help="report the cost at this price")
    a("--json", type=Path, help="write the report as JSON (the verdict line's figures too)")
    a(
        "--plot",
        type=Path,
        help="write a PNG: TTFT and TPOT against each tier's SLO, replicas asked for and "
        "ready (cold starts), and load over time",
    )
    a("--quiet", action="store_true", help="no progress line (shown on a terminal)")


def _progress(stream: TextIO, duration_s: float) -> Progress:
    """A progress line, rewritten in place. The fleet runs past the load's end while the last
    requests finish, so the simulated time shown stops at the duration (never "121/120 s"),
    and it counts whole seconds done (119.6 is not yet 120). A shorter line is padded over
    the longer one it replaces."""
    started = time.perf_counter()
    widest = 0

    def show(sim_s: float, requests: int) -> None:
        nonlocal widest
        wall = time.perf_counter() - started
        shown = min(sim_s, duration_s)
        done = shown / duration_s
        bar = "#" * math.floor(done * 30)
        finishing = "  finishing requests in flight" if sim_s > duration_s else ""
        line = (
            f"[{bar:<30}] {math.floor(done * 100):3d}%  {math.floor(shown):7d}/"
            f"{duration_s:.0f} s simulated  {requests} requests  {wall:5.0f} s wall{finishing} "
        )
        stream.write("\r" + line.ljust(widest))
        widest = max(widest, len(line))
        stream.flush()

    return show


def _title(
    service: InferenceService, workload: Workload, load: Schedule | Trace, end: float
) -> str:
    """The plot's title: the service, what it was sent and how fast, for how long."""
    if isinstance(load, Trace):
        sent = sum(1 for r in load.requests if r.start_s <= end)
        pace = f" ({sent / end:.3g} req/s)" if end > 0 else ""
        rate = f"trace {Path(load.source).name}{pace}"
    elif len(load.steps) == 1:
        rate = f"{load.steps[0].rate:g} req/s"
    else:
        low = min(step.rate for step in load.steps)
        rate = f"schedule {low:g}-{load.peak:g} req/s"
    return f"{service.name}: {workload.name}, {rate}, {end:.0f} s simulated"


def _load(args: argparse.Namespace) -> tuple[Schedule | Trace, Workload, float]:
    """The load, the workload its requests come from and the simulated duration;
    ``ValueError`` (a ``TraceError`` for a bad trace) naming what is wrong."""
    if args.trace is None:
        if args.duration is None:
            raise ValueError("--duration is required with --rate or --schedule")
        name = args.workload or DEFAULT_WORKLOAD
        shape = {option: getattr(args, option) for option in SHAPE_OPTIONS}
        options = workload_options(name, args.max_tokens, **shape)
        schedule: Schedule = args.schedule or Schedule.constant(args.rate)
        return schedule, make_workload(name, args.seed, **options), args.duration
    given = [
        "--" + name.replace("_", "-")
        for name in ("workload", "max_tokens", *SHAPE_OPTIONS)
        if getattr(args, name) is not None
    ]
    if given:
        raise ValueError(f"--trace replays its own workload; drop {', '.join(given)}")
    trace = load_trace(args.trace)
    try:
        workload = make_workload(trace.workload, trace.seed, **trace.options)
    except TypeError as e:  # an option the workload does not take
        raise ValueError(f"{args.trace}: config.workload_options: {e}") from None
    return trace, workload, args.duration or trace.duration_s


def run(args: argparse.Namespace) -> int:
    try:
        services = load_services(args.file)
    except (OSError, InvalidManifestError) as e:
        print(f"fleetpilot simulate: {e}", file=sys.stderr)
        return 2
    if len(services) != 1:
        print(
            f"fleetpilot simulate: {args.file} holds {len(services)} services; give one",
            file=sys.stderr,
        )
        return 2
    service = services[0]
    if args.plot is not None and not matplotlib_available():
        print(
            "fleetpilot simulate: --plot needs matplotlib (pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    try:
        load, workload, duration = _load(args)
    except ValueError as e:
        print(f"fleetpilot simulate: {e}", file=sys.stderr)
        return 2
    settings = SimSettings(
        load=load,
        duration_s=duration,
        seed=args.seed,
        prefix_source=args.prefix_source,
        routing=args.routing,
        full_scan_max=args.full_scan_max,
        autoscale=not args.no_autoscale,
        start_replicas=args.replicas,
        max_replicas=args.max_replicas,
    )
    try:
        fleet = Fleet(
            service,
            load_profile(args.profile),
            workload,
            settings,
        )
    except ProfileError as e:
        print(f"fleetpilot simulate: {e}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    shown = sys.stderr.isatty() and not args.quiet
    progress = _progress(sys.stderr, duration) if shown else None
    ready = report.ReadySampler(fleet)
    outcome = fleet.run(progress, progress_every_s=max(duration / 100, 1.0))
    outcome.wall_s = time.perf_counter() - started
    if progress is not None:
        progress(duration, len(outcome.requests))
        sys.stderr.write("\n")
    summary = report.summarize(
        outcome, service, args.price_per_gpu_hour, args.warmup or 0.0, ready=ready.samples
    )
    print(report.format_table(summary))
    if args.json is not None:
        write_json(args.json, summary.to_json())
        print(f"json: {args.json}")
    if args.plot is not None:
        title = _title(service, workload, load, duration)
        report.write_plot(args.plot, outcome, service, ready=ready.samples, title=title)
        print(f"plot: {args.plot}")
    print(report.format_verdict(summary))
    return 0
