"""Probing ejected replicas back into rotation with ``GET /health``.

Which replicas are ejected is decided by the pure ``policies.ejection.HealthTracker`` from the
failures the proxy and scraper report; this module only does the probing I/O.
"""

from __future__ import annotations

import asyncio

import aiohttp

from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.tasks import ReplicaRounds


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


class Prober(ReplicaRounds):
    """Every ``interval_s``, probes each ejected replica; a 200 readmits it."""

    name = "prober"

    def new_session(self) -> aiohttp.ClientSession:
        # Probes open a fresh connection each time: a pooled one could outlive the process
        # it reached and report a restarted replica as dead.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))

    async def round(self, session: aiohttp.ClientSession) -> list[str]:
        """Probe every ejected replica; the ids readmitted."""
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
