"""Per-key coalescing: a burst while work runs becomes exactly one more run, keys apart."""

from __future__ import annotations

import threading

import pytest

from fleetpilot.operator.coalesce import Coalescer


def test_a_burst_during_a_run_becomes_one_more_run_and_sees_the_last_state() -> None:
    coalescer = Coalescer()
    started, release = threading.Event(), threading.Event()
    seen: list[int] = []
    state = {"value": 0}

    def work() -> None:
        seen.append(state["value"])
        if len(seen) == 1:
            started.set()
            assert release.wait(10)

    first = threading.Thread(target=coalescer.run, args=("svc", work))
    first.start()
    assert started.wait(10)
    for value in range(1, 51):  # fifty events while the first refresh runs
        state["value"] = value
        assert coalescer.run("svc", work) is False
    release.set()
    first.join(10)
    assert seen == [0, 50]  # one more run, reading the newest state
    assert (coalescer.runs, coalescer.collapsed) == (2, 50)
    assert coalescer.run("svc", work) is True  # idle again: runs at once
    assert seen == [0, 50, 50]


def test_keys_do_not_wait_for_each_other() -> None:
    coalescer = Coalescer()
    ran: list[str] = []
    coalescer.run("a", lambda: ran.append("a") or coalescer.run("b", lambda: ran.append("b")))
    assert ran == ["a", "b"]


def test_a_failure_clears_the_key() -> None:
    coalescer = Coalescer()

    def boom() -> None:
        raise RuntimeError("API server refused")

    with pytest.raises(RuntimeError):
        coalescer.run("svc", boom)
    assert coalescer.run("svc", lambda: None) is True
