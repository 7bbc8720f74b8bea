"""The status of a service, computed from what its children report. Purely computational.

Ready means what a user means by it: every planned workload (a role's Deployment, or its
LeaderWorkerSet when a replica spans nodes; the router's Deployment) has seen the latest spec
and has all its replicas ready - not "the objects were created". Once Ready, a service stays
Ready while a workload that has rolled out its latest spec is one replica short (and has one
ready at least): what its PodDisruptionBudget allows (a node drained, an evicted or crashed
pod being replaced, a scale-up's new replica starting). It still serves; the reason
(WithinDisruptionBudget) and message say which replica is missing. Degraded
carries the reason a person would otherwise dig out of pods: crash loops, image pulls that
fail, pods no node can take (with the scheduler's words), rollouts past their deadline, or a
plan the operator refused (a spec it cannot run, or a cluster without the LeaderWorkerSet API a
multi-node role needs).

Reconciling and Stalled are kstatus' conditions (sigs.k8s.io/cli-utils), which Flux and other
GitOps tools read on a custom resource: Reconciling=True while a rollout is under way,
Stalled=True when it cannot finish without someone's help (a refused plan, a rollout past its
deadline, pods the API refuses to create). Never both True: kstatus takes the first it finds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import EngineBackend
from fleetpilot.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    InferenceServiceStatus,
    RoleStatus,
    TierStatus,
    set_condition,
)
from fleetpilot.kube import names
from fleetpilot.operator.cold_start import cold_start, samples_by_role
from fleetpilot.operator.gateway_status import GatewayObserved, gateway_condition
from fleetpilot.operator.model_cache import DownloadProgress, model_ready_condition
from fleetpilot.operator.plan_types import Capacities, Download, Refusal, sized
from fleetpilot.operator.planner import (
    all_roles,
    capacity_warnings,
    not_sized_reasons,
    tier_field,
)
from fleetpilot.operator.router_objects import endpoint_url

Obj = dict[str, Any]

_WAITING_REASONS = {
    "CrashLoopBackOff": "CrashLooping",
    "ImagePullBackOff": "ImagePullFailing",
    "ErrImagePull": "ImagePullFailing",
    "InvalidImageName": "ImagePullFailing",
    "CreateContainerConfigError": "ContainerConfigError",
    "CreateContainerError": "ContainerConfigError",
}
MAX_PROBLEMS_IN_MESSAGE = 3
_OPERATOR_CONDITIONS = {
    ConditionType.READY,
    ConditionType.PROGRESSING,
    ConditionType.DEGRADED,
    ConditionType.CAPACITY_SUFFICIENT,
    ConditionType.RECONCILING,
    ConditionType.STALLED,
    # Set from the model cache's downloads (model_cache.model_ready_condition), removed from
    # a service without a model cache.
    ConditionType.MODEL_READY,
    # From the InferencePool's parents (gateway_status), removed from a service without
    # routing.gateway.
    ConditionType.GATEWAY_ACCEPTED,
}
# Problems of the children no amount of waiting fixes: the service is Stalled on them (and
# on a refused plan, whatever its reason).
_STALLING_REASONS = {"RolloutStuck", "ReplicaFailure"}

WorkloadKey = tuple[str, str]  # (kind, name): ("Deployment", ...) or ("LeaderWorkerSet", ...)


@dataclass(frozen=True)
class Observed:
    """What the cluster reports about a service's children."""

    # The service's workloads: its Deployments and LeaderWorkerSets, by (kind, name) - not by
    # name alone: a role that turns multi-node gets a LeaderWorkerSet named as its Deployment,
    # and both exist until the Deployment is pruned.
    workloads: dict[WorkloadKey, Obj]
    pods: list[Obj]
    # The model cache's Jobs by name (none read for a service without downloads), and how far
    # each running download is, by Job (from its pod's log).
    jobs: Mapping[str, Obj] = field(default_factory=dict)
    progress: Mapping[str, DownloadProgress] = field(default_factory=dict)
    # The InferencePool, and the gateway kinds the cluster lacks (routing.gateway only).
    gateway: GatewayObserved = field(default_factory=GatewayObserved)


@dataclass(frozen=True)
class Rollout:
    tier: str | None  # None for the router
    workload: WorkloadKey
    label: str  # "tier small role decode" or "router"
    wanted: int
    ready: int
    done: bool
    # The latest spec rolled out (no pod of an older one left) and at most one replica short,
    # one ready at least: what the workload's disruption budget allows.
    within_budget: bool = False


def _rollout(tier: str | None, workload: WorkloadKey, label: str, live: Obj | None) -> Rollout:
    """How far a workload's rollout is. A LeaderWorkerSet's status has a Deployment's fields
    (``replicas``, ``readyReplicas``, ``updatedReplicas``, ``observedGeneration``), counting
    groups: a multi-node role's replicas and ready ones are groups of pods, not pods."""
    if live is None:
        return Rollout(tier, workload, label, 0, 0, False)
    spec_replicas = int(live.get("spec", {}).get("replicas", 1))
    status = live.get("status", {})
    generation = live.get("metadata", {}).get("generation", 0)
    current = status.get("observedGeneration", 0) >= generation
    ready = int(status.get("readyReplicas", 0))
    updated = int(status.get("updatedReplicas", 0))
    # Old pods still terminating or surplus surge pods mean the rollout has not settled.
    total = int(status.get("replicas", 0))
    # Rolled out: every pod there is of the latest spec and none is surplus. Not "as many as
    # wanted": an evicted pod leaves the count before its ReplicaSet makes the replacement.
    rolled = current and updated >= total and total <= spec_replicas
    done = rolled and ready >= spec_replicas
    within_budget = rolled and ready >= max(1, spec_replicas - 1)
    return Rollout(tier, workload, label, spec_replicas, ready, done, within_budget)


def _waiting(rollouts: list[Rollout]) -> str:
    """``tier T role R: ready/wanted ready`` for each workload short of replicas."""
    return "; ".join(f"{r.label}: {r.ready}/{r.wanted} ready" for r in rollouts)


def _pod_problems(pods: list[Obj]) -> list[tuple[str, str]]:
    """(reason, message) for every pod in trouble, most telling first."""
    problems = []
    for pod in pods:
        pod_name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status", {})
        for container in status.get("containerStatuses", []) or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = _WAITING_REASONS.get(waiting.get("reason", ""))
            if reason:
                detail = waiting.get("message") or waiting.get("reason")
                problems.append((reason, f"pod {pod_name}: {detail}"))
        for condition in status.get("conditions", []) or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"
            ):
                problems.append(("Unschedulable", f"pod {pod_name}: {condition.get('message')}"))
    return problems


def _workload_problems(
    rollouts: list[Rollout], workloads: dict[WorkloadKey, Obj]
) -> list[tuple[str, str]]:
    """A Deployment's rollout past its deadline, or pods it may not create. A LeaderWorkerSet
    reports no such thing: its conditions (Available, Progressing, UpdateInProgress) only say
    how far its groups are, with no deadline and no failure reason; what stops a group (pods
    no node takes, a crash loop, a refused pod) shows on its pods, which _pod_problems reads
    (worker pods carry the role's labels too)."""
    problems = []
    for rollout in rollouts:
        if rollout.workload[0] != "Deployment":
            continue
        live = workloads.get(rollout.workload, {})
        for condition in live.get("status", {}).get("conditions", []):
            kind, state, reason = (
                condition.get("type"),
                condition.get("status"),
                condition.get("reason"),
            )
            if kind == "Progressing" and state == "False" and reason == "ProgressDeadlineExceeded":
                problems.append(("RolloutStuck", f"{rollout.label}: {condition.get('message')}"))
            if kind == "ReplicaFailure" and state == "True":
                problems.append(("ReplicaFailure", f"{rollout.label}: {condition.get('message')}"))
    return problems


def compute_status(
    service: InferenceService,
    observed: Observed,
    previous: InferenceServiceStatus | None,
    now: datetime,
    refusal: Refusal | None = None,
    *,
    downloads: Sequence[Download] = (),
    capacities: Capacities | None = None,
) -> InferenceServiceStatus:
    """The status to write; keeps what other writers own (ScalingActive, desired, lastScale),
    and each role's cold-start samples, with the starts its pods completed since added.
    ``refusal``: why the latest spec was not planned (Ready False, Degraded and Stalled True
    with its reason). ``downloads``: the model cache's, as planned (ModelReady, from the
    observed Jobs; none: no ModelReady). ``capacities``: the roles as the plan sized them
    (else sized here)."""
    generation = service.metadata.generation
    old_conditions = previous.conditions if previous else []
    old_roles = {(t.name, r.role): r for t in (previous.tiers if previous else []) for r in t.roles}
    started = samples_by_role(observed.pods)

    rollouts = []
    tiers: dict[str, list[RoleStatus]] = {}
    for role in all_roles(service):
        workload = names.engine_workload(service.name, role)
        rollout = _rollout(
            role.tier.name,
            workload,
            f"tier {role.tier.name} role {role.name}",
            observed.workloads.get(workload),
        )
        rollouts.append(rollout)
        old = old_roles.get((role.tier.name, role.name))
        tiers.setdefault(role.tier.name, []).append(
            RoleStatus(
                role=role.name,
                replicas=rollout.wanted,
                ready=rollout.ready,
                desired=old.desired if old else None,
                last_scale=old.last_scale if old else None,
                cold_start=cold_start(
                    old.cold_start if old else None,
                    started.get((role.tier.name, role.name), []),
                ),
            )
        )
    router = ("Deployment", names.router_name(service.name))
    rollouts.append(_rollout(None, router, "router", observed.workloads.get(router)))

    problems = _pod_problems(observed.pods) + _workload_problems(rollouts, observed.workloads)
    stalls = [(reason, message) for reason, message in problems if reason in _STALLING_REASONS]
    if refusal is not None:
        problems.insert(0, (refusal.reason, refusal.message))
        stalls.insert(0, (refusal.reason, refusal.message))
    pending = [r for r in rollouts if not r.done]
    # A service that was Ready stays so while every workload short of replicas is within its
    # budget; one that was not becomes Ready only with every replica ready.
    was_ready = any(
        c.type == ConditionType.READY.value and c.status == ConditionStatus.TRUE
        for c in old_conditions
    )
    short = [r for r in pending if not (was_ready and r.within_budget)]

    def cond(kind: ConditionType, status: bool, reason: str, message: str) -> Condition:
        return Condition(
            type=kind.value,
            status=ConditionStatus.TRUE if status else ConditionStatus.FALSE,
            reason=reason,
            message=message,
            last_transition_time=now,
            observed_generation=generation,
        )

    if refusal is not None:
        ready = cond(ConditionType.READY, False, refusal.reason, refusal.message)
    elif short:
        ready = cond(ConditionType.READY, False, "ReplicasNotReady", _waiting(short))
    elif pending:
        waiting = _waiting(pending)
        ready = cond(
            ConditionType.READY,
            True,
            "WithinDisruptionBudget",
            f"serving, one replica short at most: {waiting}",
        )
    else:
        ready = cond(
            ConditionType.READY, True, "AllReplicasReady", "every role and the router are ready"
        )
    stalled = cond(ConditionType.STALLED, False, "NotStalled", "nothing stands in the way")
    if stalls:
        stall_message = "; ".join(m for _, m in stalls[:MAX_PROBLEMS_IN_MESSAGE])
        stalled = cond(ConditionType.STALLED, True, stalls[0][0], stall_message)
        progressing = cond(ConditionType.PROGRESSING, False, stalls[0][0], stall_message)
    elif pending:
        rolling = ", ".join(r.label for r in pending)
        progressing = cond(ConditionType.PROGRESSING, True, "RollingOut", f"rolling out: {rolling}")
    else:
        progressing = cond(
            ConditionType.PROGRESSING, False, "RolloutComplete", "no rollout under way"
        )
    # Reconciling says what Progressing says, under the name kstatus reads.
    reconciling = cond(
        ConditionType.RECONCILING,
        progressing.status == ConditionStatus.TRUE,
        progressing.reason,
        progressing.message,
    )
    if problems:
        reason = problems[0][0]
        message = "; ".join(m for _, m in problems[:MAX_PROBLEMS_IN_MESSAGE])
        if len(problems) > MAX_PROBLEMS_IN_MESSAGE:
            message += f" (and {len(problems) - MAX_PROBLEMS_IN_MESSAGE} more)"
        degraded = cond(ConditionType.DEGRADED, True, reason, message)
    else:
        degraded = cond(ConditionType.DEGRADED, False, "Healthy", "no problem observed")

    capacity = _capacity_condition(service, now, capacities)
    model = model_ready_condition(downloads, observed.jobs, now, generation, observed.progress)
    gateway = gateway_condition(
        service.spec.routing.gateway, observed.gateway, now, generation, service.namespace
    )

    # The operator's own conditions, each keeping its lastTransitionTime unless it flipped;
    # ScalingActive is the autoscaler's and is kept as it was.
    conditions = [c for c in old_conditions if c.type in _OPERATOR_CONDITIONS]
    if model is None:  # no model cache: a condition left from one would mislead
        conditions = [c for c in conditions if c.type != ConditionType.MODEL_READY.value]
    if gateway is None:
        conditions = [c for c in conditions if c.type != ConditionType.GATEWAY_ACCEPTED.value]
    for fresh in (ready, progressing, degraded, capacity, reconciling, stalled, model, gateway):
        if fresh is not None:
            conditions = set_condition(conditions, fresh)
    conditions += [c for c in old_conditions if c.type == ConditionType.SCALING_ACTIVE.value]
    unready_tiers = {r.tier for r in short if r.tier is not None}
    ready_tiers = sum(1 for name in tiers if name not in unready_tiers)
    return InferenceServiceStatus(
        observed_generation=generation,
        endpoint=endpoint_url(service),
        tiers_ready=f"{ready_tiers}/{len(tiers)}",
        conditions=conditions,
        tiers=[TierStatus(name=name, roles=roles) for name, roles in tiers.items()],
    )


def _capacity_condition(
    service: InferenceService, now: datetime, capacities: Capacities | None
) -> Condition:
    """CapacitySufficient: True when every role is sized and its KV cache holds what the spec
    asks (operator.capacity), False with the planner's warnings, Unknown naming the roles it
    could not size (an architecture or GPU it does not know: the spec can say them)."""
    warnings = capacity_warnings(service, capacities)
    unsized = [
        f"tier {role.tier.name} / {role.name}: "
        + "; ".join(not_sized_reasons(role, tier_field(service, role)))
        for role in all_roles(service)
        # A reference tier has no GPU to size: nothing for the spec to say.
        if sized(capacities, role) is None and role.engine.backend is not EngineBackend.REFERENCE
    ]
    if warnings:
        status, reason, message = ConditionStatus.FALSE, "CapacityWarning", "; ".join(warnings)
    elif unsized:
        status, reason = ConditionStatus.UNKNOWN, "NotSized"
        message = f"not sized: {' | '.join(unsized)}"
    else:
        status, reason = ConditionStatus.TRUE, "Sized"
        message = "every role's KV cache holds its maxModelLen and maxNumSeqs"
    return Condition(
        type=ConditionType.CAPACITY_SUFFICIENT.value,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=now,
        observed_generation=service.metadata.generation,
    )
