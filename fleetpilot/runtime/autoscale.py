"""The autoscaler on the local runtime: engines' /metrics in, engine processes out.

:class:`LocalActuator` is the :class:`~fleetpilot.autoscaler.actuator.Actuator` of a
:class:`~fleetpilot.runtime.local.LocalFleet`: a role's replicas are its engine processes
(ready = answering /health), scaling starts engines on free ports or stops the newest ones, and
the router's config file is rewritten with the addresses that serve. :class:`LocalAutoscaler`
ties it to :class:`~fleetpilot.autoscaler.direct.EngineMetricsSource` and
:func:`~fleetpilot.autoscaler.loop.tick` for ``fleetpilot up``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import ReplicaBounds, ServingMode, Tier
from fleetpilot.api.status import Condition
from fleetpilot.autoscaler.actuator import Replicas
from fleetpilot.autoscaler.direct import EngineMetricsSource
from fleetpilot.autoscaler.loop import Histories, tick
from fleetpilot.autoscaler.policy import Decision
from fleetpilot.runtime.local import LocalFleet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleScaling:
    """What the status table shows of one role: the last decision and the last change."""

    desired: int
    reason: str  # the last decision's sentence
    last_scale_reason: str = ""  # the sentence of the last decision that changed replicas
    last_scale_time: datetime | None = None


class LocalActuator:
    """:class:`Actuator` over a :class:`LocalFleet`'s engine processes.

    ``say`` receives one line per scale (``fleetpilot up`` prints it); every decision is also
    logged. ``decisions`` keeps every decision recorded, oldest first (tests read it).
    """

    def __init__(self, fleet: LocalFleet, say: Callable[[str], None] | None = None) -> None:
        self.fleet = fleet
        self.say = say
        self.roles: dict[tuple[str, str], RoleScaling] = {}
        self.decisions: list[Decision] = []
        self.conditions: list[Condition] = []

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        # Engines that became healthy since the last look join the router first, so "ready"
        # and "served by the router" mean the same thing.
        self.fleet.refresh_serving()
        members = self.fleet.role_replicas(tier, role)
        if not any(t.name == tier for t in service.spec.tiers):
            return None
        ready = sum(r.serving and r.child is not None and r.child.alive() for r in members)
        return Replicas(current=len(members), ready=ready)

    def scale(self, service: InferenceService, tier: str, role: str, replicas: int) -> None:
        members = self.fleet.role_replicas(tier, role)
        for _ in range(replicas - len(members)):
            added = self.fleet.add_replica(tier, role)
            log.info("started %s on port %d", added.name, added.port)
        for _ in range(len(members) - replicas):
            removed = self.fleet.remove_replica(tier, role)
            if removed is not None:
                log.info("stopped %s (port %d)", removed.name, removed.port)

    def record(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> None:
        self.conditions.append(condition)
        for decision in decisions:
            self.decisions.append(decision)
            key = (decision.tier, decision.role)
            before = self.roles.get(key)
            last_reason = before.last_scale_reason if before else ""
            last_time = before.last_scale_time if before else None
            if decision.changed:
                last_reason, last_time = decision.reason, now
                line = f"autoscaler: tier {decision.tier}: {decision.reason}"
                if decision.dry_run:
                    line += " (recommend mode: not applied)"
                log.info("%s", line)
                if self.say is not None:
                    self.say(line)
            else:
                log.debug("tier %s: %s", decision.tier, decision.reason)
            self.roles[key] = RoleScaling(
                decision.replicas, decision.reason, last_reason, last_time
            )

    def status_columns(self) -> dict[tuple[str, str], tuple[int, str]]:
        """(tier, role) -> (desired, last scale reason) for :func:`format_status`."""
        return {
            key: (scaling.desired, scaling.last_scale_reason or scaling.reason)
            for key, scaling in self.roles.items()
        }


def capped_service(service: InferenceService, max_per_role: int) -> InferenceService:
    """The service with every role's ``replicas.max`` (and min) capped at ``max_per_role``.

    A CPU runs a handful of engines: the policy must know the real ceiling, or it would keep
    deciding replicas the actuator cannot start (and say so in every reason).
    """

    def cap(bounds: ReplicaBounds) -> ReplicaBounds:
        top = min(bounds.max, max_per_role)
        initial = None if bounds.initial is None else min(bounds.initial, top)
        return bounds.model_copy(
            update={"max": top, "min": min(bounds.min, top), "initial": initial}
        )

    tiers: list[Tier] = []
    for tier in service.spec.tiers:
        serving = tier.serving
        update: dict[str, object]
        if serving.mode is ServingMode.UNIFIED:
            update = {"replicas": cap(serving.replicas or ReplicaBounds())}
        else:
            update = {
                name: spec.model_copy(update={"replicas": cap(spec.replicas)})
                for name, spec in (("prefill", serving.prefill), ("decode", serving.decode))
                if spec is not None
            }
        tiers.append(tier.model_copy(update={"serving": serving.model_copy(update=update)}))
    spec = service.spec.model_copy(update={"tiers": tiers})
    return service.model_copy(update={"spec": spec})


class LocalAutoscaler:
    """``loop.tick`` over a local fleet, once per ``period_s``; call :meth:`step` often."""

    def __init__(
        self,
        fleet: LocalFleet,
        *,
        max_replicas_per_role: int,
        say: Callable[[str], None] | None = None,
        period_s: float = 1.0,
    ) -> None:
        self.fleet = fleet
        self.service = capped_service(fleet.service, max_replicas_per_role)
        self.actuator = LocalActuator(fleet, say)
        self.source = EngineMetricsSource(fleet.serving_addresses)
        self.histories: Histories = {}
        self.period_s = period_s
        self._next = 0.0

    def step(self, now: float | None = None) -> list[Decision]:
        """Tick when a period has passed since the last tick; the decisions made, if any."""
        mono = time.monotonic()
        if mono < self._next:
            return []
        self._next = mono + self.period_s
        return tick(self.service, self.source, self.actuator, self.histories, now)

    def close(self) -> None:
        self.source.close()


__all__ = ["LocalActuator", "LocalAutoscaler", "RoleScaling", "capped_service"]
