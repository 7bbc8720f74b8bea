"""The kopf shell's own decisions (its behaviour is tested end to end in e2e/test_operator.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fleetpilot.autoscaler.actuator import AutoscalerMetrics, KubernetesActuator
from fleetpilot.autoscaler.prometheus import PrometheusSources
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube, Obj
from fleetpilot.operator import handlers
from fleetpilot.operator.autoscaling import ServiceTicker
from fleetpilot.operator.children import (
    DEPLOYMENTS_INDEX,
    LEADER_WORKER_SETS_INDEX,
    PODS_INDEX,
    Children,
    index_entry,
)
from fleetpilot.operator.handlers import (
    CONTEXT,
    DEPLOYMENT_CHANGED,
    INFERENCE_POOL_CHANGED,
    LEADER_WORKER_SET_CHANGED,
    POD_CHANGED,
    SERVICE_EVENT,
    OperatorContext,
    QuietWatchHandlers,
    build_registry,
    retry_delay,
)
from tests.factories import make_manifest, make_tier
from tests.support.kube import FakeKube

LWS_GROUP = "leaderworkerset.x-k8s.io"


def test_retry_backoff_is_exponential_and_capped() -> None:
    """Retryable API errors (409, 429, 5xx) back off 1s, 2s, 4s ... never beyond a minute."""
    assert [retry_delay(n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert retry_delay(30) == 60.0


def test_only_the_watch_handlers_success_lines_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line per pod event is noise; a reconcile's success and any failure are not."""
    logger = logging.getLogger("kopf.objects.test-quiet")
    logger.addFilter(QuietWatchHandlers())
    with caplog.at_level(logging.INFO, logger="kopf.objects.test-quiet"):
        logger.info(f"Handler {POD_CHANGED!r} succeeded.")
        logger.info(f"Handler {DEPLOYMENT_CHANGED!r} succeeded.")
        logger.info("Handler 'reconcile_service' succeeded.")
        logger.error(f"Handler {POD_CHANGED!r} failed with an exception and will stop now: boom")
    assert [r.getMessage() for r in caplog.records] == [
        "Handler 'reconcile_service' succeeded.",
        "Handler 'pod-changed' failed with an exception and will stop now: boom",
    ]


def test_the_quiet_ids_are_the_registered_handlers_ids() -> None:
    """The filter matches by handler id: a renamed handler would log again unnoticed."""
    registry = build_registry(leader_worker_sets=True, inference_pools=True)
    # kopf has no public listing of a registry's handlers.
    ids = {handler.id for handler in registry._watching.get_all_handlers()}
    ids |= {handler.id for handler in registry._indexing.get_all_handlers()}
    assert {SERVICE_EVENT, POD_CHANGED, DEPLOYMENT_CHANGED, LEADER_WORKER_SET_CHANGED} <= ids
    assert INFERENCE_POOL_CHANGED in ids
    assert {DEPLOYMENTS_INDEX, PODS_INDEX, LEADER_WORKER_SETS_INDEX} <= ids
    quiet = QuietWatchHandlers()
    for handler_id in ids - {"reconcile_service"}:
        record = logging.LogRecord("kopf.objects", logging.INFO, "", 0, "", None, None)
        record.msg = f"Handler {handler_id!r} succeeded."
        assert not quiet.filter(record), handler_id


def _lws_selectors(registry: Any) -> list[tuple[str, str | None]]:
    """(watch or index, handler id) of every handler on LeaderWorkerSets."""
    found = [("watch", h) for h in registry._watching.get_all_handlers()]
    found += [("index", h) for h in registry._indexing.get_all_handlers()]
    return sorted((kind, h.id) for kind, h in found if h.selector.group == LWS_GROUP)


@pytest.mark.parametrize("served", [True, False])
def test_leader_worker_sets_are_watched_only_where_the_cluster_serves_them(
    monkeypatch: pytest.MonkeyPatch, served: bool
) -> None:
    """Asked at build time (kopf makes its indexes before any startup handler runs): with the
    CRD, LeaderWorkerSets are indexed and their changes refresh status like Deployments';
    without it, nothing is registered for them - no watch of a resource the cluster lacks,
    no kopf warning about it at each start and CRD change."""
    cluster = FakeKube(unserved=("PodMonitor",) if served else ("PodMonitor", "LeaderWorkerSet"))
    monkeypatch.setattr(handlers, "connect", lambda kubeconfig: None)
    monkeypatch.setattr(handlers, "Kube", lambda api: cluster)
    registry = build_registry(inference_pools=False)
    expected = [("index", LEADER_WORKER_SETS_INDEX), ("watch", LEADER_WORKER_SET_CHANGED)]
    assert _lws_selectors(registry) == (expected if served else [])
    (discovery,) = cluster.calls
    assert discovery.path == f"/apis/{LWS_GROUP}/v1"


class _Marks:
    def __init__(self) -> None:
        self.marked: list[Hashable] = []

    def mark(self, key: Hashable) -> None:
        self.marked.append(key)


def test_a_leader_worker_sets_change_refreshes_its_services_status() -> None:
    """A multi-node role's groups turning Ready show on its LeaderWorkerSet: the event marks
    the owning service for a status refresh, which then reads the set from the index."""
    registry = build_registry(leader_worker_sets=True, inference_pools=False)
    (handler,) = [
        h for h in registry._watching.get_all_handlers() if h.id == LEADER_WORKER_SET_CHANGED
    ]
    labels = {names.LABEL_SERVICE: "chat", names.LABEL_MANAGED_BY: names.MANAGER}
    body = {
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "chat-big", "namespace": "ml", "labels": labels, "generation": 1},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 2},
    }
    index = {key: [entry] for key, entry in index_entry("LeaderWorkerSet", body).items()}
    # Only what a child event touches: the indexes it attaches and the queues it marks.
    touched = {"children": Children(), "refreshes": _Marks(), "adapter_syncs": _Marks()}
    context = OperatorContext(**{f.name: None for f in fields(OperatorContext)} | touched)
    indexes = {DEPLOYMENTS_INDEX: {}, PODS_INDEX: {}, LEADER_WORKER_SETS_INDEX: index}
    memo = {CONTEXT: context}
    asyncio.run(handler.fn(namespace="ml", labels=labels, body=body, memo=memo, **indexes))
    assert touched["refreshes"].marked == [("ml", "chat")]
    assert touched["adapter_syncs"].marked == []  # only a pod turning Ready holds no adapters
    observed = context.children.observed("ml", "chat")
    assert observed is not None
    assert observed.workloads[("LeaderWorkerSet", "chat-big")]["status"]["readyReplicas"] == 2


@pytest.mark.parametrize("served", [True, False])
def test_inference_pools_are_watched_only_where_the_cluster_serves_them(
    monkeypatch: pytest.MonkeyPatch, served: bool
) -> None:
    """Asked at build time too: with the CRD, a gateway writing a pool's status refreshes its
    service's GatewayAccepted; without it, no watch (and no kopf warning at each start)."""
    unserved = ("InferencePool",) if not served else ()
    cluster = FakeKube(unserved=unserved)
    monkeypatch.setattr(handlers, "connect", lambda kubeconfig: None)
    monkeypatch.setattr(handlers, "Kube", lambda api: cluster)
    registry = build_registry(leader_worker_sets=False)
    watched = [h.id for h in registry._watching.get_all_handlers()]
    assert (INFERENCE_POOL_CHANGED in watched) is served
    (discovery,) = cluster.calls
    assert discovery.path == "/apis/inference.networking.k8s.io/v1"


def test_an_inference_pools_change_refreshes_its_services_status() -> None:
    registry = build_registry(leader_worker_sets=False, inference_pools=True)
    (handler,) = [
        h for h in registry._watching.get_all_handlers() if h.id == INFERENCE_POOL_CHANGED
    ]
    labels = {names.LABEL_SERVICE: "chat", names.LABEL_MANAGED_BY: names.MANAGER}
    touched = {"refreshes": _Marks(), "adapter_syncs": _Marks()}
    context = OperatorContext(**{f.name: None for f in fields(OperatorContext)} | touched)
    body = {"kind": "InferencePool", "metadata": {"name": "chat", "labels": labels}}
    asyncio.run(handler.fn(namespace="ml", labels=labels, body=body, memo={CONTEXT: context}))
    assert touched["refreshes"].marked == [("ml", "chat")]
    assert touched["adapter_syncs"].marked == []


# -- no metrics source (issue 47) -----------------------------------------------------------

NOW = datetime(2026, 12, 6, 22, 0, tzinfo=UTC)


def _autoscaling_context(kube: Kube, prometheus_url: str | None = None) -> OperatorContext:
    """What the autoscaler loop's work touches: the Prometheus sources, the actuator, the
    clock."""
    touched = {
        "prometheus": PrometheusSources(prometheus_url),
        "actuator": KubernetesActuator(kube, metrics=AutoscalerMetrics(CollectorRegistry())),
        "clock": lambda: NOW,
        "ticker": ServiceTicker(lambda body: None, every_s=60),
    }
    return OperatorContext(**{f.name: None for f in fields(OperatorContext)} | touched)


def _no_source_events(kube: Kube, namespace: str) -> list[Obj]:
    return [e for e in kube.list("Event", namespace, {}) if e.get("reason") == "NoMetricsSource"]


def test_a_service_nothing_autoscales_gets_no_metrics_source_condition() -> None:
    """Every tier disabled or external: no Prometheus is missed, nothing is written."""
    kube = FakeKube()
    tiers = [
        make_tier("a", up_to=0.5, autoscaling={"mode": "disabled"}),
        make_tier("b", autoscaling={"mode": "external"}),
    ]
    live = kube.apply(make_manifest(tiers=tiers), "tests")
    handlers.autoscale(_autoscaling_context(kube), live)
    assert kube.writes_of("PATCH", "InferenceService", "status") == []
    assert _no_source_events(kube, "ml") == []


@pytest.mark.cluster
def test_without_a_prometheus_status_and_an_event_say_so_once_per_generation(
    api_server: Kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator started without --prometheus-url (the chart's prometheusURL empty) and a
    service naming none: its autoscaled tiers get ScalingActive False (NoMetricsSource)
    telling how to set one, and one Warning Event - not one per tick: ticks on the same
    generation, with the watch's body from before the write or after it, send nothing; a
    new generation is announced once more. On a real API server: the CRD's schema takes the
    condition, the Event is stored."""
    context = _autoscaling_context(api_server)
    tiers = [
        make_tier("small", up_to=0.5),
        make_tier("fixed", autoscaling={"mode": "disabled"}),
    ]
    manifest = make_manifest("chat", namespace=namespace, tiers=tiers)
    live = api_server.apply(manifest, "tests")
    handlers.autoscale(context, live)
    written = api_server.get("InferenceService", namespace, "chat")
    assert written is not None
    (condition,) = [c for c in written["status"]["conditions"] if c["type"] == "ScalingActive"]
    assert (condition["status"], condition["reason"]) == ("False", "NoMetricsSource")
    assert condition["observedGeneration"] == live["metadata"]["generation"]
    assert "tiers small (unified) from" in condition["message"]
    assert "prometheusURL" in condition["message"]
    assert "fixed" not in condition["message"]
    (event,) = _no_source_events(api_server, namespace)
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "chat"
    assert event["message"] == condition["message"]

    # Regression: a tick on a body the watch had not yet updated (a busy operator's) wrote
    # again, each write a 409 and a re-read - 5x the API requests of 1,000 services settling.
    writes = []
    record = context.actuator.record_no_source
    monkeypatch.setattr(
        context.actuator, "record_no_source", lambda *a, **k: writes.append(a) or record(*a, **k)
    )
    for body in (live, written, live):
        handlers.autoscale(context, body)
    assert writes == []
    assert len(_no_source_events(api_server, namespace)) == 1

    manifest["spec"]["routing"] = {"replicas": 3}
    changed = api_server.apply(manifest, "tests")
    assert changed["metadata"]["generation"] > live["metadata"]["generation"]
    handlers.autoscale(context, changed)
    handlers.autoscale(context, changed)
    assert len(writes) == 1
    assert len(_no_source_events(api_server, namespace)) == 2
    again = api_server.get("InferenceService", namespace, "chat")
    assert again is not None
    (condition,) = [c for c in again["status"]["conditions"] if c["type"] == "ScalingActive"]
    assert condition["observedGeneration"] == changed["metadata"]["generation"]
