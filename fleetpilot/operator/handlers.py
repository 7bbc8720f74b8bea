"""kopf handlers: the thin shell that feeds cluster events to the reconciler.

InferenceService create/update/resume runs a full reconcile; its watch events also feed the
autoscaler's loop (operator.autoscaling: a loop, not a kopf timer, so no finalizer holds a
service's deletion hostage to the operator running). Changes of child Deployments,
LeaderWorkerSets (where the cluster serves them) and Pods (selected by label, so the operator
never watches unrelated objects) refresh only the owning service's status, through
operator.refresh_queue: the child handlers only mark the service and return, so kopf's
per-object workers never wait on the API server. Errors the API
server may get over (409, 429, 5xx) are retried by kopf with backoff; anything else is
reported on the object and left until its next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from fleetpilot.api import GROUP, VERSION, InferenceService, parse_service
from fleetpilot.api.loading import InvalidManifestError
from fleetpilot.api.service import PLURAL
from fleetpilot.autoscaler.actuator import (
    KubernetesActuator,
    kubernetes_actuator,
    no_metrics_source_condition,
    no_metrics_source_recorded,
)
from fleetpilot.autoscaler.loop import Histories, tick
from fleetpilot.autoscaler.prometheus import PrometheusSources
from fleetpilot.engine.adapter_client import AdapterClient
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube, KubeError, Obj
from fleetpilot.kube.connect import connect
from fleetpilot.kube.events import post_event
from fleetpilot.operator import adapter_loading, metrics
from fleetpilot.operator.autoscaling import ServiceTicker
from fleetpilot.operator.children import (
    DEPLOYMENTS_INDEX,
    LEADER_WORKER_SETS_INDEX,
    PODS_INDEX,
    Children,
    index_entry,
    plain,
)
from fleetpilot.operator.model_cache import COMPONENT as FETCH_COMPONENT
from fleetpilot.operator.model_cache import job_complete, job_failed
from fleetpilot.operator.node_memory import NODE_MEMORY_TTL_S, NodeMemoryReader
from fleetpilot.operator.plan_types import (
    DEFAULT_FLEETPILOT_IMAGE,
    DEFAULT_REFERENCE_IMAGE,
    PlanOptions,
)
from fleetpilot.operator.reconcile import OPTIONAL_KINDS, Clock, Reconciler, wall_clock
from fleetpilot.operator.refresh_queue import RefreshQueue

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "operator.fleetpilot.dev"
# Exponential backoff for retryable API errors: 1s, 2s, 4s ... capped at a minute.
RETRY_BASE_S = 1.0
RETRY_MAX_S = 60.0
IMAGE_VOLUMES_FROM = (1, 35)  # ImageVolume beta and on by default


# The watch-event handlers, named: kopf logs "Handler '<id>' succeeded." for every event each
# handles - a line per pod and Deployment change, ten thousand a minute with a thousand
# services rolling out - which QuietWatchHandlers drops (unless --verbose).
SERVICE_EVENT, DEPLOYMENT_CHANGED, LEADER_WORKER_SET_CHANGED, POD_CHANGED, FETCH_JOB_CHANGED = (
    "service-event",
    "deployment-changed",
    "leader-worker-set-changed",
    "pod-changed",
    "fetch-job-changed",
)
INFERENCE_POOL_CHANGED = "inference-pool-changed"
INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION = OPTIONAL_KINDS["InferencePool"][0].split("/")


class QuietWatchHandlers(logging.Filter):
    """Drops kopf's success line of the watch-event handlers; their failures still log."""

    _quiet = frozenset(
        f"Handler '{handler}' succeeded."
        for handler in (
            SERVICE_EVENT, DEPLOYMENT_CHANGED, LEADER_WORKER_SET_CHANGED, POD_CHANGED,
            FETCH_JOB_CHANGED, DEPLOYMENTS_INDEX, LEADER_WORKER_SETS_INDEX, PODS_INDEX,
            INFERENCE_POOL_CHANGED,
        )
    )  # fmt: skip

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self._quiet


def quiet_watch_handlers() -> None:
    logging.getLogger("kopf.objects").addFilter(QuietWatchHandlers())


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` (0-based) of a failed reconcile."""
    return float(min(RETRY_MAX_S, RETRY_BASE_S * 2**retry))


# Threads reconciling services at once (kopf's executor; its default is the CPU count + 4). A
# reconcile is a score of API requests in a row, so with a thousand services created at once
# a few threads, each waiting on one request at a time, left the API server idle between them.
RECONCILE_WORKERS = 16
# Threads refreshing statuses after child events: each refresh waits mostly on the API server.
REFRESH_WORKERS = 4
# A child event's refresh waits this long for the rest of its burst (operator.refresh_queue).
REFRESH_HOLD_S = 1.0

# Threads syncing dynamic-LoRA adapters into engines: each waits on engines' HTTP calls.
ADAPTER_SYNC_WORKERS = 4


def loads_adapters_at_run_time(body: Mapping[str, Any]) -> bool:
    """Whether the (raw) service has a ``lora.dynamic`` tier: a quick look before parsing."""
    tiers = (body.get("spec") or {}).get("tiers") or []
    return any(((tier or {}).get("lora") or {}).get("dynamic") is True for tier in tiers)


# The loop ticks often; each service's roles are decided only when their own
# autoscaling.interval has passed (loop.tick skips roles not yet due).
AUTOSCALE_TICK_S = 5.0

LWS_API_VERSION, LWS_PLURAL = OPTIONAL_KINDS["LeaderWorkerSet"]
LWS_GROUP, LWS_VERSION = LWS_API_VERSION.split("/")


def serves_leader_worker_sets(kube: Kube) -> bool:
    """Whether the cluster serves LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), which the
    replicas of multi-node roles run as."""
    return kube.serves(LWS_API_VERSION, LWS_PLURAL)


@dataclass(frozen=True)
class OperatorConfig:
    """What the operator is started with (the command line's choices)."""

    fleetpilot_image: str = DEFAULT_FLEETPILOT_IMAGE
    reference_image: str = DEFAULT_REFERENCE_IMAGE
    kubeconfig: str | None = None
    prometheus_url: str | None = None
    # Whether the cluster serves LeaderWorkerSet (asked before kopf runs: build_registry).
    leader_worker_sets: bool = False
    # Whether the cluster serves InferencePool (asked before kopf runs, as LeaderWorkerSet).
    inference_pools: bool = False
    clock: Clock = wall_clock


@dataclass
class OperatorContext:
    """Everything the handlers share, built once at startup (``start_context``) and handed to
    them through kopf's memo under one key (kopf copies memo shallowly: one context for all).
    """

    kube: Kube
    options: PlanOptions
    # The watched workloads and pods (kopf's indexes, attached by the first handler).
    children: Children
    reconciler: Reconciler
    prometheus: PrometheusSources
    actuator: KubernetesActuator
    histories: Histories
    # The autoscaler's loop; also the latest body of every service, as watched.
    ticker: ServiceTicker
    adapter_client: AdapterClient
    # Status refreshes after child events; reconciles of what no spec change announces;
    # dynamic-LoRA syncs.
    refreshes: RefreshQueue
    rereconciles: RefreshQueue
    adapter_syncs: RefreshQueue
    # The nodes' memory each plan is checked against (the reconciler's, read once a minute).
    node_memory: NodeMemoryReader | None = None
    clock: Clock = wall_clock
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.ticker.close()
        for queue in (self.refreshes, self.adapter_syncs, self.rereconciles):
            queue.close()
        self.adapter_client.close()
        self.prometheus.close()


CONTEXT = "context"  # its key in kopf's memo


def context_of(memo: kopf.Memo) -> OperatorContext:
    return cast(OperatorContext, memo[CONTEXT])


def plan_options(kube: Kube, config: OperatorConfig) -> PlanOptions:
    """What the planner may assume of this cluster: optional CRDs and the API server's
    version, detected once at start (their absence never blocks a service: a multi-node role
    is refused without LeaderWorkerSet, its status saying so)."""
    pod_monitors = kube.serves(*OPTIONAL_KINDS["PodMonitor"])
    inference_pools = config.inference_pools
    http_routes = kube.serves(*OPTIONAL_KINDS["HTTPRoute"])
    log.info(
        "optional CRDs detected",
        extra={
            "podmonitor": pod_monitors,
            "leaderworkerset": config.leader_worker_sets,
            "inferencepool": inference_pools,
            "httproute": http_routes,
        },
    )
    version = kube.server_version()
    # OCI model sources mount images as volumes where Kubernetes has them on by default.
    image_volumes = version is not None and version >= IMAGE_VOLUMES_FROM
    log.info("API server", extra={"version": version, "image_volumes": image_volumes})
    return PlanOptions(
        image_volumes=image_volumes,
        fleetpilot_image=config.fleetpilot_image,
        reference_image=config.reference_image,
        pod_monitor_available=pod_monitors,
        leader_worker_set_available=config.leader_worker_sets,
        inference_pools_available=inference_pools,
        http_routes_available=http_routes,
        operator_namespace=os.environ.get("POD_NAMESPACE") or None,
    )


def start_context(config: OperatorConfig, kube: Kube | None = None) -> OperatorContext:
    """The operator's context, its queues' threads started (blocking API calls: run it off
    kopf's loop)."""
    kube = kube or Kube(connect(config.kubeconfig))
    options = plan_options(kube, config)
    children = Children()
    node_memory = NodeMemoryReader(kube)
    node_memory.refresh()  # the first reading, before any reconcile (and its log line)
    reconciler = Reconciler(kube, options, children, config.clock, node_memory)
    context: OperatorContext

    def on(work: Any) -> Any:
        # The queues and the ticker call back into the context being built.
        return lambda key: work(context, key)

    context = OperatorContext(
        kube=kube,
        options=options,
        children=children,
        reconciler=reconciler,
        prometheus=PrometheusSources(config.prometheus_url),
        actuator=kubernetes_actuator(kube),
        histories={},
        ticker=ServiceTicker(on(autoscale), AUTOSCALE_TICK_S),
        adapter_client=AdapterClient(),
        refreshes=RefreshQueue(on(refresh), REFRESH_WORKERS, "status-refresh", REFRESH_HOLD_S),
        rereconciles=RefreshQueue(on(reconcile_again), 1, "re-reconcile", REFRESH_HOLD_S),
        adapter_syncs=RefreshQueue(
            on(sync_adapters), ADAPTER_SYNC_WORKERS, "adapter-sync", REFRESH_HOLD_S
        ),
        node_memory=node_memory,
        clock=config.clock,
    )

    def reconcile_later(namespace: str, name: str) -> None:
        context.rereconciles.mark((namespace, name))

    reconciler.on_cold_start = reconcile_later
    reconciler.on_collection_due = reconcile_later
    return context


def configure(settings: kopf.OperatorSettings) -> None:
    # Explicit Events only (created/updated/pruned/refused); kopf would otherwise post one
    # for every log line of a handler.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = RECONCILE_WORKERS
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )


# -- the work, each on the context --------------------------------------------------------


def autoscale(context: OperatorContext, body: Mapping[str, Any]) -> None:
    """Decide and scale every due role of the service from its Prometheus metrics."""
    monitoring = body.get("spec", {}).get("monitoring", {}) or {}
    source = context.prometheus.for_url(monitoring.get("prometheusUrl"))
    if source is None:
        # No Prometheus for the operator or the service: nothing to read, and the status says so.
        report_no_metrics_source(context, body)
        return
    tick(body, source, context.actuator, context.histories)


def report_no_metrics_source(context: OperatorContext, body: Mapping[str, Any]) -> None:
    """ScalingActive False (NoMetricsSource) and a Warning Event on a service whose
    autoscaled tiers have no Prometheus to read: once per generation. A tick that finds the
    condition there for the service's generation (its watch's latest body), or that this
    process wrote it for that generation, sends nothing."""
    if context.ticker.reported_for(body):
        return
    if no_metrics_source_recorded(body):
        context.ticker.reported(body)
        return
    service = _parsed(body)
    if service is None:
        return
    condition = no_metrics_source_condition(service, context.clock().replace(microsecond=0))
    if condition is not None:
        context.actuator.record_no_source(
            service, condition, condition.last_transition_time, dict(body)
        )
    context.ticker.reported(body)  # written, or found there by the write's fresh read


def reconcile(context: OperatorContext, body: kopf.Body, retry: int, reason: str) -> None:
    """A full reconcile of a created, changed or resumed service (kopf's ``reason``)."""

    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message)

    started = time.monotonic()
    try:
        # A retry of a create may follow a pass that applied part of the plan: it lists.
        new = reason == kopf.Reason.CREATE and retry == 0
        result = context.reconciler.reconcile(plain(body), emit, new=new)
    except KubeError as exc:
        metrics.RECONCILE_ERRORS.inc()
        if exc.retryable:
            raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from exc
        raise kopf.PermanentError(str(exc)) from exc
    finally:
        metrics.RECONCILE_DURATION.observe(time.monotonic() - started)
    outcome = "refused" if result.refusal else "applied" if result.applied else "unchanged"
    if not result.refusal and loads_adapters_at_run_time(body):
        # A changed adapter list changes no pod: the engines hear of it from here.
        context.adapter_syncs.mark((body.metadata.namespace, body.metadata.name))
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


def _parsed(body: Mapping[str, Any] | None) -> InferenceService | None:
    if body is None:
        return None
    try:
        return parse_service(body)
    except InvalidManifestError:
        return None  # the service handler reports it; nothing else can fix it


def refresh(context: OperatorContext, key: Hashable) -> None:
    """A service's status again, after its children changed."""
    namespace, service_name = cast(tuple[str, str], key)
    # The service as its watch last delivered it, else read: a stale one only costs the
    # status write a conflict (it carries the resourceVersion) and a fresh read.
    body = context.ticker.latest(namespace, service_name) or context.kube.get(
        "InferenceService", namespace, service_name
    )
    service = _parsed(body)
    if body is None or service is None:
        return
    try:
        context.reconciler.refresh_status(service, body)
    except KubeError as exc:
        if not exc.conflict:  # a conflict means a newer write; the next event retries
            raise


def reconcile_again(context: OperatorContext, key: Hashable) -> None:
    """Reconcile a service on what no spec change announces: a model download Job finished
    (its engine Deployments waited for it), a new cold start was recorded (the router's
    config carries it), or the engines rolled out to the downloads the model cache keeps
    (its GC Job waited for that)."""
    namespace, service_name = cast(tuple[str, str], key)
    kube = context.kube
    body = kube.get("InferenceService", namespace, service_name)
    service = _parsed(body)
    if body is None or service is None:
        return

    def emit(kind: str, reason: str, message: str) -> None:
        post_event(
            kube, service, reason=reason, message=message, kind=kind,
            component="fleetpilot-operator",
        )  # fmt: skip

    context.reconciler.reconcile(body, emit)


def sync_adapters(context: OperatorContext, key: Hashable) -> None:
    namespace, service_name = cast(tuple[str, str], key)
    body = context.ticker.latest(namespace, service_name)
    if body is None or not loads_adapters_at_run_time(body):
        return
    service = _parsed(body)
    if service is not None:
        adapter_loading.sync_service(context.kube, context.adapter_client, service)


async def watch_node_memory(context: OperatorContext) -> None:
    """Every NODE_MEMORY_TTL_S, read the nodes' memory again; when it changed (a larger node
    joined, one left), plan again every service whose latest plan was refused: nothing else
    announces that a pod no node could hold now fits."""
    reader = context.node_memory
    if reader is None:
        return
    seen = reader.changes
    while True:
        await asyncio.sleep(NODE_MEMORY_TTL_S)
        await asyncio.to_thread(reader.refresh)
        if reader.changes == seen:
            continue
        seen = reader.changes
        for key in context.reconciler.refused():
            context.rereconciles.mark(key)


async def resync_adapters(context: OperatorContext) -> None:
    """Every RESYNC_S, sync every dynamic-LoRA service (what no event announces)."""
    ticker = context.ticker
    while True:
        await asyncio.sleep(adapter_loading.RESYNC_S)
        for namespace, name in ticker.services:
            body = ticker.latest(namespace, name)
            if body is not None and loads_adapters_at_run_time(body):
                context.adapter_syncs.mark((namespace, name))


def attach_indexes(context: OperatorContext, kwargs: Mapping[str, Any]) -> None:
    # kopf hands its indexes only to handlers; the status refreshes run outside them.
    context.children.attach(
        kwargs[DEPLOYMENTS_INDEX], kwargs[PODS_INDEX], kwargs.get(LEADER_WORKER_SETS_INDEX)
    )


def fetch_job_changed(
    context: OperatorContext, namespace: str | None, labels: Mapping[str, str], job: Obj
) -> None:
    """A download finished (its held engines may go now) or changed (ModelReady)."""
    service_name = labels.get(names.LABEL_SERVICE)
    if not namespace or not service_name:
        return
    if job_complete(job) or job_failed(job) is not None:
        context.rereconciles.mark((namespace, service_name))
    context.refreshes.mark((namespace, service_name))


def child_changed(
    context: OperatorContext, namespace: str | None, labels: Mapping[str, str], kind: str | None
) -> None:
    """A workload or pod of a service changed: its status is refreshed (queued)."""
    service_name = labels.get(names.LABEL_SERVICE)
    if not service_name or not namespace:
        return
    # A burst of child events (a rollout, a thousand services at once) is one refresh
    # queued or running and at most one behind it, reading the final state.
    context.refreshes.mark((namespace, service_name))
    if kind == "Pod":
        # A replica that turned Ready holds no adapters yet (sync_adapters skips services
        # without lora.dynamic at once).
        context.adapter_syncs.mark((namespace, service_name))


# -- the registry --------------------------------------------------------------------------


def build_registry(
    *,
    fleetpilot_image: str = DEFAULT_FLEETPILOT_IMAGE,
    reference_image: str = DEFAULT_REFERENCE_IMAGE,
    kubeconfig: str | None = None,
    prometheus_url: str | None = None,
    leader_worker_sets: bool | None = None,
    inference_pools: bool | None = None,
    clock: Clock = wall_clock,
) -> kopf.OperatorRegistry:
    """A fresh registry (not kopf's global one), so tests can run operators side by side.

    ``leader_worker_sets``: whether the cluster serves LeaderWorkerSet; None asks it, here,
    before kopf runs (the answer also sets PlanOptions.leader_worker_set_available). Its index
    and watch handler are registered only where it is served: conditional registration, not
    kopf's own handling of absent resources. kopf would cope with a handler for a resource the
    cluster lacks - it watches nothing for it, keeps its index empty, and does not wait for
    that index before running handlers (kopf._core.reactor.observation, orchestration) - but
    it logs a warning, "Unresolved resources cannot be served (try creating their CRDs)", at
    every start and again on every CRD change in the cluster (it rescans on each), and it
    would start watching a CRD installed later while the reconciler, whose options are fixed
    at start, still refuses multi-node roles until a restart. Nor can the choice wait for the
    startup handler: kopf creates its index stores from the registry before it runs startup
    handlers (kopf._core.reactor.running: ``indexers.ensure``), so an index registered there
    would have none. ``inference_pools`` likewise, for the InferencePool watch that refreshes
    a service's GatewayAccepted when a gateway writes the pool's status.
    """
    if leader_worker_sets is None or inference_pools is None:
        kube = Kube(connect(kubeconfig))
        if leader_worker_sets is None:
            leader_worker_sets = serves_leader_worker_sets(kube)
        if inference_pools is None:
            inference_pools = kube.serves(*OPTIONAL_KINDS["InferencePool"])
    config = OperatorConfig(
        fleetpilot_image=fleetpilot_image,
        reference_image=reference_image,
        kubeconfig=kubeconfig,
        prometheus_url=prometheus_url,
        leader_worker_sets=leader_worker_sets,
        inference_pools=inference_pools,
        clock=clock,
    )
    registry = kopf.OperatorRegistry()
    _register_lifecycle(registry, config)
    _register_services(registry)
    _register_indexes(registry, leader_worker_sets)
    _register_children(registry, leader_worker_sets, inference_pools)
    return registry


def _register_lifecycle(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own login handler lives in its global registry, which this one replaces.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings)
        context = await asyncio.to_thread(start_context, config)  # blocking API calls
        memo[CONTEXT] = context
        context.tasks.append(asyncio.create_task(context.ticker.run(), name="autoscaler"))
        context.tasks.append(asyncio.create_task(resync_adapters(context), name="adapter-resync"))
        context.tasks.append(asyncio.create_task(watch_node_memory(context), name="node-memory"))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        context: OperatorContext | None = memo.get(CONTEXT)
        if context is not None:
            await context.close()


def _register_services(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry)
    def reconcile_service(
        body: kopf.Body, memo: kopf.Memo, retry: int, reason: str, **kwargs: Any
    ) -> None:
        # Its name is its handler id, which kopf's progress annotations on the service carry.
        context = context_of(memo)
        attach_indexes(context, kwargs)
        reconcile(context, body, retry, reason)

    # Async (run in kopf's loop, not its thread pool): it only records, and must not wait
    # behind reconciles for a thread.
    @kopf.on.event(GROUP, VERSION, PLURAL, id=SERVICE_EVENT, registry=registry)
    async def service_event(
        event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any
    ) -> None:
        service = plain(body)
        context = context_of(memo)
        context.ticker.observe(event.get("type"), service)
        if event.get("type") == "DELETED":
            metrics.forget(body.metadata.namespace or "", body.metadata.name or "")
            context.reconciler.forget(body.metadata.namespace or "", body.metadata.name or "")
        else:
            metrics.export_status(service)


def _register_indexes(registry: kopf.OperatorRegistry, leader_worker_sets: bool) -> None:
    """Every Deployment, LeaderWorkerSet and pod of a service, kept by kopf from their
    watches (operator.children). Async: an index handler runs on every event of its kind, in
    kopf's loop."""

    @kopf.index(
        "apps", "v1", "deployments",
        labels={names.LABEL_MANAGED_BY: names.MANAGER}, id=DEPLOYMENTS_INDEX, registry=registry,
    )  # fmt: skip
    async def deployments_by_service(body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return index_entry("Deployment", body)

    @kopf.index(
        "", "v1", "pods",
        labels={names.LABEL_SERVICE: kopf.PRESENT}, id=PODS_INDEX, registry=registry,
    )  # fmt: skip
    async def pods_by_service(body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return index_entry("Pod", body)

    if leader_worker_sets:

        @kopf.index(
            LWS_GROUP, LWS_VERSION, LWS_PLURAL,
            labels={names.LABEL_MANAGED_BY: names.MANAGER}, id=LEADER_WORKER_SETS_INDEX,
            registry=registry,
        )  # fmt: skip
        async def leader_worker_sets_by_service(body: kopf.Body, **_: Any) -> dict[Any, Any]:
            return index_entry("LeaderWorkerSet", body)


def _register_children(
    registry: kopf.OperatorRegistry, leader_worker_sets: bool, inference_pools: bool
) -> None:
    """The children's watch events. Async (run in kopf's loop, not its thread pool): they
    only record and mark, and must not wait behind reconciles for a thread."""

    @kopf.on.event(
        "batch", "v1", "jobs",
        labels={names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_COMPONENT: FETCH_COMPONENT},
        id=FETCH_JOB_CHANGED, registry=registry,
    )  # fmt: skip
    async def fetch_job_handler(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo, **_: Any
    ) -> None:
        fetch_job_changed(context_of(memo), namespace, labels, plain(body))

    @kopf.on.event(
        "apps", "v1", "deployments",
        labels={names.LABEL_MANAGED_BY: names.MANAGER}, id=DEPLOYMENT_CHANGED, registry=registry,
    )  # fmt: skip
    @kopf.on.event(
        "", "v1", "pods",
        labels={names.LABEL_SERVICE: kopf.PRESENT}, id=POD_CHANGED, registry=registry,
    )  # fmt: skip
    async def child_handler(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, memo: kopf.Memo, **kwargs: Any
    ) -> None:
        context = context_of(memo)
        attach_indexes(context, kwargs)
        child_changed(context, namespace, labels, body.get("kind"))

    if leader_worker_sets:
        # A multi-node role's groups coming Ready (or going) show first on its LeaderWorkerSet.
        kopf.on.event(
            LWS_GROUP, LWS_VERSION, LWS_PLURAL,
            labels={names.LABEL_MANAGED_BY: names.MANAGER}, id=LEADER_WORKER_SET_CHANGED,
            registry=registry,
        )(child_handler)  # fmt: skip

    if inference_pools:
        # A gateway accepting (or refusing) a service's pool writes the pool's status.
        @kopf.on.event(
            INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION, OPTIONAL_KINDS["InferencePool"][1],
            labels={names.LABEL_MANAGED_BY: names.MANAGER}, id=INFERENCE_POOL_CHANGED,
            registry=registry,
        )  # fmt: skip
        async def inference_pool_handler(
            namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
        ) -> None:
            child_changed(context_of(memo), namespace, labels, "InferencePool")
