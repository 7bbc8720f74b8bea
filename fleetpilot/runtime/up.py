"""``fleetpilot up -f FILE``: run an InferenceService as local processes until Ctrl-C.

Validates the file first (nothing starts for an invalid one), starts the fleet (engines, the
router, Prometheus when installed, the control API and ``fleetpilot autoscaler``), prints its
endpoint and a status table every few seconds, restarts crashed children, and stops everything
it started on Ctrl-C, SIGTERM or when ``--duration`` expires. A child that still runs but stops
answering its health URL (frozen) is found by a liveness probe (``--liveness-*``), reported
once and killed and restarted. What it reports is also logged, structured (JSON lines), in
``WORKDIR/logs/up.log``. ``--cold-start DURATION`` makes every engine (those the autoscaler adds
included) answer /health, and so join the router, only that long after loading its model: a
GPU engine's start, for the autoscaler to reckon with.
``--step-delay DURATION`` makes every engine sleep that long after each busy step: its
throughput is then its pace, not its share of the CPU, so each added replica adds capacity as
a GPU's does.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from fleetpilot.api import InvalidManifestError, load_services
from fleetpilot.argtypes import (
    DefaultsHelpFormatter,
    duration_seconds,
    port_number,
    positive_duration,
)
from fleetpilot.logs import json_formatter
from fleetpilot.operator.plan_types import PlanError
from fleetpilot.operator.planner import check_reference_tiers
from fleetpilot.runtime.liveness import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_PERIOD_S,
    DEFAULT_TIMEOUT_S,
    LivenessProbe,
)
from fleetpilot.runtime.local import DEFAULT_MAX_REPLICAS_PER_ROLE
from fleetpilot.runtime.processes import ChildFailedError, PortInUseError
from fleetpilot.runtime.prometheus import PrometheusError
from fleetpilot.runtime.stack import LocalStack

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("-f", "--file", required=True, help="InferenceService YAML file (one service)")
    a(
        "--port",
        type=port_number,
        default=8000,
        help="router port; engines, then their KV-event publishers, then the router's /metrics "
        "use the ports after it (0: any free ports)",
    )
    a("--workdir", help="directory for the router config and logs (default: a temporary one)")
    a(
        "--duration",
        type=positive_duration,
        default=None,
        help="stop this long after the fleet is up: 90s, 10m, 1h (a plain number is seconds; "
        "default: until Ctrl-C)",
    )
    a(
        "--max-replicas-per-role",
        type=int,
        default=DEFAULT_MAX_REPLICAS_PER_ROLE,
        help="most engine processes started per tier and role (a CPU's safety limit)",
    )
    a(
        "--status-interval",
        type=positive_duration,
        default=5.0,
        help="time between status tables: 5s, 1m (a plain number is seconds)",
    )
    a(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run fleetpilot autoscaler on the fleet (tiers with autoscaling not disabled; "
        "at most --max-replicas-per-role per role)",
    )
    a(
        "--prometheus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run a Prometheus server scraping the engines (default: when installed; without "
        "one the autoscaler reads the engines' /metrics directly)",
    )
    a(
        "--control-port",
        type=port_number,
        default=0,
        help="control API port (default: a free one)",
    )
    a(
        "--cold-start",
        type=duration_seconds,
        default=0.0,
        metavar="DURATION",
        help="every engine, those the autoscaler adds included, answers /health (and joins "
        "the router) only this long after loading its model, as a GPU engine loading its "
        "weights would",
    )
    a(
        "--step-delay",
        type=duration_seconds,
        default=0.0,
        metavar="DURATION",
        help="every engine sleeps this long after each busy step: its throughput is set by "
        "this pace rather than by the CPU it shares, so each replica adds capacity",
    )
    a(
        "--auth-dir",
        metavar="DIR",
        help="where the API keys of routing.auth are, as DIR/<secret>/<key> files (a cluster "
        "mounts the Secrets so); without it the local router admits every request",
    )
    a(
        "--liveness-period",
        type=positive_duration,
        default=DEFAULT_PERIOD_S,
        metavar="DURATION",
        help="how often every child (router, engines, Prometheus, autoscaler) is probed on its "
        "health URL",
    )
    a(
        "--liveness-timeout",
        type=positive_duration,
        default=DEFAULT_TIMEOUT_S,
        metavar="DURATION",
        help="how long a liveness probe waits for its answer",
    )
    a(
        "--liveness-failures",
        type=int,
        default=DEFAULT_FAILURE_THRESHOLD,
        metavar="N",
        help="failed liveness probes in a row after which a child (frozen, not exited) is "
        "reported, killed and restarted",
    )


class _Stop(KeyboardInterrupt):
    """Raised by the SIGTERM handler: handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Once: a second SIGTERM must not interrupt the stopping it started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop()


def _say(text: str) -> None:
    print(text, flush=True)


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        services = load_services(path)
    except InvalidManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if len(services) != 1:
        found = len(services)
        print(f"error: {path}: expected one InferenceService, found {found}", file=sys.stderr)
        return EXIT_INVALID
    if args.max_replicas_per_role < 1:
        print("error: --max-replicas-per-role must be at least 1", file=sys.stderr)
        return EXIT_INVALID
    # The durations (--cold-start, --step-delay, --liveness-*) are checked while parsing.
    if args.liveness_failures < 1:
        print("error: --liveness-failures must be at least 1", file=sys.stderr)
        return EXIT_INVALID
    liveness = LivenessProbe(args.liveness_period, args.liveness_timeout, args.liveness_failures)
    service = services[0]
    try:
        # The local fleet caps a GPU spec for a CPU; a reference tier runs as its pods would.
        check_reference_tiers(service)
    except PlanError as exc:
        print(f"error: {path}: {service.name}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    with tempfile.TemporaryDirectory(prefix="fleetpilot-up-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        stack = LocalStack(
            service,
            workdir,
            args.port,
            max_replicas_per_role=args.max_replicas_per_role,
            autoscale=args.autoscale,
            prometheus=args.prometheus,
            control_port=args.control_port,
            say=_say,
            cold_start_s=args.cold_start,
            step_delay_s=args.step_delay,
            auth_dir=Path(args.auth_dir) if args.auth_dir else None,
            liveness=liveness,
        )
        handlers = _log_to(workdir / "logs" / "up.log")
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return _serve(stack, args)
        except BrokenPipeError:
            raise  # stdout's reader left (`up | head`): the command's main ends quietly
        # OSError: a port taken after the stack's check (another process was faster).
        except (PortInUseError, ChildFailedError, PrometheusError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            stack.stop()
            signal.signal(signal.SIGTERM, previous)
            handlers.close()


class _NotReported(logging.Filter):
    """Passes records whose event is not also in a report the stack returned (``reported``
    extra): those are printed once already, in full."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "reported", False)


class _LogHandlers:
    """The process's log handlers while ``up`` runs: removed again by :meth:`close`."""

    def __init__(self, handlers: list[logging.Handler], level: int) -> None:
        self.handlers = handlers
        self.previous_level = level

    def close(self) -> None:
        root = logging.getLogger()
        for handler in self.handlers:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(self.previous_level)


def _log_to(path: Path) -> _LogHandlers:
    """Every record of this process at info and above as a JSON line in ``path`` (the
    structured log); warnings also on stderr as the bare message, unless their event is one
    the stack reported (printed on stdout already: printing both showed a crash twice)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    structured = logging.FileHandler(path, encoding="utf-8")
    structured.setFormatter(json_formatter())
    structured.setLevel(logging.INFO)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)
    terminal.addFilter(_NotReported())
    root = logging.getLogger()
    previous = root.level
    root.setLevel(min(previous or logging.INFO, logging.INFO))
    root.addHandler(structured)
    root.addHandler(terminal)
    return _LogHandlers([structured, terminal], previous)


def _serve(stack: LocalStack, args: argparse.Namespace) -> int:
    try:
        engines = len(stack.fleet.replicas)
        _say(f"starting {stack.service.name}: {engines} engine(s) and the router")
        stack.start()
        _say(f"fleet is up; OpenAI endpoint: {stack.endpoint}")
        _say(f"logs and router config in {stack.workdir}")
        if stack.prometheus_url:
            _say(f"prometheus: {stack.prometheus_url} (scraping every engine)")
        _say(f"control API: {stack.control_url}")
        if stack.autoscaler is not None:
            source = (
                "Prometheus, the engines' /metrics while it is down"
                if stack.prometheus_url
                else "the engines' /metrics"
            )
            _say(f"autoscaler: running (reads {source}; log in {stack.autoscaler.log_path})")
        deadline = None if args.duration is None else time.monotonic() + args.duration
        next_status = 0.0
        while deadline is None or time.monotonic() < deadline:
            for report in stack.step():
                _say(report)
            if time.monotonic() >= next_status:
                _say(stack.status_table())
                next_status = time.monotonic() + args.status_interval
            pause = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            time.sleep(pause)
        _say("duration reached; stopping")
    except KeyboardInterrupt:
        _say("stopping")
    stack.stop()
    _say("stopped; nothing left running")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetpilot up", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
