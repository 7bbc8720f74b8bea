"""kopf handlers: the thin shell that feeds cluster events to the reconciler.

InferenceService create/update/resume runs a full reconcile; its watch events also feed the
autoscaler's loop (operator.autoscaling: a loop, not a kopf timer, so no finalizer holds a
service's deletion hostage to the operator running). Changes of child Deployments
and Pods (selected by label, so the operator never watches unrelated objects) refresh only the
owning service's status. Errors the API server may get over (409, 429, 5xx) are retried by
kopf with backoff; anything else is reported on the object and left until its next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from fleetpilot.api import GROUP, VERSION, parse_service
from fleetpilot.api.loading import InvalidManifestError
from fleetpilot.api.service import PLURAL
from fleetpilot.autoscaler.actuator import kubernetes_actuator
from fleetpilot.autoscaler.loop import tick
from fleetpilot.autoscaler.prometheus import PrometheusSources
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube, KubeError
from fleetpilot.kube.connect import connect
from fleetpilot.operator import metrics
from fleetpilot.operator.autoscaling import ServiceTicker
from fleetpilot.operator.coalesce import Coalescer
from fleetpilot.operator.plan_types import DEFAULT_FLEETPILOT_IMAGE, PlanOptions
from fleetpilot.operator.reconcile import Reconciler

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "operator.fleetpilot.dev"
# Exponential backoff for retryable API errors: 1s, 2s, 4s ... capped at a minute.
RETRY_BASE_S = 1.0
RETRY_MAX_S = 60.0


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` (0-based) of a failed reconcile."""
    return float(min(RETRY_MAX_S, RETRY_BASE_S * 2**retry))


def _plain(body: Any) -> dict[str, Any]:
    """kopf's Body is a read-only mapping view; the reconciler takes plain dicts."""
    if isinstance(body, dict):
        return body
    return {key: _plain(value) if hasattr(value, "keys") else value for key, value in body.items()}


# The loop ticks often; each service's roles are decided only when their own
# autoscaling.interval has passed (loop.tick skips roles not yet due).
AUTOSCALE_TICK_S = 5.0


def build_registry(
    *,
    fleetpilot_image: str = DEFAULT_FLEETPILOT_IMAGE,
    kubeconfig: str | None = None,
    prometheus_url: str | None = None,
) -> kopf.OperatorRegistry:
    """A fresh registry (not kopf's global one), so tests can run operators side by side."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own login handler lives in its global registry, which this one replaces.
        return kopf.login_via_client(**kwargs)

    def prepare(settings: kopf.OperatorSettings, memo: kopf.Memo) -> None:
        # Explicit Events only (created/updated/pruned/refused); kopf would otherwise post
        # one for every log line of a handler.
        settings.posting.level = logging.WARNING
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=ANNOTATION_PREFIX
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
        )
        kube = Kube(connect(kubeconfig))
        # Optional CRDs are detected once at start: their absence never blocks a service.
        pod_monitors = kube.serves("monitoring.coreos.com/v1", "podmonitors")
        log.info("optional CRDs detected", extra={"podmonitor": pod_monitors})
        options = PlanOptions(fleetpilot_image=fleetpilot_image, pod_monitor_available=pod_monitors)
        memo["reconciler"] = Reconciler(kube, options)
        # Shared (not copied) by every service's handlers: kopf copies memo shallowly.
        memo["prometheus"] = PrometheusSources(prometheus_url)
        memo["actuator"] = kubernetes_actuator(kube)
        memo["histories"] = {}
        memo["refreshes"] = Coalescer()

        def autoscale(body: Mapping[str, Any]) -> None:
            """Decide and scale every due role of the service from its Prometheus metrics."""
            monitoring = body.get("spec", {}).get("monitoring", {}) or {}
            source = memo["prometheus"].for_url(monitoring.get("prometheusUrl"))
            if source is None:
                return  # no Prometheus for the operator or the service: nothing to read
            tick(body, source, memo["actuator"], memo["histories"])

        memo["ticker"] = ServiceTicker(autoscale, AUTOSCALE_TICK_S)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        await asyncio.to_thread(prepare, settings, memo)  # blocking API calls
        memo["ticker_task"] = asyncio.create_task(memo["ticker"].run(), name="autoscaler")

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        task: asyncio.Task[None] | None = memo.get("ticker_task")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        ticker: ServiceTicker | None = memo.get("ticker")
        if ticker is not None:
            ticker.close()
        sources: PrometheusSources | None = memo.get("prometheus")
        if sources is not None:
            sources.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile_service(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
        reconciler: Reconciler = memo["reconciler"]

        def emit(kind: str, reason: str, message: str) -> None:
            kopf.event(body, type=kind, reason=reason, message=message)

        started = time.monotonic()
        try:
            result = reconciler.reconcile(_plain(body), emit)
        except KubeError as exc:
            metrics.RECONCILE_ERRORS.inc()
            if exc.retryable:
                raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from exc
            raise kopf.PermanentError(str(exc)) from exc
        finally:
            metrics.RECONCILE_DURATION.observe(time.monotonic() - started)
        outcome = "refused" if result.plan_error else "applied" if result.applied else "unchanged"
        metrics.RECONCILES.labels(result=outcome).inc()
        log.info(
            "reconciled",
            extra={
                "service": f"{body.metadata.namespace}/{body.metadata.name}",
                "applied": len(result.applied),
                "pruned": len(result.pruned),
                "outcome": outcome,
            },
        )

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def service_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        ticker: ServiceTicker = memo["ticker"]
        plain = _plain(body)
        ticker.observe(event.get("type"), plain)
        if event.get("type") == "DELETED":
            metrics.forget(body.metadata.namespace or "", body.metadata.name or "")
        else:
            metrics.export_status(plain)

    def refresh_owner(namespace: str | None, labels: Any, memo: kopf.Memo) -> None:
        service_name = labels.get(names.LABEL_SERVICE)
        if not service_name or not namespace:
            return
        # A burst of child events (a rollout, a thousand services at once) is one refresh
        # running and at most one behind it, reading the final state.
        refreshes: Coalescer = memo["refreshes"]
        refreshes.run((namespace, service_name), lambda: refresh(namespace, service_name, memo))

    def refresh(namespace: str, service_name: str, memo: kopf.Memo) -> None:
        reconciler: Reconciler = memo["reconciler"]
        body = reconciler.kube.get("InferenceService", namespace, service_name)
        if body is None:
            return
        try:
            service = parse_service(body)
        except InvalidManifestError:
            return  # the service handler reports it; a child event cannot fix it
        try:
            reconciler.refresh_status(service, body)
        except KubeError as exc:
            if not exc.conflict:  # a conflict means a newer write; the next event retries
                raise

    @kopf.on.event(
        "apps", "v1", "deployments",
        labels={names.LABEL_MANAGED_BY: names.MANAGER}, registry=registry,
    )  # fmt: skip
    def deployment_changed(
        namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
    ) -> None:
        refresh_owner(namespace, labels, memo)

    @kopf.on.event("", "v1", "pods", labels={names.LABEL_SERVICE: kopf.PRESENT}, registry=registry)
    def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
        refresh_owner(namespace, labels, memo)

    return registry
