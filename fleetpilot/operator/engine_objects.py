"""Engine Deployments, Services and PodDisruptionBudgets of one role, and the ServiceAccount
of every engine pod of a service. Purely computational.

A tier's pods run vLLM on GPUs (``engine.backend: vllm``), or fleetpilot's CPU reference engine
(``reference``): the reference image, the command of the one mapping the local runtime runs
too (engine.reference_launch), CPU and memory sized for it, no GPU request or GPU placement,
nothing downloaded or mounted but a writable home (and, for a checkpoint read from the model
cache, the cache and its environment exactly as a cached vLLM pod has them), a start probed
every 2 s rather than 10 s; the same ports, other probes, labels, security and overlays as a
vLLM pod.

Engine pods run as a ServiceAccount of their own that no RBAC binds, with no token mounted
(``automountServiceAccountToken: false``): an engine never calls the Kubernetes API (the router
discovers it, the operator loads its adapters), so an engine taken over through a malicious
model, adapter or request must not hold credentials - not even the namespace default
account's, which other workloads may have been granted rights through.

A host KV tier (``engine.kvOffload``) is memory the pod asks for on top of ``resources.memory``
(a reference pod's on top of its own sizing): the share of the tier the pod's engines fill,
plus :data:`KV_OFFLOAD_MEMORY_MARGIN_PERCENT`, in both the request (the scheduler places the
pod on a node with that much free) and the limit (the engine is not OOM-killed for filling it). vLLM
maps its host tier as a file in /dev/shm, so a vLLM pod's /dev/shm grows by the tier too."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from fleetpilot.api import InferenceService, ResolvedRole
from fleetpilot.api.capacity import MIB, kv_offload_bytes
from fleetpilot.api.layout import Span, role_layout
from fleetpilot.api.pod_template import GPU_PRODUCT_LABEL, PodTemplateOverlay
from fleetpilot.api.spec import EngineBackend, HuggingFaceSource, Tier
from fleetpilot.api.units import quantity_decimal
from fleetpilot.engine.reference_launch import POD_IP_ENV, reference_pod_command
from fleetpilot.engine.vllm_args import (
    ADAPTER_MOUNT,
    ENGINE_PORT,
    RUNTIME_LORA_ENV,
    EngineLaunch,
    adapter_claim_mount,
    adapter_dir,
    kv_event_ports,
    launch_for,
    vllm_serve_args,
)
from fleetpilot.kube import names
from fleetpilot.kube.names import LWS_WORKER_INDEX_LABEL, spans_nodes
from fleetpilot.operator.model_cache import ANNOTATION_FETCH_JOB, fetch_job_names
from fleetpilot.operator.model_delivery import (
    ModelDelivery,
    cached,
    delivery_for,
    model_path,
    token_env,
)
from fleetpilot.operator.overlay import apply_overlay
from fleetpilot.operator.plan_types import K8sObject, PlanOptions, object_meta
from fleetpilot.operator.pod_policy import container_security, pod_security, spread

# GPU nodes are commonly tainted so only GPU pods land there; engine pods tolerate it.
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
# Weights download and load take minutes for large models: allow 30 minutes (180 x 10s)
# before the startup probe gives up, then probe liveness as for any server.
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 180
# vLLM finishes in-flight requests on SIGTERM; two minutes covers long generations.
TERMINATION_GRACE_S = 120
CACHE_MOUNT = "/cache"
EMPTY_OVERLAY = PodTemplateOverlay()
# A reference engine's pod (engine.backend reference), either preset. Memory: measured peak RSS
# 630 MiB (tiny) and 645 MiB (small) serving 16 concurrent 1200-character prompts of 200
# tokens each: about 560 MiB of Python, torch and the server, the 64 MiB KV pool (the engine's
# default --kv-cache-memory-bytes) and under 4 MiB of weights (0.7 MiB tiny, 3.2 MiB small), so
# the presets differ by less than the noise. x1.5 for larger batches' activations -> 1Gi, the
# limit too: over it the engine is killed rather than the node's other pods squeezed. CPU: the
# engine computes on one thread (--num-threads 1), the request; the limit adds the HTTP server's
# event loop thread, so a busy engine cannot take every core of a laptop's kind node.
# The reference engine starts in seconds (torch's import and a seeded model; 2-3 s measured
# on a shared 2-core machine), not minutes of weight loading: probing its start every 2 s makes
# a new pod Ready (a scale-up, a scale from zero) up to 8 s sooner than the vLLM pods' 10 s
# period would, and 120 failures still give a starved node 4 minutes.
REFERENCE_STARTUP_PERIOD_S = 2
REFERENCE_STARTUP_FAILURES = 120
REFERENCE_RESOURCES: K8sObject = {
    "requests": {"cpu": "1", "memory": "1Gi"},
    "limits": {"cpu": "2", "memory": "1Gi"},
}
# A host KV tier's memory is asked for with this much on top. vLLM 0.33 backs it with a file
# in /dev/shm that it pre-faults and pins for DMA (cudaHostRegister): charged to the pod's
# memory cgroup from the start, and never reclaimable. Chunks are page aligned inside the
# size, and the manager's per-chunk bookkeeping (hash, LRU entry: under a KiB for a chunk of
# hundreds of KiB of KV) and the page tables (8 bytes a 4 KiB page) come to well under 1%;
# the rest of the 10% is headroom for what grows with the tier outside it - the host-side
# staging of copies to and from the GPU, the event tracker's snapshots of blocks in flight -
# so that an engine sized to resources.memory without a host tier is not OOM-killed once the
# tier is full. The reference engine keeps its host tier in one tensor of that size.
KV_OFFLOAD_MEMORY_MARGIN_PERCENT = 10


def pod_kv_offload_bytes(role: ResolvedRole) -> int:
    """The host KV tier one of the role's pods fills: a tier per engine (data-parallel rank)
    it runs; of an engine whose GPUs span nodes, each pod's workers fill their own slots of
    it (vLLM's SharedOffloadRegion: one slot a worker in every chunk), an equal share."""
    size = kv_offload_bytes(role.engine)
    if size is None:
        return 0
    layout = role_layout(role)
    if layout.span is Span.MODEL:
        return -(-size // layout.nodes)
    return size * layout.data_local


def pod_kv_offload_shm_bytes(role: ResolvedRole) -> int:
    """The /dev/shm a vLLM pod's host KV tier needs: its engines' tiers, each whole even in a
    pod of an engine over several nodes (vLLM's check_shm_free_space asks for the whole
    region's size free on every node before mapping it, though a node fills its share)."""
    size = kv_offload_bytes(role.engine)
    if size is None:
        return 0
    layout = role_layout(role)
    return size if layout.span is Span.MODEL else size * layout.data_local


def engine_memory_bytes(role: ResolvedRole) -> int:
    """The memory request (and limit) of one of the role's engine pods, in bytes: the spec's
    (or a reference pod's own), plus its host KV tier with the margin."""
    if is_reference(role.tier):
        base = quantity_decimal(REFERENCE_RESOURCES["requests"]["memory"])
    else:
        base = quantity_decimal(role.tier.resources.memory)
    offload = pod_kv_offload_bytes(role)
    margin = -(-offload * KV_OFFLOAD_MEMORY_MARGIN_PERCENT // 100)  # exact, rounded up
    return math.ceil(base) + offload + margin


def engine_memory(role: ResolvedRole) -> str:
    """The memory quantity of one of the role's engine pods: the spec's as written without a
    host KV tier (no spurious rollout of existing pods), else the sum in MiB, rounded up."""
    if kv_offload_bytes(role.engine) is None:
        if is_reference(role.tier):
            return str(REFERENCE_RESOURCES["requests"]["memory"])
        return role.tier.resources.memory
    return f"{math.ceil(engine_memory_bytes(role) / MIB)}Mi"


def reference_resources(role: ResolvedRole) -> K8sObject:
    """A reference engine pod's resources: :data:`REFERENCE_RESOURCES`, its memory grown by a
    host KV tier."""
    memory = engine_memory(role)
    return {
        "requests": {**REFERENCE_RESOURCES["requests"], "memory": memory},
        "limits": {**REFERENCE_RESOURCES["limits"], "memory": memory},
    }


def engine_service_account(service: InferenceService) -> K8sObject:
    """The engine pods' ServiceAccount: no RBAC binds it and it mounts no token by default,
    so even a pod that names it without saying ``automountServiceAccountToken`` gets none."""
    name = names.engine_service_account_name(service.name)
    labels = {**names.service_labels(service.name), names.LABEL_NAME: "fleetpilot-engine"}
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(service, name, labels),
        "automountServiceAccountToken": False,
    }


def engine_labels(service: InferenceService, role: ResolvedRole) -> dict[str, str]:
    return {
        **names.service_labels(service.name),
        **names.engine_selector(service.name, role.tier.name, role.name),
        **names.engines_selector(service.name),
        names.LABEL_NAME: "fleetpilot-engine",
    }


def hub_token_env(hub: HuggingFaceSource | None) -> list[K8sObject]:
    """``HF_TOKEN`` from the source's Secret, if it names one (never the token itself)."""
    return token_env(hub.token_secret_ref if hub is not None else None)


def _cache_env() -> list[K8sObject]:
    # Not root (pod_policy): vLLM's, torch's, triton's and the Hub's caches under ~ go to the
    # writable emptyDir, as the image's own home is root's.
    return [
        {"name": "HOME", "value": CACHE_MOUNT},
        {"name": "HF_HOME", "value": f"{CACHE_MOUNT}/huggingface"},
    ]


def adapter_claims(tier: Tier) -> list[str]:
    """The PVCs the tier's adapters are read from, each once, in the order first named."""
    claims = [a.source.pvc.claim_name for a in tier.adapters if a.source.pvc is not None]
    return list(dict.fromkeys(claims))


def _loads_at_run_time(tier: Tier) -> bool:
    settings = tier.lora_settings
    return settings is not None and settings.dynamic


def adapter_fetchers(tier: Tier, image: str) -> list[K8sObject]:
    """One init container per Hub adapter: the engine image's ``hf download`` of the repo at
    its revision, with the adapter's own token, into the adapters' emptyDir. The engine starts
    only once every adapter it is told to load is on disk."""
    fetchers: list[K8sObject] = []
    if _loads_at_run_time(tier):
        return fetchers  # the operator loads them into running engines (engine.adapter_sync)
    for index, adapter in enumerate(tier.adapters):
        hub = adapter.source.huggingface
        if hub is None:
            continue
        command = ["hf", "download", hub.repo, "--local-dir", adapter_dir(index, adapter)]
        if hub.revision:
            command += ["--revision", hub.revision]
        fetchers.append(
            {
                "name": f"adapter-{index}",
                "image": image,
                "command": command,
                "env": [*_cache_env(), *token_env(hub.token_secret_ref)],
                "volumeMounts": [
                    {"name": "cache", "mountPath": CACHE_MOUNT},
                    {"name": "adapters", "mountPath": ADAPTER_MOUNT},
                ],
                "securityContext": container_security(read_only_root=False),
            }
        )
    return fetchers


def _env(role: ResolvedRole, delivery: ModelDelivery) -> list[K8sObject]:
    tier = role.tier
    env = _cache_env()
    if not delivery.hub_offline:  # offline, the token would only be one more copy of a secret
        env += hub_token_env(tier.model.source.huggingface)
    env += delivery.env
    if role.disaggregated:
        # The KV connector advertises this address to its peers for the block hand-off.
        env.append(
            {
                "name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }
        )
    if _loads_at_run_time(tier):
        env.append({"name": RUNTIME_LORA_ENV, "value": "True"})
    managed = {item["name"] for item in env}
    env += [{"name": e.name, "value": e.value} for e in tier.engine.env if e.name not in managed]
    return env


def _reference_env(role: ResolvedRole, delivery: ModelDelivery | None) -> list[K8sObject]:
    """A reference engine's environment: the writable home, where a checkpoint's Hub cache is
    (``delivery``, a cached tier's: HF_HUB_CACHE, HF_HUB_OFFLINE), the pod's IP that a P/D
    engine advertises to its peers (``$(POD_IP)`` in its args), the tier's own variables."""
    env = _cache_env()
    if delivery is not None:
        env += delivery.env
    if role.disaggregated:
        env.append({"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    managed = {item["name"] for item in env}
    env += [{"name": e.name, "value": e.value} for e in role.engine.env if e.name not in managed]
    return env


def _probe(path: str, period_s: int, failures: int) -> K8sObject:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def _volumes(
    role: ResolvedRole, delivery: ModelDelivery
) -> tuple[list[K8sObject], list[K8sObject]]:
    tier = role.tier
    volumes: list[K8sObject] = [{"name": "cache", "emptyDir": {}}]
    mounts: list[K8sObject] = [{"name": "cache", "mountPath": CACHE_MOUNT}]
    layout = role_layout(role)
    offload_shm = pod_kv_offload_shm_bytes(role)
    if layout.gpus_per_pod > 1 or layout.multi_node or offload_shm:
        # NCCL between the GPUs of one pod, and vLLM's workers and engine processes among
        # themselves, communicate through /dev/shm; the container runtime's 64 MiB default
        # makes multi-GPU engines crash or crawl. vLLM maps a host KV tier there too (and
        # refuses to start when /dev/shm has less free).
        size = tier.resources.shared_memory
        if offload_shm:
            total = quantity_decimal(size) + offload_shm
            size = f"{math.ceil(total / MIB)}Mi"
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes += delivery.volumes
    mounts += delivery.mounts
    if not _loads_at_run_time(tier) and any(a.source.huggingface for a in tier.adapters):
        volumes.append({"name": "adapters", "emptyDir": {}})
        mounts.append({"name": "adapters", "mountPath": ADAPTER_MOUNT, "readOnly": True})
    for i, claim in enumerate(adapter_claims(tier)):
        volumes.append(
            {
                "name": f"adapters-{i}",
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True},
            }
        )
        mounts.append(
            {
                "name": f"adapters-{i}",
                "mountPath": adapter_claim_mount(claim),
                "readOnly": True,
            }
        )
    return volumes, mounts


def _placement(service: InferenceService, role: ResolvedRole) -> K8sObject:
    """Where the role's pods may run: GPU nodes of the tier's product (tolerating their
    taint) and the spec's scheduling; a reference tier, which needs no GPU, the latter only."""
    scheduling = service.spec.scheduling
    selector = dict(scheduling.node_selector)
    tolerations: list[K8sObject] = []
    if not is_reference(role.tier):
        if role.tier.resources.gpu_product:
            selector[GPU_PRODUCT_LABEL] = role.tier.resources.gpu_product
        tolerations.append(GPU_TOLERATION)
    tolerations += [t.to_wire() for t in scheduling.tolerations]
    placement: K8sObject = {"tolerations": tolerations} if tolerations else {}
    if selector:
        placement["nodeSelector"] = selector
    if scheduling.priority_class_name:
        placement["priorityClassName"] = scheduling.priority_class_name
    return placement


def fetch_job_annotation(
    service: InferenceService, tier: Tier, options: PlanOptions | None
) -> dict[str, str]:
    jobs = fetch_job_names(service, tier, options or PlanOptions())
    return {ANNOTATION_FETCH_JOB: ",".join(jobs)} if jobs else {}


def _init_containers(tier: Tier, delivery: ModelDelivery) -> K8sObject:
    # The weights first: an adapter fetch is quick, and useless if the model never arrives.
    init = delivery.init_containers + adapter_fetchers(tier, tier.engine.image)
    return {"initContainers": init} if init else {}


def is_reference(tier: Tier) -> bool:
    return tier.engine.backend is EngineBackend.REFERENCE


def engine_command(
    service: InferenceService, role: ResolvedRole, *, worker: bool = False
) -> list[str]:
    """The full command line of the role's engine container (of a multi-node replica's
    leader, or with ``worker`` its workers)."""
    if is_reference(role.tier):
        return reference_pod_command(launch_for(role))
    launch = replace(launch_for(role), model=model_path(service, role.tier))
    return ["vllm", "serve", *vllm_serve_args(launch, worker=worker)]


def _reference_container(
    role: ResolvedRole, image: str, delivery: ModelDelivery | None
) -> K8sObject:
    """The engine container of a reference tier's pod: the reference image running the one
    shared mapping's command (engine.reference_launch), CPU and memory for it, no GPU; with a
    checkpoint (``delivery``) the model cache mounted and named as in a cached vLLM pod."""
    launch = launch_for(role)
    command = reference_pod_command(launch)
    mounts: list[K8sObject] = [{"name": "cache", "mountPath": CACHE_MOUNT}]
    mounts += delivery.mounts if delivery is not None else []
    return {
        "name": "engine",
        "image": image,
        "command": command[:2],
        "args": command[2:],
        "env": _reference_env(role, delivery),
        "resources": reference_resources(role),
        "volumeMounts": mounts,
        # Not read-only: torch writes beside its caches, as in a vLLM pod.
        "securityContext": container_security(read_only_root=False),
        **_serving(launch, REFERENCE_STARTUP_PERIOD_S, REFERENCE_STARTUP_FAILURES),
    }


def _serving(
    launch: EngineLaunch,
    startup_period_s: int = STARTUP_PERIOD_S,
    startup_failures: int = STARTUP_FAILURES,
) -> K8sObject:
    """What a pod that serves the API adds: the HTTP port, the KV-event PUB and replay sockets
    the router subscribes to, and the health probes (the startup one as the engine loads)."""
    ports: list[K8sObject] = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    ports += [
        {"name": port_name, "containerPort": port, "protocol": "TCP"}
        for port_name, port in kv_event_ports(launch)
    ]
    return {
        "ports": ports,
        "startupProbe": _probe("/health", startup_period_s, startup_failures),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/health", 15, 4),
    }


def _engine_container(
    role: ResolvedRole,
    delivery: ModelDelivery,
    mounts: list[K8sObject],
    worker: bool,
) -> K8sObject:
    """The engine container of one pod of a replica: the only one of a one-node replica, or
    the leader (``worker`` False) or a worker of a multi-node one. Workers run vLLM
    ``--headless``: no HTTP server, so no serving port and no HTTP probes."""
    tier = role.tier
    resources = tier.resources
    gpus = str(role_layout(role).gpus_per_pod)
    launch = replace(launch_for(role), model=delivery.model)
    command = ["vllm", "serve", *vllm_serve_args(launch, worker=worker)]
    memory = engine_memory(role)
    requests = {"cpu": resources.cpu, "memory": memory, resources.gpu_resource: gpus}
    limits = {"memory": memory, resources.gpu_resource: gpus}
    security = container_security(read_only_root=False)
    if spans_nodes(role) and resources.rdma_resource:
        # RDMA between the nodes of a replica: the device plugin's resource, and the right
        # to pin the memory the NICs read (verbs' memory registration).
        requests[resources.rdma_resource] = "1"
        limits[resources.rdma_resource] = "1"
        security["capabilities"] = {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    container: dict[str, Any] = {
        "name": "engine",
        "image": tier.engine.image,
        "command": command[:2],
        "args": command[2:],
        "env": _env(role, delivery),
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        # Not read-only: torch and triton write JIT artefacts beside their packages' caches.
        "securityContext": security,
    }
    if worker:
        return container
    return {**container, **_serving(launch)}


def engine_pod_template(
    service: InferenceService,
    role: ResolvedRole,
    options: PlanOptions | None = None,
    *,
    worker: bool = False,
) -> K8sObject:
    """The pod template of a role's engine pods (of a multi-node replica's leader, or with
    ``worker`` its workers), the tier's and role's podTemplate overlays merged in."""
    tier = role.tier
    labels = engine_labels(service, role)
    options = options or PlanOptions()
    if is_reference(tier):
        # The model is built from a seed, or read from the model cache (a checkpoint the
        # cache's Job downloaded: mounted and named as for a cached vLLM tier, and the
        # workload held until the Job completed, by workload_annotations).
        reference = delivery_for(service, tier, options) if cached(service, tier) else None
        volumes: list[K8sObject] = [{"name": "cache", "emptyDir": {}}]
        volumes += reference.volumes if reference is not None else []
        container = _reference_container(role, options.reference_image, reference)
        init: K8sObject = {}
    else:
        delivery = delivery_for(service, tier, options)
        volumes, mounts = _volumes(role, delivery)
        container = _engine_container(role, delivery, mounts, worker)
        init = _init_containers(tier, delivery)
    metadata: K8sObject = {"labels": labels}
    if not worker:
        # Workers serve no /metrics: the leader's API server reports every rank's.
        metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ENGINE_PORT),
            "prometheus.io/path": "/metrics",
        }
    template: K8sObject = {
        "metadata": metadata,
        "spec": {
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            # A podTemplate overlay may name another account (workload identity for a bucket);
            # the API token stays unmounted whichever it names (module docstring).
            "serviceAccountName": names.engine_service_account_name(service.name),
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security(),
            "topologySpreadConstraints": spread(
                names.engine_selector(service.name, tier.name, role.name)
            ),
            **_placement(service, role),
            **init,
            "containers": [container],
            "volumes": volumes,
        },
    }
    overlay = role.pod_template
    if overlay == EMPTY_OVERLAY:
        return template
    index = service.spec.tiers.index(tier)
    field = f"spec.tiers[{index}].podTemplate"
    if role.role_pod_template is not None:
        field = f"spec.tiers[{index}].podTemplate (with serving.{role.name.value}.podTemplate)"
    return apply_overlay(template, overlay, field)


def workload_annotations(
    service: InferenceService, role: ResolvedRole, options: PlanOptions | None
) -> dict[str, str]:
    """What the workload object says of its replicas: GPUs (and nodes) each takes, and the
    model downloads it waits for."""
    layout = role_layout(role)
    gpus = 0 if is_reference(role.tier) else layout.nodes * layout.gpus_per_pod
    annotations = {"fleetpilot.dev/gpus-per-replica": str(gpus)}
    if layout.multi_node:
        annotations["fleetpilot.dev/nodes-per-replica"] = str(layout.nodes)
    return annotations | fetch_job_annotation(service, role.tier, options)


def engine_deployment(
    service: InferenceService, role: ResolvedRole, options: PlanOptions | None = None
) -> K8sObject:
    tier = role.tier
    name = names.engine_name(service.name, tier.name, role.name)
    labels = engine_labels(service, role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **object_meta(service, name, labels),
            "annotations": workload_annotations(service, role, options),
        },
        "spec": {
            "replicas": role.replicas.start,
            "selector": {"matchLabels": names.engine_selector(service.name, tier.name, role.name)},
            # Surge one pod, never drop below the running count: capacity holds during a
            # rollout when one spare replica's worth of GPUs exists.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            # Pulling a multi-GB image and loading weights is slow; don't call it stuck early.
            "progressDeadlineSeconds": STARTUP_PERIOD_S * STARTUP_FAILURES,
            "template": engine_pod_template(service, role, options),
        },
    }


def engine_service(service: InferenceService, role: ResolvedRole) -> K8sObject:
    """A headless Service: its EndpointSlices list the Ready pods the router may use - every
    engine pod, or a multi-node role's leaders (its workers serve no API)."""
    tier = role.tier
    selector = names.engine_selector(service.name, tier.name, role.name)
    if spans_nodes(role):
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(
            service, names.engine_service_name(service.name, role), engine_labels(service, role)
        ),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def engine_pdb(service: InferenceService, role: ResolvedRole) -> K8sObject:
    """At most one engine pod of a role evicted at a time (node drains, upgrades). For a
    multi-node role that is one group at a time: a group whose pod is evicted restarts whole
    (RecreateGroupOnPodRestart), and until it is back every pod of it counts as unavailable."""
    tier = role.tier
    name = names.engine_name(service.name, tier.name, role.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(service, name, engine_labels(service, role)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.engine_selector(service.name, tier.name, role.name)},
        },
    }
