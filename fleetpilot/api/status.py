"""The InferenceService status: what the operator and autoscaler observed and decided."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum

from pydantic import Field

from fleetpilot.api.base import ApiModel


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SCALING_ACTIVE = "ScalingActive"
    CAPACITY_SUFFICIENT = "CapacitySufficient"
    # spec.modelCache: every download Job of the service's models has completed.
    MODEL_READY = "ModelReady"
    # routing.gateway: a gateway took up the service's InferencePool (operator.gateway_status).
    GATEWAY_ACCEPTED = "GatewayAccepted"
    # kstatus' two conditions (sigs.k8s.io/cli-utils), the only ones Flux reads on a custom
    # resource: Reconciling=True is "in progress", Stalled=True is "failed".
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class Condition(ApiModel):
    """A status condition in the shape of metav1.Condition, so generic tools understand it."""

    type: str = Field(
        max_length=316,
        description=(
            "Ready, Progressing, Degraded, ScalingActive, CapacitySufficient, ModelReady, "
            "GatewayAccepted, Reconciling, Stalled."
        ),
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason code.",
    )
    message: str = Field("", max_length=32768, description="Human-readable details.")
    last_transition_time: datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation this condition was computed from."
    )


def set_condition(conditions: Sequence[Condition], condition: Condition) -> list[Condition]:
    """``conditions`` with ``condition`` in place of the one of its type (appended when there is
    none); every other condition is kept as it is, in its place. Purely computational.

    ``lastTransitionTime`` moves only when the status flips: while it holds, the previous
    condition's time is kept, so the condition keeps saying since when it is true (or false).
    """
    result: list[Condition] = []
    replaced = False
    for item in conditions:
        if item.type != condition.type:
            result.append(item)
            continue
        if item.status == condition.status:
            condition = condition.model_copy(
                update={"last_transition_time": item.last_transition_time}
            )
        result.append(condition)
        replaced = True
    if not replaced:
        result.append(condition)
    return result


class ScaleRecord(ApiModel):
    """The last scaling decision of a role, with its reason in words."""

    time: datetime = Field(description="When the decision was made.")
    from_replicas: int = Field(ge=0, description="Replicas before.")
    to_replicas: int = Field(ge=0, description="Replicas after.")
    reason: str = Field(max_length=1024, description="e.g. 'decode tpot p95 72ms > slo 60ms'.")


# How many of a role's latest engine starts its status keeps (operator.cold_start).
COLD_START_SAMPLES = 10


class ColdStartSample(ApiModel):
    """One observed start of a role's engine container, from the pod's own timestamps."""

    pod: str = Field(max_length=253, description="The engine pod's name.")
    started_at: datetime = Field(
        description="The engine container's start (state.running.startedAt); with the pod's "
        "name, what identifies this start (a restarted container is another one)."
    )
    ready_at: datetime = Field(
        description="When the pod turned Ready (its Ready condition's lastTransitionTime)."
    )
    start_seconds: int = Field(
        ge=0,
        description="Container start to Ready: the engine's own start (weights loaded, KV "
        "cache allocated, health check passed).",
    )
    pod_seconds: int | None = Field(
        None,
        ge=0,
        description="Pod creation to Ready: what a scale-up waits (scheduling, image pull, init "
        "containers, the engine's start). Absent for a restarted container: the pod was not new.",
    )


class DurationSummary(ApiModel):
    """p50 and max of one duration over a role's kept samples."""

    count: int = Field(ge=0, le=COLD_START_SAMPLES, description="Samples that have it.")
    p50_seconds: int = Field(ge=0, description="Median (the lower middle: an observed value).")
    max_seconds: int = Field(ge=0, description="The longest.")


class ColdStart(ApiModel):
    """Observed cold starts of a role's engine pods: the last few starts and their summary."""

    count: int = Field(ge=1, le=COLD_START_SAMPLES, description="Samples kept.")
    start: DurationSummary = Field(description="Engine container start to Ready.")
    pod: DurationSummary | None = Field(
        None, description="Pod creation to Ready; absent while every kept start was a restart."
    )
    samples: list[ColdStartSample] = Field(
        min_length=1,
        max_length=COLD_START_SAMPLES,
        description=f"The last {COLD_START_SAMPLES} starts by startedAt, oldest first.",
    )


class RoleStatus(ApiModel):
    """Replicas of one role (unified, prefill or decode) of a tier."""

    role: str = Field(description="unified, prefill or decode.")
    replicas: int = Field(0, ge=0, description="Replicas the Deployment has.")
    ready: int = Field(0, ge=0, description="Ready replicas.")
    desired: int | None = Field(None, ge=0, description="The autoscaler's latest recommendation.")
    last_scale: ScaleRecord | None = Field(None, description="The last scaling decision.")
    cold_start: ColdStart | None = Field(
        None,
        description="How long the role's engine pods took to become Ready (the operator's, "
        "from the pods' own timestamps); absent until one was seen.",
    )


class TierStatus(ApiModel):
    """Per-role replicas of one tier."""

    name: str = Field(description="Tier name.")
    roles: list[RoleStatus] = Field(default_factory=list, description="One entry per role.")


class InferenceServiceStatus(ApiModel):
    """Observed state, written through the status subresource."""

    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the status reflects."
    )
    endpoint: str | None = Field(None, description="OpenAI-compatible base URL of the router.")
    tiers_ready: str | None = Field(
        None,
        pattern=r"^[0-9]+/[0-9]+$",
        description="Tiers whose every role is rolled out and ready, of all tiers (e.g. 1/2).",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description=(
            "Ready, Progressing, Degraded, ScalingActive, CapacitySufficient, Reconciling, Stalled."
        ),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    tiers: list[TierStatus] = Field(default_factory=list, description="Per-tier replicas.")
