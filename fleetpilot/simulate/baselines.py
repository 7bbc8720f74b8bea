"""Routing baselines a what-if compares fleetpilot's replica choice with: the strongest simple
one, production-stack's longest-prefix match, and round-robin. They replace only the replica
scorers of the real router (``Router.use_policies``): tiers, spill-over, the health and
capacity filters and the prefix index (events or guessed) stay fleetpilot's."""

from __future__ import annotations

from collections.abc import Sequence

from fleetpilot.routing.policies.load import LoadScorer
from fleetpilot.routing.policies.picker import WeightedScorer
from fleetpilot.routing.policies.prefix import PrefixScorer
from fleetpilot.routing.policies.types import PickRequest, ReplicaView
from fleetpilot.routing.router import Router

FLEETPILOT = "fleetpilot"
LONGEST_PREFIX = "longest-prefix"
ROUND_ROBIN = "round-robin"
ROUTING_POLICIES = (FLEETPILOT, LONGEST_PREFIX, ROUND_ROBIN)


class RoundRobin:
    """Scores the next replica in rotation 1, the rest 0."""

    name = "round-robin"

    def __init__(self) -> None:
        self.turn = 0

    def score(self, request: PickRequest, replicas: Sequence[ReplicaView]) -> dict[str, float]:
        ids = sorted(v.id for v in replicas)
        chosen = ids[self.turn % len(ids)] if ids else ""
        self.turn += 1
        return {i: float(i == chosen) for i in ids}


def use_routing(router: Router, policy: str) -> None:
    """Make ``router`` pick replicas by ``policy`` (one of ``ROUTING_POLICIES``)."""
    if policy == FLEETPILOT:
        return
    if policy == LONGEST_PREFIX:
        # The longest cached prefix wins; load only breaks ties (production-stack's prefixaware).
        load = LoadScorer(router.config.spillover.queue_threshold)
        router.use_policies(
            scorers=[
                WeightedScorer(PrefixScorer(router.prefix_index), 1.0),
                WeightedScorer(load, 1e-3),
            ]
        )
    elif policy == ROUND_ROBIN:
        router.use_policies(scorers=[WeightedScorer(RoundRobin(), 1.0)])
    else:
        raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}")
