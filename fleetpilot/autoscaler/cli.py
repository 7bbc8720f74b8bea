"""``fleetpilot autoscaler --fleet URL``: the autoscaler as its own process, for a local fleet.

It reads the service and its roles from the fleet's control API (``fleetpilot up`` prints the
URL and starts this command itself), observes each role through Prometheus when the fleet runs
one (or ``--prometheus-url`` names one), else straight from the engines' /metrics (also while
that Prometheus is unreachable, saying so in the log and in every reason), decides with
the same policy as the operator's timer, and scales through the control API. Decisions land in
the fleet's status table, the log and ``fleetpilot_autoscaler_*`` metrics (``--metrics-port``).

It logs to stderr as every fleetpilot process does (``--log-format json``, the default, or
``plain``; ``--log-level``). A fleet that stops answering is waited for (``--fleet-timeout``),
then the command exits 1; SIGTERM ends it with 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from types import FrameType

from fleetpilot.api import InferenceService
from fleetpilot.argtypes import DefaultsHelpFormatter, duration_seconds, port_number
from fleetpilot.autoscaler.actuator import default_metrics
from fleetpilot.autoscaler.direct import EngineMetricsSource
from fleetpilot.autoscaler.fallback import FallbackSource
from fleetpilot.autoscaler.loop import Histories, interval_s, tick
from fleetpilot.autoscaler.prometheus import MetricsSource, PrometheusSource
from fleetpilot.autoscaler.remote import FleetActuator, FleetClient, FleetError, RoleState
from fleetpilot.listening import ListenError, listening_on
from fleetpilot.logs import add_log_arguments, configure_logging

log = logging.getLogger("fleetpilot.autoscaler")

EXIT_OK = 0
EXIT_FAILED = 1
# How often the loop wakes: each role still decides at its own autoscaling.interval.
WAKE_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--fleet", required=True, help="control API of a local fleet (fleetpilot up prints it)")
    a(
        "--prometheus-url",
        help="Prometheus to read (default: the fleet's own, else the engines' /metrics)",
    )
    a("--direct", action="store_true", help="read the engines' /metrics even if there is one")
    a(
        "--metrics-port",
        type=port_number,
        default=0,
        help="serve fleetpilot_autoscaler_* here (0: off)",
    )
    a(
        "--fleet-timeout",
        type=duration_seconds,
        default=30.0,
        help="how long to wait for an unanswering fleet before exiting (30s; 0: at once)",
    )
    a("--once", action="store_true", help="one tick, then exit (for scripts)")
    add_log_arguments(parser)


def _source(args: argparse.Namespace, client: FleetClient, fleet_prom: str | None) -> MetricsSource:
    direct = EngineMetricsSource(client.addresses, router=lambda: client.router_address)
    url = None if args.direct else (args.prometheus_url or fleet_prom)
    if url:
        log.info("reading Prometheus at %s (the engines' /metrics while it is unreachable)", url)
        # The fleet's engines are reachable from here: a Prometheus down must not blind us.
        return FallbackSource(PrometheusSource(url), direct, primary_name=f"prometheus at {url}")
    log.info("reading the engines' /metrics directly (no Prometheus)")
    return direct


def _wait_for_fleet(
    client: FleetClient, timeout_s: float, stop: threading.Event
) -> tuple[InferenceService, list[RoleState], str | None] | None:
    """The fleet's first answer; None when it never came or SIGTERM came first."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            return client.fleet()
        except FleetError as exc:
            if time.monotonic() > deadline:
                log.error("fleet not answering for %.0fs: %s", timeout_s, exc)
                return None
        stop.wait(0.5)
    return None


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    stop = threading.Event()

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    with FleetClient(args.fleet) as client:
        first = _wait_for_fleet(client, args.fleet_timeout, stop)
        if first is None:
            return EXIT_OK if stop.is_set() else EXIT_FAILED
        service, _, fleet_prom = first
        if interval_s(service) is None:
            log.info("%s: autoscaling is disabled on every tier; nothing to do", service.name)
        source = _source(args, client, fleet_prom)
        if args.metrics_port:
            # Served once the fleet answered and the source is chosen: a supervisor probing
            # this port sees "ready" only when the autoscaler can work.
            from prometheus_client import start_http_server

            try:
                with listening_on("127.0.0.1", args.metrics_port):
                    start_http_server(args.metrics_port, addr="127.0.0.1")
            except ListenError as exc:
                print(f"error: --metrics-port: {exc}", file=sys.stderr)
                return EXIT_FAILED
        actuator = FleetActuator(client, default_metrics())
        histories: Histories = {}
        unreachable_since: float | None = None
        try:
            while not stop.is_set():
                try:
                    # Read every tick: the fleet's service is the one source of truth.
                    service, _, _ = client.fleet()
                    tick(service, source, actuator, histories)
                    unreachable_since = None
                except FleetError as exc:
                    now = time.monotonic()
                    unreachable_since = unreachable_since or now
                    log.warning("fleet: %s", exc)
                    if now - unreachable_since > args.fleet_timeout:
                        log.error("fleet gone for %.0fs; exiting", args.fleet_timeout)
                        return EXIT_FAILED
                if args.once:
                    break
                stop.wait(WAKE_S)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetpilot autoscaler", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
