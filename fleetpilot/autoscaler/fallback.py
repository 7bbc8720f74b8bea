"""Prometheus while it answers, the engines' /metrics directly while it does not.

A local fleet can reach every engine, so a Prometheus that died (or hangs, or is still replaying
its TSDB after a restart) need not blind the autoscaler: :class:`FallbackSource` reads each role
through its primary source and, when that says :attr:`DataProblem.UNREACHABLE`, through the
fallback, marking the observation (``Metrics.source_note``, which every decision's reason
repeats). Both switches are logged once. The policy's trust rules still apply to what the
fallback reads: its first scrape has no rates, so the role holds until a window builds up; it
never scales down on data it does not have.

Only "unreachable" falls back: a Prometheus that answers with an error (a bad query) or without
series (a scrape config that lost the labels) is a problem to see and fix, not to paper over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Protocol

from fleetpilot.autoscaler.model import DataProblem, Metrics
from fleetpilot.autoscaler.prometheus import MetricsSource

log = logging.getLogger(__name__)

# While the primary is down it is asked again at most this often: a refused connection costs
# nothing, but a hung Prometheus costs its query timeout (5 s) on every ask.
DEFAULT_RECHECK_S = 5.0


class ResettableSource(MetricsSource, Protocol):
    """A fallback that can forget what it kept between spells (see :meth:`reset`)."""

    def reset(self) -> None:
        """Drop every kept snapshot: a baseline from an earlier spell would stretch the window
        the next one measures over (and inflate every rate)."""


class FallbackSource:
    """:class:`~fleetpilot.autoscaler.prometheus.MetricsSource` that reads ``primary`` and,
    while it is unreachable, ``fallback``. Thread-safe: roles of one tick observe concurrently.

    ``primary_name`` and ``fallback_name`` are how the log and the reasons name the two.
    ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(
        self,
        primary: MetricsSource,
        fallback: ResettableSource,
        *,
        primary_name: str = "prometheus",
        fallback_name: str = "the engines' /metrics",
        recheck_s: float = DEFAULT_RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.primary_name = primary_name
        self.fallback_name = fallback_name
        self.recheck_s = recheck_s
        self.clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None  # None: the primary answers
        self._next_check = 0.0
        self._why = ""

    @property
    def falling_back(self) -> bool:
        """Whether observations come from the fallback now."""
        return self._down_since is not None

    def close(self) -> None:
        for source in (self.primary, self.fallback):
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> FallbackSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def observe(
        self,
        service: str,
        tier: str,
        role: str,
        window: timedelta,
        *,
        namespace: str | None = None,
    ) -> Metrics:
        if self._ask_primary():
            metrics = self.primary.observe(service, tier, role, window, namespace=namespace)
            if metrics.problem is not DataProblem.UNREACHABLE:
                self._primary_answered()
                return metrics
            self._primary_failed(metrics.detail)
        metrics = self.fallback.observe(service, tier, role, window, namespace=namespace)
        note = f"read from {self.fallback_name} directly: {self._why}"
        return replace(metrics, source_note=note)

    def _ask_primary(self) -> bool:
        with self._lock:
            if self._down_since is None:
                return True
            now = self.clock()
            if now < self._next_check:
                return False
            self._next_check = now + self.recheck_s
            return True

    def _primary_answered(self) -> None:
        with self._lock:
            down_since, self._down_since = self._down_since, None
        if down_since is not None:
            log.warning(
                "%s answers again: reading it (after %.0fs on %s)",
                self.primary_name,
                self.clock() - down_since,
                self.fallback_name,
            )

    def _primary_failed(self, detail: str) -> None:
        with self._lock:
            self._why = detail or f"{self.primary_name} is unreachable"
            if self._down_since is not None:
                return
            now = self.clock()
            self._down_since = now
            self._next_check = now + self.recheck_s
            # A spell starts afresh: no baseline left from the last one.
            self.fallback.reset()
        log.warning("%s: reading %s directly until it answers again", self._why, self.fallback_name)


__all__ = ["DEFAULT_RECHECK_S", "FallbackSource", "ResettableSource"]
