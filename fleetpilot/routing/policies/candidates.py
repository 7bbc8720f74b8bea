"""Which replicas of a large group a pick looks at: a few, chosen so the pick finds what a scan
of every replica would. Purely computational (the caller passes the random generator).

Scoring a replica costs ~10 us of Python (its view, two filters, two scorers), so a pick over a
thousand replicas cost ~10 ms of router CPU a request (``bench/simulate_speed.py``): a router
replica could route ~100 requests a second into such a fleet. A pick only needs the replicas
that could win it:

- the **holders**: the replicas caching the deepest part of the prompt (its engines' KV events,
  or what this router just sent there), least loaded first: where a cached prompt is cheapest;
- the **home**: the replicas that follow the request's tie key on a consistent-hash ring - the
  same in every router replica, as the tie key is - where a cold prompt lands and a hot
  prefix spreads first, so router replicas still agree and a spreading prefix lands where its
  next requests will look;
- a **sample** of the rest, only when none of those has room for one more request at once
  (``load.has_headroom``): a busy neighbourhood then looks further, as the power of d random
  choices does (Mitzenmacher, 2001), and when every replica is busy the few sampled are as
  good as any.

A scan of every replica stays the rule up to ``FULL_SCAN_MAX`` replicas (where it costs under
a millisecond), and is the fallback when no candidate passes the filters.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from hashlib import blake2b

# Up to this many replicas a pick scores every one (~10 us each: ~0.6 ms at the bound).
FULL_SCAN_MAX = 64
# Holders of the prompt's deepest cached blocks a pick looks at: enough to spread a hot prefix
# over a few replicas by load before it has to be computed afresh elsewhere.
HOLDER_CANDIDATES = 8
# Replicas after the tie key on the ring: a cold prompt's home, and where a hot one spreads.
HOME_CANDIDATES = 4
# Replicas drawn at random when no holder or home replica has room.
SAMPLED_CANDIDATES = 8
# Points per replica on the ring: with 64, each replica's share of the keys is within ~15% of
# its fair share (the standard deviation of an arc's length shrinks as 1/sqrt(points)).
RING_POINTS = 64


def _point(data: bytes) -> int:
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over replica ids; the same in every process (blake2b, not the
    salted ``hash``), so every router replica finds the same home for a key. A replica joining
    or leaving moves only the keys next to its points."""

    def __init__(self, replica_ids: Iterable[str], points: int = RING_POINTS) -> None:
        ring = sorted(
            (_point(rid.encode() + b"\0" + i.to_bytes(2, "big")), rid)
            for rid in replica_ids
            for i in range(points)
        )
        self._points = [p for p, _ in ring]
        self._owners = [rid for _, rid in ring]
        self.size = len({rid for _, rid in ring})

    def successors(self, key: bytes, count: int) -> list[str]:
        """The first ``count`` distinct replicas clockwise from ``key`` (fewer if the ring
        has fewer)."""
        if not self._points:
            return []
        want = min(count, self.size)
        start = bisect.bisect(self._points, _point(key))
        owners = self._owners
        n = len(owners)
        found: dict[str, None] = {}
        for i in range(start, start + n):
            found[owners[i % n]] = None
            if len(found) >= want:
                break
        return list(found)


def holder_candidates(
    depths: Mapping[str, int], load: Callable[[str], float], count: int = HOLDER_CANDIDATES
) -> list[str]:
    """Up to ``count`` replicas from ``depths`` (replica -> cached leading blocks), the
    deepest first and, within a depth, the least loaded (``load``: lower is lighter)."""
    if len(depths) <= count:
        return list(depths)
    by_depth: dict[int, list[str]] = {}
    for rid, depth in depths.items():
        by_depth.setdefault(depth, []).append(rid)
    chosen: list[str] = []
    for depth in sorted(by_depth, reverse=True):
        level = by_depth[depth]
        need = count - len(chosen)
        chosen += level if len(level) <= need else heapq.nsmallest(need, level, key=load)
        if len(chosen) >= count:
            break
    return chosen


def sample(
    replica_ids: Sequence[str], exclude: Iterable[str], count: int, rng: random.Random
) -> list[str]:
    """Up to ``count`` replicas drawn at random, none of ``exclude``."""
    taken = set(exclude)
    if len(replica_ids) - len(taken) <= count:
        return [rid for rid in replica_ids if rid not in taken]
    drawn: list[str] = []
    # Rejection sampling: the excluded are a few of many, so few draws are wasted.
    while len(drawn) < count:
        rid = replica_ids[rng.randrange(len(replica_ids))]
        if rid not in taken:
            taken.add(rid)
            drawn.append(rid)
    return drawn


__all__ = [
    "FULL_SCAN_MAX",
    "HOLDER_CANDIDATES",
    "HOME_CANDIDATES",
    "SAMPLED_CANDIDATES",
    "HashRing",
    "holder_candidates",
    "sample",
]
