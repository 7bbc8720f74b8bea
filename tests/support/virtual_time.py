"""An asyncio event loop whose clock is virtual: when nothing is ready to run, time jumps to the
next timer instead of passing. Code whose waiting is all timers (``asyncio.sleep``,
``asyncio.timeout``, an in-memory transport) then runs instantly and exactly, so a test can
assert what happened at 0.5 s without a wall clock or a margin for a busy machine.

Real I/O still works (ready sockets are served first) but takes no virtual time; a test that
waits on real I/O belongs on the ordinary loop."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """The loop blocks in ``select(timeout)`` until its next timer is due; this selector
    answers at once, moving the virtual clock to that timer when nothing else is ready."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only real I/O (or nothing) can wake the loop
            return super().select(None)
        self.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector loop that starts at virtual time 0 and never waits for a timer."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(selector=self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
