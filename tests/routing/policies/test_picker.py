"""The replica picker: filters (health, capacity, headroom, bounded load), weighted scorers,
random tie-break."""

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
    HeadroomFilter,
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


def test_a_tie_key_breaks_ties_alike_whatever_the_random_state() -> None:
    """With a tie key, the tied replica with the highest rendezvous weight wins in every
    process; different keys still spread over all the tied replicas, and a replica leaving
    moves only the keys it held."""
    scorer = [WeightedScorer(Fixed("s", dict.fromkeys("abcd", 0.5)), 1.0)]

    def chosen(key: bytes, ids: str, seed: int) -> str:
        p = pick(PickRequest(tie_key=key), views(*ids), [], scorer, random.Random(seed))
        assert p is not None
        return p.replica.id

    keys = [bytes([n]) * 16 for n in range(200)]
    placed = {key: chosen(key, "abcd", 0) for key in keys}
    assert all(chosen(key, "abcd", seed) == placed[key] for key in keys[:20] for seed in (1, 2))
    assert all(30 < n < 70 for n in Counter(placed.values()).values())
    without_d = {key: chosen(key, "abc", 0) for key in keys}
    assert all(without_d[k] == placed[k] for k in keys if placed[k] != "d")


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


def test_with_a_fair_queue_a_replica_takes_work_only_while_its_batch_has_room() -> None:
    """Without the router's fair queue a replica is full only past maxNumSeqs plus its queue
    allowance; with it (batch_only), as soon as a new request would queue at the engine -
    the engine's queue is first come, first served, so it must stay empty to be fair."""
    replicas = [
        # The last scrape saw a full batch, but one of this router's requests ended since.
        ReplicaView("roomy", 4, in_flight=3, running=4),
        ReplicaView("batch-full", 4, in_flight=4),
        ReplicaView("queueing", 4, in_flight=2, running=2, waiting=1),
    ]
    allowance = CapacityFilter(64).filter(PickRequest(), replicas)
    assert [v.id for v in allowance] == ["roomy", "batch-full", "queueing"]
    batch_only = CapacityFilter(64, batch_only=True).filter(PickRequest(), replicas)
    assert [v.id for v in batch_only] == ["roomy"]


def test_health_filter_drops_ejected_but_panics_when_all_are() -> None:
    """Ejected replicas are skipped; when all are ejected by quick failures (refused
    connections), all are tried (panic mode)."""
    mixed = [ReplicaView("a", 8, ejected=True), ReplicaView("b", 8)]
    assert [v.id for v in HealthFilter().filter(PickRequest(), mixed)] == ["b"]
    dead = [ReplicaView("a", 8, ejected=True)]
    assert [v.id for v in HealthFilter().filter(PickRequest(), dead)] == ["a"]


KILLED = {"ejected": True}  # its failures were refused connections
FROZEN = {"ejected": True, "hangs": True}  # its failures were waits that ran out
SUSPECT = {"suspect": True}  # not ejected yet: a request waits there, its scrape failed
SOUND: dict[str, bool] = {}

SERVING = PickRequest()
PREFILL = PickRequest(optional=True)  # the P/D prefill hop: decode-only is the fallback


@pytest.mark.parametrize(
    ("scenario", "request_", "replicas", "kept"),
    [
        # Unified (or decode) replicas: the request has no other way to be served.
        ("unified, all killed: panic", SERVING, [KILLED, KILLED], ["r0", "r1"]),
        ("unified, all frozen: none (503)", SERVING, [FROZEN, FROZEN], []),
        ("unified, one of several frozen", SERVING, [FROZEN, SOUND, SOUND], ["r1", "r2"]),
        ("unified, one of several suspect", SERVING, [SUSPECT, SOUND], ["r1"]),
        ("unified, all suspect: kept", SERVING, [SUSPECT, SUSPECT], ["r0", "r1"]),
        ("unified, suspect beats ejected", SERVING, [SUSPECT, KILLED], ["r0"]),
        ("unified, killed and frozen: the killed", SERVING, [FROZEN, KILLED], ["r1"]),
        # Prefill replicas: the request can do without them.
        ("prefill, all killed: skipped", PREFILL, [KILLED, KILLED], []),
        ("prefill, all frozen: skipped", PREFILL, [FROZEN], []),
        ("prefill, one of several frozen", PREFILL, [FROZEN, SOUND], ["r1"]),
        ("prefill, the only one suspect: skipped", PREFILL, [SUSPECT], []),
        ("prefill, one of several suspect", PREFILL, [SUSPECT, SOUND], ["r1"]),
    ],
)
def test_health_filter_keeps_unsound_replicas_only_where_a_try_is_cheap(
    scenario: str, request_: PickRequest, replicas: list[dict[str, bool]], kept: list[str]
) -> None:
    """Issue 41: an ejected prefill role was kept in panic mode, so a frozen prefill engine
    held every request for its whole first-byte budget; and a frozen replica was kept when
    every one was ejected. Now: a prefill group with no sound replica is skipped (decode-only),
    suspect replicas are passed over while a sound one exists, and panic mode keeps only
    ejected replicas that fail fast."""
    views = [ReplicaView(f"r{i}", 8, **flags) for i, flags in enumerate(replicas)]
    assert [v.id for v in HealthFilter().filter(request_, views)] == kept, scenario


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


def affinity_scorers(index: PrefixIndex) -> list[WeightedScorer]:
    return [WeightedScorer(PrefixScorer(index), 3.0), WeightedScorer(LoadScorer(4.0), 1.0)]


def test_a_hot_prefix_stays_on_its_replica_while_it_has_free_slots() -> None:
    """Issue 14's regression: a hot tenant's concurrent requests all go to the replica that
    caches its prefix until that replica's batch is full - the bounded-load cap sent the second
    one away at once - and only then spread."""
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    in_flight = dict.fromkeys("abcd", 0)
    rng = random.Random(0)
    placed = []
    for _ in range(6):
        vs = [ReplicaView(r, 4, in_flight=n) for r, n in in_flight.items()]
        chosen = pick(PickRequest([1, 2, 3]), vs, [HeadroomFilter()], affinity_scorers(index), rng)
        assert chosen is not None
        in_flight[chosen.replica.id] += 1
        placed.append(chosen.replica.id)
    assert placed[:4] == ["a"] * 4  # max_num_seqs 4: four fit at once
    assert "a" not in placed[4:]  # a full batch would make the fifth wait: it goes elsewhere


@pytest.mark.parametrize(
    ("view", "roomy"),
    [
        (ReplicaView("r", 4, in_flight=3), True),
        (ReplicaView("r", 4, in_flight=4), False),  # batch full
        (ReplicaView("r", 4, running=2, waiting=1), False),  # the engine queues already
        (ReplicaView("r", 4, in_flight=1, kv_usage=0.95), False),  # KV pressure
        (ReplicaView("r", 4, in_flight=1, kv_usage=0.5), True),
        (ReplicaView("r", 4, running=3.0), True),  # other routers' requests, one slot left
        (ReplicaView("r", 4, running=4.0), False),
    ],
)
def test_headroom_bites_on_queue_full_batch_and_kv_pressure(view: ReplicaView, roomy: bool) -> None:
    """A replica is passed over for a queue, a full batch or KV pressure - by our count or the
    engine's (other router replicas' requests included) - and for nothing else."""
    kept = HeadroomFilter().filter(PickRequest(), [view, ReplicaView("idle", 4)])
    assert ("r" in [v.id for v in kept]) is roomy


def test_without_headroom_anywhere_every_replica_stays_a_candidate() -> None:
    """All replicas pressed: none is dropped (the scorers pick the least bad), never a 503."""
    vs = [ReplicaView("a", 4, in_flight=4), ReplicaView("b", 4, waiting=2.0)]
    assert [v.id for v in HeadroomFilter().filter(PickRequest(), vs)] == ["a", "b"]


def test_one_shared_prefix_spreads_over_the_fleet_under_load() -> None:
    """One system prompt shared by every user (production-stack's multi-round QA): pure
    affinity sends everything to the first replica that cached it; with headroom, new
    requests spread once it is full, so every replica ends up serving."""
    index = PrefixIndex(100)
    in_flight = dict.fromkeys("abcd", 0)
    rng = random.Random(1)
    for _ in range(16):
        vs = [ReplicaView(r, 4, in_flight=n) for r, n in in_flight.items()]
        chosen = pick(PickRequest([9, 8]), vs, [HeadroomFilter()], affinity_scorers(index), rng)
        assert chosen is not None
        in_flight[chosen.replica.id] += 1
        index.record(chosen.replica.id, [9, 8])
    assert in_flight == dict.fromkeys("abcd", 4)
