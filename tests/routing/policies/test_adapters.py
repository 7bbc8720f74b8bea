"""The adapter scorer: a replica with the request's LoRA adapter loaded scores 1."""

from __future__ import annotations

from fleetpilot.routing.policies.adapters import AdapterScorer
from fleetpilot.routing.policies.types import PickRequest, ReplicaView

VIEWS = [
    ReplicaView("a", 4, adapters=frozenset({"sql", "tax"})),
    ReplicaView("b", 4, adapters=frozenset({"legal"})),
    ReplicaView("c", 4),
]


def test_holders_of_the_adapter_score_one_and_a_base_request_scores_nothing() -> None:
    scorer = AdapterScorer()
    assert scorer.score(PickRequest(adapter="sql"), VIEWS) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert scorer.score(PickRequest(adapter="poetry"), VIEWS) == {"a": 0.0, "b": 0.0, "c": 0.0}
    assert scorer.score(PickRequest(), VIEWS) == {}
