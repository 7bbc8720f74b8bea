"""The replica picker: filters, weighted scorers, random tie-break, bounded-load cap."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.policies.load import LoadScorer
from fleetpilot.routing.policies.picker import (
    BoundedLoadFilter,
    CapacityFilter,
    HealthFilter,
    WeightedScorer,
    bounded_load_ok,
    pick,
)
from fleetpilot.routing.policies.prefix import PrefixIndex, PrefixScorer
from fleetpilot.routing.policies.types import PickRequest, ReplicaView


class Fixed:
    """A scorer with given scores."""

    def __init__(self, name: str, scores: dict[str, float]) -> None:
        self.name = name
        self.scores = scores

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        return {v.id: self.scores[v.id] for v in replicas}


def views(*ids: str, **kw: int) -> list[ReplicaView]:
    return [ReplicaView(i, 8, in_flight=kw.get(i, 0)) for i in ids]


def test_weighted_sum_decides() -> None:
    """Prefix weight 3 beats load weight 1: a full match wins over an idle replica."""
    scorers = [
        WeightedScorer(Fixed("prefix", {"a": 1.0, "b": 0.0}), 3.0),
        WeightedScorer(Fixed("load", {"a": 0.2, "b": 1.0}), 1.0),
    ]
    chosen = pick(PickRequest(), views("a", "b"), [], scorers, random.Random(0))
    assert chosen is not None
    assert chosen.replica.id == "a"
    assert chosen.scores == {"prefix": 1.0, "load": 0.2}
    assert chosen.total == pytest.approx(3.2)


def test_scores_outside_unit_interval_are_clamped() -> None:
    """A misbehaving scorer cannot dominate with a score of 100."""
    scorers = [
        WeightedScorer(Fixed("bad", {"a": 100.0, "b": 1.0}), 1.0),
        WeightedScorer(Fixed("load", {"a": 0.0, "b": 0.5}), 1.0),
    ]
    chosen = pick(PickRequest(), views("a", "b"), [], scorers, random.Random(0))
    assert chosen is not None
    assert chosen.replica.id == "b"


def test_ties_are_broken_at_random_over_all_tied() -> None:
    """Equal scores: every tied replica gets picked, about evenly."""
    rng = random.Random(1)
    scorer = [WeightedScorer(Fixed("s", {"a": 0.5, "b": 0.5, "c": 0.1}), 1.0)]
    counts = Counter(
        p.replica.id
        for _ in range(600)
        if (p := pick(PickRequest(), views("a", "b", "c"), [], scorer, rng))
    )
    assert set(counts) == {"a", "b"}
    assert 200 < counts["a"] < 400


def test_same_seed_same_pick() -> None:
    """Pure: the same inputs and seed give the same choice."""
    scorer = [WeightedScorer(Fixed("s", dict.fromkeys("abcd", 0.5)), 1.0)]
    picks = [
        [
            p.replica.id
            for _ in range(20)
            if (p := pick(PickRequest(), views(*"abcd"), [], scorer, rng))
        ]
        for rng in (random.Random(7), random.Random(7))
    ]
    assert picks[0] == picks[1]


def test_filters_leave_nothing_gives_none() -> None:
    """No candidate left after filtering: None (the caller answers 429/503)."""
    full = [ReplicaView("a", 1, in_flight=5)]
    assert pick(PickRequest(), full, [CapacityFilter(2)], [], random.Random(0)) is None


def test_health_filter_drops_ejected_but_panics_when_all_are() -> None:
    """Ejected replicas are skipped; when all are ejected, all are tried (panic mode)."""
    mixed = [ReplicaView("a", 8, ejected=True), ReplicaView("b", 8)]
    assert [v.id for v in HealthFilter().filter(PickRequest(), mixed)] == ["b"]
    dead = [ReplicaView("a", 8, ejected=True)]
    assert [v.id for v in HealthFilter().filter(PickRequest(), dead)] == ["a"]


@pytest.mark.parametrize(
    ("in_flight", "total", "n", "factor", "ok"),
    [
        (0, 0, 4, 1.25, True),
        (1, 1, 2, 1.25, True),  # cap ceil(1.25*2/2)=2
        (2, 2, 2, 1.25, False),  # cap ceil(1.25*3/2)=2, would be 3
        (3, 4, 4, 1.25, False),  # cap ceil(1.25*5/4)=2
        (1, 4, 4, 1.25, True),
        (9, 9, 1, 1.0, True),  # one replica always passes
    ],
)
def test_bounded_load_cap(in_flight: int, total: int, n: int, factor: float, ok: bool) -> None:
    """A replica may hold at most ceil(c * (total + 1) / n) counting the new request."""
    assert bounded_load_ok(in_flight, total, n, factor) is ok


@given(st.lists(st.integers(0, 100), min_size=1, max_size=16), st.floats(1.0, 3.0))
def test_bounded_load_always_leaves_someone(loads: list[int], factor: float) -> None:
    """With c >= 1 some replica is always under the cap."""
    vs = [ReplicaView(str(i), 8, in_flight=x) for i, x in enumerate(loads)]
    kept = BoundedLoadFilter(factor).filter(PickRequest(), vs)
    assert kept
    total = sum(loads)
    assert all(bounded_load_ok(v.in_flight, total, len(vs), factor) for v in kept)


def test_hot_prefix_is_spread_by_the_bounded_load_cap() -> None:
    """A single hot prefix: affinity alone would send everything to one replica; with the
    cap it takes at most c times its share of in-flight requests."""
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    scorers = [
        WeightedScorer(PrefixScorer(index), 3.0),
        WeightedScorer(LoadScorer(4.0), 1.0),
    ]
    in_flight = dict.fromkeys("abcd", 0)
    rng = random.Random(0)
    for _ in range(40):
        vs = [ReplicaView(r, 64, in_flight=n) for r, n in in_flight.items()]
        chosen = pick(PickRequest([1, 2, 3]), vs, [BoundedLoadFilter(1.25)], scorers, rng)
        assert chosen is not None
        in_flight[chosen.replica.id] += 1  # none finish: worst case
    assert max(in_flight.values()) <= 13  # ceil(1.25 * 40 / 4)
    assert in_flight["a"] == max(in_flight.values())  # affinity still prefers the cached one
