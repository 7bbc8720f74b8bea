"""The router's background tasks (config watch, endpoint reload, scrapes, probes) share this."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:  # only types: rounds need no router code to be imported
    from fleetpilot.routing.metrics import RouterMetrics
    from fleetpilot.routing.router import Router

log = logging.getLogger(__name__)


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished unwinding (None: nothing to do)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class ReplicaRounds(ABC):
    """One round over the router's replicas every ``interval_s``, in a task of its own and
    over an HTTP session of its own.

    Subclasses say how their session pools connections and what a round does. A round that
    raises is logged and the next one runs on time: one bad round must never stop scraping or
    probing for the life of the router.
    """

    name = "rounds"

    def __init__(
        self, router: Router, metrics: RouterMetrics, *, interval_s: float, timeout_s: float
    ) -> None:
        self.router = router
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    @abstractmethod
    def new_session(self) -> aiohttp.ClientSession:
        """The round's own connection pool, apart from the request traffic's."""

    @abstractmethod
    async def round(self, session: aiohttp.ClientSession) -> object:
        """One round of work over ``session``."""

    async def run_once(self) -> object:
        """One round now (tests drive rounds this way); None before ``start``."""
        session = self._session
        if session is None:
            return None
        return await self.round(session)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.run_once()
            except Exception:
                log.exception("%s round failed", self.name)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def start(self) -> None:
        if self._task is None:
            self._session = self.new_session()
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
