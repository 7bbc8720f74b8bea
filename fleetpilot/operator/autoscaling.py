"""The operator's autoscaler: one loop over every InferenceService the operator sees.

Not a kopf timer: kopf puts a finalizer on every object a timer (or daemon) runs for, so that
it can stop the timer before the object goes - and a service then cannot be deleted while the
operator is not running (uninstalled first, scaled to zero, crash-looping). A tick against a
service deleted meanwhile fails like any other API call and is skipped, so nothing has to be
stopped: the services are followed through their watch events (which need no finalizer), and
one loop ticks them all. Without a timer kopf also removes the finalizer it added before.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

# Services ticked at once: each tick waits mostly on Prometheus and the API server.
MAX_PARALLEL_SERVICES = 8

Tick = Callable[[Mapping[str, Any]], None]


class ServiceTicker:
    """Follows the services (``observe`` each watch event) and ticks each every ``every_s``."""

    def __init__(self, tick: Tick, every_s: float) -> None:
        self._tick = tick
        self.every_s = every_s
        self._services: dict[tuple[str, str], Mapping[str, Any]] = {}
        # The generation of each service whose "no metrics source" this process has written
        # or found written (see :meth:`reported_for`).
        self._reported: dict[tuple[str, str], Any] = {}
        self._executor = ThreadPoolExecutor(MAX_PARALLEL_SERVICES, thread_name_prefix="autoscaler")

    @staticmethod
    def _key(body: Mapping[str, Any]) -> tuple[str, str]:
        metadata = body.get("metadata", {})
        return (metadata.get("namespace", ""), metadata.get("name", ""))

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A watch event of an InferenceService: the latest body, or its deletion."""
        key = self._key(body)
        if event_type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
            self._services.pop(key, None)
            self._reported.pop(key, None)
        else:
            self._services[key] = body

    def latest(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The service's body as its watch last delivered it (a copy), if followed."""
        body = self._services.get((namespace, name))
        return copy.deepcopy(dict(body)) if body is not None else None

    def reported_for(self, body: Mapping[str, Any]) -> bool:
        """Whether the service's current generation was reported (:meth:`reported`) by this
        process. What the watch delivers lags what was written by as much as the operator is
        busy: a tick that trusted the watched body alone would write again each time, every
        write a 409 and a re-read (twice the status requests of 1,000 services settling)."""
        key = self._key(body)
        generation = body.get("metadata", {}).get("generation")
        return key in self._reported and self._reported[key] == generation

    def reported(self, body: Mapping[str, Any]) -> None:
        """The service's current generation is reported: its ticks need not look again."""
        self._reported[self._key(body)] = body.get("metadata", {}).get("generation")

    @property
    def services(self) -> list[tuple[str, str]]:
        return sorted(self._services)

    def _tick_one(self, key: tuple[str, str], body: Mapping[str, Any]) -> None:
        try:
            self._tick(body)
        except Exception:  # one service's failure never stops the others' scaling
            log.exception("autoscaler tick failed", extra={"service": "/".join(key)})

    async def tick_all(self) -> None:
        """One tick of every service followed now, ``MAX_PARALLEL_SERVICES`` at a time."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(
                loop.run_in_executor(self._executor, self._tick_one, key, body)
                for key, body in list(self._services.items())
            )
        )

    async def run(self) -> None:
        """Tick every ``every_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.every_s)
            await self.tick_all()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
