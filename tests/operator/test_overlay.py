"""The pod-template overlay in the planned engine pods: merged by strategic-merge rules, a
role's over its tier's, what fleetpilot owns kept, a mount of an undeclared volume refused."""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.api import parse_service
from fleetpilot.api.pod_template import (
    GPU_PRODUCT_LABEL,
    OWNED_ANNOTATION_PREFIXES,
    OWNED_ENV,
    OWNED_LABEL_PREFIXES,
    OWNED_MOUNT_PATHS,
    OWNED_VOLUMES,
)
from fleetpilot.operator.plan_types import PlanError, PlanOptions
from fleetpilot.operator.planner import plan
from tests.factories import make_manifest, make_tier


def _pod(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    (deployment,) = [
        obj
        for obj in plan(parse_service(manifest), PlanOptions())
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == name
    ]
    return deployment["spec"]["template"]  # type: ignore[no-any-return]


def _service(**tier: Any) -> dict[str, Any]:
    return make_manifest("chat", tiers=[make_tier("small", **tier)])


def test_no_overlay_changes_nothing() -> None:
    plain = _pod(_service(), "chat-small")
    assert _pod(_service(podTemplate={}), "chat-small") == plain


def test_the_overlay_adds_to_what_fleetpilot_plans_and_takes_nothing_away() -> None:
    plain = _pod(_service(), "chat-small")
    template = _pod(
        _service(
            engine={"env": [{"name": "LOG", "value": "info"}]},
            podTemplate={
                "labels": {"team": "ml"},
                "annotations": {"owner": "platform"},
                "nodeSelector": {"pool": "a"},
                "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                "affinity": {"podAntiAffinity": {}},
                "serviceAccountName": "engine",
                "imagePullSecrets": [{"name": "regcred"}],
                "env": [
                    {"name": "LOG", "value": "debug"},
                    {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                ],
                "volumes": [{"name": "extra", "configMap": {"name": "cm"}}],
                "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra"}],
                "securityContext": {"runAsUser": 1000},
            },
        ),
        "chat-small",
    )
    assert template["metadata"]["labels"] == {**plain["metadata"]["labels"], "team": "ml"}
    assert template["metadata"]["annotations"]["owner"] == "platform"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    pod = template["spec"]
    assert pod["nodeSelector"] == {**plain["spec"].get("nodeSelector", {}), "pool": "a"}
    assert pod["tolerations"] == [
        *plain["spec"]["tolerations"],
        {"key": "dedicated", "operator": "Exists"},
    ]
    assert pod["affinity"] == {"podAntiAffinity": {}}
    assert pod["serviceAccountName"] == "engine"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["securityContext"] == {**plain["spec"]["securityContext"], "runAsUser": 1000}
    assert pod["volumes"] == [
        *plain["spec"]["volumes"],
        {"name": "extra", "configMap": {"name": "cm"}},
    ]
    (container,) = pod["containers"]
    (planned,) = plain["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["LOG"] == {"name": "LOG", "value": "debug"}  # by name: the overlay's wins
    assert env["T"]["valueFrom"] == {"secretKeyRef": {"name": "s", "key": "k"}}
    assert env["HOME"] == {"name": "HOME", "value": "/cache"}
    assert container["volumeMounts"] == [
        *planned["volumeMounts"],
        {"name": "extra", "mountPath": "/etc/extra"},
    ]
    for owned in ("command", "args", "ports", "resources", "image", "startupProbe"):
        assert container[owned] == planned[owned]


def test_a_roles_overlay_goes_over_its_tiers() -> None:
    manifest = make_manifest("chat", tiers=[make_tier("large", mode="disaggregated")])
    tier = manifest["spec"]["tiers"][0]
    tier["podTemplate"] = {"labels": {"team": "ml", "cost": "a"}, "nodeSelector": {"pool": "a"}}
    tier["serving"]["decode"]["podTemplate"] = {"labels": {"cost": "b"}}
    decode = _pod(manifest, "chat-large-decode")
    prefill = _pod(manifest, "chat-large-prefill")
    assert decode["metadata"]["labels"]["cost"] == "b"
    assert decode["metadata"]["labels"]["team"] == "ml"
    assert decode["spec"]["nodeSelector"]["pool"] == "a"
    assert prefill["metadata"]["labels"]["cost"] == "a"


def test_a_mount_of_a_volume_nobody_declares_is_refused_naming_it() -> None:
    manifest = _service(podTemplate={"volumeMounts": [{"name": "nope", "mountPath": "/x"}]})
    with pytest.raises(PlanError) as refused:
        _pod(manifest, "chat-small")
    assert refused.value.field == "spec.tiers[0].podTemplate.volumeMounts[0].name"
    assert "no volume named 'nope'" in refused.value.message


def test_what_the_overlay_rules_call_owned_is_what_the_planner_sets() -> None:
    """The API's owned names (refused in an overlay) cover every env var, volume, mount path
    and label prefix the planner puts on an engine pod - a P/D role with several GPUs and a
    Hub token, which sets them all - so a new one cannot slip past the rules."""
    tier = make_tier("large", mode="disaggregated", tensor=2)
    tier["model"]["source"] = {"huggingface": {"tokenSecretRef": {"name": "hf", "key": "t"}}}
    tier["resources"] = {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}
    manifest = make_manifest("chat", tiers=[tier])
    template = _pod(manifest, "chat-large-decode")
    (container,) = template["spec"]["containers"]
    assert "HF_TOKEN" in {e["name"] for e in container["env"]}  # the case sets them all
    assert {e["name"] for e in container["env"]} <= set(OWNED_ENV)
    assert {v["name"] for v in template["spec"]["volumes"]} <= set(OWNED_VOLUMES)
    assert {m["mountPath"] for m in container["volumeMounts"]} <= set(OWNED_MOUNT_PATHS)
    assert all(k.startswith(OWNED_LABEL_PREFIXES) for k in template["metadata"]["labels"])
    assert all(k.startswith(OWNED_ANNOTATION_PREFIXES) for k in template["metadata"]["annotations"])
    assert GPU_PRODUCT_LABEL in template["spec"]["nodeSelector"]
