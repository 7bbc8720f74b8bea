"""A real Prometheus server on loopback: the local fleet's, and the autoscaler tests'.

Runs the ``prometheus`` binary (Debian's package ``prometheus``: ``apt-get install prometheus``,
or ``make prometheus``) as a child process with a generated config, its TSDB in a folder of the
caller's, on a free loopback port, scraping static targets every second. Nothing depends on a
system service the package may have set up: this module never talks to one, and stops only the
process group it started, by pid.

Each target stands for one engine pod. Its pod labels (``fleetpilot.dev/service`` ...: the
engine selector of :mod:`fleetpilot.kube.names`) reach Prometheus exactly as Kubernetes service
discovery hands them over, as ``__meta_kubernetes_pod_label_fleetpilot_dev_service`` and
``__meta_kubernetes_namespace``, and the same relabel rules a cluster's scrape config uses turn
them into ``fleetpilot_dev_service`` and ``namespace``; so the reader is tested against the
labels it will meet in a cluster.

Use it from Python::

    labels = engine_selector("chat", "small", RoleName.UNIFIED)  # fleetpilot.kube.names
    target = ScrapeTarget("127.0.0.1:8001", labels, "ml")
    with PrometheusServer(tmp_path, [target]) as prom:
        prom.wait_scraped()
        print(prom.url)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from fleetpilot.runtime.liveness import LivenessProbe
from fleetpilot.runtime.processes import (
    Child,
    ChildFailedError,
    StartsAndStops,
    Supervisor,
    free_port,
    group_members,
    unresponsive_fields,
    unresponsive_report,
)

log = logging.getLogger(__name__)

DEFAULT_BINARY = "/usr/bin/prometheus"
# Readiness is reached in about a second on a laptop; a loaded CI machine may take ten.
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# A Prometheus that keeps dying (a corrupt TSDB, its port taken) is restarted after 1, 2, 4 ...
# seconds, at most this long apart, so a crash loop neither spins nor floods the log.
MAX_RESTART_DELAY_S = 30.0
# Up this long after a restart, and the next crash starts the backoff over.
RESTART_RESET_S = 60.0
POD_LABEL_PREFIX = "__meta_kubernetes_pod_label_"
NAMESPACE_META = "__meta_kubernetes_namespace"


class PrometheusError(RuntimeError):
    """The Prometheus server could not be found, started or stopped as asked."""


def sanitize_label_name(name: str) -> str:
    """What Kubernetes service discovery makes of a pod label name: ``fleetpilot.dev/tier`` ->
    ``fleetpilot_dev_tier`` (every character outside ``[a-zA-Z0-9_]`` becomes ``_``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


@dataclass(frozen=True)
class ScrapeTarget:
    """One scraped endpoint (an engine pod), with the pod labels and namespace it would have."""

    address: str  # host:port
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    namespace: str | None = None
    metrics_path: str = "/metrics"


def find_binary(binary: str | os.PathLike[str] | None = None) -> Path:
    """The prometheus binary: as given, else $FLEETPILOT_PROMETHEUS_BIN, else on PATH."""
    candidates = [
        str(binary) if binary else None,
        os.environ.get("FLEETPILOT_PROMETHEUS_BIN"),
        shutil.which("prometheus"),
        DEFAULT_BINARY,
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise PrometheusError(
        "no prometheus binary: install Debian's package (apt-get install -y prometheus, or "
        "make prometheus), or set FLEETPILOT_PROMETHEUS_BIN"
    )


def render_config(targets: Sequence[ScrapeTarget], scrape_interval_s: float) -> dict[str, Any]:
    """The prometheus.yml for ``targets``. Purely computational.

    One static config per target carries its pod labels as service discovery would; the
    relabel rules are the ones documented for clusters in ``fleetpilot.autoscaler.prometheus``.
    """
    interval = _duration(scrape_interval_s)
    by_path: dict[str, list[ScrapeTarget]] = {}
    for target in targets:
        by_path.setdefault(target.metrics_path, []).append(target)
    jobs = []
    for index, (path, group) in enumerate(sorted(by_path.items())):
        static = []
        for target in group:
            labels = {
                POD_LABEL_PREFIX + sanitize_label_name(k): v for k, v in target.pod_labels.items()
            }
            if target.namespace is not None:
                labels[NAMESPACE_META] = target.namespace
            static.append({"targets": [target.address], "labels": labels})
        jobs.append(
            {
                "job_name": f"engines-{index}",
                "metrics_path": path,
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": static,
                "relabel_configs": [
                    {"action": "labelmap", "regex": f"{POD_LABEL_PREFIX}(.+)"},
                    {"source_labels": [NAMESPACE_META], "target_label": "namespace"},
                ],
            }
        )
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": jobs,
    }


def _duration(seconds: float) -> str:
    millis = max(1, round(seconds * 1000))
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def _opener() -> urllib.request.OpenerDirector:
    # Loopback requests must never go through an HTTP(S)_PROXY from the environment.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrometheusServer(StartsAndStops):
    """One Prometheus process; ``start()``/``stop()`` or a ``with`` block."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[ScrapeTarget] = (),
        *,
        scrape_interval_s: float = 1.0,
        binary: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.workdir = Path(workdir)
        self.targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self.binary = find_binary(binary)
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self._supervisor = Supervisor(self.workdir)
        self._child: Child | None = None
        self._http = _opener()
        # Every pid started, restarts included: leftovers() must see them all.
        self.pids: set[int] = set()
        self.restarts = 0
        self._restart_delay_s = 0.0
        self._restart_at: float | None = None  # when an exited one is due to be restarted
        self._started_at = 0.0

    # -- paths and addresses ----------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.workdir / "prometheus.yml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("prometheus is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Self:
        if self._child is not None:
            raise PrometheusError("prometheus is already started")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        # Another process may take the free port before prometheus binds it: try a new one.
        for attempt in range(3):
            self.port = free_port("127.0.0.1")
            self._spawn()
            try:
                self._wait_ready()
                log.info("prometheus ready at %s (pid %s)", self.url, self.pid)
                return self
            except PrometheusError:
                exited = self._child is not None and not self._child.alive()
                self.stop()
                if not (exited and "address already in use" in self._log_tail()) or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self) -> None:
        tsdb = self.workdir / "data"
        tsdb.mkdir(exist_ok=True)
        args = [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={tsdb}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=info",
        ]
        # The supervisor gives it its own process group (stop() signals exactly this tree)
        # and the parent-death signal (a test run killed with SIGKILL leaves no Prometheus).
        # Ready once it can serve queries; alive while it answers /-/healthy (a TSDB replaying
        # its write-ahead log after a restart is alive but not ready).
        self._child = self._supervisor.start(
            "prometheus",
            args,
            health_url=f"{self.url}/-/ready",
            liveness_url=f"{self.url}/-/healthy",
        )
        self.pids.add(self._child.pid)
        self._started_at = time.monotonic()

    def _wait_ready(self) -> None:
        assert self._child is not None
        try:
            self._supervisor.wait_healthy(self._child, self.startup_timeout_s)
        except ChildFailedError as exc:
            raise PrometheusError(str(exc)) from None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers; idempotent."""
        child, self._child = self._child, None
        if child is None:
            return
        self._supervisor.stop(child, grace_s=STOP_TIMEOUT_S)
        leftover = group_members({child.pid})
        if leftover:
            raise PrometheusError(f"processes left in prometheus' group: {leftover}")

    def restart_if_exited(self, now: float | None = None) -> str | None:
        """Restart a Prometheus that exited without being asked to, on the same port (the
        autoscaler keeps its URL) and TSDB, without waiting for it to be ready.

        Returns the report of the crash, with the tail of its log, once per crash; None when
        it runs (or was stopped, or its restart is backing off).
        """
        child = self._child
        if child is None or child.stopping or child.popen is None or child.alive():
            return None
        clock = time.monotonic() if now is None else now
        if self._restart_at is None:
            up_s = clock - self._started_at
            # The first crash, or one after a long run, restarts at once; a crash loop backs off.
            self._restart_delay_s = (
                0.0
                if self.restarts == 0 or up_s >= RESTART_RESET_S
                else min(MAX_RESTART_DELAY_S, max(1.0, 2 * self._restart_delay_s))
            )
            self._restart_at = clock + self._restart_delay_s
            report = (
                f"prometheus (pid {child.pid}) exited with code {child.popen.returncode}; "
                f"restarting it on {self.url}"
                + (f" in {self._restart_delay_s:.0f}s" if self._restart_delay_s else "")
                + f". Last lines of {child.log_path}:\n{child.tail(10)}"
            )
            log.warning(
                "prometheus exited; restarting it",
                extra={
                    "child": "prometheus",
                    "pid": child.pid,
                    "exit_code": child.popen.returncode,
                    "restart_in_s": self._restart_delay_s,
                    "reported": True,
                },
            )
            if self._restart_delay_s == 0.0:
                self._respawn(child)
            return report
        if clock >= self._restart_at:
            self._respawn(child)
        return None

    def restart_if_unresponsive(self, probe: LivenessProbe, now: float | None = None) -> str | None:
        """Probe a running Prometheus' /-/healthy when due; one that stopped answering (as
        ``probe`` decides) is killed with SIGKILL and restarted on the same port and TSDB,
        without waiting for it. Returns the one-line report, once per freeze; None otherwise.
        """
        child = self._child
        if child is None:
            return None
        for frozen in self._supervisor.unresponsive(probe, now):
            report = f"{unresponsive_report(frozen, probe)} on {self.url}"
            log.warning(
                "prometheus unresponsive; killing and restarting it",
                extra={**unresponsive_fields(frozen, probe), "reported": True},
            )
            self._respawn(frozen, kill=True)
            return report
        return None

    def _respawn(self, child: Child, *, kill: bool = False) -> None:
        self._restart_at = None
        self.restarts += 1
        self._write_config()
        self._supervisor.restart(child, kill=kill)
        assert child.popen is not None
        self.pids.add(child.pid)
        self._started_at = time.monotonic()
        log.info("prometheus restarted at %s (pid %s)", self.url, child.pid)

    # -- targets ---------------------------------------------------------------------------
    def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
        """Replace the scraped targets; a running server reloads its config (SIGHUP)."""
        self.targets = list(targets)
        self._write_config()
        if self._child is not None and self._child.alive():
            os.kill(self._child.pid, signal.SIGHUP)

    def _write_config(self) -> None:
        config = render_config(self.targets, self.scrape_interval_s)
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    # -- queries ---------------------------------------------------------------------------
    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector (for checks and status; the autoscaler has its
        own reader)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with self._http.open(url, timeout=5) as response:
            body = json.loads(response.read())
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_scraped(self, timeout_s: float = 15.0) -> None:
        """Wait until every target has been scraped successfully at least once."""
        want = {t.address for t in self.targets}
        deadline = time.monotonic() + timeout_s
        up: set[str] = set()
        while True:
            with contextlib.suppress(OSError, KeyError, ValueError):
                up = {
                    str(s["metric"].get("instance"))
                    for s in self.query("up == 1")
                    if s["metric"].get("instance") in want
                }
                if up == want:
                    return
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"targets not scraped after {timeout_s:.0f}s: {sorted(want - up)}"
                )
            time.sleep(0.1)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


__all__ = [
    "DEFAULT_BINARY",
    "MAX_RESTART_DELAY_S",
    "PrometheusError",
    "PrometheusServer",
    "ScrapeTarget",
    "find_binary",
    "render_config",
    "sanitize_label_name",
]
