"""What the model-delivery tests share: a model, its cache and sources, planning a service, and
playing the Job controller on a fake API server."""

from __future__ import annotations

from typing import Any

from fleetpilot.kube import names
from fleetpilot.kube.client import Obj
from fleetpilot.operator.model_cache import COMPONENT as FETCH_COMPONENT
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from tests.factories import make_manifest, make_service, make_tier
from tests.support.kube import FakeKube

MODEL = "Qwen/Qwen2.5-7B-Instruct"
CACHE = {"size": "200Gi", "storageClassName": "nfs"}
S3 = {
    "endpoint": "https://minio.storage:9000",
    "bucket": "models",
    "prefix": "qwen/7b/",
    "credentialsSecretRef": {"name": "minio-creds"},
}


def planned(tiers: list[Obj], options: PlanOptions | None = None, **spec: Any) -> list[Obj]:
    return plan(make_service(tiers=tiers, **spec), options or PlanOptions())


def only(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    return found[0]


def jobs_of(objects: list[Obj], component: str = FETCH_COMPONENT) -> list[Obj]:
    """The download Jobs (or, by its component, the cache's GC Job)."""
    return [
        o
        for o in objects
        if o["kind"] == "Job" and o["metadata"]["labels"][names.LABEL_COMPONENT] == component
    ]


def pod_of(objects: list[Obj], name: str = "chat-small") -> Obj:
    return only(objects, "Deployment", name)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def env_of(container: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def tier_with(source: Obj, name: str = "small", model: str = MODEL, up_to: float = 1.0) -> Obj:
    return make_tier(name, model=model, up_to=up_to) | {"model": {"name": model, "source": source}}


NS = "ml"


def apply_service(kube: FakeKube, revision: str) -> Obj:
    manifest = make_manifest(
        namespace=NS,
        tiers=[tier_with({"huggingface": {"revision": revision}})],
        modelCache=CACHE,
    )
    kube.apply(manifest, "kubectl")
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    return live


def complete(kube: FakeKube, job: str) -> None:
    """Play the Job controller: the download finished."""
    kube.set_status(
        "Job", NS, job, {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    )


def model_ready(kube: FakeKube) -> tuple[str, str] | None:
    live = kube.get("InferenceService", NS, "chat")
    assert live is not None
    found = [c for c in live["status"]["conditions"] if c["type"] == "ModelReady"]
    return (found[0]["status"], found[0]["reason"]) if found else None
