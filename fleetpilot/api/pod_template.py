"""What a user may add to the engine pods of a tier or a role: the pod-template overlay.

Labels, annotations, placement (nodeSelector, tolerations, affinity), the ServiceAccount,
image pull secrets, extra env, volumes and mounts, and the pod's securityContext. Merged over
what the planner builds by strategic-merge rules (maps by key, env and volumes by name, mounts
by path, tolerations and pull secrets appended); refused - at `kubectl apply` (CEL) and in
`fleetpilot plan` (the same message) - where it would override what fleetpilot owns: its
labels and scrape annotations, the env and volumes it sets, the GPU product selector, and the
container's command, args, ports, resources and image (engine.extraArgs, engine.image and
resources say those).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter
from typing import Any, Self, TypeVar

from pydantic import ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from fleetpilot.api.base import ApiModel, cel_rules

# Free-form core/v1 objects (affinity, a volume's source, a securityContext): the API server
# keeps their fields (a structural schema would prune them) and the kubelet judges them.
FREE_FORM: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}

OWNED_LABEL_PREFIXES = ("fleetpilot.dev/", "app.kubernetes.io/")
OWNED_ANNOTATION_PREFIXES = ("fleetpilot.dev/", "prometheus.io/")
OWNED_ENV = ("HOME", "HF_HOME", "HF_TOKEN", "VLLM_NIXL_SIDE_CHANNEL_HOST")
OWNED_VOLUMES = ("cache", "dshm", "models", "adapters")
OWNED_VOLUME_PREFIXES = ("adapters-",)  # the PVCs of a tier's LoRA adapters
OWNED_MOUNT_PATHS = ("/cache", "/dev/shm", "/models", "/adapters", "/adapter-volumes")
OWNED_MOUNT_PREFIXES = ("/adapters/", "/adapter-volumes/")
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CONTAINER_FIELDS = ("command", "args", "ports", "resources", "image")


T = TypeVar("T")


def merged_by(items: Sequence[T], newer: Sequence[T], key: Callable[[T], Hashable]) -> list[T]:
    """A strategic merge of a list keyed by ``key``: ``items`` with each of ``newer`` in place
    of the item of the same key, appended when there is none."""
    merged = {key(item): item for item in items}
    merged.update({key(item): item for item in newer})
    return list(merged.values())


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


def _cel_no_prefix(var: str, prefixes: tuple[str, ...]) -> str:
    return " && ".join(f"!{var}.startsWith('{prefix}')" for prefix in prefixes)


class OverlayRule:
    """Messages of the overlay's rules (CEL and pydantic say the same)."""

    LABELS = (
        "podTemplate.labels may not set fleetpilot.dev/ or app.kubernetes.io/ labels: "
        "fleetpilot selects its pods by them"
    )
    ANNOTATIONS = (
        "podTemplate.annotations may not set fleetpilot.dev/ or prometheus.io/ annotations: "
        "fleetpilot sets them"
    )
    ENV = "podTemplate.env may not set HOME, HF_HOME, HF_TOKEN or VLLM_NIXL_SIDE_CHANNEL_HOST"
    VOLUMES = (
        "podTemplate.volumes may not be named cache, dshm, models, adapters or adapters-*: "
        "fleetpilot's own"
    )
    MOUNTS = (
        "podTemplate.volumeMounts may not mount at /cache, /dev/shm, /models, /adapters or "
        "/adapter-volumes, or below the last two"
    )
    GPU_PRODUCT = (
        "podTemplate.nodeSelector may not set nvidia.com/gpu.product: set resources.gpuProduct"
    )
    CONTAINER = (
        "podTemplate may not set command, args, ports, resources or image: fleetpilot owns "
        "them (engine.extraArgs, resources and engine.image say them)"
    )


class OverlayEnvVar(ApiModel):
    """An environment variable: a value, or a reference (secretKeyRef, configMapKeyRef,
    fieldRef, resourceFieldRef) as in core/v1."""

    name: str = Field(
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$", max_length=128, description="Variable name."
    )
    value: str | None = Field(None, max_length=4096, description="Its value.")
    value_from: dict[str, Any] | None = Field(
        None, description="core/v1 EnvVarSource.", json_schema_extra=FREE_FORM
    )


class OverlayVolume(ApiModel):
    """A pod volume as in core/v1: a name and one source (configMap, secret, csi, ...)."""

    # The source (configMap, secret, csi, ...) is kept as written: the kubelet judges it.
    model_config = ApiModel.model_config | ConfigDict(extra="allow", json_schema_extra=FREE_FORM)

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="Volume name."
    )


class OverlayVolumeMount(ApiModel):
    """A mount of one of the overlay's volumes into the engine container."""

    name: str = Field(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63, description="Volume name."
    )
    mount_path: str = Field(pattern=r"^/", max_length=1024, description="Where in the container.")
    read_only: bool | None = Field(None, description="Mount read-only.")
    sub_path: str | None = Field(None, max_length=1024, description="A path inside the volume.")


class LocalObjectReference(ApiModel):
    """A Secret in the service's namespace, by name."""

    name: str = Field(max_length=253, description="Secret name.")


_OVERLAY_CEL = cel_rules(
    (
        f"!has(self.labels) || self.labels.all(k, {_cel_no_prefix('k', OWNED_LABEL_PREFIXES)})",
        OverlayRule.LABELS,
    ),
    (
        "!has(self.annotations) || self.annotations.all(k, "
        f"{_cel_no_prefix('k', OWNED_ANNOTATION_PREFIXES)})",
        OverlayRule.ANNOTATIONS,
    ),
    (f"!has(self.env) || self.env.all(e, !(e.name in {_cel_list(OWNED_ENV)}))", OverlayRule.ENV),
    (
        f"!has(self.volumes) || self.volumes.all(v, !(v.name in {_cel_list(OWNED_VOLUMES)}) "
        f"&& {_cel_no_prefix('v.name', OWNED_VOLUME_PREFIXES)})",
        OverlayRule.VOLUMES,
    ),
    (
        "!has(self.volumeMounts) || self.volumeMounts.all(m, "
        f"!(m.mountPath in {_cel_list(OWNED_MOUNT_PATHS)}) "
        f"&& {_cel_no_prefix('m.mountPath', OWNED_MOUNT_PREFIXES)})",
        OverlayRule.MOUNTS,
    ),
    (
        f"!has(self.nodeSelector) || !('{GPU_PRODUCT_LABEL}' in self.nodeSelector)",
        OverlayRule.GPU_PRODUCT,
    ),
    (" && ".join(f"!has(self.{name})" for name in CONTAINER_FIELDS), OverlayRule.CONTAINER),
)


class PodTemplateOverlay(ApiModel):
    """Added to the engine pods of a tier (or of one role, over the tier's)."""

    model_config = ApiModel.model_config | {"json_schema_extra": _OVERLAY_CEL}

    labels: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Extra pod labels."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Extra pod annotations."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=32, description="Extra node labels the pods require."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description="Extra core/v1 tolerations (the GPU taint's is always there).",
        json_schema_extra={"items": {"type": "object", **FREE_FORM}},
    )
    affinity: dict[str, Any] | None = Field(
        None,
        description="core/v1 Affinity (node, pod, anti-affinity).",
        json_schema_extra=FREE_FORM,
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        description=(
            "ServiceAccount of the engine pods, instead of the one fleetpilot plans for them "
            "(<service>-engines, bound to no role). Its API token is not mounted either "
            "(automountServiceAccountToken: false): engines never call the Kubernetes API; "
            "workload identity (projected tokens, the metadata server) is unaffected."
        ),
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets for pulling the engine image."
    )
    env: list[OverlayEnvVar] = Field(
        default_factory=list, max_length=64, description="Extra engine container env."
    )
    volumes: list[OverlayVolume] = Field(
        default_factory=list, max_length=32, description="Extra pod volumes (core/v1 Volume)."
    )
    volume_mounts: list[OverlayVolumeMount] = Field(
        default_factory=list, max_length=32, description="Extra engine container mounts."
    )
    security_context: dict[str, Any] | None = Field(
        None,
        description=(
            "core/v1 PodSecurityContext, merged over fleetpilot's restricted default (e.g. "
            "runAsUser for an image that needs its own user)."
        ),
        json_schema_extra=FREE_FORM,
    )
    # Refused when set: named so that `kubectl apply` says why rather than pruning them.
    command: list[str] | None = Field(None, max_length=1, description="Refused: owned.")
    args: list[str] | None = Field(None, max_length=1, description="Refused: engine.extraArgs.")
    ports: list[dict[str, Any]] | None = Field(
        None,
        max_length=1,
        description="Refused: owned.",
        json_schema_extra={"items": {"type": "object", **FREE_FORM}},
    )
    resources: dict[str, Any] | None = Field(
        None, description="Refused: the tier's resources.", json_schema_extra=FREE_FORM
    )
    image: str | None = Field(None, max_length=512, description="Refused: engine.image.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if any(k.startswith(OWNED_LABEL_PREFIXES) for k in self.labels):
            raise ValueError(OverlayRule.LABELS)
        if any(k.startswith(OWNED_ANNOTATION_PREFIXES) for k in self.annotations):
            raise ValueError(OverlayRule.ANNOTATIONS)
        if any(e.name in OWNED_ENV for e in self.env):
            raise ValueError(OverlayRule.ENV)
        if any(
            v.name in OWNED_VOLUMES or v.name.startswith(OWNED_VOLUME_PREFIXES)
            for v in self.volumes
        ):
            raise ValueError(OverlayRule.VOLUMES)
        if any(
            m.mount_path in OWNED_MOUNT_PATHS or m.mount_path.startswith(OWNED_MOUNT_PREFIXES)
            for m in self.volume_mounts
        ):
            raise ValueError(OverlayRule.MOUNTS)
        if GPU_PRODUCT_LABEL in self.node_selector:
            raise ValueError(OverlayRule.GPU_PRODUCT)
        if any(getattr(self, name) is not None for name in CONTAINER_FIELDS):
            raise ValueError(OverlayRule.CONTAINER)
        return self


def combine(tier: PodTemplateOverlay | None, role: PodTemplateOverlay | None) -> PodTemplateOverlay:
    """A role's overlay over its tier's: maps by key, lists by name (role wins)."""
    if tier is None and role is None:
        return PodTemplateOverlay()
    if tier is None or role is None:
        return tier or role  # type: ignore[return-value]

    return PodTemplateOverlay(
        labels={**tier.labels, **role.labels},
        annotations={**tier.annotations, **role.annotations},
        node_selector={**tier.node_selector, **role.node_selector},
        tolerations=[*tier.tolerations, *role.tolerations],
        affinity=role.affinity if role.affinity is not None else tier.affinity,
        service_account_name=role.service_account_name or tier.service_account_name,
        image_pull_secrets=merged_by(
            tier.image_pull_secrets, role.image_pull_secrets, attrgetter("name")
        ),
        env=merged_by(tier.env, role.env, attrgetter("name")),
        volumes=merged_by(tier.volumes, role.volumes, attrgetter("name")),
        volume_mounts=merged_by(tier.volume_mounts, role.volume_mounts, attrgetter("mount_path")),
        security_context=(
            {**(tier.security_context or {}), **(role.security_context or {})}
            if tier.security_context or role.security_context
            else None
        ),
    )
