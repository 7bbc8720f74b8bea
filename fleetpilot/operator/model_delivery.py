"""How a tier's weights reach its engine pods, by source. Purely computational.

- ``huggingface`` (the default): vLLM downloads the repo at start into the pod's cache
  emptyDir (from ``endpoint``, a mirror, when set: ``HF_ENDPOINT``); with ``spec.modelCache``
  a Job downloads it once into the shared volume instead
  (:mod:`fleetpilot.operator.model_cache`) and the engines read it there offline. The only
  source of a reference tier (``engine.backend: reference``), named and with a cache only:
  that engine downloads nothing, so without a cache it builds its seeded preset instead.
- ``pvc``: the claim, mounted read-only.
- ``oci``: an image carrying the weights (a "modelcar"), mounted read-only as an image volume
  (Kubernetes >= 1.35, where the ImageVolume feature is on by default), or copied out of it by an
  init container that runs the image's own ``cp`` (older clusters; the image needs a shell's
  ``cp``, as modelcars built FROM busybox have). The kubelet's image cache is the model cache.
- ``s3``: without a model cache, an init container (the fleetpilot image's ``fleetpilot model
  fetch s3``) downloads the objects into an emptyDir before the engine starts; with one, the
  Job downloads them once into the shared volume.

Every source ends with the engine reading the model at :func:`model_path` (a Hub id, resolved in
the cache, or a directory).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import (
    EngineBackend,
    HuggingFaceSource,
    OciMount,
    OciSource,
    S3Source,
    SecretKeyRef,
    SecretRef,
    Tier,
)
from fleetpilot.engine.vllm_args import MODEL_MOUNT, model_location, reference_checkpoint
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.pod_policy import container_security

# The shared model cache, where engine pods mount it (read-only) and the fetch Job (writable).
CACHE_MOUNT = "/model-cache"
CACHE_VOLUME = "model-cache"
# The Hub's own cache layout (models--org--name/snapshots/<commit>), so vLLM finds a repo id
# there with HF_HUB_OFFLINE=1 exactly as it would after downloading it itself.
HUB_CACHE_DIR = f"{CACHE_MOUNT}/hub"
S3_CACHE_DIR = f"{CACHE_MOUNT}/s3"
# The keys a source's credentials Secret holds (boto3's own environment variables).
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_OPTIONAL_KEYS = ("AWS_SESSION_TOKEN",)


@dataclass(frozen=True)
class ModelDelivery:
    """What an engine pod needs for its tier's weights."""

    model: str
    volumes: list[K8sObject] = field(default_factory=list)
    mounts: list[K8sObject] = field(default_factory=list)
    env: list[K8sObject] = field(default_factory=list)
    init_containers: list[K8sObject] = field(default_factory=list)
    # The engine reads the Hub's cache without a network (the Job downloaded it).
    hub_offline: bool = False


def cached(service: InferenceService, tier: Tier) -> bool:
    """Whether the tier's weights come from the service's model cache (Hub and S3 sources;
    for the reference engine only a named Hub source, its checkpoint: without one it builds
    its model from a seed, and the planner refuses its other sources)."""
    source = tier.model.source
    if service.spec.model_cache is None:
        return False
    if tier.engine.backend is EngineBackend.REFERENCE:
        return reference_checkpoint(tier)
    return source.from_hub or source.s3 is not None


def hub_endpoint_env(hub: HuggingFaceSource | None) -> list[K8sObject]:
    """``HF_ENDPOINT`` for a download from the Hub source's mirror (huggingface_hub, in the
    fetch Job and in vLLM, reads it); none for huggingface.co."""
    if hub is None or hub.endpoint is None:
        return []
    return [{"name": "HF_ENDPOINT", "value": hub.endpoint}]


def s3_key(s3: S3Source) -> str:
    """A directory name for one S3 location in the cache: the same location, the same name."""
    where = json.dumps([s3.endpoint, s3.bucket, s3.prefix, s3.region])
    return f"{s3.bucket}-{hashlib.sha256(where.encode()).hexdigest()[:12]}"


def s3_fetch_args(s3: S3Source, dest: str) -> list[str]:
    """``fleetpilot model fetch s3`` for one location."""
    args = ["fleetpilot", "model", "fetch", "s3", "--bucket", s3.bucket, "--dest", dest]
    if s3.prefix:
        args += ["--prefix", s3.prefix]
    if s3.endpoint:
        args += ["--endpoint", s3.endpoint]
    if s3.region:
        args += ["--region", s3.region]
    return args


def s3_credentials_env(ref: SecretRef | None) -> list[K8sObject]:
    """boto3's credentials from the source's Secret (never their values); none: the pod's own
    identity."""
    if ref is None:
        return []
    return [
        {
            "name": key,
            "valueFrom": {
                "secretKeyRef": {
                    "name": ref.name,
                    "key": key,
                    **({"optional": True} if key in S3_OPTIONAL_KEYS else {}),
                }
            },
        }
        for key in (*S3_SECRET_KEYS, *S3_OPTIONAL_KEYS)
    ]


def token_env(ref: SecretKeyRef | None) -> list[K8sObject]:
    """``HF_TOKEN`` from a Secret key, if one is named (never the token itself)."""
    if ref is None:
        return []
    return [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def cache_claim_name(service: InferenceService) -> str:
    """The cache's PVC: the one named in the spec, else the one the operator creates."""
    cache = service.spec.model_cache
    if cache is not None and cache.claim_name:
        return cache.claim_name
    return names.bounded_name(service.name, "model-cache")


def cache_volume(service: InferenceService, read_only: bool) -> K8sObject:
    return {
        "name": CACHE_VOLUME,
        "persistentVolumeClaim": {"claimName": cache_claim_name(service), "readOnly": read_only},
    }


def model_path(service: InferenceService, tier: Tier) -> str:
    """What vLLM loads: a Hub id (found in the cache when there is one), or a directory."""
    s3 = tier.model.source.s3
    if s3 is not None and cached(service, tier):
        return f"{S3_CACHE_DIR}/{s3_key(s3)}"
    return model_location(tier)


def _uses_image_volume(oci: OciSource, options: PlanOptions) -> bool:
    if oci.mount is OciMount.AUTO:
        return options.image_volumes
    return oci.mount is OciMount.IMAGE_VOLUME


def _oci(oci: OciSource, options: PlanOptions, model: str) -> ModelDelivery:
    mount = {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True}
    if _uses_image_volume(oci, options):
        volume = {
            "name": "models",
            "image": {"reference": oci.image, "pullPolicy": oci.pull_policy.value},
        }
        # subPath in an image volume needs Kubernetes >= 1.33 (auto picks it from 1.35).
        return ModelDelivery(model, [volume], [{**mount, "subPath": oci.path.lstrip("/")}], [], [])
    copier = {
        "name": "model-copy",
        "image": oci.image,
        "imagePullPolicy": oci.pull_policy.value,
        "command": ["cp", "-R", f"{oci.path}/.", f"{MODEL_MOUNT}/"],
        "volumeMounts": [{"name": "models", "mountPath": MODEL_MOUNT}],
        "securityContext": container_security(read_only_root=True),
    }
    return ModelDelivery(model, [{"name": "models", "emptyDir": {}}], [mount], [], [copier])


def _s3_in_pod(s3: S3Source, options: PlanOptions, model: str) -> ModelDelivery:
    fetcher = {
        "name": "model-fetch",
        "image": options.fleetpilot_image,
        "command": s3_fetch_args(s3, MODEL_MOUNT),
        "env": s3_credentials_env(s3.credentials_secret_ref),
        "volumeMounts": [
            {"name": "models", "mountPath": MODEL_MOUNT},
            {"name": "fetch-tmp", "mountPath": "/tmp"},
        ],
        "securityContext": container_security(read_only_root=True),
    }
    volumes = [{"name": "models", "emptyDir": {}}, {"name": "fetch-tmp", "emptyDir": {}}]
    mount = {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True}
    return ModelDelivery(model, volumes, [mount], [], [fetcher])


def weights_summary(service: InferenceService, tier: Tier) -> str:
    """Where the tier's weights come from and how, in words (``fleetpilot plan -o summary``)."""
    source = tier.model.source
    if tier.engine.backend is EngineBackend.REFERENCE and not cached(service, tier):
        return f"none: a seeded random model ({tier.engine.reference_model.value} preset)"
    if source.pvc is not None:
        return f"pvc {source.pvc.claim_name}"
    if source.oci is not None:
        how = {
            OciMount.AUTO: "image volume on Kubernetes >= 1.35, else copied",
            OciMount.IMAGE_VOLUME: "image volume",
            OciMount.COPY: "copied by an init container",
        }
        return f"oci {source.oci.image}:{source.oci.path} ({how[source.oci.mount]})"  # fmt: skip
    if source.s3 is not None:
        where = f"s3 {source.s3.bucket}/{source.s3.prefix}"
    else:
        hub = source.huggingface
        where = f"hub {tier.model.name}@{(hub.revision if hub else None) or 'main'}"
        if hub is not None and hub.endpoint:
            where += f" from {hub.endpoint}"
    if cached(service, tier):
        return f"{where} (downloaded once into the model cache by a Job; engines wait for it)"
    return f"{where} (downloaded by every engine pod at start)"


def delivery_for(service: InferenceService, tier: Tier, options: PlanOptions) -> ModelDelivery:
    """The volumes, mounts, environment and init containers that bring the tier's weights."""
    source = tier.model.source
    model = model_path(service, tier)
    if cached(service, tier):
        mount = {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True}
        env: list[K8sObject] = []
        if source.from_hub:
            env = [
                {"name": "HF_HUB_CACHE", "value": HUB_CACHE_DIR},
                {"name": "HF_HUB_OFFLINE", "value": "1"},
            ]
        return ModelDelivery(
            model, [cache_volume(service, read_only=True)], [mount], env, [], source.from_hub
        )
    if source.pvc is not None:
        volume = {
            "name": "models",
            "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True},
        }
        mount = {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True}
        return ModelDelivery(model, [volume], [mount])
    if source.oci is not None:
        return _oci(source.oci, options, model)
    if source.s3 is not None:
        return _s3_in_pod(source.s3, options, model)
    # vLLM downloads the repo itself at start: from the mirror, when one is named.
    return ModelDelivery(model, env=hub_endpoint_env(source.huggingface))
