"""Operator metrics, served on /metrics by ``fleetpilot operator``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from fleetpilot.api import InvalidManifestError, parse_service
from fleetpilot.api.spec import RoleName
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
# Each tier's latency objectives (spec autoscaling.slo), one series per role that the objective
# is about - the roles the autoscaler holds to it (autoscaler.model.RolePolicy): TTFT for
# unified and prefill replicas, TPOT for unified and decode ones. The chart's SLO alerts and
# the dashboard join the engines' latency histograms to these: a tier without an objective has
# no series, so no alert and no SLO line.
SLO_TTFT = Gauge(
    "fleetpilot_slo_ttft_seconds",
    "A tier's objective for the 95th percentile of time to first token "
    "(autoscaling.slo.ttftP95), for each of its roles that makes first tokens.",
    ["namespace", "service", "tier", "role"],
)
SLO_TPOT = Gauge(
    "fleetpilot_slo_tpot_seconds",
    "A tier's objective for the 95th percentile of time per output token "
    "(autoscaling.slo.tpotP95), for each of its roles that makes output tokens.",
    ["namespace", "service", "tier", "role"],
)
_TTFT_ROLES = (RoleName.UNIFIED, RoleName.PREFILL)
_TPOT_ROLES = (RoleName.UNIFIED, RoleName.DECODE)
_STATUSES = ("True", "False", "Unknown")
_Series = list[tuple[Gauge, tuple[str, ...], float]]
_exported: dict[tuple[str, str], list[tuple[Gauge, tuple[str, ...]]]] = {}
# The SLO series of each service, by the generation of the spec they were read from: statuses
# change far more often than specs, and each status write is an event.
_slo_series: dict[tuple[str, str], tuple[object, _Series]] = {}
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
    for gauge, labels, seconds in _slos(key, body):
        gauge.labels(*labels).set(seconds)
        series.append((gauge, labels))
    _exported[key] = series


def _slos(key: tuple[str, str], body: Mapping[str, Any]) -> _Series:
    """The SLO series of a service's spec, read as the reconciler reads it: none when the spec
    does not validate (the reconciler refuses it too). The status is left out: whatever it
    holds (another writer's, an older operator's), the objectives are the spec's."""
    generation = body.get("metadata", {}).get("generation")
    cached = _slo_series.get(key)
    if cached is not None and generation is not None and cached[0] == generation:
        return cached[1]
    try:
        spec_only = {k: v for k, v in body.items() if k != "status"}
        service = parse_service(spec_only, f"{key[0]}/{key[1]}")
    except InvalidManifestError:
        found: _Series = []
    else:
        found = []
        for tier in service.spec.tiers:
            slo = tier.autoscaling.slo
            for gauge, objective, roles in (
                (SLO_TTFT, slo.ttft_p95, _TTFT_ROLES),
                (SLO_TPOT, slo.tpot_p95, _TPOT_ROLES),
            ):
                if objective is None:
                    continue
                for role in tier.role_names:
                    if role in roles:
                        labels = (*key, tier.name, str(role))
                        found.append((gauge, labels, objective.total_seconds()))
    _slo_series[key] = (generation, found)
    return found


def _forget_gauges(key: tuple[str, str]) -> None:
    for gauge, labels in _exported.pop(key, []):
        with contextlib.suppress(KeyError):
            gauge.remove(*labels)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted service's series."""
    _forget_gauges((namespace, name))
    _slo_series.pop((namespace, name), None)
    for labels in _cold_start_series.pop((namespace, name), set()):
        with contextlib.suppress(KeyError):
            ENGINE_COLD_START.remove(*labels)
