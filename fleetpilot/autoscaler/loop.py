"""One autoscaler tick over one InferenceService: observe, decide, act, record.

The shell around the pure policy: it reads (replicas from the actuator, metrics from the
source), calls :func:`~fleetpilot.autoscaler.policy.decide`, and writes (scale, record). It
holds no state: past recommendations live in the ``histories`` mapping the caller owns (a kopf
timer keeps one per operator process; ``fleetpilot autoscaler`` one per run).

One role failing (its workload missing, the API server refusing a scale) is logged and
skipped; the other roles of the tick still decide, act and get recorded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fleetpilot.api import InferenceService, parse_service
from fleetpilot.api.spec import AutoscalingMode, Tier
from fleetpilot.autoscaler.actuator import Actuator, scaling_active_condition
from fleetpilot.autoscaler.model import (
    DataProblem,
    Decision,
    History,
    Metrics,
    Observation,
    RolePolicy,
)
from fleetpilot.autoscaler.policy import decide
from fleetpilot.autoscaler.prometheus import MetricsSource

log = logging.getLogger(__name__)

# A timer fires a little early or late; a role whose interval has 90% elapsed is due, so a
# 15 s timer never skips a 15 s role for arriving 10 ms early.
_DUE_SLACK = 0.9
# Roles observed at once: Prometheus answers each in milliseconds; this bounds the threads.
_MAX_PARALLEL_ROLES = 8


@dataclass(frozen=True)
class RoleKey:
    """Identifies one role's history across ticks."""

    namespace: str
    service: str
    tier: str
    role: str


Histories = MutableMapping[RoleKey, History]


# Modes fleetpilot's autoscaler does not decide for: fixed replicas, or someone else's.
NOT_OURS = {AutoscalingMode.DISABLED, AutoscalingMode.EXTERNAL}


def autoscaled_roles(service: InferenceService) -> list[tuple[Tier, str]]:
    """Every (tier, role) fleetpilot's autoscaler decides for (auto, recommend), in spec order."""
    return [
        (tier, role)
        for tier in service.spec.tiers
        if tier.autoscaling.mode not in NOT_OURS
        for role in tier.role_names
    ]


def interval_s(service: InferenceService) -> float | None:
    """How often to tick the service: its shortest tier interval; None when nothing scales."""
    intervals = [tier.autoscaling.interval.total_seconds() for tier, _ in autoscaled_roles(service)]
    return min(intervals) if intervals else None


def _due(history: History | None, policy: RolePolicy, now_s: float) -> bool:
    if history is None or not history.recommendations:
        return True
    last = history.recommendations[-1].time_s
    return now_s - last >= policy.interval_s * _DUE_SLACK


def _as_datetime(now: float | datetime) -> datetime:
    return now if isinstance(now, datetime) else datetime.fromtimestamp(now, tz=UTC)


def _observe(source: MetricsSource, service: InferenceService, tier: Tier, role: str) -> Metrics:
    try:
        return source.observe(
            service.name, tier.name, role, tier.autoscaling.window, namespace=service.namespace
        )
    except Exception as exc:  # a source must not raise; if one does, it is "no data"
        log.exception("metrics source failed for %s/%s/%s", service.name, tier.name, role)
        return Metrics(problem=DataProblem.UNREACHABLE, detail=f"metrics source failed: {exc}")


def observed_cold_start(service: InferenceService, tier: str, role: str) -> float | None:
    """The role's slowest kept cold start from the service's status (pod created to Ready,
    else engine start to Ready when every kept start was a restart); None before any."""
    status = service.status
    for tier_status in status.tiers if status is not None else []:
        if tier_status.name != tier:
            continue
        for role_status in tier_status.roles:
            cold = role_status.cold_start
            if role_status.role == role and cold is not None:
                return float((cold.pod or cold.start).max_seconds)
    return None


def tick(
    service_obj: InferenceService | Mapping[str, Any],
    source: MetricsSource,
    actuator: Actuator,
    histories: Histories,
    now: float | datetime | None = None,
) -> list[Decision]:
    """Decide every due autoscaled role of one service, scale it, record the tick.

    ``service_obj`` is the InferenceService as read from the API server (a dict, parsed here)
    or already parsed. ``now`` defaults to the wall clock. Returns the decisions made; a role
    that failed has none. Scaling happens only in mode ``auto``; mode ``recommend`` records.
    """
    service = (
        service_obj
        if isinstance(service_obj, InferenceService)
        else parse_service(dict(service_obj), "InferenceService")
    )
    when = time.time() if now is None else now
    now_dt = _as_datetime(when)
    now_s = now_dt.timestamp()
    scrape_s = service.spec.monitoring.scrape_interval.total_seconds()

    due: list[tuple[Tier, str, RoleKey, RolePolicy]] = []
    keys_now: set[RoleKey] = set()
    for tier, role in autoscaled_roles(service):
        key = RoleKey(service.namespace, service.name, tier.name, role)
        keys_now.add(key)
        policy = RolePolicy.for_role(tier, role, scrape_interval_s=scrape_s)
        if _due(histories.get(key), policy, now_s):
            due.append((tier, role, key, policy))
    # Roles renamed or removed from the spec leave no history behind.
    for stale in [
        k
        for k in histories
        if (k.namespace, k.service) == (service.namespace, service.name) and k not in keys_now
    ]:
        del histories[stale]
    if not due:
        return []

    decisions: list[Decision] = []
    workers = min(_MAX_PARALLEL_ROLES, len(due))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="autoscale") as pool:
        observed: list[Future[Metrics]] = [
            pool.submit(_observe, source, service, tier, role) for tier, role, _, _ in due
        ]
        for (tier, role, key, policy), metrics in zip(due, observed, strict=True):
            try:
                decision = _decide_and_act(
                    service, tier, role, key, policy, metrics.result(), actuator, histories, now_s
                )
            except Exception:
                log.exception("autoscaling %s/%s/%s failed", service.name, tier.name, role)
                continue
            if decision is not None:
                decisions.append(decision)

    if decisions:
        condition = scaling_active_condition(decisions, service.metadata.generation, now_dt)
        try:
            actuator.record(service, decisions, condition, now_dt)
        except Exception:
            log.exception("recording the decisions of %s failed", service.name)
    return decisions


def _decide_and_act(
    service: InferenceService,
    tier: Tier,
    role: str,
    key: RoleKey,
    policy: RolePolicy,
    metrics: Metrics,
    actuator: Actuator,
    histories: Histories,
    now_s: float,
) -> Decision | None:
    replicas = actuator.current(service, tier.name, role)
    if replicas is None:
        log.info("%s/%s/%s: no workload yet, nothing to scale", service.name, tier.name, role)
        return None
    cold_start_s = observed_cold_start(service, tier.name, role)
    observation = Observation(replicas.current, replicas.ready, metrics, cold_start_s)
    decision = decide(observation, policy, histories.get(key, History()), now_s)
    if decision.changed and not decision.dry_run:
        actuator.scale(service, tier.name, role, decision.replicas)
        log.info("scaled %s/%s/%s: %s", service.name, tier.name, role, decision.reason)
    # Kept only once acted on: a failed scale is decided afresh next tick.
    histories[key] = decision.history
    return decision


__all__ = ["Histories", "RoleKey", "autoscaled_roles", "interval_s", "tick"]
