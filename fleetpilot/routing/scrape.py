"""Scraping each replica's ``/metrics`` for its queue and KV-cache usage, all replicas
concurrently, once per interval."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from fleetpilot.routing.policies.load import parse_engine_metrics
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.tasks import ReplicaRounds


class Scraper(ReplicaRounds):
    """Keeps ``ReplicaState.metrics`` fresh.

    Its own connection pool, apart from the request traffic's: a slow scrape must never take a
    pooled connection a request is waiting for. A scrape that cannot connect counts as a
    replica failure (a killed replica with no traffic gets ejected all the same), and so does
    one that times out: an engine that accepts the connection and never answers is frozen
    (SIGSTOP, a wedged process), and without traffic nothing else would notice. A busy engine
    is safe from this: /metrics is served by its API server, not queued behind generation,
    and every request it completes clears its failure count, so only an engine that answers
    neither scrapes nor requests reaches ``ejection.failures`` in a row. A timeout counts as a
    failure that hung (``ejection``), and either failure makes the replica silent until it
    answers again (``policies.suspicion``): with a request waiting there, suspect at once.
    """

    name = "scraper"

    def new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=max(5.0, 3 * self.interval_s))
        )

    async def round(self, session: aiohttp.ClientSession) -> None:
        replicas = self.router.replicas()
        if replicas:
            await asyncio.gather(*(self._scrape(session, r) for r in replicas))

    async def _scrape(self, session: aiohttp.ClientSession, replica: ReplicaState) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with session.get(replica.endpoint.base_url + "/metrics", timeout=timeout) as r:
                replica.heard_from()
                if r.status != 200:
                    self.metrics.scrape_errors.labels(replica.id).inc()
                    return
                text = await r.text(errors="replace")
        except (aiohttp.ClientConnectorError, TimeoutError) as exc:  # aiohttp's are TimeoutErrors
            self.metrics.scrape_errors.labels(replica.id).inc()
            replica.went_silent(self.router.clock())
            self.router.record_failure(replica, hung=isinstance(exc, TimeoutError))
            return
        except aiohttp.ClientError:
            self.metrics.scrape_errors.labels(replica.id).inc()
            return
        parsed = parse_engine_metrics(text)
        if parsed is not None:
            replica.metrics = parsed
            replica.scraped_at = time.monotonic()
