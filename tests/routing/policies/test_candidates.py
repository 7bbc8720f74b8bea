"""The candidate replicas of a large group's pick: the consistent-hash ring, the deepest and
least loaded holders, the random sample."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from fleetpilot.routing.policies.candidates import HashRing, holder_candidates, sample

IDS = [f"10.0.{i // 250}.{i % 250}:8000" for i in range(300)]


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def test_the_ring_is_the_same_in_every_process_and_gives_distinct_successors() -> None:
    """Built from the same replicas in another order (another router replica's discovery),
    the ring gives every key the same successors; they are distinct and as many as asked."""
    ring, shuffled = HashRing(IDS), HashRing(random.Random(1).sample(IDS, len(IDS)))
    for n in range(200):
        first = ring.successors(key(n), 4)
        assert first == shuffled.successors(key(n), 4)
        assert len(set(first)) == 4
    assert HashRing(IDS[:3]).successors(key(0), 8) == HashRing(IDS[:3]).successors(key(0), 3)
    assert len(HashRing(IDS[:3]).successors(key(0), 8)) == 3
    assert HashRing([]).successors(key(0), 4) == []


def test_a_replica_leaving_the_ring_moves_only_the_keys_it_was_home_to() -> None:
    ring, without = HashRing(IDS), HashRing(IDS[1:])
    moved = 0
    for n in range(3000):
        home = ring.successors(key(n), 1)[0]
        if home == IDS[0]:
            moved += 1
        else:
            assert without.successors(key(n), 1)[0] == home
    assert 0 < moved < 3000 * 3 / len(IDS)  # about its share, 1/300, of the keys


def test_every_replica_is_home_to_about_its_share_of_keys() -> None:
    ring = HashRing(IDS[:20])
    counts = dict.fromkeys(IDS[:20], 0)
    for n in range(20_000):
        counts[ring.successors(key(n), 1)[0]] += 1
    assert max(counts.values()) < 2 * 1000
    assert min(counts.values()) > 1000 / 2


def test_holders_are_taken_deepest_first_then_least_loaded() -> None:
    depths = {"a": 3, "b": 5, "c": 5, "d": 5, "e": 1, "f": 3}
    load = {"a": 0, "b": 9, "c": 1, "d": 4, "e": 0, "f": 7}.__getitem__
    assert holder_candidates(depths, load, count=2) == ["c", "d"]
    assert holder_candidates(depths, load, count=4) == ["b", "c", "d", "a"]
    assert sorted(holder_candidates(depths, load, count=6)) == sorted(depths)
    assert holder_candidates({}, load) == []


@given(st.integers(0, 40), st.lists(st.sampled_from(IDS[:50]), max_size=30), st.integers(0, 2**32))
def test_a_sample_is_distinct_excludes_what_it_must_and_is_as_large_as_it_can_be(
    count: int, exclude: list[str], seed: int
) -> None:
    group = IDS[:50]
    drawn = sample(group, exclude, count, random.Random(seed))
    assert len(set(drawn)) == len(drawn)
    assert not set(drawn) & set(exclude)
    assert set(drawn) <= set(group)
    assert len(drawn) == min(count, len(set(group) - set(exclude)))
