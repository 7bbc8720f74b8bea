"""The silence budget of a stream already flowing.

An engine that dies with a RST ends its stream with an error the proxy sees at once; one that
freezes (SIGSTOP, a wedged GPU, its node gone silently) just stops sending. :class:`StallWatch`
is :class:`~fleetpilot.routing.first_byte.FirstByteWatch` for the middle of a stream: once no
byte has come for the budget it probes the replica's ``/health``, and ends the stream's read
only if the probe fails. A live replica that is merely slow (a long prefill of another request
in its batch) keeps the stream.

Cheap per token: the caller stores the loop time on each chunk (``progress``); one timer per
budget period, not per chunk, checks whether the stream went quiet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType

from fleetpilot.routing.first_byte import LIVENESS_PROBE_S


class StallError(Exception):
    """The stream's replica sent nothing for the budget and failed its liveness probe."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"no byte for {budget_s:g}s and the replica failed its /health probe")
        self.budget_s = budget_s


class StallWatch:
    """``async with StallWatch(probe, budget_s) as watch`` around a stream's read loop, calling
    ``watch.progress()`` on every chunk. Raises :class:`StallError` from ``__aexit__`` when it
    ended the loop."""

    def __init__(self, probe: Callable[[float], Awaitable[bool]], budget_s: float) -> None:
        if budget_s <= 0:
            raise ValueError("the stall budget must be positive")
        self.probe = probe
        self.budget_s = budget_s
        self.probe_s = min(LIVENESS_PROBE_S, budget_s / 2)
        self.stalled = False
        self._timeout = asyncio.timeout(None)
        self._timer: asyncio.TimerHandle | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = 0.0

    async def __aenter__(self) -> StallWatch:
        self._loop = asyncio.get_running_loop()
        await self._timeout.__aenter__()
        self.progress()
        self._arm(self._last)
        return self

    def progress(self) -> None:
        assert self._loop is not None
        self._last = self._loop.time()

    def _arm(self, since: float) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_at(since + self.budget_s - self.probe_s, self._check)

    def _check(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._loop.time() - self._last < self.budget_s - self.probe_s:
            self._arm(self._last)  # bytes came meanwhile: wait a budget from the last one
            return
        self._probe_task = self._loop.create_task(self._judge())

    async def _judge(self) -> None:
        alive = await self.probe(self.probe_s)
        assert self._loop is not None
        if alive:
            self._arm(self._loop.time())  # slow, not dead: probed again a budget later
            return
        self.stalled = True
        self._timeout.reschedule(self._loop.time())  # ends the read now

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._probe_task is not None:
            self._probe_task.cancel()
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if not self.stalled:  # pragma: no cover - only the watch reschedules it
                raise
            raise StallError(self.budget_s) from None
