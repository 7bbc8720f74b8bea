"""The adapter scorer: a replica with the request's LoRA adapter loaded scores 1; among the
others, the one whose eviction costs least, then the adapter's home."""

from __future__ import annotations

import math

from fleetpilot.routing.policies.adapters import EVICT_SCORE, HOME_SCORE, AdapterScorer
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
