"""The adapter scorer: a replica with the request's LoRA adapter loaded scores 1; among the
others, the one whose eviction costs least, then the adapter's home."""

from __future__ import annotations

import math
from dataclasses import replace

from fleetpilot.routing.policies.adapters import (
    EVICT_SCORE,
    HOLDER_SLACK,
    HOME_SCORE,
    AdapterHolderFilter,
    AdapterScorer,
)
from fleetpilot.routing.policies.picker import rendezvous_weight
from fleetpilot.routing.policies.types import PickRequest, ReplicaView

VIEWS = [
    ReplicaView("a", 4, adapters=frozenset({"sql", "tax"}), adapter_lru_at=10.0),
    ReplicaView("b", 4, adapters=frozenset({"legal"}), adapter_lru_at=30.0),
    ReplicaView("c", 4, adapters=frozenset({"x"}), adapter_lru_at=20.0),
]


def test_holders_score_one_and_a_base_request_scores_nothing() -> None:
    scorer = AdapterScorer()
    scores = scorer.score(PickRequest(adapter="sql"), VIEWS)
    assert scores["a"] == 1.0
    assert max(scores["b"], scores["c"]) <= EVICT_SCORE + HOME_SCORE < 1.0
    assert scorer.score(PickRequest(), VIEWS) == {}


def test_an_adapter_nobody_holds_evicts_the_stalest_adapter_then_goes_home() -> None:
    """Among replicas without it, the one whose least recently sent adapter is the oldest (a
    free slot, -inf, oldest of all) gains the most; the adapter's home order (the same in
    every router replica) adds the rest, so two replicas alike in staleness differ by it."""
    scores = AdapterScorer().score(PickRequest(adapter="poetry"), VIEWS)
    by_staleness = ["a", "c", "b"]  # lru_at 10 < 20 < 30
    evict = {rid: EVICT_SCORE * (1 - rank / 3) for rank, rid in enumerate(by_staleness)}
    home = sorted("abc", key=lambda rid: rendezvous_weight(b"poetry", rid), reverse=True)
    homed = {rid: HOME_SCORE * (1 - rank / 3) for rank, rid in enumerate(home)}
    assert scores == {rid: evict[rid] + homed[rid] for rid in "abc"}
    free = [*VIEWS, ReplicaView("d", 4, adapter_lru_at=-math.inf)]
    scores = AdapterScorer().score(PickRequest(adapter="poetry"), free)
    assert scores["d"] >= EVICT_SCORE
    assert scores["d"] == max(scores.values())


def test_a_replica_that_answered_it_lacks_the_adapter_scores_last_for_it() -> None:
    """Regression (dynamic LoRA): a replica whose engine answered 404 for "sql" - a new or
    restarted one the operator has not loaded it into yet - scores 0 for "sql", below every
    replica that would have to load it, even with the free slot that otherwise draws a cold
    adapter first, and even where an older send or scrape still lists it as held. For any
    other adapter it scores as before."""
    lacking = ReplicaView("d", 4, adapter_lru_at=-math.inf, missing_adapters=frozenset({"sql"}))
    stale_holder = ReplicaView(
        "e", 4, adapters=frozenset({"sql"}), missing_adapters=frozenset({"sql"})
    )
    scores = AdapterScorer().score(PickRequest(adapter="sql"), [*VIEWS, lacking, stale_holder])
    assert scores["d"] == scores["e"] == 0.0
    assert min(scores[rid] for rid in "bc") > 0.0
    assert scores["a"] == 1.0
    other = AdapterScorer().score(PickRequest(adapter="poetry"), [*VIEWS, lacking])
    assert other["d"] == max(other.values()) >= EVICT_SCORE  # its free slot, as before


def test_holders_with_room_take_the_adapter_and_no_one_else() -> None:
    """While a replica holding the adapter has a free batch slot, no queue and load within the
    bound, only holders like it are candidates; a base-model request keeps every replica."""
    holder_filter = AdapterHolderFilter()
    kept = holder_filter.filter(PickRequest(adapter="sql"), VIEWS)
    assert [v.id for v in kept] == ["a"]
    assert holder_filter.filter(PickRequest(), VIEWS) == VIEWS
    assert holder_filter.filter(PickRequest(adapter="poetry"), VIEWS) == VIEWS  # no holder


def test_a_hot_adapter_spreads_once_its_holders_are_over_the_bound_or_out_of_room() -> None:
    """The bound is what spreads one hot adapter: a holder may run factor x the group's mean
    in-flight plus HOLDER_SLACK; above it - or with a full batch, or a queue - every replica
    is a candidate again and the scorers pick where to load it."""
    fleet = [ReplicaView("h", 16, in_flight=0, adapters=frozenset({"hot"})), *(
        ReplicaView(rid, 16, in_flight=1) for rid in "xyz"
    )]  # fmt: skip
    holder_filter = AdapterHolderFilter(1.5)
    assert [v.id for v in holder_filter.filter(PickRequest(adapter="hot"), fleet)] == ["h"]
    # The others run 3; a holder running f may take one more while
    # f + 1 <= 1.5 * (3 + f + 1) / 4 + 2, i.e. up to f = 4: the fifth spreads.
    assert HOLDER_SLACK == 2
    for in_flight in range(8):
        views = [replace(fleet[0], in_flight=in_flight), *fleet[1:]]
        kept = holder_filter.filter(PickRequest(adapter="hot"), views)
        assert kept == (views[:1] if in_flight <= 4 else views), in_flight
    full = replace(fleet[0], max_num_seqs=1, in_flight=0, running=1.0)
    assert holder_filter.filter(PickRequest(adapter="hot"), [full, *fleet[1:]]) == [
        full,
        *fleet[1:],
    ]
    lacking = replace(fleet[0], missing_adapters=frozenset({"hot"}))
    assert len(holder_filter.filter(PickRequest(adapter="hot"), [lacking, *fleet[1:]])) == 4
