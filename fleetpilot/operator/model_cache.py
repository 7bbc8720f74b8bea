"""The service's model cache: its PersistentVolumeClaim and the Jobs that fill it. Purely
computational.

Why per service (``spec.modelCache``) and not a cluster-scoped ModelCache object: a PVC is
namespaced and a pod can mount only claims of its own namespace, so a cluster-wide object would
still need a claim per namespace, and its lifetime would no longer follow anything GitOps
declares; with the cache in the service, the claim is created, owned and garbage-collected with
it. Services that should share one cache name an existing ReadWriteMany claim (``claimName``).

One Job per distinct download (a Hub repo at a revision, or an S3 location), named by a digest of
its pod spec: the same model in two tiers is fetched once, a changed revision (or fetcher image)
is a new Job beside the old one, and a Job is never patched (its pod template is immutable).
The engine Deployments of a tier are applied only once its Job has completed
(:func:`job_complete`), so a changed revision keeps the old engines serving until the new weights
are on the volume, then rolls the tier.

Garbage collection (:func:`collection_job`): the old revision's files stay on the volume once its
Job is pruned; a GC Job (``fleetpilot model gc``) removes from the cache every download but the
ones the service plans now. Named by a digest of its container like the fetch Jobs, it runs once
per kept set. Only for a claim the operator created (``size``): a named claim (``claimName``)
may be shared, and the downloads other services read there are not in this service's plan.

When it may run. The downloads being complete (what the planner says the engines wait for,
:class:`~fleetpilot.operator.plan_types.JobComplete`) is not enough: at that moment the tier
starts to roll, and the old revision's pods keep serving until their replacements are up. An
engine reads its weights when it starts, so a running one loses nothing when they are deleted
(its open files live on), but one that starts again - a container restarted after a crash or a
failed liveness probe, a pod of the old ReplicaSet recreated during the roll, or a roll that
never completes because the new revision fails to start, leaving the old pods as the only ones
serving - would find its snapshot gone. So the GC Job also waits until every engine workload of
the service is rolled out (:class:`~fleetpilot.operator.plan_types.RolledOut`): applied as
planned, so it reads only kept downloads, and no pod of an older template is left
(:func:`rolled_out`). The end of a rollout is seen by the status refresh, which asks for a
reconcile then (``Reconciler.on_collection_due``). A rollback to the old revision after the GC
ran downloads it again. Left open: a GC Job still running when the kept set changes is pruned
(its pod stopped) while the new download starts. In that short overlap it may remove files of
the new download that were on the volume when it scanned it (never later ones); the download's
verification then finds them missing, and its Job retries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import HuggingFaceSource, Tier
from fleetpilot.api.status import Condition, ConditionStatus, ConditionType
from fleetpilot.kube import names
from fleetpilot.operator.model_delivery import (
    CACHE_MOUNT,
    HUB_CACHE_DIR,
    S3_CACHE_DIR,
    cache_claim_name,
    cache_volume,
    cached,
    hub_endpoint_env,
    s3_credentials_env,
    s3_fetch_args,
    s3_key,
    token_env,
)
from fleetpilot.operator.plan_types import Download, K8sObject, PlanOptions, object_meta
from fleetpilot.operator.pod_policy import container_security, pod_security

COMPONENT = "model-fetch"
# The GC Job's own: the fetch component selects the downloads (ModelReady, the Job watch).
GC_COMPONENT = "model-gc"


@dataclass(frozen=True)
class _Download:
    what: str  # for people: repo@revision, s3://bucket/prefix
    command: list[str]
    env: list[K8sObject]
    keep: tuple[str, str]  # what keeps it in the cache: ("--keep-hub"|"--keep-s3", value)


# A download interrupted by a node or network failure resumes where it stopped in the next pod.
FETCH_BACKOFF_LIMIT = 6
# Removing files fails only on a volume gone wrong; a retry or two covers a lost node.
GC_BACKOFF_LIMIT = 2
ANNOTATION_MODEL = "fleetpilot.dev/model"
# For people (kubectl describe), never read back: the operator acts on what the planner says
# each object waits for (plan_types.Planned.waits_for). On an engine Deployment (not its pod
# template: no rollout): the Jobs its weights come from, comma-separated. On the GC Job: every
# download Job, all of which it waits for.
ANNOTATION_FETCH_JOB = "fleetpilot.dev/model-fetch-job"
# On the GC Job: the engine Deployments that must be rolled out first, comma-separated.
ANNOTATION_AFTER_ROLLOUT = "fleetpilot.dev/after-rollout"


def cache_claim(service: InferenceService) -> K8sObject | None:
    """The claim the operator creates for the cache; none when the spec names its own."""
    cache = service.spec.model_cache
    if cache is None or cache.size is None:
        return None
    spec: K8sObject = {
        "accessModes": [cache.access_mode.value],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        spec["storageClassName"] = cache.storage_class_name
    labels = {**names.service_labels(service.name), names.LABEL_COMPONENT: "model-cache"}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": object_meta(service, cache_claim_name(service), labels),
        "spec": spec,
    }


def _hub_fetch(repo: str, revision: str | None, hub: HuggingFaceSource | None) -> _Download:
    command = ["fleetpilot", "model", "fetch", "hub", "--repo", repo]
    if revision:
        command += ["--revision", revision]
    command += ["--cache-dir", HUB_CACHE_DIR]
    # The fetcher's default revision is main: the GC keeps what the fetch wrote.
    what = f"{repo}@{revision or 'main'}"
    # The fetcher reads a mirror from HF_ENDPOINT (delivery.hub.hub_endpoint), as vLLM would.
    token = hub.token_secret_ref if hub is not None else None
    env = token_env(token) + hub_endpoint_env(hub)
    return _Download(what, command, env, ("--keep-hub", what))


def _downloads(service: InferenceService, tier: Tier) -> list[_Download]:
    """What the tier's engines read from the cache: its model, and a speculative draft model
    from the Hub (the engines read the Hub cache offline, so they could not fetch it)."""
    if not cached(service, tier):
        return []
    source = tier.model.source
    hub = source.huggingface
    if source.s3 is not None:
        s3 = source.s3
        fetches = [
            _Download(
                f"s3://{s3.bucket}/{s3.prefix}",
                s3_fetch_args(s3, f"{S3_CACHE_DIR}/{s3_key(s3)}"),
                s3_credentials_env(s3.credentials_secret_ref),
                ("--keep-s3", s3_key(s3)),
            )
        ]
    else:
        fetches = [_hub_fetch(tier.model.name, hub.revision if hub is not None else None, hub)]
    draft = tier.engine.speculative.model if tier.engine.speculative is not None else None
    if draft is not None and source.from_hub:
        # From the model's Hub (its mirror and token), at the default branch.
        fetches.append(_hub_fetch(draft, None, hub))
    return fetches


def _container(download: _Download, options: PlanOptions) -> K8sObject:
    return _cache_writer(
        "fetch",
        download.command,
        download.env,
        {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        options,
    )


def _cache_writer(
    name: str, command: list[str], env: list[K8sObject], resources: K8sObject, options: PlanOptions
) -> K8sObject:
    """A container of the fleetpilot image that writes to the cache (a fetch, the GC)."""
    return {
        "name": name,
        "image": options.fleetpilot_image,
        "command": command,
        "env": [{"name": "HOME", "value": "/tmp"}, *env],
        "resources": resources,
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security(read_only_root=True),
    }


def _job_name(service: InferenceService, container: K8sObject, kind: str = "fetch") -> str:
    """A Job named by a digest of what it runs: a changed command or image is a new Job."""
    digest = hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()[:10]
    return names.bounded_name(service.name, kind, digest)


def fetch_job_names(service: InferenceService, tier: Tier, options: PlanOptions) -> list[str]:
    """The Jobs that download what the tier's engines read from the cache (none without one)."""
    return [_job_name(service, _container(d, options)) for d in _downloads(service, tier)]


def fetch_jobs(service: InferenceService, options: PlanOptions) -> list[K8sObject]:
    """One Job per distinct download the service's tiers need, in tier order."""
    return [job for _, job in planned_downloads(service, options)]


def planned_downloads(
    service: InferenceService, options: PlanOptions
) -> list[tuple[Download, K8sObject]]:
    """Each distinct download the service's tiers need, with its Job, in tier order."""
    jobs: dict[str, tuple[Download, K8sObject]] = {}
    for tier in service.spec.tiers:
        for download in _downloads(service, tier):
            container = _container(download, options)
            name = _job_name(service, container)
            if name not in jobs:
                model = {ANNOTATION_MODEL: download.what}
                job = _job(service, name, COMPONENT, container, model, FETCH_BACKOFF_LIMIT)
                jobs[name] = (Download(name, download.what), job)
    return list(jobs.values())


def collection_job(
    service: InferenceService, options: PlanOptions, engines: Sequence[str], fetches: Sequence[str]
) -> K8sObject | None:
    """The Job that removes from the cache every download but those the service plans now
    (the fetch Jobs ``fetches``), to run once they are complete and the engine workloads
    ``engines`` are rolled out to them (the planner says so in what it waits for); none for a
    claim the operator did not create (see the module's docstring)."""
    cache = service.spec.model_cache
    if cache is None or cache.size is None:
        return None
    downloads = [d for tier in service.spec.tiers for d in _downloads(service, tier)]
    # Sorted and once each: the same kept set is the same command, whatever the tier order.
    kept = [arg for keep in sorted({d.keep for d in downloads}) for arg in keep]
    command = ["fleetpilot", "model", "gc", "--hub-cache-dir", HUB_CACHE_DIR]
    command += ["--s3-dir", S3_CACHE_DIR, *kept]
    resources = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
    container = _cache_writer("gc", command, [], resources, options)
    # For people (kubectl describe): what it waits for. The operator does not read them back.
    annotations = {ANNOTATION_AFTER_ROLLOUT: ",".join(engines)}
    if fetches:
        annotations[ANNOTATION_FETCH_JOB] = ",".join(fetches)
    name = _job_name(service, container, "model-gc")
    job = _job(service, name, GC_COMPONENT, container, {}, GC_BACKOFF_LIMIT)
    job["metadata"]["annotations"] = annotations
    return job


def _job(
    service: InferenceService,
    name: str,
    component: str,
    container: K8sObject,
    annotations: dict[str, str],
    backoff_limit: int,
) -> K8sObject:
    """A Job of the service writing to its cache; ``annotations`` on the Job and its pods."""
    labels = {**names.service_labels(service.name), names.LABEL_COMPONENT: component}
    meta = object_meta(service, name, labels)
    meta["annotations"] = annotations
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": backoff_limit,
            "template": {
                # Not the service label: status reads the service's pods as its engines.
                "metadata": {
                    "labels": {
                        names.LABEL_INSTANCE: service.name,
                        names.LABEL_COMPONENT: component,
                    },
                    "annotations": annotations,
                },
                "spec": {
                    "restartPolicy": "Never",
                    # A download or the GC never calls the Kubernetes API: no token to steal.
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security(),
                    "containers": [container],
                    "volumes": [
                        cache_volume(service, read_only=False),
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def job_complete(job: K8sObject | None) -> bool:
    """The Job finished successfully (its Complete condition, as the Job controller sets it)."""
    if job is None:
        return False
    conditions: list[dict[str, Any]] = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Complete" and c.get("status") == "True" for c in conditions)


def job_failed(job: K8sObject | None) -> str | None:
    """The Failed condition's message, when the Job gave up."""
    if job is None:
        return None
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return str(c.get("message") or c.get("reason") or "failed")
    return None


def rolled_out(workload: K8sObject | None) -> bool:
    """Whether an engine workload's controller has seen its spec and no pod of an older
    template is left (pods being deleted no longer start). A LeaderWorkerSet's rollout is
    read as a Deployment's: the same status fields, counting groups."""
    if workload is None:
        return False
    status = workload.get("status") or {}
    generation = workload.get("metadata", {}).get("generation") or 0
    if int(status.get("observedGeneration") or 0) < int(generation):
        return False
    return int(status.get("replicas") or 0) <= int(status.get("updatedReplicas") or 0)


# The fetcher's progress lines come one per file: the last few hold the latest counts.
PROGRESS_LOG_LINES = 20


@dataclass(frozen=True)
class DownloadProgress:
    """How far one download is, from its fetcher's last progress line."""

    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int

    def __str__(self) -> str:
        share = self.bytes_done / self.bytes_total if self.bytes_total else 1.0
        return (
            f"{_gib(self.bytes_done)} of {_gib(self.bytes_total)} GiB ({share:.0%}), "
            f"{self.files_done} of {self.files_total} files"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f}"


def download_progress(log: str) -> DownloadProgress | None:
    """The latest counts a fetcher's log reports (``fleetpilot model fetch``'s JSON lines,
    :mod:`fleetpilot.delivery.progress`); None when no line carries them yet."""
    for line in reversed(log.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        keys = ("bytes_done", "bytes_total", "files_done", "files_total")
        counts = [record.get(k) for k in keys]
        if all(type(c) is int and c >= 0 for c in counts):  # not bool, not float
            return DownloadProgress(*(int(c or 0) for c in counts))
    return None


def model_ready_condition(
    downloads: Sequence[Download],
    live: Mapping[str, K8sObject],
    now: datetime,
    generation: int | None,
    progress: Mapping[str, DownloadProgress] | None = None,
) -> Condition | None:
    """``ModelReady`` from the service's planned downloads and their live Jobs (by name):
    True when every download has completed, False while one runs (``Downloading``, with how
    far it is where ``progress`` - by Job - says) or after one gave up (``DownloadFailed``,
    with the Job's message); None for a service without a model cache."""
    if not downloads:
        return None
    done, running, failed = [], [], []
    for download in downloads:
        name = download.job
        what = f"{download.what} (Job {name})"
        current = live.get(name)
        failure = job_failed(current)
        if job_complete(current):
            done.append(what)
        elif failure is not None:
            failed.append(f"{what}: {failure}")
        else:
            active = int((current or {}).get("status", {}).get("active") or 0)
            retries = int((current or {}).get("status", {}).get("failed") or 0)
            state = "running" if active else "pending"
            done_so_far = (progress or {}).get(name) if active else None
            if done_so_far is not None:
                state += f", {done_so_far}"
            running.append(f"{what}: {state}" + (f", {retries} pods failed" if retries else ""))
    if failed:
        status, reason, message = False, "DownloadFailed", "; ".join(failed)
    elif running:
        status, reason = False, "Downloading"
        message = "; ".join(running) + (f"; done: {', '.join(done)}" if done else "")
    else:
        status, reason, message = True, "Downloaded", "in the cache: " + ", ".join(done)
    return Condition(
        type=ConditionType.MODEL_READY,
        status=ConditionStatus.TRUE if status else ConditionStatus.FALSE,
        reason=reason,
        message=message,
        last_transition_time=now,
        observed_generation=generation,
    )
