"""The one waiting helper: what it returns, what it waits through, what its timeout says."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from fleetpilot.testing.polling import eventually, eventually_async


def answers(*values: object) -> Callable[[], object]:
    """A probe giving ``values`` in turn, then the last one forever."""
    it: Iterator[object] = iter(values)
    last: list[object] = [None]

    def probe() -> object:
        last[0] = next(it, last[0])
        if isinstance(last[0], Exception):
            raise last[0]
        return last[0]

    return probe


def test_returns_the_first_value_that_is_not_none() -> None:
    """None means not yet; a falsy value such as 0 or [] is an answer."""
    assert eventually("a count", answers(None, None, 0), interval=0) == 0


def test_until_waits_for_an_accepted_value() -> None:
    """With ``until``, values it refuses are observations, not answers."""
    assert eventually("3 ready", answers(1, 2, 3, 4), until=lambda n: n == 3, interval=0) == 3


def test_timeout_names_what_and_the_last_value_seen() -> None:
    """The failure says what was awaited and what the probe last gave, so a red test explains
    itself without a rerun."""
    with pytest.raises(
        AssertionError, match=r"waiting for 2 replicas ready; last seen: \{'ready': 1\}"
    ):
        eventually("2 replicas ready", lambda: {"ready": 1}, 0, until=lambda s: s["ready"] == 2)


def test_ignored_exceptions_mean_not_yet_and_are_reported() -> None:
    """A refused connection while a server starts is waited through; if it never ends, the
    message shows it."""
    probe = answers(ConnectionRefusedError("refused"), "up")
    assert eventually("the server", probe, interval=0, ignoring=(OSError,)) == "up"
    with pytest.raises(TimeoutError, match="last seen: ConnectionRefusedError: refused"):
        eventually(
            "the server",
            answers(ConnectionRefusedError("refused")),
            0,
            ignoring=(OSError,),
            error=TimeoutError,
        )


def test_context_is_read_only_on_failure() -> None:
    """``context`` (a log's tail, say) joins the failure message, and costs nothing otherwise."""
    reads: list[str] = []

    def log() -> str:
        reads.append("read")
        return "engine: out of memory"

    assert eventually("a value", lambda: 1, context=log) == 1
    assert reads == []
    with pytest.raises(AssertionError, match="waiting for a value; last seen: None\nengine: out"):
        eventually("a value", lambda: None, 0, context=log)


def test_other_exceptions_propagate_at_once() -> None:
    """An exception not listed in ``ignoring`` is a bug in the probe or the code under test, not
    a reason to keep waiting."""
    with pytest.raises(KeyError):
        eventually("a key", answers(KeyError("k")), 60, ignoring=(OSError,))


@pytest.mark.asyncio
async def test_async_form_yields_to_the_loop_and_awaits_coroutine_probes() -> None:
    """The awaited thing runs on the same loop: the wait must let it run."""
    flag = asyncio.Event()
    asyncio.get_running_loop().call_soon(flag.set)
    assert await eventually_async("the flag", lambda: flag.is_set() or None, interval=0)

    async def coroutine_probe() -> int | None:
        await asyncio.sleep(0)
        return 7

    assert await eventually_async("seven", coroutine_probe, interval=0) == 7
    with pytest.raises(AssertionError, match="waiting for never; last seen: False"):
        await eventually_async("never", lambda: False, 0, until=bool)
