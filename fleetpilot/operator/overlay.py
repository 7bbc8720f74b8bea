"""A tier's (and role's) pod-template overlay merged into its engine pods, by strategic-merge
rules: maps by key, env and volumes by name, mounts by path, tolerations and pull secrets
appended; what the planner owns always wins (the API refuses overlays that touch it).
Purely computational."""

from __future__ import annotations

from typing import Any

from fleetpilot.api.pod_template import PodTemplateOverlay
from fleetpilot.operator.plan_types import K8sObject, PlanError


def _merged_by(items: list[K8sObject], key: str, newer: list[K8sObject]) -> list[K8sObject]:
    """``items`` with each of ``newer`` in place of the item of the same ``key`` (appended
    when there is none): a strategic merge of a list keyed by ``key``."""
    merged = {item[key]: item for item in items}
    for item in newer:
        merged[item[key]] = item
    return list(merged.values())


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
        spec["volumes"] = _merged_by(spec.get("volumes", []), "name", volumes)
    declared = {v["name"] for v in spec.get("volumes", [])}
    for i, mount in enumerate(overlay.volume_mounts):
        if mount.name not in declared:
            raise PlanError(
                f"{field}.volumeMounts[{i}].name",
                f"no volume named {mount.name!r} (declare it in {field}.volumes)",
            )
    if overlay.volume_mounts:
        mounts = [m.to_wire() for m in overlay.volume_mounts]
        container["volumeMounts"] = _merged_by(
            container.get("volumeMounts", []), "mountPath", mounts
        )
    if overlay.env:
        env = [e.to_wire() for e in overlay.env]
        container["env"] = _merged_by(container.get("env", []), "name", env)
    spec["containers"] = [container]
    return {**template, "metadata": metadata, "spec": spec}
