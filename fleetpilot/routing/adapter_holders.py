"""Which replicas hold which LoRA adapter, as this router knows it. No I/O.

An engine keeps the ``max_loras`` adapters it ran last (it evicts the least recently used), so
the replicas this router last sent an adapter to are where it is loaded: a pick in a group too
large to score every replica looks at them (and at the adapter's home on the hash ring) first.
``AdapterHolders`` owns that record; each replica's own marks (``ReplicaState.note_adapter*``)
are what its view shows the adapter scorer.
"""

from __future__ import annotations

from dataclasses import replace

from fleetpilot.api.router_config import RouterTier
from fleetpilot.routing.policies.candidates import HOLDER_CANDIDATES, HOME_CANDIDATES
from fleetpilot.routing.policies.types import PickRequest
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replica_set import ReplicaSet


class AdapterHolders:
    """Per LoRA adapter, the replicas this router sent it to that still hold it, in order."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._holders: dict[str, dict[str, None]] = {}

    def sent(
        self, tier: RouterTier, replica: ReplicaState, adapter: str | None, now: float
    ) -> None:
        """A request for ``adapter`` (None: the base model) goes to ``replica`` at ``now``."""
        if adapter is None:
            return
        evicted = replica.note_adapter(adapter, tier.max_loras, now)
        self._holders.setdefault(adapter, {})[replica.id] = None
        for gone in evicted:
            holders = self._holders.get(gone)
            if holders is not None:
                holders.pop(replica.id, None)

    def missing(self, replica: ReplicaState, adapter: str, now: float) -> None:
        """The replica answered a request for ``adapter`` with 404 at ``now``: no holder."""
        replica.note_adapter_missing(adapter, now)
        holders = self._holders.get(adapter)
        if holders is not None:
            holders.pop(replica.id, None)

    def with_adapter(
        self, tier: RouterTier, role: str, request: PickRequest, adapter: str | None
    ) -> PickRequest:
        """The pick request naming the request's adapter, for the adapter scorer; in a group
        too large to score every replica, its candidates gain the replicas this router last
        sent the adapter to and the adapter's home on the ring (where it goes when nobody
        holds it), so the pick can find them."""
        if adapter is None:
            return request
        candidates = request.candidates
        large = self.replicas.large(tier.name, role)
        if candidates is not None and large is not None:
            held = self._holders.get(adapter, {})
            holders = [rid for rid in reversed(held) if rid in large.ids][:HOLDER_CANDIDATES]
            home = large.ring.successors(adapter.encode("utf-8", "surrogatepass"), HOME_CANDIDATES)
            candidates = tuple(dict.fromkeys([*candidates, *holders, *home]))
        return replace(request, adapter=adapter, candidates=candidates)
