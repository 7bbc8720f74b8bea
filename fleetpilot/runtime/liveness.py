"""When a child of the local runtime that still runs has stopped serving: its liveness verdict.

An exit is seen at once (the supervisor polls it); a frozen process (SIGSTOP, a deadlock, a
wedged event loop) still runs, and only a deadline on its health URL shows it: a frozen router
hung every request of ``fleetpilot up`` while nothing said so. So each child is probed as a
kubelet's liveness probe does: every ``period_s``, its health URL must answer 2xx within
``timeout_s``; ``failure_threshold`` failures in a row and it is unresponsive, reported once and
restarted (killed: SIGTERM never reaches a stopped process).

A child is judged only once it has answered since its (re)start, as a kubelet holds liveness
until the startup probe passed: an engine loading its model (or waiting out ``--cold-start``)
answers 503 on purpose, and a restarted Prometheus needs a moment to listen.

Purely computational: the supervisor does the probing and restarting (:mod:`.processes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

# Kubelet's defaults are a 10 s period, a 1 s timeout and 3 failures: up to 31 s of a freeze
# unnoticed. A frozen router hangs every request of the fleet (bench/up_frozen_router.py: 25 s
# of nothing served without a probe), and a probe of /health costs microseconds: every 2 s.
DEFAULT_PERIOD_S = 2.0
# /health of the router and the engines is answered on their event loop with no I/O, in
# milliseconds; on a busy 2-core machine a process may wait a few hundred ms for a CPU: 2 s is
# ten times that. No longer than the period, so a probe ends before the next is due.
DEFAULT_TIMEOUT_S = 2.0
# One or two slow answers never restart anything (a restart costs an engine its cache and its
# requests); three in a row is not a hiccup. A frozen child is found within
# period x threshold + timeout = 8 s of its freeze.
DEFAULT_FAILURE_THRESHOLD = 3


@dataclass(frozen=True)
class LivenessProbe:
    """How a child's liveness is probed: every ``period_s``, an answer within ``timeout_s``,
    ``failure_threshold`` failures in a row make it unresponsive."""

    period_s: float = DEFAULT_PERIOD_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD

    def __post_init__(self) -> None:
        for name in ("period_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number of seconds above 0")
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")

    @property
    def detection_s(self) -> float:
        """The longest a child may be frozen before it is found unresponsive: it froze just
        after a probe passed, then ``failure_threshold`` probes a period apart each waited out
        the timeout."""
        return self.period_s * self.failure_threshold + self.timeout_s

    def describe(self) -> str:
        """``3 probes in a row, 2 s apart, 2 s timeout``: for reports."""
        return (
            f"{self.failure_threshold} probe{'s' if self.failure_threshold > 1 else ''} in a "
            f"row, {self.period_s:g} s apart, {self.timeout_s:g} s timeout"
        )


class Verdict(StrEnum):
    STARTING = "starting"  # not answered since its (re)start: not judged yet
    LIVE = "live"
    FAILING = "failing"  # failed its last probes, fewer than the threshold
    UNRESPONSIVE = "unresponsive"  # the threshold reached: report once, restart


@dataclass(frozen=True)
class Liveness:
    """What the probes of one child process have seen (a new process starts afresh)."""

    answered: bool = False  # answered at least once since its (re)start
    failures: int = 0  # failed probes in a row since the last answer
    last_probe_s: float | None = None  # monotonic time of the last probe


def due(state: Liveness, now_s: float, probe: LivenessProbe) -> bool:
    """Whether the child should be probed at ``now_s``. Purely computational."""
    return state.last_probe_s is None or now_s - state.last_probe_s >= probe.period_s


def judge(
    state: Liveness, answered: bool, now_s: float, probe: LivenessProbe
) -> tuple[Liveness, Verdict]:
    """The child's state and verdict after one probe at ``now_s`` (``answered``: 2xx within
    the timeout). Purely computational.

    UNRESPONSIVE comes once per process: the state it returns is a fresh process's (the
    supervisor restarts it), which is not judged again until it has answered.
    """
    if answered:
        return Liveness(answered=True, failures=0, last_probe_s=now_s), Verdict.LIVE
    if not state.answered:
        return Liveness(last_probe_s=now_s), Verdict.STARTING
    failures = state.failures + 1
    if failures >= probe.failure_threshold:
        return Liveness(last_probe_s=now_s), Verdict.UNRESPONSIVE
    return Liveness(answered=True, failures=failures, last_probe_s=now_s), Verdict.FAILING


__all__ = [
    "DEFAULT_FAILURE_THRESHOLD",
    "DEFAULT_PERIOD_S",
    "DEFAULT_TIMEOUT_S",
    "Liveness",
    "LivenessProbe",
    "Verdict",
    "due",
    "judge",
]
