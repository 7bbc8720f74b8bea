"""Helpers for tests against a real API server: polling, and playing the kubelet's part."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from kubernetes import client as k8s

from fleetpilot.api import load_services
from fleetpilot.autoscaler.remote import RecordedDecision
from fleetpilot.kube.client import Kube, Obj
from fleetpilot.runtime.processes import port_in_use
from fleetpilot.runtime.stack import LocalStack

T = TypeVar("T")


def pod_ready(pod: k8s.V1Pod) -> bool:
    """Whether the pod's Ready condition is True (as the endpointslice controller reads it)."""
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _stamp(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def mark_pods_ready(
    kube: Kube,
    namespace: str,
    selector: dict[str, str],
    pod_ip: str = "10.0.0.1",
    *,
    started_at: datetime | None = None,
    ready_at: datetime | None = None,
) -> int:
    """Do what a kubelet would: report every scheduled pod Running and Ready, at ``pod_ip``
    (a loopback address where a test serves what the pod would, to reach it there), its
    containers running since ``started_at`` and Ready (with ContainersReady) since
    ``ready_at`` (both now unless given: what the operator's cold-start samples read).

    Unscheduled pods are left alone, as no kubelet would ever see them. Returns how many pods
    were marked. Only for pods that cannot run here (vLLM's, which need GPUs): pods the
    reference engine serves run for real on the process node (e2e/test_whole_loop.py).
    """
    now = datetime.now(UTC)
    started = _stamp(started_at or now)
    since = _stamp(ready_at or now)
    marked = 0
    for pod in kube.list("Pod", namespace, selector):
        if not pod["spec"].get("nodeName") or pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        ready = [
            {"type": kind, "status": "True", "lastTransitionTime": at}
            for kind, at in (
                ("PodScheduled", _stamp(now)),
                ("Initialized", _stamp(now)),
                ("ContainersReady", since),
                ("Ready", since),
            )
        ]
        containers = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod["spec"]["containers"]
        ]
        status = {
            "phase": "Running",
            "conditions": ready,
            "containerStatuses": containers,
            "podIP": pod_ip,
            "startTime": _stamp(now),
        }
        path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status"
        kube.request(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json"
        )
        marked += 1
    return marked


def finish_job_pods(kube: Kube, namespace: str, job: str, *, exit_code: int = 0) -> int:
    """Do what a kubelet would when a Job's pod ends: every scheduled, still running pod of
    ``job`` reports its containers terminated with ``exit_code`` (Succeeded at 0, Failed
    otherwise), which the Job controller turns into the Job's completion or a retry. Returns
    how many pods were finished."""
    now = _stamp(datetime.now(UTC))
    finished = 0
    for pod in kube.list("Pod", namespace, {"batch.kubernetes.io/job-name": job}):
        phase = (pod.get("status") or {}).get("phase")
        if not pod["spec"].get("nodeName") or phase in ("Succeeded", "Failed"):
            continue
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": now,
            "finishedAt": now,
        }
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "startTime": now,
            "containerStatuses": [
                {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                 "restartCount": 0, "state": {"terminated": terminated}}
                for c in pod["spec"]["containers"]
            ],
        }  # fmt: skip
        path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status"
        kube.request(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json"
        )
        finished += 1
    return finished


def condition(obj: Obj | None, kind: str) -> Obj | None:
    """The status condition ``kind`` of an object, if present."""
    if obj is None:
        return None
    for item in obj.get("status", {}).get("conditions", []) or []:
        if item.get("type") == kind:
            return item  # type: ignore[no-any-return]
    return None


# Below Linux's ephemeral range (32768-60999): a port from it can be handed to any outgoing
# connection on the machine between this check and the fleet's bind, as happened under load.
_FIXED_PORTS = (20000, 32768)


def free_port_range(count: int) -> int:
    """A base port such that ``count`` consecutive loopback ports are free now, outside the
    range the kernel picks connections' local ports from."""
    low, high = _FIXED_PORTS
    for _ in range(100):
        base = random.randrange(low, high - count)
        if not any(port_in_use(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range")


def route_fields(header: str | None) -> dict[str, str]:
    """The router's ``x-fleetpilot-route`` header (``tier=small; replica=...``) as a dict."""
    assert header, "the router sets x-fleetpilot-route"
    return dict(part.split("=", 1) for part in header.split("; "))


def step_until(
    stack: LocalStack,
    done: Callable[[], bool],
    timeout_s: float,
    what: str,
    reports: list[str] | None = None,
) -> list[tuple[float, RecordedDecision]]:
    """Supervise the stack (in this thread) until ``done()``; the decisions recorded meanwhile,
    with the time each was seen. The supervisor's crash reports are appended to ``reports``."""
    seen: list[tuple[float, RecordedDecision]] = []
    recorded = stack.actuator.decisions
    known = len(recorded)
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            reasons = "\n".join(d.reason for _, d in seen[-5:])
            raise AssertionError(f"timed out waiting for {what}; last reasons:\n{reasons}")
        said = stack.step()
        if reports is not None:
            reports.extend(said)
        now = time.monotonic()
        seen.extend((now, d) for d in recorded[known:])
        known = len(recorded)
        time.sleep(0.1)
    # Records that arrived since the last look (done() may have seen them already).
    seen.extend((time.monotonic(), d) for d in recorded[known:])
    return seen


@contextlib.contextmanager
def running_stack(workdir: Path, manifest: str, *, prometheus: bool) -> Iterator[LocalStack]:
    """A LocalStack of the one service in ``manifest`` on free ports, with or without its
    Prometheus; stopped on exit, leaving no process behind."""
    path = workdir / "service.yaml"
    path.write_text(manifest)
    (service,) = load_services(path)
    stack = LocalStack(service, workdir / "fleet", 0, prometheus=prometheus, say=print)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()
        assert stack.leftovers() == []


def autoscaler_log(stack: LocalStack) -> str:
    """What the stack's autoscaler process has logged so far (its decisions, its source)."""
    assert stack.autoscaler is not None
    return stack.autoscaler.log_path.read_text()
