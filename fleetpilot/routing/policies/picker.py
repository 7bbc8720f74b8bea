"""Replica choice as a pipeline: filters, then weighted scorers in [0, 1], then the maximum;
a tie goes by the request's tie key (alike in every router replica) or at random. Purely
computational: the caller passes the plugin instances and the random generator, so the same
inputs and seed always give the same pick.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetpilot.routing.policies.load import has_headroom, is_full
from fleetpilot.routing.policies.types import Filter, PickRequest, ReplicaView, Scorer

# Scores are sums of a few products of floats; anything closer than this is a tie, so float
# noise never decides between two equally good replicas.
TIE_EPSILON = 1e-9


class HealthFilter:
    """Drops ejected and suspect replicas; what it keeps when that leaves none is an explicit
    rule, by what a try would cost:

    - a group the request can do without (``PickRequest.optional``: the P/D prefill hop, whose
      fallback is decode-only) keeps none: the fallback is certain and costs nothing, where a
      frozen prefill replica would hold each request for its whole first-byte budget;
    - otherwise the suspect replicas, not ejected (suspicion is no verdict: slow ones answer);
    - otherwise, panic mode as Envoy's outlier detection has it, the ejected replicas that fail
      fast (refused connections, 5xx: ``ReplicaView.hangs`` false): with every replica ejected,
      a failure that hit all at once (a network blip) is likelier than all being dead, and a
      dead replica refuses the connection at once, so trying costs little;
    - never an ejected replica that hangs (frozen): each try would wait out a whole budget for
      a failure, where none kept answers 503 at once (or holds the request for a cold start)
      until its /health probe readmits it.
    """

    name = "health"

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        sound = [v for v in replicas if not v.ejected and not v.suspect]
        if sound or request.optional:
            return sound
        suspect = [v for v in replicas if not v.ejected]
        if suspect:
            return suspect
        return [v for v in replicas if not v.hangs]


class CapacityFilter:
    """Drops replicas whose queue is at the hard limit (see ``load.is_full``); with
    ``batch_only`` (the router's fair queue holds what waits: routing.flow), those whose batch
    this router has filled or whose engine reports a queue: an engine's queue is first come,
    first served, so fairness across tenants needs it empty. The batch is judged by the
    router's own in-flight count, which drops the moment a request ends: the scraped running
    count lags by a scrape interval, and every slot freed meanwhile would sit idle."""

    name = "capacity"

    def __init__(self, max_waiting: int, *, batch_only: bool = False) -> None:
        self.max_waiting = max_waiting
        self.batch_only = batch_only

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if self.batch_only:
            return [v for v in replicas if v.in_flight < v.max_num_seqs and v.waiting <= 0]
        return [v for v in replicas if not is_full(v, self.max_waiting)]


class HeadroomFilter:
    """Keeps the replicas where one more request runs at once (``load.has_headroom``), when
    any has: load bites only where it hurts a request - a queue, a full batch, KV pressure -
    so a hot prefix stays on the replica that caches it while that replica has room, and
    spreads the moment it has none (one shared system prompt cannot drown one engine). With no
    replica in headroom every one passes, and the scorers pick the least bad."""

    name = "headroom"

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        roomy = [v for v in replicas if has_headroom(v)]
        return roomy if roomy else list(replicas)


def bounded_load_ok(in_flight: int, total_in_flight: int, replicas: int, factor: float) -> bool:
    """Consistent hashing with bounded loads: may a replica with ``in_flight`` take one more?

    Each replica may hold at most ``ceil(factor * (total + 1) / replicas)`` requests counting
    the new one. With ``factor >= 1`` the capacities sum to at least ``total + 1``, so some
    replica always passes. (Mirrokni et al., 2016; KubeAI's ``chwblLoadOK``.)
    """
    if replicas <= 0:
        return False
    cap = math.ceil(factor * (total_in_flight + 1) / replicas)
    return in_flight + 1 <= cap


class BoundedLoadFilter:
    """Drops replicas above the bounded-load cap, so one hot prefix cannot flatten a replica
    while its peers idle; the prefix scorer then picks the best of the rest.

    Not the router's default any more (``HeadroomFilter`` is): at small totals the cap is one
    request, which pushed a hot tenant's second request off its cached replica even with free
    batch slots there. Kept for consistent hashing with bounded loads (KubeAI's CHWBL), a
    baseline the benchmarks compare against."""

    name = "bounded-load"

    def __init__(self, factor: float) -> None:
        if factor < 1.0:
            raise ValueError("the bounded-load factor must be at least 1")
        self.factor = factor

    def filter(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        total = sum(v.in_flight for v in replicas)
        n = len(replicas)
        kept = [v for v in replicas if bounded_load_ok(v.in_flight, total, n, self.factor)]
        # Cannot be empty for factor >= 1 (see bounded_load_ok); guard anyway.
        return kept if kept else list(replicas)


def rendezvous_weight(key: bytes, replica_id: str) -> int:
    """Highest-random-weight hashing: the replica with the largest weight for a key takes it.
    Stable across processes (unlike ``hash``, salted per process), so every router replica
    breaks a tie the same way; a replica leaving moves only the keys it held."""
    digest = hashlib.blake2b(replica_id.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Pick:
    """The chosen replica, its total score and each scorer's score for it."""

    replica: ReplicaView
    total: float
    scores: dict[str, float] = field(default_factory=dict)
    candidates: int = 0


def pick(
    request: PickRequest,
    replicas: Sequence[ReplicaView],
    filters: Sequence[Filter],
    scorers: Sequence[WeightedScorer],
    rng: random.Random,
) -> Pick | None:
    """Filter, score, take the maximum; ``None`` when the filters leave nothing."""
    candidates: Sequence[ReplicaView] = replicas
    for f in filters:
        candidates = f.filter(request, candidates)
        if not candidates:
            return None
    totals = dict.fromkeys((v.id for v in candidates), 0.0)
    per_scorer: dict[str, dict[str, float]] = {}
    for weighted in scorers:
        if weighted.weight == 0.0:
            continue
        scores = weighted.scorer.score(request, candidates)
        per_scorer[weighted.scorer.name] = scores
        for rid, value in scores.items():
            if rid in totals:
                totals[rid] += weighted.weight * min(1.0, max(0.0, value))
    best = max(totals.values())
    ties = [v for v in candidates if totals[v.id] >= best - TIE_EPSILON]
    if len(ties) == 1:
        chosen = ties[0]
    elif (tie_key := request.tie_key) is not None:
        chosen = max(ties, key=lambda v: rendezvous_weight(tie_key, v.id))
    else:
        chosen = rng.choice(ties)
    return Pick(
        replica=chosen,
        total=totals[chosen.id],
        scores={name: s.get(chosen.id, 0.0) for name, s in per_scorer.items()},
        candidates=len(candidates),
    )
