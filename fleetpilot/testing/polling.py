"""Waiting for something asynchronous to converge: a cluster's controllers, a child process, a
server's thread, a task on the event loop. The one waiting helper of the tests, e2e tests and
demos, so that a timeout always says what was awaited and what was last seen."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: What a failure message shows of the last value: enough to recognise a status or a list, not a
#: page of it.
_SHOWN_CHARS = 300


class _Watch:
    """One wait's clock and its last observation; shared by the thread and asyncio forms."""

    def __init__(
        self,
        what: str,
        timeout: float,
        error: type[Exception],
        context: Callable[[], str] | None,
    ) -> None:
        self.what = what
        self.timeout = timeout
        self.error = error
        self.context = context
        self.deadline = time.monotonic() + timeout
        self.last = "nothing yet"

    def saw(self, value: object) -> None:
        shown = repr(value)
        if len(shown) > _SHOWN_CHARS:
            shown = shown[:_SHOWN_CHARS] + "..."
        self.last = shown

    def failed(self, raised: BaseException) -> None:
        self.last = f"{type(raised).__name__}: {raised}"[:_SHOWN_CHARS]

    def done(self, value: T | None, until: Callable[[T], object] | None) -> bool:
        self.saw(value)
        return value is not None and (until is None or bool(until(value)))

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            message = (
                f"timed out after {self.timeout:g}s waiting for {self.what}; last seen: {self.last}"
            )
            if self.context is not None:
                message += "\n" + self.context()
            raise self.error(message)


def eventually(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 60.0,
    *,
    until: Callable[[T], object] | None = None,
    interval: float = 0.25,
    error: type[Exception] = AssertionError,
    ignoring: tuple[type[Exception], ...] = (),
    context: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something other than None (and, given ``until``, something
    ``until`` accepts), and return that. Past ``timeout`` seconds, raise ``error`` (a test's
    AssertionError, a demo's TimeoutError) naming ``what`` and the last value seen.

    ``ignoring``: exceptions of the probe that mean "not yet" (a connection refused while a
    server starts); the last one is shown on failure. Any other exception propagates at once.
    ``context``: what else a failure should show, read only then (a process's log)."""
    watch = _Watch(what, timeout, error, context)
    while True:
        try:
            if watch.done(value := probe(), until):
                assert value is not None
                return value
        except ignoring as raised:
            watch.failed(raised)
        watch.check_deadline()
        time.sleep(interval)


async def eventually_async(
    what: str,
    probe: Callable[[], Awaitable[T | None]] | Callable[[], T | None],
    timeout: float = 60.0,
    *,
    until: Callable[[T], object] | None = None,
    interval: float = 0.05,
    error: type[Exception] = AssertionError,
    ignoring: tuple[type[Exception], ...] = (),
    context: Callable[[], str] | None = None,
) -> T:
    """``eventually`` on an event loop: the wait yields to the loop (the thing awaited usually
    runs on it), and ``probe`` may be a coroutine function."""
    watch = _Watch(what, timeout, error, context)
    while True:
        try:
            value = probe()
            if isinstance(value, Awaitable):
                value = await value
            if watch.done(value, until):
                assert value is not None
                return value
        except ignoring as raised:
            watch.failed(raised)
        watch.check_deadline()
        await asyncio.sleep(interval)
