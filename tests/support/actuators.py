"""An in-memory :class:`~fleetpilot.autoscaler.actuator.Actuator` for the autoscaler's tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from fleetpilot.api import InferenceService
from fleetpilot.api.status import Condition
from fleetpilot.autoscaler.actuator import Replicas, event_reason, merge_roles
from fleetpilot.autoscaler.model import Decision
from fleetpilot.kube.client import Obj


@dataclass
class MemoryActuator:
    """An Actuator over a dict of replicas: what a cluster would keep, in memory.

    ``replicas`` maps ``(tier, role)`` to :class:`Replicas`; ``ready_on_scale`` makes scaled
    replicas ready at once (a kubelet that never lags). Records land in ``status_tiers``
    (merged as the Kubernetes actuator merges them), ``events`` and ``conditions``.
    """

    replicas: dict[tuple[str, str], Replicas] = field(default_factory=dict)
    ready_on_scale: bool = True
    scaled: list[tuple[str, str, int]] = field(default_factory=list)
    recorded: list[Decision] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    status_tiers: list[Obj] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        return self.replicas.get((tier, role))

    def scale(self, service: InferenceService, tier: str, role: str, replicas: int) -> None:
        before = self.replicas.get((tier, role), Replicas(0, 0))
        ready = replicas if self.ready_on_scale else min(before.ready, replicas)
        self.replicas[(tier, role)] = Replicas(replicas, ready)
        self.scaled.append((tier, role, replicas))

    def record(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> None:
        self.recorded.extend(decisions)
        self.status_tiers, eventful = merge_roles(self.status_tiers, decisions, now)
        self.events.extend((event_reason(d), f"tier {d.tier}: {d.reason}") for d in eventful)
        self.conditions.append(condition)
