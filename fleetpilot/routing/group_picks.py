"""A group's replicas as the policies see them, and a pick among them. No I/O.

``GroupPicks`` makes the views of a group's replicas (``ReplicaState.view``, with the ejection
tracker's word on each), the tier state they add up to, and a pick through the filters and a
request's scorers - among a large group's candidates first. Within one decision a group's views
are made once (``one_decision``): the tier's state and the pick read the same views.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator

from fleetpilot.api.router_config import RouterConfig, RouterTier
from fleetpilot.routing.policies.adapters import AdapterHolderFilter
from fleetpilot.routing.policies.candidates import SAMPLED_CANDIDATES, sample
from fleetpilot.routing.policies.complexity import TierState
from fleetpilot.routing.policies.ejection import HealthTracker
from fleetpilot.routing.policies.load import group_saturated, has_headroom
from fleetpilot.routing.policies.picker import (
    CapacityFilter,
    HealthFilter,
    Pick,
    WeightedScorer,
    pick,
)
from fleetpilot.routing.policies.types import Filter, PickRequest, ReplicaView
from fleetpilot.routing.replica import ReplicaState
from fleetpilot.routing.replica_set import TIER_STATE_MAX_AGE_S, ReplicaSet
from fleetpilot.routing.route import serving_role
from fleetpilot.routing.tiers import CLOSED


class GroupPicks:
    """Views, tier states and picks over the replica set's groups."""

    def __init__(
        self,
        replicas: ReplicaSet,
        config: RouterConfig,
        health: HealthTracker,
        rng: random.Random,
    ) -> None:
        self.replicas = replicas
        self.rng = rng
        # The views of one decision; None outside ``one_decision``.
        self._memo: dict[tuple[str, str], list[ReplicaView]] | None = None
        self.configure(config, health)

    def configure(self, config: RouterConfig, health: HealthTracker) -> None:
        """Adopt a (re)loaded config and its ejection tracker; restores the default filters."""
        self.config = config
        self.health = health
        self._health_filter = HealthFilter()
        self._capacity_filter = CapacityFilter(
            config.backpressure.max_waiting_per_replica, batch_only=config.flow is not None
        )
        # No headroom filter: the prefill-cost scorer weighs a replica's queue against what
        # its cache saves, where a filter dropped the caching replica at its first queued
        # request and, on evicting engines, spread every tenant over every cache.
        self.filters: list[Filter] = [
            self._health_filter,
            self._capacity_filter,
            AdapterHolderFilter(),
        ]

    @contextlib.contextmanager
    def one_decision(self) -> Iterator[None]:
        """Within the block, each group's views are made once."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def views(self, tier: str, role: str, now: float) -> list[ReplicaView]:
        """The group's replicas as the policies see them now."""
        memo = self._memo
        if memo is None:
            return self._views_of(self.replicas.group(tier, role), now)
        found = memo.get((tier, role))
        if found is None:
            found = memo[(tier, role)] = self._views_of(self.replicas.group(tier, role), now)
        return found

    def _views_of(self, states: Iterable[ReplicaState], now: float) -> list[ReplicaView]:
        stale = self.config.scrape.stale_after.total_seconds()
        health = self.health
        is_ejected = health.is_ejected
        return [
            r.view(now, stale, True, health.hangs(r.id)) if is_ejected(r.id)
            else r.view(now, stale, False)
            for r in states
        ]  # fmt: skip

    def tier_state(self, tier: RouterTier, now: float) -> TierState:
        """Whether the tier's serving group has replicas, room, and a queue (read again every
        ``TIER_STATE_MAX_AGE_S`` for a large group)."""
        large = self.replicas.large(tier.name, serving_role(tier))
        if large is None:
            return self._tier_state(tier, now)
        if large.state is None or not 0.0 <= now - large.state_at <= TIER_STATE_MAX_AGE_S:
            large.state = self._tier_state(tier, now)
            large.state_at = now
        return large.state

    def _tier_state(self, tier: RouterTier, now: float) -> TierState:
        views = self.views(tier.name, serving_role(tier), now)
        if not views:
            return CLOSED
        healthy = self._health_filter.filter(PickRequest(), views)
        open_ = self._capacity_filter.filter(PickRequest(), healthy)
        return TierState(
            # Every replica ejected as frozen: as good as none (503, or a cold-start hold,
            # until a /health probe readmits one), not "at capacity".
            has_replicas=bool(healthy),
            available=bool(open_),
            saturated=group_saturated(healthy, self.config.spillover.queue_threshold),
        )

    def pick(
        self,
        tier: RouterTier,
        role: str,
        request: PickRequest,
        now: float,
        scorers: list[WeightedScorer],
        exclude: frozenset[str] = frozenset(),
    ) -> Pick | None:
        """The group's replica for the request, none of ``exclude``; None when none passes."""
        if request.candidates is not None:
            chosen = self._pick_candidates(tier, role, request, now, scorers, exclude)
            if chosen is not None:
                return chosen
        views = self.views(tier.name, role, now)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        return pick(request, views, self.filters, scorers, self.rng)

    def _pick_candidates(
        self,
        tier: RouterTier,
        role: str,
        request: PickRequest,
        now: float,
        scorers: list[WeightedScorer],
        exclude: frozenset[str],
    ) -> Pick | None:
        """The pick among the request's candidates - and, when none of them has room for it
        at once, a random sample of the rest of the group too; ``None`` when none passes the
        filters (the caller then scans the whole group)."""
        assert request.candidates is not None
        large = self.replicas.large(tier.name, role)
        if large is None:  # the group shrank since the request was made, or another role's
            return None
        ids = [rid for rid in request.candidates if rid in large.ids and rid not in exclude]
        replicas = self.replicas
        views = self._views_of((replicas[rid] for rid in ids), now)
        if not any(has_headroom(v) for v in views):
            drawn = sample(large.order, [*ids, *exclude], SAMPLED_CANDIDATES, self.rng)
            views += self._views_of((replicas[rid] for rid in drawn), now)
        if not views:
            return None
        return pick(request, views, self.filters, scorers, self.rng)
