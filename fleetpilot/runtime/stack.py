"""A local fleet and what runs beside it: Prometheus, the control API, the autoscaler.

:class:`LocalStack` is what ``fleetpilot up`` and ``make demo`` run:

- the :class:`~fleetpilot.runtime.local.LocalFleet` (engines per tier/role, the router);
- a Prometheus server when one is installed, scraping every engine and the router with the
  pod labels the planner sets (its targets follow the fleet as it scales); without one, the
  autoscaler reads the engines' (and, for a role at zero, the router's) /metrics directly,
  through the same reader interface;
- the control API (:mod:`fleetpilot.runtime.control`) on a loopback port;
- ``fleetpilot autoscaler --fleet URL`` as a supervised child process: it decides with the
  operator's policy and scales through the control API.

Call :meth:`LocalStack.step` from the thread that started the stack, every half second or so:
it restarts crashed children, Prometheus included (reported with their log tail), and those
that stopped answering their liveness probe (reported in one line, killed), lists newly
healthy engines in the router's config and updates Prometheus' targets. While Prometheus is
down the autoscaler reads the engines' /metrics directly, and says so.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

from fleetpilot.api import InferenceService
from fleetpilot.kube.names import engine_selector, router_selector
from fleetpilot.runtime.autoscale import LocalActuator, RoleScaling, capped_service
from fleetpilot.runtime.control import ControlServer
from fleetpilot.runtime.liveness import LivenessProbe
from fleetpilot.runtime.local import DEFAULT_MAX_REPLICAS_PER_ROLE, HOST, LocalFleet, StatusRow
from fleetpilot.runtime.processes import Child, free_port, group_members, require_free_ports
from fleetpilot.runtime.prometheus import (
    PrometheusError,
    PrometheusServer,
    ScrapeTarget,
    find_binary,
)

log = logging.getLogger(__name__)

# The first scrape of every target comes within about 5 s (Prometheus' target update
# period) plus one interval; a loaded CPU may take longer, and the wait must not fail the fleet.
PROMETHEUS_FIRST_SCRAPE_TIMEOUT_S = 30.0


# "10 -> 20, 59m ago" fits; the decision's sentence, of any length, comes last.
_LAST_SCALE_WIDTH = 18


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds == float("inf"):
        return "inf"
    return f"{seconds * 1000:.0f}ms"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def _ago(then: datetime, now: datetime) -> str:
    seconds = max(0.0, (now - then).total_seconds())
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.0f}h ago"


def _last_scale(record: RoleScaling | None, now: datetime) -> str:
    """``1 -> 2, 12s ago``: the last change of replicas, its reason being long gone from the
    decision column once the role holds."""
    if record is None or record.last_scale_time is None:
        return "-"
    change = f"{record.last_scale_from} -> {record.last_scale_to}"
    return f"{change}, {_ago(record.last_scale_time, now)}"


def format_status(
    rows: Sequence[StatusRow],
    scaling: Mapping[tuple[str, str], RoleScaling] | None = None,
    now: datetime | None = None,
) -> str:
    """A fixed-width table of the fleet: replicas per tier and role and, with ``scaling``
    (the autoscaler's records), what its current decision saw, the last change of replicas,
    and the current decision's reason. Purely computational (``now`` defaults to the clock)."""
    when = now or datetime.now(UTC)
    header = f"{'TIER':<10} {'ROLE':<8} {'REPLICAS':>8} {'HEALTHY':>7}"
    if scaling is not None:
        header += (
            f" {'TTFT p95':>8} {'TPOT p95':>8} {'KV':>4} {'HITS':>4}"
            f"  {'LAST SCALE':<{_LAST_SCALE_WIDTH}}  DECISION"
        )
    lines = [header]
    for row in rows:
        line = f"{row.tier:<10} {row.role:<8} {row.replicas:>8} {row.healthy:>7}"
        if scaling is not None:
            record = scaling.get((row.tier, row.role))
            m = record.metrics if record is not None else None
            reason = record.reason if record is not None else ""
            line += (
                f" {_ms(m.ttft_p95_s if m else None):>8} {_ms(m.tpot_p95_s if m else None):>8}"
                f" {_percent(m.kv_cache_usage_frac if m else None):>4}"
                f" {_percent(m.prefix_hit_rate_frac if m else None):>4}"
                f"  {_last_scale(record, when):<{_LAST_SCALE_WIDTH}}  {reason or '-'}"
            )
        lines.append(line)
    return "\n".join(lines)


def prometheus_installed() -> bool:
    try:
        find_binary()
    except PrometheusError:
        return False
    return True


class LocalStack:
    """The fleet, optional Prometheus, the control API and the autoscaler; ``stop()`` ends all.

    ``prometheus``: True requires it, False never starts it, None starts it when installed.
    ``say`` receives what a person should read (scales, crashes, fallbacks).
    """

    def __init__(
        self,
        service: InferenceService,
        workdir: Path,
        port: int,
        *,
        max_replicas_per_role: int = DEFAULT_MAX_REPLICAS_PER_ROLE,
        autoscale: bool = True,
        prometheus: bool | None = None,
        control_port: int = 0,
        say: Callable[[str], None] = print,
        python: str = sys.executable,
        cold_start_s: float = 0.0,
        step_delay_s: float = 0.0,
        auth_dir: Path | None = None,
        liveness: LivenessProbe | None = None,
    ) -> None:
        self.fleet = LocalFleet(
            service,
            workdir,
            port,
            max_replicas_per_role=max_replicas_per_role,
            python=python,
            cold_start_s=cold_start_s,
            step_delay_s=step_delay_s,
            say=say,
            auth_dir=auth_dir,
            liveness=liveness,
        )
        self.service = service
        self.workdir = workdir
        self.max_replicas_per_role = max_replicas_per_role
        self.autoscale = autoscale
        self.want_prometheus = prometheus
        self.control_port = control_port
        self.say = say
        self.python = python
        self.lock = threading.RLock()
        self.actuator = LocalActuator(self.fleet, say, self.lock)
        self.prometheus: PrometheusServer | None = None
        self.control: ControlServer | None = None
        self.autoscaler: Child | None = None
        self._targets: list[ScrapeTarget] = []

    @property
    def endpoint(self) -> str:
        return self.fleet.endpoint

    @property
    def prometheus_url(self) -> str | None:
        return self.prometheus.url if self.prometheus is not None else None

    @property
    def control_url(self) -> str | None:
        return self.control.url if self.control is not None else None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything; on any failure stop what started and raise (PortInUseError,
        before anything starts, for any port of the fleet or the control API; ChildFailedError
        with a log tail; PrometheusError when required but missing)."""
        ports = self.fleet.ports()
        if self.control_port:
            ports["control API"] = self.control_port
        require_free_ports(ports, HOST)
        try:
            self.fleet.start()
            self._start_prometheus()
            self.control = ControlServer(
                self.actuator,
                capped_service(self.service, self.max_replicas_per_role),
                max_replicas=self.max_replicas_per_role,
                prometheus_url=self.prometheus_url,
                router_address=self.fleet.router_metrics_address,
                port=self.control_port,
            )
            self.control.start()
            if self.autoscale:
                self._start_autoscaler()
        except BaseException:
            self.stop()
            raise

    def _start_prometheus(self) -> None:
        if self.want_prometheus is False:
            return
        if not prometheus_installed():
            if self.want_prometheus:
                find_binary()  # raises with the install hint
            self.say(
                "prometheus is not installed (apt-get install prometheus): the autoscaler "
                "reads the engines' /metrics directly"
            )
            return
        interval = self.service.spec.monitoring.scrape_interval.total_seconds()
        self._targets = self.scrape_targets()
        self.prometheus = PrometheusServer(
            self.workdir / "prometheus", self._targets, scrape_interval_s=interval
        )
        self.prometheus.start()
        # Prometheus 2.x hands new targets to its scrapers every 5 s: until the first scrape,
        # every role has "no series". The autoscaler starts after it, or a tier that decides
        # every 15 s shows that first blind decision for 15 s (issue 12, the large tier's
        # "no series" during make demo's load step).
        try:
            self.prometheus.wait_scraped(PROMETHEUS_FIRST_SCRAPE_TIMEOUT_S)
        except PrometheusError as exc:
            self.say(f"{exc}; the autoscaler holds those roles until they are")

    def _start_autoscaler(self) -> None:
        assert self.control is not None
        metrics_port = free_port(HOST)
        argv = [
            *(self.python, "-m", "fleetpilot", "autoscaler"),
            *("--fleet", self.control.url, "--metrics-port", str(metrics_port)),
            # A person reads this log (the demo's decisions, crash tails), as the fleet's others.
            *("--log-format", "plain"),
        ]
        self.autoscaler = self.fleet.supervisor.start(
            "autoscaler",
            argv,
            health_url=f"http://{HOST}:{metrics_port}/metrics",
            env={"PYTHONUNBUFFERED": "1"},
        )
        self.fleet.supervisor.wait_healthy(self.autoscaler, self.fleet.health_timeout_s)

    def step(self) -> list[str]:
        """Supervise once; returns one report per restarted child - crashed (with its log
        tail) or unresponsive to its liveness probe (killed) -, Prometheus included (restarted
        without waiting: meanwhile the autoscaler reads the engines directly)."""
        with self.lock:
            reports = self.fleet.supervise_once()
            self.fleet.refresh_serving()
            targets = self.scrape_targets()
        if self.prometheus is not None:
            if targets != self._targets:
                self._targets = targets
                self.prometheus.set_targets(targets)
            # Each logs its event itself (structured); the report is for the person.
            for report in (
                self.prometheus.restart_if_exited(),
                self.prometheus.restart_if_unresponsive(self.fleet.liveness),
            ):
                if report is not None:
                    reports.append(report)
        return reports

    def scrape_targets(self) -> list[ScrapeTarget]:
        """Every engine process and the router, labeled as the planner labels their pods."""
        namespace = self.service.namespace
        router = ScrapeTarget(
            self.fleet.router_metrics_address, router_selector(self.service.name), namespace
        )
        engines = [
            ScrapeTarget(r.address, engine_selector(self.service.name, r.tier, r.role), namespace)
            for r in self.fleet.replicas
        ]
        return [router, *engines]

    def status_table(self) -> str:
        with self.lock:
            rows = self.fleet.status_rows()
        return format_status(rows, self.actuator.roles if self.autoscale else None)

    def stop(self) -> None:
        """The autoscaler first (it must not scale a fleet being stopped), then the control
        API, the fleet and Prometheus; nothing is left running."""
        if self.autoscaler is not None:
            self.fleet.supervisor.stop(self.autoscaler, grace_s=5.0)
        if self.control is not None:
            self.control.stop()
        self.actuator.close()
        self.fleet.stop()
        if self.prometheus is not None:
            self.prometheus.stop()

    def leftovers(self) -> list[int]:
        """Pids still alive of anything the stack started (empty after ``stop``)."""
        pids = self.prometheus.pids if self.prometheus is not None else set()
        prometheus = group_members(pids) if pids else []
        return sorted([*self.fleet.leftovers(), *prometheus])

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LocalStack", "format_status", "prometheus_installed"]
