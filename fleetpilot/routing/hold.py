"""How long the router holds a request for a tier at zero replicas, and what it answers when
the hold runs out. Purely computational.

A request that finds no replica of its tier (scaled to zero) is held while the tier's first
replica starts - the held request is the demand the autoscaler scales from zero on. The hold
lasts the tier's observed cold start (``RouterTier.cold_start_observed``: the longest
pod-created-to-Ready of its roles' kept starts) times ``cold_start_factor`` plus
``cold_start_margin``, and at most the config's ``cold_start_wait``; with no start observed
yet, the whole ``cold_start_wait``. When it runs out (or the request timeout ends it first),
the answer is 503 with ``Retry-After``: the part of the observed cold start the request has not
waited yet, in whole seconds and at least 1, so a client comes back about when the start is
expected to be done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from fleetpilot.api.router_config import RouterConfig
from fleetpilot.routing.errors import NoReplicaError


def hold_for(
    observed: timedelta | None, maximum: timedelta, factor: float, margin: timedelta
) -> timedelta:
    """``min(maximum, observed x factor + margin)``; ``maximum`` when nothing was observed."""
    if observed is None:
        return maximum
    return min(maximum, observed * factor + margin)


def retry_after_s(observed: timedelta | None, waited_s: float) -> int:
    """Retry-After (RFC 9110 delay-seconds) for a request refused after waiting ``waited_s``:
    what remains of the observed cold start, rounded up, at least 1 (1 too with nothing
    observed: there is no estimate to offer)."""
    remaining = (observed.total_seconds() if observed is not None else 0.0) - waited_s
    return max(1, math.ceil(remaining))


@dataclass(frozen=True)
class ColdStartHold:
    """One request's hold for a tier at zero: how long, and the 503 that ends it."""

    tier: str
    roles: tuple[str, ...]
    seconds: float
    observed: timedelta | None

    @classmethod
    def of(cls, config: RouterConfig, tier: str, roles: tuple[str, ...]) -> ColdStartHold:
        """The hold for ``tier`` under ``config`` (a tier the config no longer names: as one
        with nothing observed)."""
        observed = next((t.cold_start_observed for t in config.tiers if t.name == tier), None)
        hold = hold_for(
            observed, config.cold_start_wait, config.cold_start_factor, config.cold_start_margin
        )
        return cls(tier, roles, hold.total_seconds(), observed)

    def refusal(self, waited_s: float) -> NoReplicaError:
        """The 503 for a request held ``waited_s`` in vain: it names the tier and the hold."""
        seen = (
            f"observed cold start {self.observed.total_seconds():g}s"
            if self.observed is not None
            else "no cold start observed yet"
        )
        retry = retry_after_s(self.observed, waited_s)
        return NoReplicaError(
            f"no replica of tier {self.tier} became ready within the cold-start wait "
            f"({round(min(self.seconds, waited_s), 2):g}s; {seen}); retry in {retry}s",
            tier=self.tier,
            roles=self.roles,
            headers={"Retry-After": str(retry)},
        )
