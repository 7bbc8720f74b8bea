"""Probing ejected replicas back into rotation with ``GET /health``.

Which replicas are ejected is decided by the pure ``policies.ejection.HealthTracker`` from the
failures the proxy and scraper report; this module only does the probing I/O.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.router import ReplicaState, Router
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)


async def answers_health(
    session: aiohttp.ClientSession, replica: ReplicaState, timeout_s: float
) -> bool:
    """Whether the replica's ``/health`` answers 200 within ``timeout_s``: the one liveness
    check, for probing ejected replicas back and for judging a replica past its first-byte
    budget."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(replica.url("/health"), timeout=timeout) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


class Prober:
    """Every ``interval_s``, probes each ejected replica; a 200 readmits it."""

    def __init__(
        self, router: Router, metrics: RouterMetrics, *, interval_s: float, timeout_s: float
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def probe_once(self) -> list[str]:
        """Probe every ejected replica; the ids readmitted."""
        session = self._session
        if session is None:
            return []
        ejected = [r for rid in self.router.health.ejected() if (r := self.router.replica(rid))]
        if not ejected:
            return []
        results = await asyncio.gather(
            *(answers_health(session, r, self.timeout_s) for r in ejected)
        )
        readmitted = []
        for replica, ok in zip(ejected, results, strict=True):
            if ok and self.router.readmit(replica.id):
                self.metrics.readmissions.labels(replica.id).inc()
                readmitted.append(replica.id)
        return readmitted

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_once()
            except Exception:
                log.exception("probe round failed")

    async def start(self) -> None:
        if self._task is None:
            # Probes open a fresh connection each time: a pooled one could outlive the process
            # it reached and report a restarted replica as dead.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0)
            )
            self._task = asyncio.create_task(self._run(), name="prober")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
