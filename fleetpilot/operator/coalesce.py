"""Collapse bursts of work per key: while a key's work runs, further requests for it only
mark it dirty, and it runs once more when done - never twice at once, never more than once
behind. The operator refreshes a service's status on every event of its Deployments and pods;
a rollout of a thousand services sends tens of thousands of them, and each refresh reads the
service, its Deployments and its pods: one refresh per burst reads the same final state."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

_RUNNING = "running"
_DIRTY = "dirty"


class Coalescer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[Hashable, str] = {}
        self.runs = 0  # how often work ran (for tests and metrics)
        self.collapsed = 0  # requests folded into a run already due

    def run(self, key: Hashable, work: Callable[[], None]) -> bool:
        """Run ``work`` for ``key`` now, or leave it to the run in progress (which repeats it
        once when it ends); whether this call ran it. An exception of ``work`` propagates and
        clears the key (the next request runs afresh)."""
        with self._lock:
            if key in self._state:
                self._state[key] = _DIRTY
                self.collapsed += 1
                return False
            self._state[key] = _RUNNING
        try:
            while True:
                self.runs += 1
                work()
                with self._lock:
                    if self._state[key] == _DIRTY:
                        self._state[key] = _RUNNING
                        continue
                    del self._state[key]
                    return True
        except BaseException:
            with self._lock:
                self._state.pop(key, None)
            raise
