"""One reconcile of one InferenceService: plan, apply what changed, prune, report status.

The I/O shell around the pure planner and status computation. Never half-applies: a spec the
planner refuses changes no child object and only reports Degraded. Idempotent: with nothing
changed it performs no write at all (the tests count them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from fleetpilot.api import KIND, InferenceService, InvalidManifestError, parse_service
from fleetpilot.api.spec import AutoscalingMode
from fleetpilot.api.status import InferenceServiceStatus
from fleetpilot.kube import names
from fleetpilot.kube.client import Kube, KubeError, Obj
from fleetpilot.kube.managers import OPERATOR_MANAGER, owns_field
from fleetpilot.kube.status import StatusWrite, update_status
from fleetpilot.operator import metrics
from fleetpilot.operator.children import WORKLOAD_KINDS, Children
from fleetpilot.operator.cold_start import new_samples
from fleetpilot.operator.drift import needs_apply, with_hash
from fleetpilot.operator.gateway_objects import inference_pool_name
from fleetpilot.operator.gateway_status import GatewayObserved
from fleetpilot.operator.model_cache import (
    PROGRESS_LOG_LINES,
    DownloadProgress,
    download_progress,
    job_complete,
)
from fleetpilot.operator.node_memory import NodeMemoryReader
from fleetpilot.operator.plan_types import (
    Dependency,
    JobComplete,
    PlanOptions,
    Refusal,
    ServicePlan,
)
from fleetpilot.operator.planner import all_roles, plan_service
from fleetpilot.operator.status import Observed, WorkloadKey, compute_status
from fleetpilot.operator.waits import due, unmet

log = logging.getLogger(__name__)
# The Job controller's label on the pods of a Job (Kubernetes 1.27 and later).
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"

# What a service may own, in apply order; prune looks at each of these kinds.
MANAGED_KINDS = (
    "NetworkPolicy",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "PersistentVolumeClaim",
    "Job",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
)
# Kinds of optional CRDs, managed only where the cluster serves them (detected at start):
# PodMonitor (the Prometheus Operator's), LeaderWorkerSet (a multi-node role's workload),
# InferencePool and HTTPRoute (``routing.gateway``: the Inference Extension's, the Gateway API's).
OPTIONAL_KINDS = {
    "PodMonitor": ("monitoring.coreos.com/v1", "podmonitors"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io/v1", "leaderworkersets"),
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
}

EventSink = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)
# What time it is: the reconciler stamps conditions with it (tests set it).
Clock = Callable[[], datetime]


def wall_clock() -> datetime:
    return datetime.now(UTC)


def _no_events(kind: str, reason: str, message: str) -> None:
    del kind, reason, message


@dataclass
class ReconcileResult:
    applied: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)
    # Why the spec was not planned (an invalid manifest, the planner's PlanError); None when
    # it was.
    refusal: Refusal | None = None
    status_written: bool = False
    # The planned objects held back, by (kind, name), with what they still wait for.
    held: dict[tuple[str, str], list[Dependency]] = field(default_factory=dict)

    @property
    def waiting_for_model(self) -> dict[str, str]:
        """Engine workloads held back until their model's downloads complete, by name, with
        the Jobs."""
        return {
            name: ", ".join(w.job for w in waits if isinstance(w, JobComplete))
            for (kind, name), waits in self.held.items()
            if kind in WORKLOAD_KINDS
        }

    @property
    def waiting_to_collect(self) -> list[str]:
        """What the model cache's GC Job (the one Job that waits), held back, waits for."""
        return [str(w) for (kind, _), waits in self.held.items() if kind == "Job" for w in waits]


# kopf truncates an Event's message to 1,024 characters; a summary stays under it.
EVENT_MESSAGE_MAX = 1000


def change_summary(verb: str, keys: list[tuple[str, str]]) -> str:
    """One Event's message for every object a reconcile changed one way, by kind:
    "created Deployment chat-small, chat-router; Service chat-small". One Event per
    reconcile and verb, not one per object: a thousand services created at once would
    otherwise post a dozen Events each, as many API writes as the objects themselves."""
    by_kind: dict[str, list[str]] = {}
    for kind, name in keys:
        by_kind.setdefault(kind, []).append(name)
    message = f"{verb} " + "; ".join(
        f"{kind} {', '.join(names)}" for kind, names in by_kind.items()
    )
    if len(message) <= EVENT_MESSAGE_MAX:
        return message
    counts = ", ".join(f"{len(names)} {kind}" for kind, names in by_kind.items())
    return f"{verb} {len(keys)} objects: {counts}"[:EVENT_MESSAGE_MAX]


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _autoscaled_workloads(service: InferenceService) -> set[WorkloadKey]:
    """Engine workloads (kind, name) whose replicas a scaler owns once created: fleetpilot's
    autoscaler (auto, recommend) or an HPA/KEDA (external) - every mode but disabled. Both
    kinds scale through their ``/scale`` subresource."""
    return {
        names.engine_workload(service.name, role)
        for role in all_roles(service)
        if role.tier.autoscaling.mode is not AutoscalingMode.DISABLED
    }


def settle_replicas(desired: Obj, live: Obj | None, autoscaled: bool) -> Obj:
    """Decide whether this apply writes ``spec.replicas`` of an engine workload (a Deployment,
    or a LeaderWorkerSet, whose replicas are groups).

    The autoscaler owns replicas through its own field manager. The operator writes them on
    creation, and keeps writing the live value only while it is still their sole owner
    (omitting a field one owns makes server-side apply delete it). Once the autoscaler has
    scaled, the operator's applies leave replicas out, so a re-applied spec never resets them.
    """
    if live is None or not autoscaled:
        return desired
    spec = dict(desired["spec"])
    if owns_field(live, OPERATOR_MANAGER, ("spec", "replicas")):
        spec["replicas"] = live.get("spec", {}).get("replicas", spec["replicas"])
    else:
        spec.pop("replicas", None)
    return {**desired, "spec": spec}


def _owned_by(obj: Obj, uid: str | None) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences", []) or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


class Reconciler:
    """Reconciles services through one :class:`Kube` connection."""

    def __init__(
        self,
        kube: Kube,
        options: PlanOptions | None = None,
        children: Children | None = None,
        clock: Clock = wall_clock,
        node_memory: NodeMemoryReader | None = None,
    ) -> None:
        self.kube = kube
        self.options = options or PlanOptions()
        # The cluster's nodes' memory, which each plan is checked against (refreshed at most
        # once a minute); None: not checked.
        self.node_memory = node_memory
        # The watched workloads and pods (operator.children); without them, listed.
        self.children = children
        self.clock = clock
        # Called with (namespace, name) when a status write recorded a new cold start: the
        # router's config carries the observed cold start (its hold for a tier at zero), and
        # only a reconcile rewrites it.
        self.on_cold_start: Callable[[str, str], None] | None = None
        # Called with (namespace, name) when a status write finds a planned object held back
        # (the model cache's GC Job) waiting for nothing any more but not applied: the end of
        # an engine rollout, which it waits for, reaches the operator as a workload's status
        # change, and only a reconcile applies the object.
        self.on_collection_due: Callable[[str, str], None] | None = None
        # The latest plan of each service (its outline), with the uid and generation it was
        # planned for: a status refresh reuses it rather than plan the same spec again.
        self._plans: dict[tuple[str, str], tuple[tuple[str | None, int | None], ServicePlan]] = {}

    def managed_kinds(self) -> tuple[str, ...]:
        """MANAGED_KINDS, and the optional kinds the cluster serves."""
        kinds: tuple[str, ...] = MANAGED_KINDS
        if self.options.leader_worker_set_available:
            at = kinds.index("Deployment") + 1
            kinds = (*kinds[:at], "LeaderWorkerSet", *kinds[at:])
        if self.options.pod_monitor_available:
            kinds = (*kinds, "PodMonitor")
        if self.options.inference_pools_available:
            kinds = (*kinds, "InferencePool")
        if self.options.http_routes_available:
            kinds = (*kinds, "HTTPRoute")
        return kinds

    def _list(self, kind: str, namespace: str, selector: dict[str, str]) -> list[Obj]:
        """The service's children of one kind; none of an optional kind whose CRD is gone (or
        was never there, for a reconciler that assumes it): an uninstalled PodMonitor or
        LeaderWorkerSet CRD must not fail every reconcile until the operator restarts."""
        try:
            return self.kube.list(kind, namespace, selector)
        except KubeError as exc:
            if kind in OPTIONAL_KINDS and exc.not_found:
                return []
            raise

    def live_children(self, namespace: str, service: str) -> dict[tuple[str, str], Obj]:
        selector = {names.LABEL_SERVICE: service, names.LABEL_MANAGED_BY: names.MANAGER}
        live: dict[tuple[str, str], Obj] = {}
        for kind in self.managed_kinds():
            for obj in self._list(kind, namespace, selector):
                live[_key(obj)] = obj
        return live

    def reconcile(
        self, body: Obj, emit: EventSink = _no_events, *, new: bool = False
    ) -> ReconcileResult:
        """Bring the children of ``body`` (an InferenceService object) in line with its spec.

        ``new``: nothing was ever reconciled for this service (kopf's create cause, first
        try), so it owns no child yet and none is listed: one LIST per managed kind, ten, was
        a fifth of the operator's requests while a thousand services were created at once,
        each scanning the namespace on the API server for nothing. Should an earlier pass have
        applied children and died before kopf recorded it, this one applies them again (the
        same objects) and the next reconcile prunes what it left."""
        result = ReconcileResult()
        meta = body.get("metadata", {})
        namespace, name = meta.get("namespace", "default"), meta.get("name", "")
        try:
            service = parse_service(body, f"{namespace}/{name}")
        except InvalidManifestError as exc:
            result.refusal = Refusal("; ".join(str(p) for p in exc.problems))
            self._refused(result.refusal, namespace, name, emit)
            return result
        planned = self.plan(service)
        if planned.refusal is not None:
            result.refusal = planned.refusal
            self._refused(planned.refusal, namespace, name, emit)
            result.status_written = self.write_status(service, body, planned)
            return result

        live = {} if new else self.live_children(namespace, name)
        jobs = {n: o for (k, n), o in live.items() if k == "Job"}
        changed = self._apply(service, planned, live, jobs, result)
        pruned = self._prune(service, planned, live, result)
        for reason, keys in changed.items():
            if keys:
                emit("Normal", reason, change_summary(reason.lower(), keys))
        if pruned:
            emit("Normal", "Pruned", change_summary("deleted (no longer planned)", pruned))
        if result.waiting_for_model:
            held = ", ".join(f"{d} (Job {j})" for d, j in sorted(result.waiting_for_model.items()))
            emit("Normal", "WaitingForModel", f"engine workloads wait for their model: {held}")
        applied = {key: obj for key, obj in changed.written.items() if key[0] in WORKLOAD_KINDS}
        # With the Jobs just applied: a GC Job this pass applied is there, not due again.
        jobs |= {n: obj for (kind, n), obj in changed.written.items() if kind == "Job"}
        result.status_written = self.write_status(service, body, planned, applied, jobs)
        return result

    def _refused(self, refusal: Refusal, namespace: str, name: str, emit: EventSink) -> None:
        emit("Warning", refusal.reason, refusal.message)
        log.warning(
            "plan refused",
            extra={
                "service": f"{namespace}/{name}",
                "reason": refusal.reason,
                "refusal": refusal.message,
            },
        )

    def _apply(
        self,
        service: InferenceService,
        planned: ServicePlan,
        live: Mapping[tuple[str, str], Obj],
        jobs: Mapping[str, Obj],
        result: ReconcileResult,
    ) -> _Changes:
        """Apply, in plan order, every planned object that differs from its live one and
        waits for nothing unmet; hold back the others (an existing one keeps what it has)."""
        autoscaled = _autoscaled_workloads(service)
        changes = _Changes()
        # The objects this pass left as planned (applied, or found so), as the API server
        # answered: what a later object's wait for a rollout reads.
        as_planned: dict[tuple[str, str], Obj] = {}
        for item in planned.objects:
            key = item.key
            waiting = unmet(item.waits_for, jobs, as_planned)
            if waiting:
                result.held[key] = waiting
                continue
            current = live.get(key)
            desired = item.obj
            if key[0] in WORKLOAD_KINDS:
                desired = settle_replicas(desired, current, key in autoscaled)
            desired = with_hash(desired)
            if not needs_apply(desired, current):
                assert current is not None
                as_planned[key] = current
                continue
            written = self.kube.apply(desired, OPERATOR_MANAGER)
            as_planned[key] = changes.written[key] = written
            changes["Created" if current is None else "Updated"].append(key)
            result.applied.append(f"{key[0]}/{key[1]}")
        return changes

    def _prune(
        self,
        service: InferenceService,
        planned: ServicePlan,
        live: Mapping[tuple[str, str], Obj],
        result: ReconcileResult,
    ) -> list[tuple[str, str]]:
        """Delete the service's children no longer planned (held ones are still planned)."""
        wanted = {item.key for item in planned.objects}
        pruned: list[tuple[str, str]] = []
        for key, obj in live.items():
            stale = key not in wanted and _owned_by(obj, service.metadata.uid)
            if stale and self.kube.delete(key[0], service.namespace, key[1]):
                pruned.append(key)
                result.pruned.append(f"{key[0]}/{key[1]}")
        return pruned

    def plan(self, service: InferenceService) -> ServicePlan:
        """The service planned once for this pass (its refusal included); its outline is kept
        for the status refreshes of the same spec."""
        options = self.options
        if self.node_memory is not None:
            options = self.node_memory.options(options, service)
        planned = plan_service(service, options)
        spec = (service.metadata.uid, service.metadata.generation)
        self._plans[(service.namespace, service.name)] = (spec, planned.outline())
        return planned

    def known_plan(self, service: InferenceService) -> ServicePlan:
        """The outline of the service's latest plan, if it was made for this spec (same uid
        and generation: the plan's refusal, downloads, sizes and waits follow from the spec
        alone); else the service planned now."""
        known = self._plans.get((service.namespace, service.name))
        spec = (service.metadata.uid, service.metadata.generation)
        if known is not None and known[0] == spec and spec[1] is not None:
            return known[1]
        return self.plan(service)

    def refused(self) -> list[tuple[str, str]]:
        """The services (namespace, name) whose latest plan was refused: what a change in the
        cluster (its nodes' memory) may now let through."""
        plans = list(self._plans.items())  # a copy: reconciles in other threads add to it
        return sorted(key for key, (_, outline) in plans if outline.refusal)

    def forget(self, namespace: str, name: str) -> None:
        """A deleted service's kept plan."""
        self._plans.pop((namespace, name), None)

    def refresh_status(self, service: InferenceService, body: Obj) -> bool:
        """The status again after a child changed, still saying whether the latest spec's plan
        was refused: a refresh that forgot it would report the old children as the service's
        state and clear Stalled and Degraded. The reconcile of the spec planned it already."""
        return self.write_status(service, body, self.known_plan(service))

    def observe(
        self,
        service: InferenceService,
        applied: Mapping[WorkloadKey, Obj] | None = None,
        jobs: Mapping[str, Obj] | None = None,
        progress: Mapping[str, DownloadProgress] | None = None,
    ) -> Observed:
        """The service's workloads and pods: as watched, with the workloads this reconcile
        just wrote as the API server answered (their watch events may not be in yet), or
        listed when the operator runs without watches; and its model cache's ``jobs`` and
        their ``progress``, as read for this status."""
        jobs, progress = jobs or {}, progress or {}
        gateway = self._gateway_observed(service)
        watched = self.children.observed(service.namespace, service.name) if self.children else None
        if watched is not None:
            workloads = {**watched.workloads, **(applied or {})}
            return Observed(workloads, watched.pods, jobs, progress, gateway)
        selector = {names.LABEL_SERVICE: service.name, names.LABEL_MANAGED_BY: names.MANAGER}
        managed = self.managed_kinds()
        workloads = {
            _key(w): w
            for kind in WORKLOAD_KINDS
            if kind in managed
            for w in self._list(kind, service.namespace, selector)
        }
        pods = self.kube.list("Pod", service.namespace, {names.LABEL_SERVICE: service.name})
        return Observed(workloads, pods, jobs, progress, gateway)

    def _gateway_observed(self, service: InferenceService) -> GatewayObserved:
        """The service's live InferencePool and the gateway kinds the cluster lacks; nothing
        read for a service without ``routing.gateway``."""
        if service.spec.routing.gateway is None:
            return GatewayObserved()
        served = {
            "InferencePool": self.options.inference_pools_available,
            "HTTPRoute": self.options.http_routes_available,
        }
        missing = tuple(kind for kind, available in served.items() if not available)
        pool = None
        if self.options.inference_pools_available:
            pool = self.kube.get(
                "InferencePool", service.namespace, inference_pool_name(service.name)
            )
        return GatewayObserved(pool, missing)

    def _cache_jobs(self, service: InferenceService) -> dict[str, Obj]:
        """The service's live Jobs (the model cache's downloads and GC), by name; none listed
        for a service without a cache."""
        if service.spec.model_cache is None:
            return {}
        selector = {names.LABEL_SERVICE: service.name, names.LABEL_MANAGED_BY: names.MANAGER}
        return {
            j["metadata"]["name"]: j for j in self.kube.list("Job", service.namespace, selector)
        }

    def _download_progress(
        self, service: InferenceService, planned: ServicePlan, jobs: Mapping[str, Obj]
    ) -> dict[str, DownloadProgress]:
        """How far each running download is, by Job, from the last progress line its running
        pod logged; a download whose log cannot be read (no pod running yet, no ``pods/log``
        permission) is shown without it - never a reason to fail the status write."""
        progress: dict[str, DownloadProgress] = {}
        for download in planned.downloads:
            name = download.job
            live = jobs.get(name)
            if live is None or job_complete(live) or not (live.get("status") or {}).get("active"):
                continue
            try:
                pods = self.kube.list("Pod", service.namespace, {JOB_NAME_LABEL: name})
                running = [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]
                for pod in running[-1:]:
                    pod_name = pod["metadata"]["name"]
                    log_text = self.kube.pod_log(service.namespace, pod_name, PROGRESS_LOG_LINES)
                    seen = download_progress(log_text or "")
                    if seen is not None:
                        progress[name] = seen
            except KubeError as exc:
                log.debug("download progress unread", extra={"job": name, "error": str(exc)})
        return progress

    def write_status(
        self,
        service: InferenceService,
        body: Obj,
        planned: ServicePlan,
        applied: Mapping[WorkloadKey, Obj] | None = None,
        jobs: Mapping[str, Obj] | None = None,
    ) -> bool:
        """Patch the status subresource if (and only if) it changed; whether it was written.

        ``planned``: this pass's plan of the service (its refusal, downloads and sizes).
        ``jobs``: the service's live Jobs by name, when the pass has just listed them.
        Child events refresh status concurrently and the autoscaler writes its own parts of
        it; a write that lost the race (409) is computed again on the fresh object, so the
        newest observation lands and no one else's fields are lost.
        """

        computed: list[tuple[InferenceServiceStatus | None, InferenceServiceStatus]] = []
        observations: list[Observed] = []
        if jobs is None:
            jobs = self._cache_jobs(service)
        progress = self._download_progress(service, planned, jobs)

        def mutate(live: Obj) -> Obj:
            previous = _parse_status(live.get("status") or None)
            now = self.clock().replace(microsecond=0)
            observations.append(self.observe(service, applied, jobs, progress))
            status = compute_status(
                service,
                observations[-1],
                previous,
                now,
                planned.refusal,
                downloads=planned.downloads,
                capacities=planned.capacities,
            )
            computed.append((previous, status))
            return status.to_wire()

        outcome = update_status(
            self.kube,
            KIND,
            service.namespace,
            service.name,
            mutate,
            manager=OPERATOR_MANAGER,
            live=body,
        )
        if outcome is StatusWrite.WRITTEN:
            # The starts this write recorded, each observed once: by the write that added it.
            added = new_samples(*computed[-1])
            metrics.observe_cold_starts(service.namespace, service.name, added)
            if added and self.on_cold_start is not None:
                self.on_cold_start(service.namespace, service.name)
        collect = self.on_collection_due
        if collect and observations and planned.refusal is None:
            seen = observations[-1]
            present = {**seen.workloads, **{("Job", n): j for n, j in jobs.items()}}
            if due(planned, present, jobs):
                collect(service.namespace, service.name)
        return outcome is StatusWrite.WRITTEN


class _Changes(dict[str, list[tuple[str, str]]]):
    """What an apply pass changed: the keys it created and updated (by Event reason), and
    every object it wrote, as the API server answered."""

    def __init__(self) -> None:
        super().__init__(Created=[], Updated=[])
        self.written: dict[tuple[str, str], Obj] = {}


def _parse_status(raw: Obj | None) -> InferenceServiceStatus | None:
    if not raw:
        return None
    try:
        return InferenceServiceStatus.model_validate(raw, by_alias=True)
    except ValueError:
        # A status written by an older operator (or by hand) is recomputed from scratch.
        return None


__all__ = ["KubeError", "ReconcileResult", "Reconciler", "settle_replicas"]
