"""The liveness watch on its own, in its two uses: the wait for a first byte (budget from the
start, a live replica kept or given up, ``give_up`` before the budget) and a stream already
flowing (budget from the last chunk). When it ends the awaited work, and when it must not.

Each test runs on a virtual-time loop (``tests.support.virtual_time``): the watch's waiting is
all timers, so the times asserted are exact whatever the machine's load, and a watch that never
ends its work meets the outer deadline (or the hour-long sleep) at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from fleetpilot.routing.liveness import LivenessWatch, SilentReplicaError
from tests.support.virtual_time import run_virtual

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


def virtual(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the async test on a virtual-time loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        run_virtual(test(*args, **kwargs))

    return run


# -- the first byte ---------------------------------------------------------------------------


@virtual
async def test_an_answer_within_the_budget_is_never_probed() -> None:
    """An attempt answered within the budget costs no probe, and its timer does not fire after the
    block."""
    probe = Probe()
    async with LivenessWatch(probe, BUDGET_S, keep_while_alive=True):
        await asyncio.sleep(BUDGET_S / 4)
    await asyncio.sleep(BUDGET_S)  # the timer is gone: nothing fires after the block
    assert probe.calls == 0


@virtual
async def test_a_dead_replica_ends_the_attempt_at_the_budget() -> None:
    """A replica failing its liveness probe ends the attempt (verdict dead) once the probe is due,
    not after the hour the attempt would wait."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SilentReplicaError) as caught:
        async with LivenessWatch(probe, BUDGET_S, keep_while_alive=True):
            await asyncio.sleep(3600)
    assert caught.value.verdict == "dead"
    assert probe.calls == 1
    # When the probe was due (half the budget here; the probe itself answers at once), not the
    # hour the attempt would have waited.
    assert loop.time() - started == pytest.approx(BUDGET_S / 2)


@virtual
async def test_a_live_replica_keeps_a_long_attempt_until_its_probe_fails() -> None:
    """A replica that answers its probes keeps the attempt, probed again each budget, until a probe
    fails."""
    probe = Probe(True, True, False)
    with pytest.raises(SilentReplicaError) as caught:
        async with LivenessWatch(probe, BUDGET_S, keep_while_alive=True):
            await asyncio.sleep(3600)
    assert (caught.value.verdict, probe.calls) == ("dead", 3)


@virtual
async def test_a_live_but_slow_replica_is_given_up_when_the_caller_will_not_wait() -> None:
    """Without keep_while_alive (the prefill hop) even a live replica is given up at the budget,
    with verdict slow."""
    probe = Probe(True)
    with pytest.raises(SilentReplicaError) as caught:
        async with LivenessWatch(probe, BUDGET_S, keep_while_alive=False):
            await asyncio.sleep(3600)
    assert caught.value.verdict == "slow"


@virtual
async def test_a_long_attempt_on_a_live_replica_completes() -> None:
    """A long non-streamed attempt on a live replica runs to its end, however many budgets it
    spans."""
    probe = Probe(True, True, True, True, True, True)
    async with LivenessWatch(probe, BUDGET_S, keep_while_alive=True):
        await asyncio.sleep(BUDGET_S * 2.5)
    assert probe.calls >= 2


@virtual
async def test_the_attempts_own_error_and_an_outer_cancellation_pass_through() -> None:
    """The watch changes nothing else: the attempt's own exception, a cancellation and an outer
    request timeout reach the caller as they are."""
    with pytest.raises(ConnectionResetError):
        async with LivenessWatch(Probe(), BUDGET_S, keep_while_alive=True):
            raise ConnectionResetError

    async def attempt() -> None:
        async with LivenessWatch(Probe(False), 60.0, keep_while_alive=True):
            await asyncio.sleep(3600)

    task = asyncio.create_task(attempt())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # An outer deadline (the request timeout) stays the outer one's.
    async def within_request_timeout() -> None:
        async with asyncio.timeout(0.05):
            await attempt()

    with pytest.raises(TimeoutError):
        await within_request_timeout()


@virtual
async def test_give_up_ends_the_attempt_before_its_budget_without_a_probe() -> None:
    """Issue 41: a wait on a replica that turned suspect is given up (verdict suspect) as soon
    as ``give_up`` says so, asked from ``give_up_after_s`` on - not only at the budget's end,
    and with no liveness probe of its own; ``on_due`` (the proxy's /health question) runs once,
    when the first question is due."""
    probe = Probe()
    asked = 0
    due = []

    def give_up() -> bool:
        nonlocal asked
        asked += 1
        return asked >= 2  # suspect from the second question on

    with pytest.raises(SilentReplicaError) as caught:
        async with LivenessWatch(
            probe,
            3600.0,
            keep_while_alive=True,
            give_up=give_up,
            give_up_after_s=0.01,
            on_due=lambda: due.append(asked),
        ):
            await asyncio.sleep(3600)
    assert caught.value.verdict == "suspect"
    assert (asked, probe.calls, due) == (2, 0, [0])


@virtual
async def test_give_up_is_not_asked_of_an_attempt_answered_in_time() -> None:
    """An answer before ``give_up_after_s`` costs no question, and no timer fires later."""
    asked = []
    async with LivenessWatch(
        Probe(), BUDGET_S, keep_while_alive=True, give_up=lambda: asked.append(1) or True,
        give_up_after_s=BUDGET_S / 2,
    ):  # fmt: skip
        pass
    await asyncio.sleep(BUDGET_S)
    assert asked == []


# -- a stream already flowing ------------------------------------------------------------


@virtual
async def test_a_steady_stream_is_never_probed() -> None:
    """Chunks far more often than the budget: no probe, however long the stream runs, and no timer
    fires after the block."""
    budget = 0.5  # progress every 10 ms against 250 ms before a probe is due: room for noise
    probe = Probe(False, budget_s=budget)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(OUTER_S), LivenessWatch(probe, budget) as watch:
        end = loop.time() + 2 * budget
        while loop.time() < end:
            await asyncio.sleep(0.01)
            watch.progress()
    await asyncio.sleep(budget)  # nothing fires after the block
    assert probe.calls == 0
    assert watch.verdict is None


@virtual
async def test_a_silent_stream_on_a_dead_replica_ends_promptly() -> None:
    """No chunk for the budget and a failed probe: the read is cancelled and
    SilentReplicaError raised, not the hour the read would have waited."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    watch = LivenessWatch(probe, BUDGET_S)
    cancelled: list[bool] = []

    async def read() -> None:
        async with asyncio.timeout(OUTER_S), watch:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    started = loop.time()
    with pytest.raises(SilentReplicaError) as caught:
        await read()
    elapsed = loop.time() - started
    assert cancelled == [True]
    assert watch.verdict == "dead"
    assert probe.calls == 1
    assert caught.value.budget_s == BUDGET_S
    assert elapsed == pytest.approx(BUDGET_S / 2)  # when the probe was due


@virtual
async def test_the_budget_counts_from_the_last_chunk() -> None:
    """A stream that flowed for several budgets and then went silent is ended a budget after its
    last chunk, not measured from its start."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    last: list[float] = []

    async def read() -> None:
        async with asyncio.timeout(OUTER_S), LivenessWatch(probe, BUDGET_S) as watch:
            end = loop.time() + 3 * BUDGET_S
            while loop.time() < end:
                await asyncio.sleep(0.01)
                watch.progress()
            last.append(loop.time())
            await asyncio.sleep(3600)

    with pytest.raises(SilentReplicaError):
        await read()
    assert loop.time() - last[0] == pytest.approx(BUDGET_S / 2)
    assert probe.calls == 1


@virtual
async def test_a_silent_stream_on_a_live_replica_keeps_reading() -> None:
    """A replica that answers its probe is slow, not dead: the loop keeps waiting, probed again a
    budget later, and reads on when the chunks come back."""
    probe = Probe(True)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(OUTER_S), LivenessWatch(probe, BUDGET_S) as watch:
        await asyncio.sleep(3 * BUDGET_S)  # silence across several budgets
        assert probe.calls >= 2  # probed, and probed again
        for _ in range(5):
            await asyncio.sleep(0.01)
            watch.progress()
        chunks_back = loop.time()
    assert watch.verdict is None
    assert loop.time() - chunks_back < 5


@virtual
async def test_a_live_replica_that_dies_ends_the_stream_at_its_failed_probe() -> None:
    """Probes that pass keep the loop; the first that fails ends it."""
    probe = Probe(True, True, False)
    with pytest.raises(SilentReplicaError):
        async with asyncio.timeout(OUTER_S), LivenessWatch(probe, BUDGET_S):
            await asyncio.sleep(3600)
    assert probe.calls == 3


@virtual
async def test_a_stream_that_ends_before_the_budget_costs_no_probe() -> None:
    probe = Probe(False)
    async with LivenessWatch(probe, BUDGET_S) as watch:
        await asyncio.sleep(BUDGET_S / 4)
    await asyncio.sleep(BUDGET_S)
    assert probe.calls == 0
    assert watch.verdict is None


@pytest.mark.parametrize("budget", [0.0, -1.0])
@virtual
async def test_a_budget_must_be_positive(budget: float) -> None:
    """A budget of zero or less is refused when the watch is made, not a timer that fires at
    once."""
    with pytest.raises(ValueError, match="positive"):
        LivenessWatch(Probe(False), budget)
