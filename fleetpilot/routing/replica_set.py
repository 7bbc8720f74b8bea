"""The router's replicas as discovery last published them, grouped by tier and role. No I/O.

``ReplicaSet`` owns the ``ReplicaState`` of every endpoint a source publishes: it keeps the state
of an endpoint that stays from one discovery change to the next (its counts, metrics, marks), and
what a pick needs of a group too large to score every replica (``LargeGroup``). Others ask it for
a replica or a group; only ``sync`` changes which replicas there are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fleetpilot.routing.endpoints import EndpointSource
from fleetpilot.routing.policies.candidates import HashRing
from fleetpilot.routing.policies.complexity import TierState
from fleetpilot.routing.replica import ReplicaState

# How long a group of over ``candidates.FULL_SCAN_MAX`` replicas keeps its tier state (is any
# replica open, is the group saturated) before reading every replica again: that read is the one
# part of a decision still proportional to the group, and spill-over and 429s turn on the
# group's mean queue, which a few milliseconds do not change (a scraped queue is up to a
# second old anyway). A pick never sends to a full replica: it reads its candidates now.
TIER_STATE_MAX_AGE_S = 0.05


class LargeGroup:
    """What a pick needs of a group of over ``FULL_SCAN_MAX`` replicas, kept from one
    discovery change to the next."""

    def __init__(self, group: Sequence[ReplicaState]) -> None:
        self.order = [r.id for r in group]
        self.ids = frozenset(self.order)
        self.ring = HashRing(self.order)
        self.stream_owner = {s: r.id for r in group for s in r.kv_streams}
        self.state: TierState | None = None
        self.state_at = -math.inf
        self.block_size: int | None = None
        self.block_size_at = -math.inf


class ReplicaSet:
    """The replicas of every configured group, by id and by ``(tier, role)``."""

    def __init__(self, full_scan_max: int) -> None:
        # Groups of more replicas than this are picked among candidates (``LargeGroup``).
        self.full_scan_max = full_scan_max
        self._replicas: dict[str, ReplicaState] = {}
        self._groups: dict[tuple[str, str], list[ReplicaState]] = {}
        self._large: dict[tuple[str, str], LargeGroup] = {}
        self._seen_version = -1

    def forget_version(self) -> None:
        """Re-read the source at the next ``sync`` even if it did not change (a new config)."""
        self._seen_version = -1

    def sync(
        self,
        source: EndpointSource,
        max_seqs: Mapping[tuple[str, str], int],
        suspect_after_s: Mapping[str, float],
    ) -> Mapping[str, ReplicaState] | None:
        """Re-read the source's endpoints if they changed: the new replica set, else None.
        ``max_seqs`` names the configured groups (an endpoint of another is dropped) and their
        batch sizes; ``suspect_after_s`` each tier's suspicion wait."""
        version = source.version
        if version == self._seen_version:
            return None
        self._seen_version = version
        replicas: dict[str, ReplicaState] = {}
        groups: dict[tuple[str, str], list[ReplicaState]] = {}
        for ep in source.endpoints():
            max_num_seqs = max_seqs.get((ep.tier, ep.role))
            if max_num_seqs is None or ep.id in replicas:
                continue  # a group the config no longer has, or a duplicate address
            state = self._replicas.get(ep.id)
            if state is None or state.endpoint != ep:
                state = ReplicaState(ep, max_num_seqs)
            state.max_num_seqs = max_num_seqs
            state.suspect_after_s = suspect_after_s.get(ep.tier, math.inf)
            replicas[ep.id] = state
            groups.setdefault((ep.tier, ep.role), []).append(state)
        self._replicas = replicas
        self._groups = groups
        big = self.full_scan_max
        self._large = {key: LargeGroup(g) for key, g in groups.items() if len(g) > big}
        return replicas

    def all(self) -> list[ReplicaState]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> ReplicaState | None:
        return self._replicas.get(replica_id)

    def __getitem__(self, replica_id: str) -> ReplicaState:
        return self._replicas[replica_id]

    def group(self, tier: str, role: str) -> list[ReplicaState]:
        return self._groups.get((tier, role), [])

    def large(self, tier: str, role: str) -> LargeGroup | None:
        """The group's candidate structures when it has over ``full_scan_max`` replicas."""
        return self._large.get((tier, role))

    def demand(self, replica_id: str) -> float:
        """A replica's requests (``ReplicaView.demand``, scraped gauges however old): how the
        holders of a prompt in a large group are ranked before their views are made."""
        state = self._replicas[replica_id]
        m = state.metrics
        in_flight = float(state.in_flight + state.peer_in_flight)
        return max(in_flight, m.running + m.waiting if m is not None else 0.0)
