"""A tier's (and role's) pod-template overlay merged into its engine pods, by strategic-merge
rules: maps by key, env and volumes by name, mounts by path, tolerations and pull secrets
appended; what the planner owns always wins (the API refuses overlays that touch it).
Purely computational."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from fleetpilot.api.pod_template import PodTemplateOverlay, merged_by
from fleetpilot.operator.plan_types import K8sObject, PlanError


def apply_overlay(template: K8sObject, overlay: PodTemplateOverlay, field: str) -> K8sObject:
    """``template`` (a Deployment's pod template, one container) with ``overlay`` merged in;
    ``field`` names the overlay in a refusal (a mount of a volume nobody declares)."""
    metadata = dict(template["metadata"])
    spec: dict[str, Any] = dict(template["spec"])
    (container,) = spec["containers"]
    container = dict(container)

    metadata["labels"] = {**overlay.labels, **metadata.get("labels", {})}
    metadata["annotations"] = {**overlay.annotations, **metadata.get("annotations", {})}
    if overlay.node_selector:
        spec["nodeSelector"] = {**overlay.node_selector, **spec.get("nodeSelector", {})}
    if overlay.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *overlay.tolerations]
    if overlay.affinity is not None:
        spec["affinity"] = overlay.affinity
    if overlay.service_account_name:
        spec["serviceAccountName"] = overlay.service_account_name
    if overlay.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in overlay.image_pull_secrets]
    if overlay.security_context:
        spec["securityContext"] = {**spec.get("securityContext", {}), **overlay.security_context}
    volumes = [v.to_wire() for v in overlay.volumes]
    if volumes:
        spec["volumes"] = merged_by(spec.get("volumes", []), volumes, itemgetter("name"))
    declared = {v["name"] for v in spec.get("volumes", [])}
    for i, mount in enumerate(overlay.volume_mounts):
        if mount.name not in declared:
            raise PlanError(
                f"{field}.volumeMounts[{i}].name",
                f"no volume named {mount.name!r} (declare it in {field}.volumes)",
            )
    if overlay.volume_mounts:
        mounts = [m.to_wire() for m in overlay.volume_mounts]
        owned = container.get("volumeMounts", [])
        container["volumeMounts"] = merged_by(owned, mounts, itemgetter("mountPath"))
    if overlay.env:
        env = [e.to_wire() for e in overlay.env]
        container["env"] = merged_by(container.get("env", []), env, itemgetter("name"))
    spec["containers"] = [container]
    return {**template, "metadata": metadata, "spec": spec}
