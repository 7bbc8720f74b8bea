"""Kubernetes Events on an InferenceService, posted by the operator's background loops (the
autoscaler, the adapter loader), which run outside kopf's handlers and so cannot use
``kopf.event``."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from fleetpilot.api import API_VERSION, KIND, InferenceService
from fleetpilot.kube.client import RESOURCES, Kube, KubeError, Obj

log = logging.getLogger(__name__)


def post_event(
    kube: Kube,
    service: InferenceService,
    *,
    reason: str,
    message: str,
    kind: str,
    component: str,
    now: datetime | None = None,
) -> None:
    """Post one Event (``kind`` Normal or Warning) on ``service``. An Event is a courtesy: what
    it reports is also in status, metrics or logs, so a failed post is logged, not raised."""
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: Obj = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": service.name,
        "namespace": service.namespace,
    }
    if service.metadata.uid:
        involved["uid"] = service.metadata.uid
    body: Obj = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{service.name}.", "namespace": service.namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": kind,
        "source": {"component": component},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
    try:
        kube.request("POST", RESOURCES["Event"].path(service.namespace), body=body)
    except KubeError as exc:
        log.warning("could not post Event %s on %s: %s", reason, service.name, exc)
