"""The status-refresh queue: marks never wait on work, a burst becomes one more run reading the
newest state, a key never runs in two threads at once, and a failure stops nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator

import pytest

from fleetpilot.operator.refresh_queue import RefreshQueue

WAIT_S = 10.0


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Released at teardown too, so a failing test never leaves a worker blocked."""
    event = threading.Event()
    yield event
    event.set()


def test_a_burst_while_work_runs_becomes_one_more_run_that_sees_the_last_state(
    gate: threading.Event,
) -> None:
    started = threading.Event()
    seen: list[int] = []
    state = {"value": 0}

    def work(key: Hashable) -> None:
        seen.append(state["value"])
        if len(seen) == 1:
            started.set()
            assert gate.wait(WAIT_S)

    queue = RefreshQueue(work, workers=2, name="test")
    try:
        queue.mark("svc")
        assert started.wait(WAIT_S)
        for value in range(1, 51):  # fifty events while the first refresh runs
            state["value"] = value
            queue.mark("svc")  # returns at once: the work is blocked, the mark is not
        gate.set()
        assert queue.wait_idle(WAIT_S)
        assert seen == [0, 50]  # one more run, after the first, reading the newest state
        assert (queue.runs, queue.collapsed) == (2, 50)
    finally:
        queue.close()


def test_one_key_never_runs_in_two_threads_and_others_do_not_wait_for_it(
    gate: threading.Event,
) -> None:
    running: dict[Hashable, int] = {}
    overlap: list[Hashable] = []
    lock = threading.Lock()
    blocked_started = threading.Event()

    def work(key: Hashable) -> None:
        with lock:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlap.append(key)
        if key == "slow":
            blocked_started.set()
            assert gate.wait(WAIT_S)
        with lock:
            running[key] -= 1

    queue = RefreshQueue(work, workers=4, name="test")
    try:
        queue.mark("slow")
        assert blocked_started.wait(WAIT_S)
        for _ in range(20):
            queue.mark("slow")
        for i in range(100):
            queue.mark(f"svc-{i}")
        # Every other key is worked while "slow" is held.
        deadline = threading.Event()
        for _ in range(int(WAIT_S * 100)):
            with lock:
                if queue.runs >= 100:
                    break
            deadline.wait(0.01)
        assert queue.runs == 100
        assert not queue.idle()
        gate.set()
        assert queue.wait_idle(WAIT_S)
        assert queue.runs == 102  # "slow" once more for its twenty marks
        assert overlap == []
    finally:
        queue.close()


def test_a_failing_refresh_is_logged_and_the_next_mark_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[Hashable] = []

    def work(key: Hashable) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("API server refused")

    queue = RefreshQueue(work, workers=1, name="test")
    try:
        queue.mark("svc")
        assert queue.wait_idle(WAIT_S)
        queue.mark("svc")
        assert queue.wait_idle(WAIT_S)
        assert calls == ["svc", "svc"]
        assert "status refresh failed" in caplog.text
    finally:
        queue.close()


def test_close_stops_the_workers() -> None:
    queue = RefreshQueue(lambda key: None, workers=3, name="test")
    queue.close()
    threads = [t for t in threading.enumerate() if t.name.startswith("test-")]
    assert threads == []


def test_a_mark_is_held_so_a_burst_of_child_events_is_one_refresh() -> None:
    """A Deployment and its pods change within a second; every mark in the hold is the one
    refresh that follows it, and none runs before the hold is over."""
    ran_at: list[float] = []
    queue = RefreshQueue(lambda key: ran_at.append(time.monotonic()), 2, "test", hold_s=0.3)
    try:
        marked_at = time.monotonic()
        for _ in range(30):
            queue.mark("svc")
        queue.mark("other")
        assert queue.wait_idle(WAIT_S)
        assert len(ran_at) == 2
        assert min(ran_at) - marked_at >= 0.3
        assert queue.collapsed == 29
    finally:
        queue.close()
