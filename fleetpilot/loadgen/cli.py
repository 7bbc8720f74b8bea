"""``fleetpilot bench``: load against an OpenAI-compatible URL, a summary, JSON and a plot."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from fleetpilot.argtypes import DefaultsHelpFormatter, positive_duration
from fleetpilot.loadgen import report
from fleetpilot.loadgen.runner import Progress, RunConfig, Runner, Schedule, parse_schedule
from fleetpilot.loadgen.workloads import (
    SHAPE_OPTIONS,
    WORKLOADS,
    ModelMix,
    make_workload,
    workload_options,
)


def _schedule(text: str) -> Schedule:
    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
        return value

    return check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (…/v1)")
    a("--model", default="m", help="the 'model' sent in every request")
    a(
        "--adapters",
        type=lambda text: tuple(name for name in text.split(",") if name),
        default=None,
        help="comma-separated LoRA adapter names: each request asks for one (instead of "
        "--model), by a Zipf popularity in the order given",
    )
    a(
        "--adapter-skew",
        type=float,
        default=1.0,
        help="the adapters' popularity: the k-th given weighs 1/k^skew (0: all alike)",
    )
    a("--api-key", default=None, help="sent as a Bearer token when given")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--rate", type=_positive(float), help="open loop: Poisson arrivals at this many req/s"
    )
    mode.add_argument(
        "--schedule",
        type=_schedule,
        help="open loop with a rate schedule: 't:rate' steps, '~' for a ramp to that rate, "
        "e.g. '0:2,30:8,60:2' or '0:1,60:~10'",
    )
    mode.add_argument(
        "--concurrency", type=_positive(int), help="closed loop: this many clients (default 4)"
    )
    a(
        "--duration",
        type=positive_duration,
        help="how long to send for: 30s, 2m, 1h30m (a plain number is seconds; default: 60s "
        "when neither it nor --requests bounds the run)",
    )
    a("--requests", type=_positive(int), help="stop after sending this many requests")
    a("--workload", choices=sorted(WORKLOADS), default="shared-prefix", help="what to send")
    a("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    a(
        "--timeout",
        type=positive_duration,
        default=60.0,
        help="per-request limit: 500ms, 30s, 2m (a plain number is seconds)",
    )
    a(
        "--max-in-flight",
        type=_positive(int),
        default=256,
        help="open loop: arrivals beyond this many in flight are dropped and counted",
    )
    a("--max-tokens", type=_positive(int), default=None, help="override the workload's max_tokens")
    add_shape_arguments(parser)
    a(
        "--ignore-eos",
        action="store_true",
        help="vLLM extension: always decode max_tokens (for random-weight test models)",
    )
    a("--progress", action="store_true", help="show the progress line even when not a TTY")
    a("--out", type=Path, default=None, help="write per-request records and the summary as JSON")
    a("--plot", type=Path, default=None, help="write a PNG of latency and replicas over time")


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape one workload (``SHAPE_OPTIONS``), as ``bench`` and ``simulate``
    both take them: a recorded run replays as the same requests."""
    a = parser.add_argument
    a("--tenants", type=_positive(int), help="shared-prefix: tenants (system prompts)")
    a(
        "--tenant-skew",
        type=float,
        help="shared-prefix: Zipf exponent of the tenants' popularity (default 0: uniform)",
    )
    a("--system-chars", type=_positive(int), help="shared-prefix: characters a system prompt")
    a("--documents", type=_positive(int), help="long-context: documents asked about")
    a(
        "--context-chars",
        type=_positive(int),
        help="long-context: document length in characters (default 6000; the reference "
        "engine's byte tokenizer makes this its prompt length in tokens)",
    )


def _workload_options(args: argparse.Namespace) -> dict[str, Any]:
    shape = {option: getattr(args, option) for option in SHAPE_OPTIONS}
    return workload_options(args.workload, args.max_tokens, **shape)


BAR_WIDTH = 20


def progress_line(
    p: Progress, elapsed: float, duration_s: float | None, max_requests: int | None
) -> str:
    """One progress line: counters and rate, and - when the run has a bound - a bar and the
    time left (by the clock for --duration, by the send rate for --requests)."""
    rate = p.done / elapsed if elapsed > 0 else 0.0
    line = (
        f"{elapsed:6.1f} s  sent {p.sent}  done {p.done}  errors {p.errors}  "
        f"in flight {p.in_flight}  {rate:.1f} req/s"
    )
    fractions, lefts = [], []
    if duration_s:
        fractions.append(elapsed / duration_s)
        lefts.append(max(0.0, duration_s - elapsed))
    if max_requests:
        fractions.append(p.sent / max_requests)
        send_rate = p.sent / elapsed if elapsed > 0 else 0.0
        if send_rate > 0:
            lefts.append(max(0.0, (max_requests - p.sent) / send_rate))
    if not fractions:
        return line
    done = min(1.0, max(fractions))
    filled = int(done * BAR_WIDTH)
    eta = f"ETA {min(lefts):.0f} s" if lefts else "ETA ?"
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4.0%}  {eta}  {line}"


def _progress_printer(
    stream: TextIO, duration_s: float | None, max_requests: int | None
) -> Callable[[Progress, float], None]:
    def show(p: Progress, elapsed: float) -> None:
        stream.write(f"\r{progress_line(p, elapsed, duration_s, max_requests)}   ")
        stream.flush()

    return show


def run(args: argparse.Namespace) -> int:
    schedule: Schedule | None = args.schedule
    if args.rate is not None:
        schedule = Schedule.constant(args.rate)
    duration = args.duration
    if duration is None and args.requests is None:
        duration = 60.0  # every run ends by itself, even when no bound was given
    try:
        config = RunConfig(
            base_url=args.url,
            model=args.model,
            schedule=schedule,
            concurrency=args.concurrency or 4,
            duration_s=duration,
            max_requests=args.requests,
            timeout_s=args.timeout,
            max_in_flight=args.max_in_flight,
            seed=args.seed,
            api_key=args.api_key,
            ignore_eos=args.ignore_eos,
            model_mix=(
                ModelMix(args.adapters, args.adapter_skew, args.seed) if args.adapters else None
            ),
        )
        options = _workload_options(args)
        workload = make_workload(args.workload, args.seed, **options)
    except ValueError as e:
        print(f"fleetpilot bench: {e}", file=sys.stderr)
        return 2
    show = args.progress or sys.stderr.isatty()
    printer = _progress_printer(sys.stderr, duration, args.requests) if show else None
    runner = Runner(config, workload, on_progress=printer)
    try:
        result = asyncio.run(runner.run())
    except KeyboardInterrupt:
        print("\nfleetpilot bench: interrupted", file=sys.stderr)
        return 130
    if show:
        sys.stderr.write("\n")
    summary = report.summarize(result.records, result.elapsed_s)
    print(report.format_table(summary))
    for kind, detail in report.first_errors(result.records).items():
        print(f"first {kind}: {detail}", file=sys.stderr)  # why, not just how many
    if args.out is not None:
        meta = {
            "url": args.url,
            "model": args.model,
            "adapters": list(args.adapters or ()),
            "adapter_skew": args.adapter_skew if args.adapters else None,
            "workload": args.workload,
            "seed": args.seed,
            # With the workload and the seed, what regenerates every request (``fleetpilot
            # simulate --trace`` replays the run from them).
            "workload_options": options,
            "mode": "closed" if schedule is None else "open",
            "rate": args.rate,
            "schedule": [vars(s) for s in schedule.steps] if schedule else None,
            "concurrency": None if schedule else config.concurrency,
            "duration_s": duration,
            "requests": args.requests,
        }
        report.write_json(args.out, report.result_json(result, summary, meta))
        print(f"results: {args.out}")
    if args.plot is not None:
        if report.matplotlib_available():
            report.write_plot(args.plot, result.records)
            print(f"plot: {args.plot}")
        else:
            print(
                "fleetpilot bench: --plot needs matplotlib (pip install matplotlib); "
                "skipped the plot",
                file=sys.stderr,
            )
    # Only a run where nothing got through fails: errors under load are results, not faults.
    return 0 if summary.succeeded else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter,
        prog="fleetpilot bench",
        description="Load an OpenAI-compatible server and summarize TTFT, TPOT, hits and tiers.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
