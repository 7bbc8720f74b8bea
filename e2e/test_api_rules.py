"""The CRD's rules on the real API server: every case of the rule table refused with its
message at `kubectl apply --server-side` (dry run), the base object accepted - so the CEL the
models generate compiles, fits the server's cost budget and says what `fleetpilot plan` says.
And an engine Deployment carrying a pod-template overlay is one the server accepts."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.chart_support import apply
from fleetpilot.api import parse_service
from fleetpilot.kube.client import RESOURCES, Kube, KubeError
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from tests.factories import make_manifest, make_tier
from tests.rule_cases import RULE_CASES, RuleCase, base_manifest

pytestmark = pytest.mark.cluster


def _dry_run(kube: Kube, namespace: str, manifest: dict[str, Any]) -> None:
    manifest["metadata"]["namespace"] = namespace
    meta = manifest["metadata"]
    path = RESOURCES["InferenceService"].path(namespace, meta["name"])
    apply(kube, path, manifest, dry_run=True)


def test_the_base_object_is_accepted(kube: Kube, namespace: str, chart_crds: None) -> None:
    _dry_run(kube, namespace, base_manifest())


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_the_api_server_refuses_each_rule_case_with_its_message(
    kube: Kube, namespace: str, chart_crds: None, case: RuleCase
) -> None:
    manifest = base_manifest()
    case.mutate(manifest)
    with pytest.raises(KubeError) as refused:
        _dry_run(kube, namespace, manifest)
    assert refused.value.status == 422
    assert case.message in str(refused.value)


def test_an_engine_pod_with_an_overlay_is_accepted(
    kube: Kube, namespace: str, chart_crds: None
) -> None:
    """The overlay's free-form parts (affinity, a volume's source, env from a Secret, the
    securityContext) survive the CRD's schema and make a Deployment the server accepts."""
    overlay = {
        "labels": {"team": "ml"},
        "annotations": {"owner": "ml-platform"},
        "nodeSelector": {"pool": "gpu-a"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "serviceAccountName": "engine",
        "imagePullSecrets": [{"name": "regcred"}],
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
        "volumes": [{"name": "extra", "configMap": {"name": "chat-extra"}}],
        "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}],
        "securityContext": {"runAsUser": 1000},
    }
    manifest = make_manifest("chat", namespace=namespace, tiers=[make_tier("small")])
    manifest["spec"]["tiers"][0]["podTemplate"] = overlay
    _dry_run(kube, namespace, manifest)
    # What the server kept of the overlay is what the planner reads.
    stored = apply(
        kube,
        RESOURCES["InferenceService"].path(namespace, "chat"),
        manifest,
        dry_run=True,
    )
    assert stored["spec"]["tiers"][0]["podTemplate"]["affinity"] == overlay["affinity"]
    assert stored["spec"]["tiers"][0]["podTemplate"]["volumes"] == overlay["volumes"]
    service = parse_service(stored)
    (deployment,) = [
        obj
        for obj in plan(service, PlanOptions())
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "chat-small"
    ]
    deployment["metadata"].pop("ownerReferences", None)
    path = RESOURCES["Deployment"].path(namespace, "chat-small")
    accepted = apply(kube, path, deployment, dry_run=True)
    pod = accepted["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "engine"
    assert pod["securityContext"]["runAsUser"] == 1000
    assert {"name": "extra", "mountPath": "/etc/extra", "readOnly": True} in pod["containers"][0][
        "volumeMounts"
    ]


@pytest.mark.parametrize("size", ["0", "0Gi", "0.0", "-64Gi", 0, -1])
def test_the_api_server_refuses_a_host_kv_tier_of_no_size(
    kube: Kube, namespace: str, chart_crds: None, size: str | int
) -> None:
    """engine.kvOffload.size must be more than 0 (vLLM refuses an offloading connector of no
    bytes at start): the CRD's pattern refuses a string, its minimum an integer, so a pod
    that cannot start is never planned from an object the server accepted."""
    manifest = base_manifest()
    manifest["spec"]["tiers"][0]["engine"]["kvOffload"]["size"] = size
    with pytest.raises(KubeError) as refused:
        _dry_run(kube, namespace, manifest)
    assert refused.value.status == 422
    assert "kvOffload.size" in str(refused.value)


@pytest.mark.parametrize("size", ["512Mi", "0.5Gi", "64Gi", "100G", 68719476736])
def test_the_api_server_accepts_a_host_kv_tier_of_any_positive_size(
    kube: Kube, namespace: str, chart_crds: None, size: str | int
) -> None:
    manifest = base_manifest()
    manifest["spec"]["tiers"][0]["engine"]["kvOffload"]["size"] = size
    _dry_run(kube, namespace, manifest)
