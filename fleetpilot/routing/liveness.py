"""The liveness watch of one upstream exchange: a silence budget, a liveness probe when it is
spent, and a verdict.

A replica that accepts TCP but never answers (SIGSTOPped, wedged, its node gone without a RST)
would otherwise hold a request for the whole request timeout, and one that freezes mid-stream
just stops sending. :class:`LivenessWatch` bounds both waits the same way: once nothing has come
for the budget (less the probe's own time) it probes the replica's ``/health`` and, if the
probe fails, ends the awaited work (verdict "dead"). A replica that answers its probe keeps the
exchange - a non-streamed generation sends its first byte only when done, a long prefill of
another request stalls a stream - probed again a budget later, unless the caller wants a slow
replica given up on too (``keep_while_alive=False``, verdict "slow": the prefill hop, where
past the budget the decode replica computing the prompt itself is the quicker answer).

Its two uses:

- the first byte: ``async with`` around the await that ends at the first byte; the budget
  counts from the start. It can also be given up before its budget: ``give_up`` is asked from
  ``give_up_after_s`` on, every ``GIVE_UP_POLL_S``, and ends the wait when it says so (verdict
  "suspect": the proxy asks whether the replica turned suspect, ``policies.suspicion``);
  ``on_due`` is called once when the first question is due (the proxy asks the replica's
  /health then, so a frozen one turns suspect without waiting for its next scrape);
- a stream already flowing: ``async with`` around the read loop, calling ``progress()`` on
  every chunk; the budget counts from the last chunk.

Cheap on the common path: no task of its own, one or two timer handles and one
``asyncio.timeout`` around the caller's own await; ``progress`` stores the loop time, and one
timer per budget period, not per chunk, checks whether the exchange went quiet. The probe runs
only when the budget is nearly spent. The watch does no I/O of its own: the probe is the
caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Literal

Verdict = Literal["dead", "slow", "suspect"]

# The liveness probe gets at most this much of the budget (and at most half of it): /health of
# a live engine is answered by its API server, never queued behind generation.
LIVENESS_PROBE_S = 2.0
# How often ``give_up`` is asked once due: it turns with a scrape's or probe's outcome; 50 ms
# is small beside the ~0.75 s a frozen replica takes to turn suspect, and a question costs a
# few attribute reads.
GIVE_UP_POLL_S = 0.05


class SilentReplicaError(Exception):
    """The watch ended the awaited work: ``verdict`` says why ("dead": silent for the budget,
    the replica failed its liveness probe; "slow": it is alive, but the caller does not wait for
    slow ones; "suspect": before its budget, ``give_up`` said so)."""

    def __init__(self, verdict: Verdict, budget_s: float) -> None:
        super().__init__(f"nothing from the replica within {budget_s:g}s ({verdict})")
        self.verdict: Verdict = verdict
        self.budget_s = budget_s


class LivenessWatch:
    """``async with LivenessWatch(probe, budget_s) as watch`` around the await (or read loop).

    ``probe(timeout_s)`` answers whether the replica is alive. Raises
    :class:`SilentReplicaError` from ``__aexit__`` when the watch ended the work; any other
    outcome (the work's own result or exception, an outer cancellation) passes through.
    """

    def __init__(
        self,
        probe: Callable[[float], Awaitable[bool]],
        budget_s: float,
        *,
        keep_while_alive: bool = True,
        give_up: Callable[[], bool] | None = None,
        give_up_after_s: float = 0.0,
        on_due: Callable[[], None] | None = None,
    ) -> None:
        if budget_s <= 0:
            raise ValueError("the liveness budget must be positive")
        self.probe = probe
        self.budget_s = budget_s
        self.probe_s = min(LIVENESS_PROBE_S, budget_s / 2)
        self.keep_while_alive = keep_while_alive
        self.give_up = give_up
        self.give_up_after_s = give_up_after_s
        self.on_due = on_due
        self.verdict: Verdict | None = None
        self._timeout = asyncio.timeout(None)
        self._timer: asyncio.TimerHandle | None = None
        self._give_up_timer: asyncio.TimerHandle | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last = 0.0

    async def __aenter__(self) -> LivenessWatch:
        self._loop = asyncio.get_running_loop()
        await self._timeout.__aenter__()
        self.progress()
        self._arm(self._last)
        if self.give_up is not None and self.give_up_after_s < self.budget_s:
            self._give_up_timer = self._loop.call_later(self.give_up_after_s, self._ask)
        return self

    def progress(self) -> None:
        """Something came: the budget counts from now."""
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
        if self.verdict is not None:
            return  # given up meanwhile
        assert self._loop is not None
        if alive and self.keep_while_alive:
            self._arm(self._loop.time())  # slow, not dead: probed again a budget later
            return
        self._end("slow" if alive else "dead")

    def _ask(self) -> None:
        assert self.give_up is not None
        self._give_up_timer = None
        if self.verdict is not None:
            return
        if self.on_due is not None:
            self.on_due()
            self.on_due = None
        if self.give_up():
            self._end("suspect")
            return
        assert self._loop is not None
        self._give_up_timer = self._loop.call_later(GIVE_UP_POLL_S, self._ask)

    def _end(self, verdict: Verdict) -> None:
        assert self._loop is not None
        self.verdict = verdict
        self._timeout.reschedule(self._loop.time())  # ends the awaited work now

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._give_up_timer is not None:
            self._give_up_timer.cancel()
        if self._probe_task is not None:
            self._probe_task.cancel()  # a probe still out is moot now
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if self.verdict is None:  # pragma: no cover - only the watch reschedules it
                raise
            raise SilentReplicaError(self.verdict, self.budget_s) from None
