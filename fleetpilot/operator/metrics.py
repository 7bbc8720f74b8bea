"""Operator metrics, served on /metrics by ``fleetpilot operator``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from fleetpilot.api.status import ColdStartSample

RECONCILES = Counter(
    "fleetpilot_operator_reconciles_total",
    "Reconciles of InferenceServices, by outcome (applied, unchanged, refused).",
    ["result"],
)
RECONCILE_ERRORS = Counter(
    "fleetpilot_operator_reconcile_errors_total", "Reconciles that failed with an API error."
)
RECONCILE_DURATION = Histogram(
    "fleetpilot_operator_reconcile_duration_seconds",
    "Wall time of one reconcile.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ADAPTER_CALLS = Counter(
    "fleetpilot_operator_adapter_calls_total",
    "Calls to engines of lora.dynamic tiers, by call (list, load, reload, unload) and result.",
    ["call", "result"],
)

# The services' status as metrics, from the operator's watch of InferenceServices (every
# status write, the autoscaler's included, arrives as an event): what the chart's alerts and
# dashboard read, in the shape of kube-state-metrics' condition gauges.
CONDITION = Gauge(
    "fleetpilot_inferenceservice_condition",
    "1 for each condition's current status (True, False or Unknown), 0 for the others.",
    ["namespace", "service", "type", "status"],
)
ROLE_REPLICAS = Gauge(
    "fleetpilot_inferenceservice_role_replicas",
    "Replicas of a role from the service's status: spec (the Deployment's), ready, desired "
    "(the autoscaler's latest recommendation).",
    ["namespace", "service", "tier", "role", "state"],
)
# Observed by the operator that writes the status (the leader), once per start it records in
# a role's status.coldStart (operator.cold_start): phase "start" is the engine container's start
# to the pod's Ready, "pod" the pod's creation to Ready (not observed for a restarted container).
ENGINE_COLD_START = Histogram(
    "fleetpilot_operator_engine_cold_start_seconds",
    "Time engine pods took to become Ready, by phase: start (engine container start to Ready), "
    "pod (pod creation to Ready: scheduling, image pull, init containers and the start).",
    ["namespace", "service", "tier", "role", "phase"],
    buckets=(1, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 450, 600, 900, 1200, 1800, 3600),
)
_STATUSES = ("True", "False", "Unknown")
_exported: dict[tuple[str, str], list[tuple[Gauge, tuple[str, ...]]]] = {}
_cold_start_series: dict[tuple[str, str], set[tuple[str, ...]]] = {}


def observe_cold_starts(
    namespace: str, service: str, samples: Iterable[tuple[str, str, ColdStartSample]]
) -> None:
    """Observe each (tier, role, sample): call it once per start, when it is first recorded."""
    for tier, role, sample in samples:
        for phase, seconds in (("start", sample.start_seconds), ("pod", sample.pod_seconds)):
            if seconds is None:
                continue
            labels = (namespace, service, tier, role, phase)
            ENGINE_COLD_START.labels(*labels).observe(float(seconds))
            _cold_start_series.setdefault((namespace, service), set()).add(labels)


def export_status(body: Mapping[str, Any]) -> None:
    """Set the gauges of one service from its latest body (replacing what it had)."""
    metadata = body.get("metadata", {})
    key = (str(metadata.get("namespace", "")), str(metadata.get("name", "")))
    _forget_gauges(key)
    status = body.get("status") or {}
    series: list[tuple[Gauge, tuple[str, ...]]] = []
    for condition in status.get("conditions") or []:
        for value in _STATUSES:
            condition_labels = (*key, str(condition.get("type")), value)
            is_current = condition.get("status") == value
            CONDITION.labels(*condition_labels).set(1.0 if is_current else 0.0)
            series.append((CONDITION, condition_labels))
    for tier in status.get("tiers") or []:
        for role in tier.get("roles") or []:
            for state, field in (("spec", "replicas"), ("ready", "ready"), ("desired", "desired")):
                if role.get(field) is None:
                    continue
                role_labels = (*key, str(tier.get("name")), str(role.get("role")), state)
                ROLE_REPLICAS.labels(*role_labels).set(float(role[field]))
                series.append((ROLE_REPLICAS, role_labels))
    _exported[key] = series


def _forget_gauges(key: tuple[str, str]) -> None:
    for gauge, labels in _exported.pop(key, []):
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted service's series."""
    _forget_gauges((namespace, name))
    for labels in _cold_start_series.pop((namespace, name), set()):
        with contextlib.suppress(KeyError):
            ENGINE_COLD_START.remove(*labels)
