"""Applying and recording scaling decisions.

An :class:`Actuator` reads a role's replicas, scales it, and records decisions where people
look: the InferenceService status (``desired``, ``lastScale``, the ``ScalingActive``
condition), an Event per change, and two metrics. :class:`KubernetesActuator` does it on a
cluster through ``fleetpilot.kube``, for the operator's autoscaler timer. ``fleetpilot
autoscaler`` acts on a local fleet through its control API instead (``remote.FleetActuator``),
and the tests use an in-memory one (``tests/support/actuators.py``).

The pure parts (the ScalingActive condition, the role records merged into ``status.tiers``)
are functions here; the status is written through ``fleetpilot.kube.status.update_status``,
the one optimistic status writer the operator uses too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from fleetpilot.api import KIND, InferenceService
from fleetpilot.api.spec import AutoscalingMode
from fleetpilot.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    ScaleRecord,
    set_condition,
)
from fleetpilot.autoscaler.model import DataProblem, Decision
from fleetpilot.kube import names
from fleetpilot.kube.client import MERGE_CONTENT_TYPE, RESOURCES, Kube, Obj
from fleetpilot.kube.events import post_event
from fleetpilot.kube.managers import AUTOSCALER_MANAGER
from fleetpilot.kube.status import StatusWrite, update_status

log = logging.getLogger(__name__)

COMPONENT = "fleetpilot-autoscaler"

# Condition reasons of ScalingActive.
REASON_FRESH = "FreshMetrics"
REASON_UNREACHABLE = "PrometheusUnreachable"
REASON_MISSING = "MetricsMissing"
REASON_STALE = "StaleMetrics"
# No Prometheus to read at all: neither the operator's (the chart's prometheusURL, its
# --prometheus-url) nor the service's spec.monitoring.prometheusUrl. Nothing is observed, so
# no decision is made and nothing else would say why the replicas never move.
REASON_NO_SOURCE = "NoMetricsSource"
# The modes fleetpilot's autoscaler decides for (autoscaler.loop.NOT_OURS are the others).
AUTOSCALED_MODES = frozenset({AutoscalingMode.AUTO, AutoscalingMode.RECOMMEND})
_PROBLEM_REASONS = (
    (DataProblem.UNREACHABLE, REASON_UNREACHABLE),
    (DataProblem.QUERY_ERROR, REASON_MISSING),
    (DataProblem.MISSING, REASON_MISSING),
    (DataProblem.STALE, REASON_STALE),
)


@dataclass(frozen=True)
class Replicas:
    """A role's workload as the cluster reports it: its Deployment, or the LeaderWorkerSet of
    a role whose replicas span nodes (whose replicas, and ready ones, are groups of pods)."""

    current: int  # spec.replicas
    ready: int  # status.readyReplicas


class Actuator(Protocol):
    """Reads and moves one role's replicas; records a service's decisions of one tick."""

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        """The role's replicas, or None when its workload does not exist (yet)."""

    def scale(self, service: InferenceService, tier: str, role: str, replicas: int) -> None:
        """Set the role's replicas."""

    def record(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> None:
        """Record decisions (status, Events, metrics) and the ScalingActive condition."""


# ------------------------------------------------------------------------------ metrics


class AutoscalerMetrics:
    """``fleetpilot_autoscaler_desired_replicas`` and ``..._decisions_total``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["namespace", "service", "tier", "role"]
        self.desired = Gauge(
            "fleetpilot_autoscaler_desired_replicas",
            "Replicas the autoscaler last decided for a role (recommended, in mode recommend).",
            labels,
            registry=registry,
        )
        self.decisions = Counter(
            "fleetpilot_autoscaler_decisions",
            "Scaling decisions by direction (up, down, none) and what drove them.",
            [*labels, "direction", "reason_kind"],
            registry=registry,
        )

    def observe(self, service: InferenceService, decision: Decision) -> None:
        key = (service.namespace, service.name, decision.tier, decision.role)
        self.desired.labels(*key).set(decision.replicas)
        self.decisions.labels(*key, decision.direction.value, decision.reason_kind.value).inc()


_default_metrics: AutoscalerMetrics | None = None
_default_metrics_lock = threading.Lock()


def default_metrics() -> AutoscalerMetrics:
    """The metrics on the default registry, created once (registering twice is an error)."""
    global _default_metrics
    with _default_metrics_lock:
        if _default_metrics is None:
            _default_metrics = AutoscalerMetrics()
        return _default_metrics


# ------------------------------------------------------------------------------ pure parts


def scaling_active_condition(
    decisions: Sequence[Decision], generation: int | None, now: datetime
) -> Condition:
    """ScalingActive for one tick. Purely computational.

    True while every role decided on fresh data; False with the gravest problem otherwise
    (Prometheus unreachable, then metrics missing or refused, then stale). The message names
    the roles and says why; it stays the same from tick to tick while nothing changes, so a
    steady state writes no status.
    """
    for problem, reason in _PROBLEM_REASONS:
        hit = [d for d in decisions if d.data_problem is problem]
        if hit:
            message = "; ".join(f"tier {d.tier}: {d.reason}" for d in hit)
            return Condition(
                type=ConditionType.SCALING_ACTIVE.value,
                status=ConditionStatus.FALSE,
                reason=reason,
                message=message[:4000],
                last_transition_time=now,
                observed_generation=generation,
            )
    roles = ", ".join(f"{d.tier}/{d.role}" for d in decisions)
    return Condition(
        type=ConditionType.SCALING_ACTIVE.value,
        status=ConditionStatus.TRUE,
        reason=REASON_FRESH,
        message=f"deciding on fresh metrics: {roles}",
        last_transition_time=now,
        observed_generation=generation,
    )


def no_metrics_source_condition(service: InferenceService, now: datetime) -> Condition | None:
    """ScalingActive False (NoMetricsSource) for a service whose autoscaled tiers have no
    Prometheus to read, naming them and saying how to give them one; None for a service
    with no tier the autoscaler decides for. Purely computational."""
    tiers = [tier for tier in service.spec.tiers if tier.autoscaling.mode in AUTOSCALED_MODES]
    if not tiers:
        return None
    named = ", ".join(f"{tier.name} ({', '.join(tier.role_names)})" for tier in tiers)
    message = (
        f"not autoscaled: no Prometheus to read the metrics of tiers {named} from; set the "
        "chart value prometheusURL (the operator's --prometheus-url), e.g. "
        "http://prometheus-operated.monitoring:9090, or this service's "
        "spec.monitoring.prometheusUrl. Until then the replicas stay as they are"
    )
    return Condition(
        type=ConditionType.SCALING_ACTIVE.value,
        status=ConditionStatus.FALSE,
        reason=REASON_NO_SOURCE,
        message=message[:4000],
        last_transition_time=now,
        observed_generation=service.metadata.generation,
    )


def no_metrics_source_recorded(obj: Mapping[str, Any]) -> bool:
    """Whether the service object's status says NoMetricsSource already, for its current
    generation (what :meth:`KubernetesActuator.record_no_source` writes once per
    generation). Purely computational: a tick that finds it costs no request."""
    generation = (obj.get("metadata") or {}).get("generation")
    return any(
        c.get("type") == ConditionType.SCALING_ACTIVE.value
        and c.get("reason") == REASON_NO_SOURCE
        and c.get("observedGeneration") == generation
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def with_condition(live: Mapping[str, Any], condition: Condition) -> tuple[list[Obj], bool]:
    """The live object's conditions (wire form) with ``condition`` set, stamped with the
    object's generation as read, and whether the condition's status flipped (or it is new).
    Purely computational."""
    status = live.get("status") or {}
    old = [Condition.model_validate(c) for c in status.get("conditions") or []]
    generation = (live.get("metadata") or {}).get("generation")
    stamped = condition.model_copy(update={"observed_generation": generation})
    before = next((c for c in old if c.type == condition.type), None)
    flipped = before is None or before.status != condition.status
    return [c.to_wire() for c in set_condition(old, stamped)], flipped


def _record_of(decision: Decision, now: datetime) -> ScaleRecord:
    reason = decision.reason
    if decision.dry_run:
        reason = f"recommended (autoscaling.mode recommend): {reason}"
    return ScaleRecord(
        time=now,
        from_replicas=decision.current_replicas,
        to_replicas=decision.replicas,
        reason=reason[:1024],
    )


def worth_an_event(decision: Decision, previous_desired: int | None) -> bool:
    """A change was made, or (mode recommend) a new change is recommended. Holds are not."""
    if not decision.changed:
        return False
    return not decision.dry_run or previous_desired != decision.replicas


def merge_roles(
    tiers: Sequence[Obj], decisions: Sequence[Decision], now: datetime
) -> tuple[list[Obj], list[Decision]]:
    """``status.tiers`` with each decided role's ``desired`` (and ``lastScale`` when it is
    worth an Event); returns the new list and the decisions worth an Event. Purely
    computational: other tiers, roles and fields are kept as they are."""
    merged = [dict(t, roles=[dict(r) for r in t.get("roles", []) or []]) for t in tiers]
    eventful: list[Decision] = []
    for decision in decisions:
        tier = next((t for t in merged if t.get("name") == decision.tier), None)
        if tier is None:
            tier = {"name": decision.tier, "roles": []}
            merged.append(tier)
        role = next((r for r in tier["roles"] if r.get("role") == decision.role), None)
        if role is None:
            role = {"role": decision.role}
            tier["roles"].append(role)
        previous = role.get("desired")
        if worth_an_event(decision, previous if isinstance(previous, int) else None):
            role["lastScale"] = _record_of(decision, now).to_wire()
            eventful.append(decision)
        role["desired"] = decision.replicas
    return merged, eventful


def event_reason(decision: Decision) -> str:
    if decision.dry_run:
        return "ScaleRecommended"
    return "ScaledUp" if decision.replicas > decision.current_replicas else "ScaledDown"


# ------------------------------------------------------------------------------ Kubernetes


def _timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubernetesActuator:
    """:class:`Actuator` on a cluster, through :class:`Kube` (run it in a thread, not a loop).

    Scaling goes through the scale subresource of the role's workload (its Deployment, or its
    LeaderWorkerSet when a replica spans nodes: ``names.engine_workload``) under the
    autoscaler's own field manager, so the operator's server-side applies see
    ``spec.replicas`` owned by someone else and leave it alone.
    """

    def __init__(
        self,
        kube: Kube,
        *,
        manager: str = AUTOSCALER_MANAGER,
        metrics: AutoscalerMetrics | None = None,
    ) -> None:
        self.kube = kube
        self.manager = manager
        self.metrics = metrics or default_metrics()

    @staticmethod
    def workload(service: InferenceService, tier: str, role: str) -> tuple[str, str]:
        """(kind, name) of the object that runs the role's replicas."""
        resolved = next((t.role(role) for t in service.spec.tiers if t.name == tier), None)
        if resolved is None:
            raise KeyError(f"{service.name} has no role {role} in a tier {tier}")
        return names.engine_workload(service.name, resolved)

    def current(self, service: InferenceService, tier: str, role: str) -> Replicas | None:
        kind, name = self.workload(service, tier, role)
        live = self.kube.get(kind, service.namespace, name)
        if live is None:
            return None
        spec_replicas = live.get("spec", {}).get("replicas")
        ready = live.get("status", {}).get("readyReplicas") or 0
        # spec.replicas is defaulted to 1 by the API server; absent only in odd test objects.
        current = 1 if spec_replicas is None else int(spec_replicas)
        return Replicas(current=current, ready=int(ready))

    def scale(self, service: InferenceService, tier: str, role: str, replicas: int) -> None:
        kind, name = self.workload(service, tier, role)
        path = RESOURCES[kind].path(service.namespace, name) + "/scale"
        self.kube.request(
            "PATCH",
            path,
            query=[("fieldManager", self.manager)],
            body={"spec": {"replicas": replicas}},
            content_type=MERGE_CONTENT_TYPE,
        )

    def record(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> None:
        for decision in decisions:
            self.metrics.observe(service, decision)
        eventful, flipped = self._write_status(service, decisions, condition, now)
        for decision in eventful:
            self._event(
                service,
                event_reason(decision),
                f"tier {decision.tier}: {decision.reason}",
                "Normal",
                now,
            )
        if flipped and condition.status is ConditionStatus.FALSE:
            self._event(service, condition.reason, condition.message, "Warning", now)

    def record_no_source(
        self,
        service: InferenceService,
        condition: Condition,
        now: datetime,
        live: Obj | None = None,
    ) -> bool:
        """Set ``condition`` (:func:`no_metrics_source_condition`) as the service's
        ScalingActive, keeping the rest of its status; a Warning Event when the write landed.
        The condition carries the service's generation, so it is written - and the Event
        posted - once per generation, not on every tick. ``live``: the object as just seen
        (its watch's latest), saving a read. Whether it was written."""

        def mutate(current: Obj) -> Obj:
            return {"conditions": with_condition(current, condition)[0]}

        outcome = update_status(
            self.kube,
            KIND,
            service.namespace,
            service.name,
            mutate,
            manager=self.manager,
            live=live,
        )
        if outcome is not StatusWrite.WRITTEN:
            return False
        log.warning(
            "not autoscaled: no metrics source",
            extra={
                "service": f"{service.namespace}/{service.name}",
                "generation": service.metadata.generation,
            },
        )
        self._event(service, condition.reason, condition.message, "Warning", now)
        return True

    def _write_status(
        self,
        service: InferenceService,
        decisions: Sequence[Decision],
        condition: Condition,
        now: datetime,
    ) -> tuple[list[Decision], bool]:
        """Write the decided roles and the condition into the status; the decisions worth an
        Event and whether the condition flipped (both as of the write that landed).

        Only ``tiers`` and ``conditions`` are sent, rebuilt from the live status so what the
        operator wrote (replicas, Ready, the other tiers) stays.
        """
        eventful: list[Decision] = []
        flipped = False

        def mutate(live: Obj) -> Obj:
            nonlocal eventful, flipped
            tiers, eventful = merge_roles(
                (live.get("status") or {}).get("tiers") or [], decisions, now
            )
            conditions, flipped = with_condition(live, condition)
            return {"tiers": tiers, "conditions": conditions}

        outcome = update_status(
            self.kube,
            KIND,
            service.namespace,
            service.name,
            mutate,
            manager=self.manager,
        )
        if outcome is StatusWrite.GONE:
            return [], False  # deleted meanwhile: nothing left to record on
        return eventful, flipped

    def _event(
        self, service: InferenceService, reason: str, message: str, kind: str, now: datetime
    ) -> None:
        post_event(
            self.kube, service, reason=reason, message=message, kind=kind,
            component=COMPONENT, now=now,
        )  # fmt: skip


def kubernetes_actuator(
    kube: Kube, *, metrics: AutoscalerMetrics | None = None
) -> KubernetesActuator:
    """The actuator the operator's autoscaler timer uses on a cluster."""
    return KubernetesActuator(kube, metrics=metrics)


__all__ = [
    "AUTOSCALED_MODES",
    "COMPONENT",
    "REASON_FRESH",
    "REASON_MISSING",
    "REASON_NO_SOURCE",
    "REASON_STALE",
    "REASON_UNREACHABLE",
    "Actuator",
    "AutoscalerMetrics",
    "KubernetesActuator",
    "Replicas",
    "default_metrics",
    "event_reason",
    "kubernetes_actuator",
    "merge_roles",
    "no_metrics_source_condition",
    "no_metrics_source_recorded",
    "scaling_active_condition",
    "with_condition",
    "worth_an_event",
]
