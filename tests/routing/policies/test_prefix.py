"""Prefix affinity: chained block hashes, the per-replica LRU index, the match score."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.policies.prefix import (
    PrefillCostScorer,
    PrefixIndex,
    PrefixScorer,
    block_hashes,
)
from fleetpilot.routing.policies.types import PickRequest, ReplicaView


def test_only_full_blocks_are_hashed() -> None:
    """A partial tail block is not hashed (engines cache only full blocks)."""
    assert len(block_hashes("x" * 63, "m", 64)) == 0
    assert len(block_hashes("x" * 64, "m", 64)) == 1
    assert len(block_hashes("x" * 200, "m", 64)) == 3


def test_block_count_is_capped() -> None:
    """A huge prompt costs a bounded amount of hashing."""
    assert len(block_hashes("x" * 10_000, "m", 16, max_blocks=100)) == 100


def test_hashes_are_chained_and_seeded_with_the_model() -> None:
    """Equal blocks after different prefixes hash differently; so do equal prompts for two
    models (two tiers never share KV)."""
    a = block_hashes("A" * 64 + "B" * 64, "m", 64)
    b = block_hashes("C" * 64 + "B" * 64, "m", 64)
    assert a[1] != b[1]
    assert block_hashes("A" * 64, "m1", 64) != block_hashes("A" * 64, "m2", 64)


@given(st.text(min_size=0, max_size=600), st.text(max_size=300), st.integers(16, 64))
def test_shared_prefix_shares_leading_hashes(prefix: str, tail: str, block: int) -> None:
    """Two prompts sharing a prefix share exactly the hashes of the blocks inside it."""
    a = block_hashes(prefix + tail, "m", block)
    b = block_hashes(prefix, "m", block)
    full = len(prefix) // block
    assert a[:full] == b[:full]


def view(rid: str) -> ReplicaView:
    return ReplicaView(rid, max_num_seqs=8)


def test_score_is_the_matched_leading_fraction() -> None:
    """A replica that was sent the prompt's first half scores 0.5; an unrelated one 0."""
    index = PrefixIndex(1000)
    hashes = block_hashes("x" * 64 * 4 + "tail" * 100, "m", 64)[:4]
    index.record("a", hashes[:2])
    scores = PrefixScorer(index).score(PickRequest(hashes), [view("a"), view("b")])
    assert scores == {"a": 0.5, "b": 0.0}


def test_no_blocks_scores_zero_everywhere() -> None:
    """A prompt shorter than a block has no affinity."""
    index = PrefixIndex(10)
    assert PrefixScorer(index).score(PickRequest(()), [view("a")]) == {"a": 0.0}


def test_match_stops_at_first_missing_block() -> None:
    """A hole in the chain ends the match (later blocks are useless to the engine)."""
    index = PrefixIndex(10)
    index.record("a", [1, 3])
    assert index.matched_blocks("a", [1, 2, 3]) == 1


def test_lru_evicts_tail_blocks_first_and_keeps_size() -> None:
    """Over capacity, the least recently used blocks go, a prompt's tail before its head."""
    index = PrefixIndex(4)
    index.record("a", [1, 2, 3])
    index.record("a", [10, 11, 12])
    assert index.size("a") == 4
    assert index.matched_blocks("a", [10, 11, 12]) == 3
    assert index.matched_blocks("a", [1, 2, 3]) == 1  # head of the older prompt survives


def test_recording_again_refreshes_recency() -> None:
    """A prefix sent again is most recent again and survives newer traffic."""
    index = PrefixIndex(4)
    index.record("a", [1, 2])
    index.record("a", [3, 4])
    index.record("a", [1, 2])
    index.record("a", [5])
    assert index.matched_blocks("a", [1, 2]) == 2


def test_forget_and_retain_drop_departed_replicas() -> None:
    """A replica that left takes its predicted cache with it."""
    index = PrefixIndex(10)
    index.record("a", [1])
    index.record("b", [1])
    index.retain(["b"])
    assert index.matched_blocks("a", [1]) == 0
    index.forget("b")
    assert index.matched_blocks("b", [1]) == 0


@given(st.lists(st.lists(st.integers(0, 50), max_size=20), max_size=30), st.integers(1, 40))
def test_index_never_exceeds_capacity(batches: list[list[int]], capacity: int) -> None:
    """Whatever is recorded, the LRU holds at most its capacity."""
    index = PrefixIndex(capacity)
    for batch in batches:
        index.record("a", batch)
        assert index.size("a") <= capacity


def test_prefill_cost_prefers_the_cached_replica_while_its_prefill_queue_is_short() -> None:
    """A replica caching 9 of 10 blocks with nothing pending beats an idle one that caches
    nothing (cost 2 x 1 vs 2 x 10: a block computed costs this request and those behind it);
    12 blocks of other prompts waiting to be prefilled there do not move it (14 vs 20), 20 do
    (22 vs 20): only a wait longer than computing the prompt twice sends it elsewhere."""
    index = PrefixIndex(100)
    hashes = list(range(10))
    index.record("a", hashes[:9])
    scorer = PrefillCostScorer(index)

    def scores(pending: float) -> dict[str, float]:
        views = [ReplicaView("a", 4, pending_prefill=pending), ReplicaView("b", 4)]
        return scorer.score(PickRequest(hashes), views)

    assert scores(0.0)["a"] > scores(0.0)["b"]
    assert scores(12.0)["a"] > scores(12.0)["b"]
    assert scores(20.0)["b"] > scores(20.0)["a"]
    # Priced at its own prefill only, 12 pending blocks were enough (13 vs 10).
    once = PrefillCostScorer(index, block_cost=1.0)
    busy = [ReplicaView("a", 4, pending_prefill=12.0), ReplicaView("b", 4)]
    assert once.score(PickRequest(hashes), busy)["b"] > once.score(PickRequest(hashes), busy)["a"]
    with pytest.raises(ValueError, match="at least its own prefill"):
        PrefillCostScorer(index, block_cost=0.5)


def test_prefill_cost_weighs_the_engines_queue_against_what_the_cache_saves() -> None:
    """Another router's requests queued at the caching replica are seen only in its scraped
    queue, a block each (most queued requests hit the cache; a full batch counts as one ahead),
    and a miss there costs a block more per request waiting: one to five ahead keep the prompt
    where 9 of its 10 blocks are cached, nine waiting send it to the idle replica, unless that one
    would have to evict for it."""
    index = PrefixIndex(100)
    hashes = list(range(10))
    index.record("a", hashes[:9])
    scorer = PrefillCostScorer(index)

    def scores(waiting: float, **kwargs: dict[str, float]) -> dict[str, float]:
        views = [ReplicaView("a", 4, waiting=waiting, running=4.0), ReplicaView("b", 4)]
        return scorer.score(PickRequest(hashes, **kwargs), views)

    full = [ReplicaView("a", 4, running=4.0), ReplicaView("b", 4)]
    assert [v.ahead for v in full] == [1.0, 0.0]
    assert scores(0.0)["a"] > scores(0.0)["b"]  # 1 ahead + (2 + 1) x 1 uncached = 4 vs 20
    assert scores(2.0)["a"] > scores(2.0)["b"]  # 3 ahead + 5 = 8 vs 20
    assert scores(5.0)["a"] > scores(5.0)["b"]  # 6 ahead + 8 = 14 vs 20
    assert scores(9.0)["b"] > scores(9.0)["a"]  # 10 ahead + 12 = 22 vs 20
    evicting = scores(9.0, pressure={"b": 1.0})
    assert evicting["a"] > evicting["b"]  # 22 vs 30: a miss on b evicts another prefix


def test_prefill_cost_scores_lie_in_the_unit_interval_and_tie_when_all_are_free() -> None:
    """Scores stay in [0, 1] (the picker's contract), the cheapest gets 1; with no prompt and
    nothing pending every replica ties, so load and the tie-break decide."""
    index = PrefixIndex(100)
    index.record("a", [1, 2])
    scorer = PrefillCostScorer(index)
    views = [ReplicaView("a", 4, pending_prefill=3.0), ReplicaView("b", 4), ReplicaView("c", 4)]
    scores = scorer.score(PickRequest([1, 2, 3]), views)
    assert all(0.0 <= s <= 1.0 for s in scores.values())
    assert max(scores.values()) == 1.0
    assert scorer.score(PickRequest([]), [ReplicaView("a", 4), ReplicaView("b", 4)]) == {
        "a": 1.0,
        "b": 1.0,
    }


def test_a_cold_prompt_goes_where_the_traffic_is_light_not_where_one_shared_block_is_cached() -> (
    None
):
    """Issue 44: a prompt whose only cached block is one that every tenant's prompts start
    with (a chat template's header) went to the replica that held it, the busiest, whose next
    requests then waited behind its long prefill; the replicas that held nothing got nothing
    (4 engines, 6 req/s: a third of the traffic on one engine, none on another). An uncached
    block costs the requests behind it in proportion to the traffic the replica gets: the
    cold prompt goes to the quiet replica, while a prompt the busy one caches stays there."""
    index = PrefixIndex(1000)
    prompt = list(range(100))
    index.record("busy", prompt[:1])
    scorer = PrefillCostScorer(index)
    views = [ReplicaView("busy", 4, recent_sends=30.0), ReplicaView("quiet", 4, recent_sends=2.0)]
    cold = scorer.score(PickRequest(prompt), views)
    assert cold["quiet"] > cold["busy"]
    index.record("busy", prompt[:90])
    warm = scorer.score(PickRequest(prompt), views)
    assert warm["busy"] > warm["quiet"]


def test_with_even_traffic_an_uncached_block_costs_as_before() -> None:
    """Replicas with the group's mean traffic (or none yet anywhere) price an uncached block
    at ``UNCACHED_BLOCK_COST``: the same scores as with no traffic recorded."""
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    scorer = PrefillCostScorer(index)
    plain = [ReplicaView("a", 4, pending_prefill=4.0), ReplicaView("b", 4)]
    even = [ReplicaView("a", 4, pending_prefill=4.0, recent_sends=7.0),
            ReplicaView("b", 4, recent_sends=7.0)]  # fmt: skip
    request = PickRequest(list(range(1, 11)))
    assert scorer.score(request, plain) == scorer.score(request, even)


# ---- a second KV tier: blocks in host memory (issue 46) ------------------------------------


def tiered(cached: dict[str, float], host: dict[str, float]) -> PickRequest:
    """A prompt of 10 blocks the engines' KV events judged for replicas ``dev``, ``host`` and
    ``miss``: ``cached`` the fraction each holds (device prefix and host run), ``host`` the
    part of it in host memory only."""
    return PickRequest(list(range(10)), frozenset(["dev", "host", "miss"]), cached, host=host)


THREE = [ReplicaView("dev", 4), ReplicaView("host", 4), ReplicaView("miss", 4)]


def test_a_host_block_prices_between_a_device_hit_and_a_miss() -> None:
    """The same 8 of 10 blocks on the device, copied back from host memory, or nowhere: the
    device replica scores best, the host one close behind (8 copies at 0.1 a block, against
    16 blocks of prefill priced at 2), the cold one last."""
    request = tiered({"dev": 0.8, "host": 0.8}, {"host": 0.8})
    scores = PrefillCostScorer(PrefixIndex(100)).score(request, THREE)
    assert scores["dev"] > scores["host"] > scores["miss"]
    # cost: dev 2 x 2 = 4; host 4 + 0.1 x 8 = 4.8; miss 2 x 10 = 20 (a prompt of 10 is 1.0)
    assert scores == pytest.approx({"dev": 1.0, "host": 1.0 - 0.08, "miss": 1.0 - 1.0})


def test_the_host_hit_cost_is_tunable_from_a_device_hit_to_a_prefill() -> None:
    """At 0 a host block is a device hit; at 1, with a block priced at its own prefill only,
    it is a miss; outside 0..1 the scorer refuses it."""
    request = tiered({"dev": 0.8, "host": 0.8}, {"host": 0.8})
    free = PrefillCostScorer(PrefixIndex(100), host_hit_cost=0.0).score(request, THREE)
    assert free["dev"] == free["host"] == 1.0
    dear = PrefillCostScorer(PrefixIndex(100), block_cost=1.0, host_hit_cost=1.0)
    scores = dear.score(tiered({"dev": 0.8, "host": 0.8}, {"host": 0.8}), THREE)
    assert scores["host"] == pytest.approx(scores["miss"])
    assert scores["dev"] > scores["host"]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between a device hit"):
            PrefillCostScorer(PrefixIndex(100), host_hit_cost=bad)


def test_a_host_hit_beats_a_device_hit_behind_a_long_prefill_queue() -> None:
    """Host copies cost this request's wait only: a replica holding the prompt in host memory
    wins over one holding it on the device behind 5 blocks of others' prefill, and loses to
    it once the queue is gone."""
    request = tiered({"dev": 1.0, "host": 1.0}, {"host": 1.0})
    queued = [ReplicaView("dev", 4, pending_prefill=5.0), ReplicaView("host", 4)]
    scorer = PrefillCostScorer(PrefixIndex(100))
    assert scorer.score(request, queued)["host"] > scorer.score(request, queued)["dev"]
    idle = [ReplicaView("dev", 4), ReplicaView("host", 4)]
    assert scorer.score(request, idle)["dev"] > scorer.score(request, idle)["host"]
