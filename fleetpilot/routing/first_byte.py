"""The time-to-first-byte budget of one upstream attempt.

A replica that accepts TCP but never answers (SIGSTOPped, wedged, its node gone without a RST)
would otherwise hold a request for the whole request timeout. :class:`FirstByteWatch` bounds the
wait: shortly before the budget ends it probes the replica's ``/health`` and, if the probe
fails, ends the attempt at the budget. A replica that answers its probe keeps a request that
may legitimately take long (a non-streamed generation sends its first byte only when done),
unless the caller wants a slow replica given up on too (the prefill hop: past the budget the
decode replica computing the prompt itself is the quicker answer).

An attempt can also be given up before its budget: ``give_up`` is asked from
``give_up_after_s`` on, every ``GIVE_UP_POLL_S``, and ends the attempt when it says so (the
proxy asks whether the replica has turned suspect: ``policies.suspicion``); ``on_due`` is called
once when the first question is due (the proxy asks the replica's /health then, so a frozen
one turns suspect without waiting for its next scrape).

Cheap on the common path: no task of its own per attempt, one or two timer handles and one
``asyncio.timeout`` around the caller's own await; the probe runs only when the budget is
nearly spent.
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


class FirstByteTimeoutError(Exception):
    """The attempt was ended: ``verdict`` says why ("dead": at its budget, the replica failed
    its liveness probe; "slow": it is alive, but the caller does not wait for slow ones;
    "suspect": before its budget, ``give_up`` said so)."""

    def __init__(self, verdict: Verdict, budget_s: float) -> None:
        super().__init__(f"no first byte within {budget_s:g}s ({verdict})")
        self.verdict: Verdict = verdict
        self.budget_s = budget_s


class FirstByteWatch:
    """``async with FirstByteWatch(...)`` around the await that ends at the first byte.

    ``probe(timeout_s)`` answers whether the replica is alive. Raises
    :class:`FirstByteTimeoutError` from ``__aexit__`` when the watch ended the attempt; any other
    outcome (the attempt's own result or exception, an outer cancellation) passes through.
    """

    def __init__(
        self,
        probe: Callable[[float], Awaitable[bool]],
        budget_s: float,
        *,
        keep_while_alive: bool,
        give_up: Callable[[], bool] | None = None,
        give_up_after_s: float = 0.0,
        on_due: Callable[[], None] | None = None,
    ) -> None:
        if budget_s <= 0:
            raise ValueError("the first-byte budget must be positive")
        self.give_up = give_up
        self.give_up_after_s = give_up_after_s
        self.on_due = on_due
        self._give_up_timer: asyncio.TimerHandle | None = None
        self.probe = probe
        self.budget_s = budget_s
        self.probe_s = min(LIVENESS_PROBE_S, budget_s / 2)
        self.keep_while_alive = keep_while_alive
        self.verdict: Verdict | None = None
        self._timeout = asyncio.timeout(None)
        self._timer: asyncio.TimerHandle | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> FirstByteWatch:
        self._loop = asyncio.get_running_loop()
        await self._timeout.__aenter__()
        self._arm()
        if self.give_up is not None and self.give_up_after_s < self.budget_s:
            self._give_up_timer = self._loop.call_later(self.give_up_after_s, self._ask)
        return self

    def _ask(self) -> None:
        assert self._loop is not None
        assert self.give_up is not None
        self._give_up_timer = None
        if self.verdict is not None:
            return
        if self.on_due is not None:
            self.on_due()
            self.on_due = None
        if self.give_up():
            self.verdict = "suspect"
            self._timeout.reschedule(self._loop.time())  # ends the attempt now
            return
        self._give_up_timer = self._loop.call_later(GIVE_UP_POLL_S, self._ask)

    def _arm(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(self.budget_s - self.probe_s, self._start_probe)

    def _start_probe(self) -> None:
        assert self._loop is not None
        self._timer = None
        self._probe_task = self._loop.create_task(self._judge())

    async def _judge(self) -> None:
        alive = await self.probe(self.probe_s)
        if self.verdict is not None:
            return  # given up meanwhile
        if alive and self.keep_while_alive:
            self._arm()  # probed again one budget later
            return
        self.verdict = "slow" if alive else "dead"
        assert self._loop is not None
        self._timeout.reschedule(self._loop.time())  # ends the attempt now

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
            raise FirstByteTimeoutError(self.verdict, self.budget_s) from None
