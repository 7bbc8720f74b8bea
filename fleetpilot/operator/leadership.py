"""Lease-based leader election around the operator: several replicas, one acts.

kopf's peering is not leader election (replicas of equal priority that see each other all
pause), so the operator is wrapped in the kubernetes client's LeaderElection over a
coordination.k8s.io Lease: a replica waits as a standby (serving /healthz, so its liveness
probe holds) until it holds the Lease, then runs kopf; a leader that cannot renew the Lease
within the renew deadline exits at once, so two replicas never act together for longer than
that - its pod restarts as a standby. A leader killed outright is replaced once its Lease,
unrenewed, has been seen unchanged for the lease duration.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kubernetes import client as k8s
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseSettings:
    """Which Lease, who we are, and the timings (client-go's defaults: 15 s, 10 s, 2 s)."""

    name: str
    namespace: str
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: int = 10
    retry_period_s: int = 2


def default_identity() -> str:
    """The pod's name (the chart sets POD_NAME) or the host's, made unique per process."""
    base = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


class Leadership:
    """Campaigns for the Lease in a daemon thread; ``wait`` blocks until this process leads.
    ``on_lost`` runs (in that thread) when a leader fails to renew: it must stop the process."""

    def __init__(
        self, api: k8s.ApiClient, settings: LeaseSettings, on_lost: Callable[[], None]
    ) -> None:
        self.settings = settings
        self._leading = threading.Event()
        lock = LeaseLock(settings.name, settings.namespace, settings.identity)  # type: ignore[no-untyped-call]
        lock.api_instance = k8s.CoordinationV1Api(api)  # our credentials, not the global ones
        config = electionconfig.Config(  # type: ignore[no-untyped-call]
            lock,
            lease_duration=settings.lease_duration_s,
            renew_deadline=settings.renew_deadline_s,
            retry_period=settings.retry_period_s,
            onstarted_leading=self._started,
            onstopped_leading=on_lost,
        )
        self._election = leaderelection.LeaderElection(config)  # type: ignore[no-untyped-call]
        self._thread = threading.Thread(
            target=self._election.run, name="leader-election", daemon=True
        )

    def _started(self) -> None:
        log.info("leading", extra={"identity": self.settings.identity})
        self._leading.set()

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    def start(self) -> None:
        log.info(
            "standing by for the lease",
            extra={
                "lease": f"{self.settings.namespace}/{self.settings.name}",
                "identity": self.settings.identity,
            },
        )
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._leading.wait(timeout)


class _Healthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path == "/healthz"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"standby\n" if ok else b"not found\n")

    def log_message(self, format: str, *args: object) -> None:  # quiet: probes every few s
        return


class StandbyHealth:
    """/healthz for a standby replica, on the port kopf's liveness endpoint takes once this
    replica leads (``close`` frees it first)."""

    def __init__(self, host: str, port: int) -> None:
        self._server = ThreadingHTTPServer((host, port), _Healthy)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
