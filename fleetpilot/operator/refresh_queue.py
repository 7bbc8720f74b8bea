"""Status refreshes after child events, worked off kopf's per-object workers.

Every event of a service's Deployments and pods calls for its status to be refreshed. kopf
hands each object's events to a worker of that object, and runs a sync handler in its small
thread pool: a handler that refreshed in place held its worker - and the event's body - until
a thread was free. With a thousand services applied at once, four thousand workers queued
(half a gigabyte, most of the operator's memory). So the handlers only mark the service here
and return at once; a few threads refresh the marked services, each once however many events
named it meanwhile (the refresh reads the newest state), never one service in two threads.

A mark is held ``hold_s`` before its work runs: a service's children change in bursts (a
Deployment and its pods, each changed by the controller-manager and the scheduler within a
second), and a refresh per change read the same lists again and wrote statuses nobody saw -
at a thousand services a third more API requests than with a one-second hold, which costs a
status at most that second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)


class RefreshQueue:
    """Keys marked for work, worked by ``workers`` threads ``hold_s`` after their first mark; a
    key is queued at most once, and a key marked while its work runs is worked once more
    afterwards (held again)."""

    def __init__(
        self, work: Callable[[Hashable], None], workers: int, name: str, hold_s: float = 0.0
    ) -> None:
        self._work = work
        self.hold_s = hold_s
        self._changed = threading.Condition()
        # key -> when it may run; insertion-ordered, and every key is held as long, so the
        # first key is always the first due.
        self._pending: dict[Hashable, float] = {}
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()  # marked while running
        self._closed = False
        self.runs = 0  # how often work ran (for tests and logs)
        self.collapsed = 0  # marks that found their key queued or running
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def mark(self, key: Hashable) -> None:
        """Ask for ``key``'s work; never blocks on the work itself (safe from the event loop)."""
        with self._changed:
            if key in self._running:
                self._again.add(key)
                self.collapsed += 1
            elif key in self._pending:
                self.collapsed += 1
            else:
                self._pending[key] = time.monotonic() + self.hold_s
                self._changed.notify()

    def _next(self) -> Hashable | None:
        with self._changed:
            while not self._closed:
                if self._pending:
                    key, due = next(iter(self._pending.items()))
                    wait_s = due - time.monotonic()
                    if wait_s <= 0:
                        del self._pending[key]
                        self._running.add(key)
                        return key
                    self._changed.wait(wait_s)
                else:
                    self._changed.wait()
            return None

    def _loop(self) -> None:
        while (key := self._next()) is not None:
            try:
                self._work(key)
            except Exception:  # one service's failure never stops the others' refreshes
                log.exception("status refresh failed", extra={"key": str(key)})
            with self._changed:
                self.runs += 1
                self._running.discard(key)
                if key in self._again:
                    self._again.discard(key)
                    self._pending[key] = time.monotonic() + self.hold_s
                self._changed.notify_all()

    def _idle(self) -> bool:  # under the lock
        return not self._pending and not self._running

    def idle(self) -> bool:
        with self._changed:
            return self._idle()

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every marked key was worked within ``timeout_s`` (for tests)."""
        with self._changed:
            return self._changed.wait_for(self._idle, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking work; wait up to ``timeout_s`` for work in progress to finish."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
