"""The stall watch on its own: when it ends a stream's read loop, and when it must not.

Real asyncio time with short budgets; the bounds are generous (a noisy machine), and every test
that a broken watch would leave waiting forever runs under an outer deadline.
"""

from __future__ import annotations

import asyncio

import pytest

from fleetpilot.routing.stall import StallError, StallWatch

pytestmark = pytest.mark.asyncio

BUDGET_S = 0.2
# Far past any budget here: a test that reaches it found a watch that never ended the loop.
OUTER_S = 10.0


class Probe:
    """Answers from a script of liveness results (the last one repeats); counts the probes and
    checks the time each one is given."""

    def __init__(self, *answers: bool, budget_s: float = BUDGET_S) -> None:
        self.answers = list(answers)
        self.budget_s = budget_s
        self.calls = 0

    async def __call__(self, timeout_s: float) -> bool:
        assert 0 < timeout_s <= self.budget_s / 2
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


async def test_a_steady_stream_is_never_probed() -> None:
    """Chunks far more often than the budget: no probe, however long the stream runs, and no timer
    fires after the block."""
    budget = 0.5  # progress every 10 ms against 250 ms before a probe is due: room for noise
    probe = Probe(False, budget_s=budget)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(OUTER_S), StallWatch(probe, budget) as watch:
        end = loop.time() + 2 * budget
        while loop.time() < end:
            await asyncio.sleep(0.01)
            watch.progress()
    await asyncio.sleep(budget)  # nothing fires after the block
    assert probe.calls == 0
    assert not watch.stalled


async def test_a_silent_stream_on_a_dead_replica_ends_promptly() -> None:
    """No chunk for the budget and a failed probe: the read is cancelled and StallError raised,
    not the hour the read would have waited."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    watch = StallWatch(probe, BUDGET_S)
    cancelled: list[bool] = []

    async def read() -> None:
        async with asyncio.timeout(OUTER_S), watch:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    started = loop.time()
    with pytest.raises(StallError) as caught:
        await read()
    elapsed = loop.time() - started
    assert cancelled == [True]
    assert watch.stalled
    assert probe.calls == 1
    assert caught.value.budget_s == BUDGET_S
    assert elapsed >= BUDGET_S / 2  # not before the probe was due
    assert elapsed < 5


async def test_the_budget_counts_from_the_last_chunk() -> None:
    """A stream that flowed for several budgets and then went silent is ended a budget after its
    last chunk, not measured from its start."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    last: list[float] = []

    async def read() -> None:
        async with asyncio.timeout(OUTER_S), StallWatch(probe, BUDGET_S) as watch:
            end = loop.time() + 3 * BUDGET_S
            while loop.time() < end:
                await asyncio.sleep(0.01)
                watch.progress()
            last.append(loop.time())
            await asyncio.sleep(3600)

    with pytest.raises(StallError):
        await read()
    assert loop.time() - last[0] >= BUDGET_S / 2
    assert probe.calls == 1


async def test_a_silent_stream_on_a_live_replica_keeps_reading() -> None:
    """A replica that answers its probe is slow, not dead: the loop keeps waiting, probed again a
    budget later, and reads on when the chunks come back."""
    probe = Probe(True)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(OUTER_S), StallWatch(probe, BUDGET_S) as watch:
        await asyncio.sleep(3 * BUDGET_S)  # silence across several budgets
        assert probe.calls >= 2  # probed, and probed again
        for _ in range(5):
            await asyncio.sleep(0.01)
            watch.progress()
        chunks_back = loop.time()
    assert not watch.stalled
    assert loop.time() - chunks_back < 5


async def test_a_live_replica_that_dies_ends_the_stream_at_its_failed_probe() -> None:
    """Probes that pass keep the loop; the first that fails ends it."""
    probe = Probe(True, True, False)
    with pytest.raises(StallError):
        async with asyncio.timeout(OUTER_S), StallWatch(probe, BUDGET_S):
            await asyncio.sleep(3600)
    assert probe.calls == 3


async def test_chunks_after_a_passed_probe_reset_the_watch() -> None:
    """After a passed probe, a stream flowing again is not probed while it flows."""
    budget = 0.5
    probe = Probe(True, budget_s=budget)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(OUTER_S), StallWatch(probe, budget) as watch:
        await asyncio.sleep(budget * 0.75)  # past the probe's due time (half the budget)
        watch.progress()
        probed = probe.calls
        assert probed >= 1
        end = loop.time() + 2 * budget
        while loop.time() < end:
            await asyncio.sleep(0.01)
            watch.progress()
    # At most a probe already started when the chunks came back; unreset, the watch would have
    # probed every quarter second.
    assert probe.calls <= probed + 1


async def test_the_loops_own_error_and_an_outer_cancellation_pass_through() -> None:
    """The watch changes nothing else: the read's own exception, a cancellation and an outer
    request timeout reach the caller as they are."""
    with pytest.raises(ConnectionResetError):
        async with StallWatch(Probe(False), BUDGET_S):
            raise ConnectionResetError

    async def read() -> None:
        async with StallWatch(Probe(False), 60.0):
            await asyncio.sleep(3600)

    task = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def within_request_timeout() -> None:
        async with asyncio.timeout(0.05):
            await read()

    with pytest.raises(TimeoutError):
        await within_request_timeout()


async def test_a_stream_that_ends_before_the_budget_costs_no_probe() -> None:
    probe = Probe(False)
    async with StallWatch(probe, BUDGET_S) as watch:
        await asyncio.sleep(BUDGET_S / 4)
    await asyncio.sleep(BUDGET_S)
    assert probe.calls == 0
    assert not watch.stalled


@pytest.mark.parametrize("budget", [0.0, -1.0])
async def test_a_budget_must_be_positive(budget: float) -> None:
    """A budget of zero or less is refused when the watch is made."""
    with pytest.raises(ValueError, match="positive"):
        StallWatch(Probe(False), budget)
