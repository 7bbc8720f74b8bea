"""Outlier ejection: which replicas stop getting traffic after failing. Purely computational:
the caller passes the time in; ``health.Prober`` does the probing I/O.

A replica is ejected after ``failures`` consecutive failures (connection errors, timeouts,
5xx) within ``window_s``; a success in between clears the count, so a busy replica with a rare
5xx is never ejected for failures spread over the window. It returns when its ``/health``
answers 200.
"""

from __future__ import annotations

from collections import deque


class HealthTracker:
    """Per-replica consecutive-failure counts and the ejected set."""

    def __init__(self, failures: int, window_s: float) -> None:
        if failures < 1:
            raise ValueError("failures must be at least 1")
        self.failures = failures
        self.window_s = window_s
        # Per replica, its failures in a row: when, and whether each hung.
        self._recent: dict[str, deque[tuple[float, bool]]] = {}
        self._ejected: dict[str, float] = {}
        self._hung: set[str] = set()

    def record_failure(self, replica_id: str, now: float, *, hung: bool = False) -> bool:
        """Count a failure (``hung``: a wait that ran out, not a quick refusal); True when this
        one ejects the replica."""
        if replica_id in self._ejected:
            if hung:
                self._hung.add(replica_id)  # ejected as refusing, it now hangs
            return False
        recent = self._recent.get(replica_id)
        if recent is None:
            recent = self._recent[replica_id] = deque()
        recent.append((now, hung))
        while recent and now - recent[0][0] > self.window_s:
            recent.popleft()
        if len(recent) >= self.failures:
            self._ejected[replica_id] = now
            if any(h for _, h in recent):
                self._hung.add(replica_id)
            del self._recent[replica_id]
            return True
        return False

    def record_success(self, replica_id: str) -> None:
        self._recent.pop(replica_id, None)

    def hangs(self, replica_id: str) -> bool:
        """Whether the replica is ejected and some failure that ejected it (or came since) was
        a wait that ran out."""
        return replica_id in self._hung

    def is_ejected(self, replica_id: str) -> bool:
        return replica_id in self._ejected

    def ejected(self) -> list[str]:
        return list(self._ejected)

    def ejected_since(self, replica_id: str) -> float | None:
        return self._ejected.get(replica_id)

    def readmit(self, replica_id: str) -> bool:
        """Back into rotation (its probe passed); True if it was ejected."""
        self._recent.pop(replica_id, None)
        self._hung.discard(replica_id)
        return self._ejected.pop(replica_id, None) is not None

    def retain(self, replica_ids: set[str]) -> None:
        """Forget replicas that discovery no longer lists."""
        for rid in [r for r in self._recent if r not in replica_ids]:
            del self._recent[rid]
        for rid in [r for r in self._ejected if r not in replica_ids]:
            del self._ejected[rid]
        self._hung &= replica_ids
