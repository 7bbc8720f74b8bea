"""The fleet's side of scaling a local fleet: a role's replicas are engine processes.

:class:`LocalActuator` reads and moves the replicas of a
:class:`~fleetpilot.runtime.local.LocalFleet`: ready = answering /health, scaling starts
engines on free ports or stops the newest ones, and the router's config file is rewritten with
the addresses that serve. The control API (:mod:`fleetpilot.runtime.control`) exposes it to
``fleetpilot autoscaler``, which runs apart (its
:class:`~fleetpilot.autoscaler.remote.FleetActuator` is the policy loop's actuator); the
decisions it reports back are kept here for the status table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import ReplicaBounds, RoleName, Tier
from fleetpilot.api.status import Condition, InferenceServiceStatus
from fleetpilot.autoscaler.model import Metrics
from fleetpilot.autoscaler.remote import RecordedDecision, RoleState
from fleetpilot.runtime.local import LocalFleet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleScaling:
    """What the status table shows of one role: the last decision and the last change."""

    desired: int
    reason: str  # the last decision's sentence
    last_scale_reason: str = ""  # the sentence of the last decision that changed replicas
    last_scale_time: datetime | None = None
    metrics: Metrics | None = None  # what the last decision saw
    last_scale_from: int | None = None  # replicas before and after the last change
    last_scale_to: int | None = None


class LocalActuator:
    """A :class:`LocalFleet`'s engine processes, per role, and the decisions taken on them.

    ``say`` receives one line per scale (``fleetpilot up`` prints it); every decision is also
    logged. ``decisions`` keeps every decision recorded, oldest first (tests read it). All
    access to the fleet holds ``lock``: the control API's threads and ``fleetpilot up``'s loop
    share it.
    """

    def __init__(
        self,
        fleet: LocalFleet,
        say: Callable[[str], None] | None = None,
        lock: threading.RLock | None = None,
    ) -> None:
        self.fleet = fleet
        self.say = say
        self.lock = lock or threading.RLock()
        self.roles: dict[tuple[str, str], RoleScaling] = {}
        self.decisions: list[RecordedDecision] = []
        self.conditions: list[Condition] = []
        # Engines are started from this one long-lived thread: a child gets the parent-death
        # signal when the *thread* that forked it ends, and the control API's request threads
        # end after each request.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-spawn")

    def close(self) -> None:
        self._spawner.shutdown(wait=True)

    def role_state(self, tier: str, role: str) -> RoleState | None:
        """One role now, or None when the service has no such tier or role."""
        spec = next((t for t in self.fleet.service.spec.tiers if t.name == tier), None)
        if spec is None or spec.role(role) is None:
            return None
        with self.lock:
            self.fleet.refresh_serving()
            return self._state(tier, role)

    def fleet_status(self) -> InferenceServiceStatus:
        """The fleet's status as the operator would write it (cold starts included)."""
        with self.lock:
            self.fleet.refresh_serving()
            return self.fleet.status()

    def role_states(self) -> list[RoleState]:
        """Every role of the service, in spec order (one health refresh for all)."""
        with self.lock:
            self.fleet.refresh_serving()
            return [
                self._state(tier.name, role)
                for tier in self.fleet.service.spec.tiers
                for role in tier.role_names
            ]

    def _state(self, tier: str, role: str) -> RoleState:
        # Called after refresh_serving: engines that became healthy joined the router first,
        # so "ready" and "served by the router" mean the same thing.
        members = self.fleet.role_replicas(tier, role)
        ready = [r for r in members if r.serving and r.child is not None and r.child.alive()]
        return RoleState(tier, role, len(members), len(ready), tuple(r.address for r in ready))

    def scale(self, tier: str, role: str, replicas: int) -> None:
        self._spawner.submit(self._scale, tier, role, replicas).result()

    def _scale(self, tier: str, role: str, replicas: int) -> None:
        with self.lock:
            members = self.fleet.role_replicas(tier, role)
            for _ in range(replicas - len(members)):
                added = self.fleet.add_replica(tier, role)
                log.info("started %s on port %d", added.name, added.port)
            for _ in range(len(members) - replicas):
                removed = self.fleet.remove_replica(tier, role)
                if removed is not None:
                    log.info("stopped %s (port %d)", removed.name, removed.port)

    def note(
        self,
        decisions: Sequence[RecordedDecision],
        condition: Condition | None = None,
        now: datetime | None = None,
    ) -> None:
        """Keep a tick's decisions for the status table; say each change."""
        when = now or datetime.now(UTC)
        if condition is not None:
            self.conditions.append(condition)
        for decision in decisions:
            self.decisions.append(decision)
            key = (decision.tier, decision.role)
            before = self.roles.get(key)
            last_reason = before.last_scale_reason if before else ""
            last_time = before.last_scale_time if before else None
            last_from = before.last_scale_from if before else None
            last_to = before.last_scale_to if before else None
            if decision.changed:
                last_reason, last_time = decision.reason, when
                last_from, last_to = decision.current_replicas, decision.replicas
                line = f"autoscaler: tier {decision.tier}: {decision.reason}"
                if decision.dry_run:
                    line += " (recommend mode: not applied)"
                log.info("%s", line)
                if self.say is not None:
                    self.say(line)
            else:
                log.debug("tier %s: %s", decision.tier, decision.reason)
            self.roles[key] = RoleScaling(
                decision.replicas,
                decision.reason,
                last_reason,
                last_time,
                decision.metrics,
                last_from,
                last_to,
            )


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
        update: dict[str, object] = {}
        for role in tier.roles():
            if role.name is RoleName.UNIFIED:
                update["replicas"] = cap(role.replicas)
            else:  # serving.prefill / serving.decode hold the role's own bounds
                spec = getattr(serving, role.name.value)
                update[role.name.value] = spec.model_copy(update={"replicas": cap(role.replicas)})
        tiers.append(tier.model_copy(update={"serving": serving.model_copy(update=update)}))
    spec = service.spec.model_copy(update={"tiers": tiers})
    return service.model_copy(update={"spec": spec})


__all__ = ["LocalActuator", "RoleScaling", "capped_service"]
