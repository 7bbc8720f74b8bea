"""Scraping each replica's ``/metrics`` for its queue and KV-cache usage, all replicas
concurrently, once per interval."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.load import parse_engine_metrics
from fleetpilot.routing.router import ReplicaState, Router
from fleetpilot.routing.tasks import cancel

log = logging.getLogger(__name__)


class Scraper:
    """Keeps ``ReplicaState.metrics`` fresh.

    Its own connection pool, apart from the request traffic's: a slow scrape must never take a
    pooled connection a request is waiting for. A scrape that cannot connect counts as a
    replica failure (a killed replica with no traffic gets ejected all the same), and so does
    one that times out: an engine that accepts the connection and never answers is frozen
    (SIGSTOP, a wedged process), and without traffic nothing else would notice. A busy engine
    is safe from this: /metrics is served by its API server, not queued behind generation,
    and every request it completes clears its failure count, so only an engine that answers
    neither scrapes nor requests reaches ``ejection.failures`` in a row.
    """

    def __init__(
        self,
        router: Router,
        metrics: RouterMetrics,
        *,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> None:
        session = self._session
        if session is None:
            return
        replicas = self.router.replicas()
        if replicas:
            await asyncio.gather(*(self._scrape(session, r) for r in replicas))

    async def _scrape(self, session: aiohttp.ClientSession, replica: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.get(replica.endpoint.base_url + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    self.metrics.scrape_errors.labels(replica.id).inc()
                    return
                text = await r.text(errors="replace")
        except (aiohttp.ClientConnectorError, TimeoutError):  # aiohttp's timeouts are TimeoutErrors
            self.metrics.scrape_errors.labels(replica.id).inc()
            self.router.record_failure(replica)
            return
        except aiohttp.ClientError:
            self.metrics.scrape_errors.labels(replica.id).inc()
            return
        parsed = parse_engine_metrics(text)
        if parsed is not None:
            replica.metrics = parsed
            replica.scraped_at = time.monotonic()

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.scrape_once()
            except Exception:  # never let one bad round stop scraping
                log.exception("scrape round failed")
            elapsed = time.monotonic() - started
            await asyncio.sleep(max(0.0, self.interval_s - elapsed))

    async def start(self) -> None:
        if self._task is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, keepalive_timeout=max(5.0, 3 * self.interval_s)
                )
            )
            self._task = asyncio.create_task(self._run(), name="scraper")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
