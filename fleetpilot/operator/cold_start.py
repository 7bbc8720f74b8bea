"""How long engine pods take to become Ready, from Kubernetes' own timestamps. Purely
computational: pods and the previous status in, samples and their summary out.

Two durations per start, both ending at the pod's Ready condition's ``lastTransitionTime``
(the readiness probe passed: weights loaded, KV cache allocated, the engine answering):

- **start**: from the engine container's ``state.running.startedAt``, the engine's own start;
- **pod**: from the pod's ``metadata.creationTimestamp``, what a scale-up waits for (scheduling,
  image pull, init containers such as a weight download, then the engine's start).

A start is identified by the pod's name and the container's ``startedAt``, so a restarted
container is a new start, and a pod seen again is not. It counts once the pod is Ready and
its Ready transition is not before the container's start (a Ready condition older than the
running container is a stale report, not this start's end). A restarted container gives a
``start`` duration only: its pod was not created for it. Pods being deleted are ignored.

Each role keeps its last :data:`COLD_START_SAMPLES` starts by ``startedAt`` in its status, so
the history outlives the pods and the operator's restarts: every status is the previous one's
samples plus the starts seen since. A kept sample is never recomputed; a start older than
every kept one (when they are as many as are kept) is never added. Together these mean a
Ready pod that flaps (NotReady, then Ready again, without a restart: its Ready transition
moves) is not counted again, whether its start is still kept or was pushed out by later ones.
What timestamps cannot tell apart: a pod that flapped before the operator first saw it
Ready (the operator was down through its whole start and the flap) is counted with the later
Ready, as if it had started that slowly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from statistics import median_low
from typing import Any

from fleetpilot.api.status import (
    COLD_START_SAMPLES,
    ColdStart,
    ColdStartSample,
    DurationSummary,
    InferenceServiceStatus,
)
from fleetpilot.kube import names

# The engine container's name in every engine pod (operator.engine_objects; a test holds them
# to the same name).
ENGINE_CONTAINER = "engine"

RoleKey = tuple[str, str]  # (tier, role)
SampleKey = tuple[str, datetime]  # (pod, startedAt)


def _time(value: Any) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, ``Z``) as an aware datetime; None if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _seconds(start: datetime, end: datetime) -> int:
    return round((end - start).total_seconds())


def _ready_since(status: Mapping[str, Any]) -> datetime | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            if condition.get("status") != "True":
                return None
            return _time(condition.get("lastTransitionTime"))
    return None


def _engine_status(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for container in status.get("containerStatuses") or []:
        if container.get("name") == ENGINE_CONTAINER:
            return container  # type: ignore[no-any-return]
    return None


def role_of(pod: Mapping[str, Any]) -> RoleKey | None:
    """The (tier, role) whose engine the pod is, from its labels; None for any other pod, and
    for the workers of a multi-node replica: they have no readiness probe (no HTTP server), so
    their Ready says nothing of the engine's start - the leader's does, for the whole group."""
    labels = pod.get("metadata", {}).get("labels") or {}
    if labels.get(names.LWS_WORKER_INDEX_LABEL, "0") != "0":
        return None
    tier, role = labels.get(names.LABEL_TIER), labels.get(names.LABEL_ROLE)
    return (tier, role) if tier and role else None


def pod_sample(pod: Mapping[str, Any]) -> ColdStartSample | None:
    """The start the pod's engine container completed, if it is Ready and not being deleted."""
    metadata = pod.get("metadata", {})
    name = metadata.get("name")
    if not name or metadata.get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    ready_at = _ready_since(status)
    engine = _engine_status(status)
    if ready_at is None or engine is None:
        return None
    started_at = _time(((engine.get("state") or {}).get("running") or {}).get("startedAt"))
    if started_at is None or ready_at < started_at:
        return None
    created = _time(metadata.get("creationTimestamp"))
    first_start = not engine.get("restartCount")
    pod_seconds = None
    if first_start and created is not None and created <= ready_at:
        pod_seconds = _seconds(created, ready_at)
    return ColdStartSample(
        pod=name,
        started_at=started_at,
        ready_at=ready_at,
        start_seconds=_seconds(started_at, ready_at),
        pod_seconds=pod_seconds,
    )


def samples_by_role(pods: Iterable[Mapping[str, Any]]) -> dict[RoleKey, list[ColdStartSample]]:
    """Every completed start among ``pods``, by the (tier, role) of its pod."""
    found: dict[RoleKey, list[ColdStartSample]] = {}
    for pod in pods:
        role = role_of(pod)
        sample = pod_sample(pod) if role is not None else None
        if role is not None and sample is not None:
            found.setdefault(role, []).append(sample)
    return found


def _key(sample: ColdStartSample) -> SampleKey:
    return (sample.pod, sample.started_at)


def _order(sample: ColdStartSample) -> tuple[datetime, str]:
    return (sample.started_at, sample.pod)


def merge(
    kept: Sequence[ColdStartSample],
    observed: Iterable[ColdStartSample],
    limit: int = COLD_START_SAMPLES,
) -> list[ColdStartSample]:
    """The last ``limit`` starts by startedAt (oldest first) of ``kept`` and ``observed``; a
    start already kept stays as it was first recorded."""
    by_key = {_key(sample): sample for sample in kept}
    for sample in observed:
        by_key.setdefault(_key(sample), sample)
    return sorted(by_key.values(), key=_order)[-limit:] if limit > 0 else []


def _summary(values: Sequence[int]) -> DurationSummary | None:
    if not values:
        return None
    return DurationSummary(
        count=len(values), p50_seconds=median_low(values), max_seconds=max(values)
    )


def summarize(samples: Sequence[ColdStartSample]) -> ColdStart | None:
    """p50 and max of both durations over ``samples``; None when there is none."""
    start = _summary([s.start_seconds for s in samples])
    if start is None:
        return None
    pod = _summary([s.pod_seconds for s in samples if s.pod_seconds is not None])
    return ColdStart(count=len(samples), start=start, pod=pod, samples=list(samples))


def cold_start(
    previous: ColdStart | None,
    observed: Iterable[ColdStartSample],
    limit: int = COLD_START_SAMPLES,
) -> ColdStart | None:
    """A role's cold start: its previous samples with the starts observed now."""
    return summarize(merge(previous.samples if previous else [], observed, limit))


def _samples_of(status: InferenceServiceStatus | None) -> dict[RoleKey, list[ColdStartSample]]:
    if status is None:
        return {}
    return {
        (tier.name, role.role): list(role.cold_start.samples)
        for tier in status.tiers
        for role in tier.roles
        if role.cold_start is not None
    }


def new_samples(
    previous: InferenceServiceStatus | None, current: InferenceServiceStatus
) -> list[tuple[str, str, ColdStartSample]]:
    """(tier, role, sample) for each start ``current`` records that ``previous`` did not:
    what a metric observes once, when the status that records it is written."""
    before = {
        role: {_key(sample) for sample in samples}
        for role, samples in _samples_of(previous).items()
    }
    return [
        (tier, role, sample)
        for (tier, role), samples in _samples_of(current).items()
        for sample in samples
        if _key(sample) not in before.get((tier, role), set())
    ]
