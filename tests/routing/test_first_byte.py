"""The first-byte watch on its own: when it ends an attempt, and when it must not."""

from __future__ import annotations

import asyncio

import pytest

from fleetpilot.routing.first_byte import FirstByteTimeoutError, FirstByteWatch

pytestmark = pytest.mark.asyncio

BUDGET_S = 0.2


class Probe:
    """Answers from a script of liveness results; counts the probes."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self, timeout_s: float) -> bool:
        assert 0 < timeout_s <= BUDGET_S / 2
        self.calls += 1
        return self.answers.pop(0)


async def test_an_answer_within_the_budget_is_never_probed() -> None:
    """An attempt answered within the budget costs no probe, and its timer does not fire after the
    block."""
    probe = Probe()
    async with FirstByteWatch(probe, BUDGET_S, keep_while_alive=True):
        await asyncio.sleep(BUDGET_S / 4)
    await asyncio.sleep(BUDGET_S)  # the timer is gone: nothing fires after the block
    assert probe.calls == 0


async def test_a_dead_replica_ends_the_attempt_at_the_budget() -> None:
    """A replica failing its liveness probe ends the attempt (verdict dead) once the probe is due,
    not after the hour the attempt would wait."""
    probe = Probe(False)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(FirstByteTimeoutError) as caught:
        async with FirstByteWatch(probe, BUDGET_S, keep_while_alive=True):
            await asyncio.sleep(3600)
    assert caught.value.verdict == "dead"
    assert probe.calls == 1
    # Not before the probe was due (half the budget here); the upper bound only says "not the
    # hour the attempt would have waited".
    assert loop.time() - started >= BUDGET_S / 2
    assert loop.time() - started < 60


async def test_a_live_replica_keeps_a_long_attempt_until_its_probe_fails() -> None:
    """A replica that answers its probes keeps the attempt, probed again each budget, until a probe
    fails."""
    probe = Probe(True, True, False)
    with pytest.raises(FirstByteTimeoutError) as caught:
        async with FirstByteWatch(probe, BUDGET_S, keep_while_alive=True):
            await asyncio.sleep(3600)
    assert (caught.value.verdict, probe.calls) == ("dead", 3)


async def test_a_live_but_slow_replica_is_given_up_when_the_caller_will_not_wait() -> None:
    """Without keep_while_alive (the prefill hop) even a live replica is given up at the budget,
    with verdict slow."""
    probe = Probe(True)
    with pytest.raises(FirstByteTimeoutError) as caught:
        async with FirstByteWatch(probe, BUDGET_S, keep_while_alive=False):
            await asyncio.sleep(3600)
    assert caught.value.verdict == "slow"


async def test_a_long_attempt_on_a_live_replica_completes() -> None:
    """A long non-streamed attempt on a live replica runs to its end, however many budgets it
    spans."""
    probe = Probe(True, True, True, True, True, True)
    async with FirstByteWatch(probe, BUDGET_S, keep_while_alive=True):
        await asyncio.sleep(BUDGET_S * 2.5)
    assert probe.calls >= 2


async def test_the_attempts_own_error_and_an_outer_cancellation_pass_through() -> None:
    """The watch changes nothing else: the attempt's own exception, a cancellation and an outer
    request timeout reach the caller as they are."""
    with pytest.raises(ConnectionResetError):
        async with FirstByteWatch(Probe(), BUDGET_S, keep_while_alive=True):
            raise ConnectionResetError

    async def attempt() -> None:
        async with FirstByteWatch(Probe(False), 60.0, keep_while_alive=True):
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


async def test_a_budget_must_be_positive() -> None:
    """A zero budget is refused when the watch is made, not a timer that fires at once."""
    with pytest.raises(ValueError, match="positive"):
        FirstByteWatch(Probe(), 0.0, keep_while_alive=True)


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

    with pytest.raises(FirstByteTimeoutError) as caught:
        async with FirstByteWatch(
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


async def test_give_up_is_not_asked_of_an_attempt_answered_in_time() -> None:
    """An answer before ``give_up_after_s`` costs no question, and no timer fires later."""
    asked = []
    async with FirstByteWatch(
        Probe(), BUDGET_S, keep_while_alive=True, give_up=lambda: asked.append(1) or True,
        give_up_after_s=BUDGET_S / 2,
    ):  # fmt: skip
        pass
    await asyncio.sleep(BUDGET_S)
    assert asked == []
