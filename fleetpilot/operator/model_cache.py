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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import SecretKeyRef, Tier
from fleetpilot.api.status import Condition, ConditionStatus, ConditionType
from fleetpilot.kube import names
from fleetpilot.operator.model_delivery import (
    CACHE_MOUNT,
    HUB_CACHE_DIR,
    S3_CACHE_DIR,
    cache_claim_name,
    cache_volume,
    cached,
    s3_credentials_env,
    s3_fetch_args,
    s3_key,
    token_env,
)
from fleetpilot.operator.plan_types import K8sObject, PlanOptions, object_meta
from fleetpilot.operator.pod_policy import container_security, pod_security

COMPONENT = "model-fetch"


@dataclass(frozen=True)
class _Download:
    what: str  # for people: repo@revision, s3://bucket/prefix
    command: list[str]
    env: list[K8sObject]


# A download interrupted by a node or network failure resumes where it stopped in the next pod.
FETCH_BACKOFF_LIMIT = 6
ANNOTATION_MODEL = "fleetpilot.dev/model"
# On an engine Deployment (not its pod template: no rollout): the Jobs its weights come from,
# comma-separated.
ANNOTATION_FETCH_JOB = "fleetpilot.dev/model-fetch-job"


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


def _hub_fetch(repo: str, revision: str | None, token: SecretKeyRef | None) -> _Download:
    command = ["fleetpilot", "model", "fetch", "hub", "--repo", repo]
    if revision:
        command += ["--revision", revision]
    command += ["--cache-dir", HUB_CACHE_DIR]
    return _Download(f"{repo}@{revision or 'main'}", command, token_env(token))


def _downloads(service: InferenceService, tier: Tier) -> list[_Download]:
    """What the tier's engines read from the cache: its model, and a speculative draft model
    from the Hub (the engines read the Hub cache offline, so they could not fetch it)."""
    if not cached(service, tier):
        return []
    source = tier.model.source
    hub = source.huggingface
    token = hub.token_secret_ref if hub is not None else None
    if source.s3 is not None:
        s3 = source.s3
        fetches = [
            _Download(
                f"s3://{s3.bucket}/{s3.prefix}",
                s3_fetch_args(s3, f"{S3_CACHE_DIR}/{s3_key(s3)}"),
                s3_credentials_env(s3.credentials_secret_ref),
            )
        ]
    else:
        fetches = [_hub_fetch(tier.model.name, hub.revision if hub is not None else None, token)]
    draft = tier.engine.speculative.model if tier.engine.speculative is not None else None
    if draft is not None and source.from_hub:
        fetches.append(_hub_fetch(draft, None, token))
    return fetches


def _container(download: _Download, options: PlanOptions) -> K8sObject:
    return {
        "name": "fetch",
        "image": options.fleetpilot_image,
        "command": download.command,
        "env": [{"name": "HOME", "value": "/tmp"}, *download.env],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security(read_only_root=True),
    }


def _job_name(service: InferenceService, container: K8sObject) -> str:
    digest = hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()[:10]
    return names.bounded_name(service.name, "fetch", digest)


def fetch_job_names(service: InferenceService, tier: Tier, options: PlanOptions) -> list[str]:
    """The Jobs that download what the tier's engines read from the cache (none without one)."""
    return [_job_name(service, _container(d, options)) for d in _downloads(service, tier)]


def fetch_jobs(service: InferenceService, options: PlanOptions) -> list[K8sObject]:
    """One Job per distinct download the service's tiers need, in tier order."""
    jobs: dict[str, K8sObject] = {}
    for tier in service.spec.tiers:
        for download in _downloads(service, tier):
            container = _container(download, options)
            name = _job_name(service, container)
            if name not in jobs:
                jobs[name] = _job(service, name, download.what, container)
    return list(jobs.values())


def _job(service: InferenceService, name: str, what: str, container: K8sObject) -> K8sObject:
    labels = {**names.service_labels(service.name), names.LABEL_COMPONENT: COMPONENT}
    meta = object_meta(service, name, labels)
    meta["annotations"] = {ANNOTATION_MODEL: what}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "backoffLimit": FETCH_BACKOFF_LIMIT,
            "template": {
                # Not the service label: status reads the service's pods as its engines.
                "metadata": {
                    "labels": {
                        names.LABEL_INSTANCE: service.name,
                        names.LABEL_COMPONENT: COMPONENT,
                    },
                    "annotations": {ANNOTATION_MODEL: what},
                },
                "spec": {
                    "restartPolicy": "Never",
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


def fetch_jobs_of(obj: K8sObject) -> list[str]:
    """The download Jobs a planned engine Deployment waits for."""
    annotations = obj.get("metadata", {}).get("annotations") or {}
    return [job for job in str(annotations.get(ANNOTATION_FETCH_JOB, "")).split(",") if job]


def model_ready_condition(
    planned: list[K8sObject], live: dict[str, K8sObject], now: datetime, generation: int | None
) -> Condition | None:
    """``ModelReady`` from the service's planned download Jobs and the live ones: True when
    every download has completed, False while one runs (``Downloading``) or after one gave up
    (``DownloadFailed``, with the Job's message); None for a service without a model cache."""
    if not planned:
        return None
    done, running, failed = [], [], []
    for job in planned:
        name = job["metadata"]["name"]
        what = f"{job['metadata']['annotations'][ANNOTATION_MODEL]} (Job {name})"
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
