"""One way to write the status of an object that several writers share.

The operator (conditions, replicas, endpoint) and the autoscaler (desired, lastScale,
ScalingActive) both write the InferenceService status. A JSON merge patch replaces lists
whole, so each writer rebuilds its lists from what it read, and the read's resourceVersion
goes with the patch as a precondition: a write that lost the race gets 409 instead of
silently dropping the other writer's fields, and is computed again from a fresh read.
KServe's ``updateStatus`` (pkg/controller/v1alpha1/llmisvc/lifecycle_crud.go) is the model:
read, compute, skip the write when nothing changed, write, retry on conflict.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

from fleetpilot.kube.client import Kube, KubeError, Obj

log = logging.getLogger(__name__)

Mutate = Callable[[Obj], "Obj | None"]

# The operator and the autoscaler conflict only with each other (and with child events'
# status refreshes): a handful of fresh reads settles any race they can have.
STATUS_ATTEMPTS = 5


class StatusWrite(Enum):
    """What :func:`update_status` did."""

    WRITTEN = "written"
    UNCHANGED = "unchanged"  # what mutate computed is already there (or mutate said None)
    GONE = "gone"  # the object was deleted meanwhile: nothing left to write on


def update_status(
    kube: Kube,
    kind: str,
    namespace: str,
    name: str,
    mutate: Mutate,
    *,
    manager: str,
    attempts: int = STATUS_ATTEMPTS,
    live: Obj | None = None,
) -> StatusWrite:
    """Read the object, let ``mutate`` compute its status, and merge-patch it if it changed.

    ``mutate`` gets the whole live object (a fresh read each attempt) and returns the status
    fields to set (those it leaves out are kept as they are), or None to write nothing. The
    patch carries the read's resourceVersion; a 409 re-reads and computes again, up to
    ``attempts`` tries, after which the conflict is raised. ``live``, when the caller has
    just read the object, stands in for the first read. Other errors are raised at once.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    for attempt in range(1, attempts + 1):
        if live is None:
            live = kube.get(kind, namespace, name)
            if live is None:
                return StatusWrite.GONE
        fields = mutate(live)
        current: dict[str, Any] = live.get("status") or {}
        if fields is None or all(current.get(key) == value for key, value in fields.items()):
            return StatusWrite.UNCHANGED
        version = live.get("metadata", {}).get("resourceVersion")
        try:
            kube.patch_status(kind, namespace, name, fields, manager, resource_version=version)
        except KubeError as exc:
            if exc.conflict and attempt < attempts:
                log.debug("status of %s %s/%s changed meanwhile, re-reading", kind, namespace, name)
                live = None
                continue
            raise
        return StatusWrite.WRITTEN
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


__all__ = ["Mutate", "StatusWrite", "update_status"]
