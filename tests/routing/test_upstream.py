"""An upstream attempt's accounting on its replica: the one writer of ``in_flight`` and
``pending_prefill``, so a replica's load reads true however an attempt ends."""

from __future__ import annotations

import pytest

from fleetpilot.routing.endpoints import Endpoint
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.upstream import Attempt


def _replica() -> ReplicaState:
    return ReplicaState(Endpoint("small", "unified", "10.0.0.1", 1), max_num_seqs=4)


def test_an_attempt_counts_while_it_lasts_and_its_blocks_until_the_first_chunk() -> None:
    """The prompt's blocks leave ``pending_prefill`` at the first chunk, the request leaves
    ``in_flight`` at the end; ending twice (a leg closed in two places) takes nothing twice."""
    replica = _replica()
    attempt = Attempt(replica, prefill_blocks=3).begin()
    assert (replica.in_flight, replica.pending_prefill) == (1, 3)
    attempt.prefilled()
    attempt.prefilled()
    assert (replica.in_flight, replica.pending_prefill) == (1, 0)
    attempt.end()
    attempt.end()
    assert (replica.in_flight, replica.pending_prefill) == (0, 0)


def test_an_attempt_that_fails_gives_back_what_it_counted() -> None:
    """An attempt ended by an error before its first chunk leaves nothing behind on the
    replica: neither its request nor its prompt's blocks."""
    replica = _replica()
    seen: list[tuple[int, float]] = []

    def attempt() -> None:
        with Attempt(replica, prefill_blocks=2):
            seen.append((replica.in_flight, replica.pending_prefill))
            raise ConnectionResetError

    with pytest.raises(ConnectionResetError):
        attempt()
    assert seen == [(1, 2)]
    assert (replica.in_flight, replica.pending_prefill) == (0, 0)


def test_a_decode_attempt_prefills_nothing() -> None:
    """Without blocks (a P/D decode replica pulling the KV) only ``in_flight`` moves."""
    replica = _replica()
    with Attempt(replica):
        assert (replica.in_flight, replica.pending_prefill) == (1, 0)
    assert replica.in_flight == 0
