"""The service's tiers and the tier choice of a request: its target, worked out once
(``resolve``), then capacity applied to it (``choose``). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fleetpilot.api.router_config import RouterConfig, RouterTier
from fleetpilot.routing.errors import NoReplicaError, OverloadedError, PermissionDeniedError
from fleetpilot.routing.features import RequestFeatures
from fleetpilot.routing.policies.complexity import (
    ComplexityWeights,
    TierChoice,
    TierSpec,
    TierState,
    choose_tier,
    resolve_target,
)
from fleetpilot.routing.route import Resolved

# A tier a tenant may not use, as the tier choice sees it: never chosen, never spilled to.
CLOSED = TierState(has_replicas=False, available=False, saturated=True)


class Tiers:
    """The config's tiers, smallest first, and how a request picks among them."""

    def __init__(self, config: RouterConfig, weights: ComplexityWeights) -> None:
        self.config = config
        self.weights = weights
        self.ordered = sorted(config.tiers, key=lambda t: t.up_to)
        self.specs = [
            TierSpec(t.name, t.model, t.up_to, frozenset(t.adapters)) for t in self.ordered
        ]
        self._index = {t.name: i for i, t in enumerate(self.ordered)}

    def named(self, name: str) -> RouterTier:
        return self.ordered[self._index[name]]

    def resolve(self, features: RequestFeatures) -> Resolved:
        """The request's target tier (by name, model or complexity) and the tiers its tenant
        may use: a tier it named that it may not use is refused (403); the router's own
        choice moves to the nearest allowed tier, the next one up first (as a spill would)."""
        target = resolve_target(features, self.specs, self.config.service, self.weights)
        allowed = features.allowed_tiers
        if allowed is None:
            return Resolved(features, target)
        permitted = [i for i, tier in enumerate(self.ordered) if tier.name in allowed]
        if target.pinned and target.index not in permitted:
            wanted = self.ordered[target.index].name
            raise PermissionDeniedError(
                f"this API key may not use tier {wanted!r}", reason="tier_not_allowed"
            )
        if not permitted:
            raise PermissionDeniedError(
                "this API key may use no tier of this service", reason="tier_not_allowed"
            )
        if target.index not in permitted:
            above = [i for i in permitted if i > target.index]
            target = replace(target, index=above[0] if above else permitted[-1])
        return Resolved(features, target, frozenset(permitted))

    def choose(
        self, resolved: Resolved, state: Callable[[RouterTier], TierState]
    ) -> tuple[RouterTier, TierChoice]:
        """The tier (and why) for the request, each tier's capacity now by ``state`` - never
        one its tenant may not use, nor a spill to one. Raises ``OverloadedError`` (429) when
        every tier in reach is full, ``NoReplicaError`` (503) when none has a replica."""
        permitted = resolved.permitted

        def state_of(i: int) -> TierState:
            if permitted is not None and i not in permitted:
                return CLOSED
            return state(self.ordered[i])

        target = resolved.target
        choice = choose_tier(target, len(self.ordered), state_of, self.config.spillover.enabled)
        if choice.index is None:
            if choice.reason == "saturated":
                raise self.overloaded()
            wanted = self.ordered[target.index]
            raise NoReplicaError(
                "no ready replica can serve this request",
                tier=wanted.name,
                roles=tuple(group.role for group in wanted.endpoints),
            )
        return self.ordered[choice.index], choice

    def overloaded(self) -> OverloadedError:
        """429: every replica that could serve the request is at capacity."""
        retry = self.config.backpressure.retry_after.total_seconds()
        return OverloadedError(
            "every replica that could serve this request is at capacity; retry later",
            reason="overloaded",
            headers={"Retry-After": str(max(1, round(retry)))},
        )
