"""``plan(service) -> objects``: everything a service becomes in the cluster.

Purely computational: no I/O, no clock, no randomness. The same service always yields the
same objects in the same order (dependencies first), so the operator can apply them
idempotently and ``fleetpilot plan`` shows a GitOps user exactly what will be applied.
A service that cannot be realized raises :class:`PlanError` before any object is produced,
so nothing is ever half-applied.
"""

from __future__ import annotations

import re

from fleetpilot.api import InferenceService, ResolvedRole
from fleetpilot.api.capacity import (
    GPU_MEMORY,
    RESERVE_BYTES_PER_GPU,
    RoleCapacity,
    architecture_of,
    format_bytes,
    gpu_memory_of,
    smallest_fitting_tensor,
)
from fleetpilot.api.layout import LayoutError, Span, role_layout
from fleetpilot.api.pod_template import GPU_PRODUCT_LABEL
from fleetpilot.api.spec import EngineBackend, KvCacheDtype, ModelDtype, PodMonitorMode, Tier
from fleetpilot.api.units import format_duration
from fleetpilot.engine.reference_launch import REFERENCE_MAX_MODEL_LEN
from fleetpilot.engine.vllm_args import reference_checkpoint
from fleetpilot.kube import names
from fleetpilot.operator.engine_objects import (
    KV_OFFLOAD_MEMORY_MARGIN_PERCENT,
    engine_deployment,
    engine_memory_bytes,
    engine_pdb,
    engine_service,
    engine_service_account,
    is_reference,
    pod_kv_offload_bytes,
)
from fleetpilot.operator.gateway_objects import gateway_objects
from fleetpilot.operator.leader_worker_set import engine_leader_worker_set
from fleetpilot.operator.model_cache import (
    cache_claim,
    collection_job,
    fetch_job_names,
    planned_downloads,
)
from fleetpilot.operator.network_policy import network_policies
from fleetpilot.operator.plan_types import (
    LEADER_WORKER_SET_MISSING,
    Capacities,
    Dependency,
    JobComplete,
    K8sObject,
    PlanError,
    Planned,
    PlanOptions,
    RolledOut,
    ServicePlan,
    object_meta,
    role_capacities,
    sized,
)
from fleetpilot.operator.router_auth import check_auth
from fleetpilot.operator.router_objects import METRICS_PORT_NAME, router_objects

# Flags the planner derives from the spec; setting them again in extraArgs would make the
# spec and the running engine disagree, so they are refused instead.
MANAGED_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--served-model-name",
        "--tensor-parallel-size",
        "-tp",
        "--pipeline-parallel-size",
        "-pp",
        "--data-parallel-size",
        "-dp",
        "--data-parallel-size-local",
        "--data-parallel-start-rank",
        "-dpr",
        "--data-parallel-rank",
        "--data-parallel-address",
        "-dpa",
        "--data-parallel-rpc-port",
        "-dpp",
        "--nnodes",
        "-n",
        "--node-rank",
        "-r",
        "--master-addr",
        "--master-port",
        "--headless",
        "--enable-expert-parallel",
        "-ep",
        "--enable-eplb",
        "--eplb-config",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--kv-cache-dtype",
        "--quantization",
        "-q",
        "--speculative-config",
        "--kv-transfer-config",
        "--kv-events-config",
        "--kv-offloading-size",
        "--kv-offloading-backend",
        "--dtype",
        "--revision",
        "--enable-lora",
        "--no-enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--max-cpu-loras",
        "--lora-modules",
    }
)


def all_roles(service: InferenceService) -> list[ResolvedRole]:
    """Every role of every tier, in spec order: one engine Deployment (or LeaderWorkerSet)
    each."""
    return [role for tier in service.spec.tiers for role in tier.roles()]


def tier_field(service: InferenceService, role: ResolvedRole) -> str:
    """Where a role's tier sits in the spec, for error messages: ``spec.tiers[1]``."""
    index = next(i for i, tier in enumerate(service.spec.tiers) if tier.name == role.tier.name)
    return f"spec.tiers[{index}]"


def check(
    service: InferenceService,
    options: PlanOptions | None = None,
    capacities: Capacities | None = None,
) -> None:
    """Refuse what the CRD schema allows but the planner cannot realize (``capacities``: the
    roles sized, else sized here)."""
    options = options or PlanOptions()
    seen: dict[str, str] = {
        names.router_name(service.name): "the router",
        names.router_peers_name(service.name): "the router's peer Service",
    }
    for role in all_roles(service):
        # Tier "a" in P/D mode and a unified tier "a-decode" would both name "svc-a-decode".
        owner = f"tier {role.tier.name!r} role {role.name}"
        derived = {
            names.engine_name(service.name, role.tier.name, role.name),
            names.engine_workload(service.name, role)[1],
            names.engine_service_name(service.name, role),
        }
        for name in sorted(derived):
            if name in seen:
                raise PlanError(
                    f"{tier_field(service, role)}.name",
                    f"{owner} and {seen[name]} would both be named {name!r}; rename a tier",
                )
        seen |= dict.fromkeys(derived, owner)
    check_auth(service)
    _check_model_cache(service)
    for role in all_roles(service):
        tier = role.tier
        where = tier_field(service, role)
        if tier.engine.backend is EngineBackend.REFERENCE:
            _check_reference(role, where, service.spec.model_cache is not None)
            _check_node_memory(role, where, options)
            continue  # one CPU process: no layout, no GPU capacity, none of vLLM's flags
        _check_layout(role, where, options)
        _check_node_memory(role, where, options)
        _check_capacity(role, where, sized(capacities, role))
        _check_run_time_adapters(tier, where, service.spec.model_cache is not None)
        for i, arg in enumerate(tier.engine.extra_args):
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise PlanError(
                    f"{where}.engine.extraArgs[{i}]",
                    f"{flag} is set by fleetpilot from the spec; change the matching "
                    "spec field instead",
                )


def check_reference_tiers(service: InferenceService) -> None:
    """Refuse what the reference engine cannot run in the service's reference tiers: also
    where no cluster plans them (``fleetpilot up``), so a spec runs the same engines, or is
    refused with the same words, on a laptop and in a cluster. One thing more is refused
    here: a checkpoint (``model.source.huggingface``), which only a cluster's model cache
    delivers (the local fleet downloads nothing, and running the preset instead would serve
    another model under the spec's name)."""
    for role in all_roles(service):
        if role.tier.engine.backend is not EngineBackend.REFERENCE:
            continue
        where = tier_field(service, role)
        if reference_checkpoint(role.tier):
            raise PlanError(
                f"{where}.model.source.huggingface",
                f"tier {role.tier.name!r}: fleetpilot up cannot run a reference checkpoint: "
                "the Job of a cluster's spec.modelCache downloads it, and the local fleet "
                "downloads nothing; remove model.source to run the seeded "
                f"{role.tier.engine.reference_model.value} preset locally",
            )
        _check_reference(role, where, service.spec.model_cache is not None)


def _check_model_cache(service: InferenceService) -> None:
    """A model cache that no tier downloads into would be a claim (and Jobs) for nothing: the
    reference engine builds its model from a seed unless it reads a Hub checkpoint."""
    if service.spec.model_cache is None:
        return
    seeded = [
        tier.engine.backend is EngineBackend.REFERENCE and not reference_checkpoint(tier)
        for tier in service.spec.tiers
    ]
    if all(seeded):
        raise PlanError(
            "spec.modelCache",
            "no tier downloads weights: every tier's engine.backend is reference without "
            "model.source.huggingface, a model built from a seed; remove modelCache, or "
            "give a tier a Hub checkpoint to read",
        )


def _check_reference(role: ResolvedRole, where: str, model_cache: bool) -> None:
    """Refuse, with the numbers, what the CPU reference engine cannot run. A cluster user chose
    ``backend: reference`` for this tier, so a setting it cannot honour is a mistake to say
    (the local runtime, which runs GPU specs on a CPU, caps instead). ``model_cache``: the
    service has one, which alone can bring a checkpoint (the engine downloads nothing)."""
    tier, p = role.tier, role.parallelism
    owner = f"tier {tier.name!r} role {role.name}"
    engine = tier.engine
    one_process = "the reference engine is one CPU process"
    for name, value in (("tensor", p.tensor), ("pipeline", p.pipeline), ("data", p.data)):
        if value > 1:
            raise PlanError(
                f"{_parallelism_field(role, where)}.{name}",
                f"{owner}: {name} {value} > 1: {one_process} (no GPUs, no parallel ranks, "
                "no multi-node groups); set it to 1 or use engine.backend vllm",
            )
    if p.expert:
        raise PlanError(
            f"{_parallelism_field(role, where)}.expert",
            f"{owner}: {one_process}, with no experts to spread; remove it",
        )
    preset = engine.reference_model
    cap = REFERENCE_MAX_MODEL_LEN[preset]
    asked = tier.model.max_model_len
    # The preset's limit binds only the seeded preset: a checkpoint's limit is in its
    # config.json, which the engine checks at start (max_position_embeddings), not here.
    if asked is not None and asked > cap and not reference_checkpoint(tier):
        larger = [
            f"engine.referenceModel {other.value} ({limit})"
            for other, limit in REFERENCE_MAX_MODEL_LEN.items()
            if limit >= asked
        ]
        raise PlanError(
            f"{where}.model.maxModelLen",
            f"{owner}: maxModelLen {asked} > {cap}, the most the reference engine's "
            f"{preset.value} preset holds (its max_position_embeddings); set at most {cap}"
            + "".join(f" or {choice}" for choice in larger[:1]),
        )
    source = tier.model.source
    if source.huggingface is not None and not model_cache:
        raise PlanError(
            f"{where}.model.source.huggingface",
            f"{owner}: the reference engine downloads nothing at start: it reads a Hub "
            "checkpoint from the model cache only; add spec.modelCache (its Job downloads "
            f"the checkpoint once), or remove model.source to run the seeded {preset.value} "
            "preset",
        )
    given = [
        name
        for name, value in (
            ("pvc", source.pvc),
            ("oci", source.oci),
            ("s3", source.s3),
        )
        if value is not None
    ]
    if given:
        raise PlanError(
            f"{where}.model.source.{given[0]}",
            f"{owner}: the reference engine builds a seeded random model of its preset "
            f"({preset.value}) and reads no weights but a Hub checkpoint from spec.modelCache "
            "(model.source.huggingface); remove model.source",
        )
    refused = [
        ("model.quantization", tier.model.quantization is not None, "runs float32 weights"),
        ("model.dtype", tier.model.dtype is not ModelDtype.AUTO, "runs its preset's dtype"),
        (
            "engine.kvCache.dtype",
            engine.kv_cache.dtype is not KvCacheDtype.AUTO,
            "stores KV in the model's dtype",
        ),
        ("engine.speculative", engine.speculative is not None, "has none of vLLM's proposers"),
        ("adapters", bool(tier.adapters), "serves no LoRA adapters in a cluster"),
        ("lora", tier.lora is not None, "serves no LoRA adapters in a cluster"),
        ("engine.extraArgs", bool(engine.extra_args), "takes no vLLM arguments"),
        (
            "engine.kvOffload",
            engine.kv_offload is not None and not engine.kv_cache.prefix_caching,
            "keeps a host KV tier by prefix hashes, which kvCache.prefixCaching false turns off",
        ),
    ]
    for field, set_, why in refused:
        if set_:
            raise PlanError(
                f"{where}.{field}", f"{owner}: the reference engine {why}; remove {field}"
            )


def _parallelism_field(role: ResolvedRole, where: str) -> str:
    """Where a role's parallelism is set: the role's override, else the tier's."""
    spec = getattr(role.tier.serving, role.name.value, None)
    if role.disaggregated and spec is not None and spec.parallelism is not None:
        return f"{where}.serving.{role.name.value}.parallelism"
    return f"{where}.parallelism"


def _check_layout(role: ResolvedRole, where: str, options: PlanOptions) -> None:
    """Refuse a replica that cannot be cut evenly into nodes, or that needs several nodes in
    a cluster without LeaderWorkerSet."""
    owner = f"tier {role.tier.name!r} role {role.name}"
    try:
        layout = role_layout(role)
    except LayoutError as exc:
        raise PlanError(_parallelism_field(role, where), f"{owner}: {exc}") from None
    if layout.multi_node and not options.leader_worker_set_available:
        per_node = role.tier.resources.gpus_per_node
        raise PlanError(
            _parallelism_field(role, where),
            f"{owner} needs {layout.nodes} nodes per replica ({role.parallelism.gpus} GPUs, "
            f"resources.gpusPerNode {per_node}), which fleetpilot runs as LeaderWorkerSet "
            "groups, but the cluster does not serve the LeaderWorkerSet API "
            "(leaderworkerset.x-k8s.io/v1): install LeaderWorkerSet "
            "(https://lws.sigs.k8s.io) and restart the operator",
            reason=LEADER_WORKER_SET_MISSING,
        )


def node_memory_for(tier: Tier, options: PlanOptions) -> tuple[int | None, str]:
    """The most allocatable memory of a node that can run the tier's engine pods (None:
    unknown, not checked), and what nodes that is of, in words. Purely computational.

    By product where the options know it by product (the operator, from the cluster's
    Nodes): a GPU tier with ``resources.gpuProduct`` runs only on nodes of that product (the
    pods' node selector), so those are the ones that count; a product no node carries is not
    checked. A tier without a product, or a reference tier (no GPU, no product selector),
    takes the largest node of all."""
    by_product = options.node_memory_by_product
    product = tier.resources.gpu_product
    if by_product is None:
        return options.node_memory, "the largest allocatable memory of a node that can run it"
    if product and not is_reference(tier):
        return (
            by_product.get(product),
            f"the largest allocatable memory of the nodes labelled {GPU_PRODUCT_LABEL}={product}",
        )
    return options.node_memory, "the largest allocatable memory of the cluster's nodes"


def _check_node_memory(role: ResolvedRole, where: str, options: PlanOptions) -> None:
    """Refuse an engine pod that asks for more memory than a node can give (when the planner
    knows how much: ``options.node_memory``, by GPU product where known), naming what the
    request is made of and what the nodes give."""
    node, nodes = node_memory_for(role.tier, options)
    asked = engine_memory_bytes(role)
    if node is None or asked <= node:
        return
    tier = role.tier
    parts = [
        "the reference engine's own"
        if is_reference(tier)
        else f"resources.memory {tier.resources.memory}"
    ]
    field, lower = "resources.memory", "resources.memory"
    offload = tier.engine.kv_offload
    if offload is not None:
        layout = role_layout(role)
        of = f"engine.kvOffload.size {offload.size}"
        if layout.span is Span.MODEL:
            of = f"its 1/{layout.nodes} of {of}"
        elif layout.data_local > 1:
            of += f" for each of its {layout.data_local} data-parallel ranks"
        share = pod_kv_offload_bytes(role)
        parts.append(
            f"a host KV tier of {format_bytes(share)} ({of}) + {KV_OFFLOAD_MEMORY_MARGIN_PERCENT}%"
        )
        field, lower = "engine.kvOffload.size", "engine.kvOffload.size or resources.memory"
    raise PlanError(
        f"{where}.{field}",
        f"tier {tier.name!r} role {role.name}: an engine pod asks for {format_bytes(asked)} "
        f"of memory ({' + '.join(parts)}), more than the {format_bytes(node)} a node can "
        f"give ({nodes}); lower {lower}",
    )


def _check_run_time_adapters(tier: Tier, where: str, model_cache: bool) -> None:
    """With ``lora.dynamic`` an engine downloads a Hub adapter itself when told to load it,
    and vLLM's load call takes a repo id only: the default branch, with the engine's (the
    model's) token. Refuse what would silently be served otherwise."""
    if tier.lora is None or not tier.lora.dynamic:
        return
    for i, arg in enumerate(tier.engine.extra_args):
        if arg.split("=", 1)[0] in ("--api-server-count", "-asc"):
            raise PlanError(
                f"{where}.engine.extraArgs[{i}]",
                "vLLM refuses more than one API server with runtime LoRA updating (lora.dynamic), "
                "and fleetpilot runs one; remove the flag",
            )
    for i, adapter in enumerate(tier.adapters):
        hub = adapter.source.huggingface
        if hub is None:
            continue
        field = f"{where}.adapters[{i}].source.huggingface"
        if model_cache and tier.model.source.from_hub:
            raise PlanError(
                field,
                f"adapter {adapter.name!r}: with lora.dynamic the engine downloads a Hub "
                "adapter itself, but with spec.modelCache its engines read the Hub cache "
                "offline; put the adapter on a PVC, or set lora.dynamic false",
            )
        if hub.revision:
            raise PlanError(
                f"{field}.revision",
                f"adapter {adapter.name!r}: with lora.dynamic the engine downloads a Hub "
                "adapter itself, and vLLM's load call takes no revision (only the default "
                "branch); remove the revision, put the adapter on a PVC, or set lora.dynamic "
                "false (the pods then fetch it at this revision, and a changed list rolls them)",
            )
        if hub.token_secret_ref is not None:
            raise PlanError(
                f"{field}.tokenSecretRef",
                f"adapter {adapter.name!r}: with lora.dynamic the engine downloads a Hub "
                "adapter with its own token (the model's), not the adapter's; remove the "
                "adapter's token, put the adapter on a PVC, or set lora.dynamic false",
            )


def _check_capacity(role: ResolvedRole, where: str, capacity: RoleCapacity | None) -> None:
    """Refuse a role whose weights leave its GPUs no room for a KV cache, naming the numbers
    and the smallest tensor-parallel size that fits (roles the planner cannot size pass)."""
    if capacity is None or capacity.fits:
        return
    sized = capacity
    tier, p = role.tier, role.parallelism
    smallest = smallest_fitting_tensor(role, sized)
    remedy = (
        f"tensor {smallest} fits"
        if smallest is not None
        else f"no tensor size within resources.gpusPerNode {tier.resources.gpus_per_node} fits"
    )
    lora = sized.lora_bytes_per_gpu
    held = f"{format_bytes(sized.weights_per_gpu_bytes)} of weights"
    if lora:
        held += f" and {format_bytes(lora)} of LoRA slots"
    raise PlanError(
        f"{where}.parallelism.tensor",
        f"tier {tier.name!r} role {role.name}: {held} per GPU "
        f"(tensor {p.tensor} x pipeline {p.pipeline}) leave no room for a KV cache in "
        f"{format_bytes(sized.budget_per_gpu_bytes)} "
        f"({format_bytes(sized.gpu_memory_bytes)} x "
        f"gpuMemoryUtilization {tier.engine.gpu_memory_utilization:g}, less "
        f"{format_bytes(RESERVE_BYTES_PER_GPU)} for activations); {remedy}",
    )


def not_sized_reasons(role: ResolvedRole, where: str) -> list[str]:
    """Why the planner cannot size a GPU role's capacity, each naming the field to set
    (``where``: the tier's place in the spec, ``spec.tiers[0]``). Purely computational."""
    tier = role.tier
    reasons = []
    if architecture_of(role) is None:
        reasons.append(
            f"{where}.model.name {tier.model.name!r}: model architecture unknown; set "
            f"{where}.model.architecture"
        )
    if gpu_memory_of(role) is None:
        product = tier.resources.gpu_product
        known = ", ".join(sorted(GPU_MEMORY))
        if product is None:
            reasons.append(
                f"GPU memory unknown; set {where}.resources.gpuMemory (e.g. 80Gi), or "
                f"{where}.resources.gpuProduct to one of: {known}"
            )
        else:
            reasons.append(
                f"{where}.resources.gpuProduct {product!r}: GPU memory unknown for this "
                f"product; set {where}.resources.gpuMemory (e.g. 48Gi) or use one of: {known}"
            )
    if not reasons:
        reasons.append(
            "the size of its weights is unknown (its model.quantization, or its experts' "
            "share with expert parallelism)"
        )
    return reasons


def capacity_warnings(service: InferenceService, capacities: Capacities | None = None) -> list[str]:
    """What a user should know about each role's KV capacity before deploying."""
    warnings = []
    for role in all_roles(service):
        capacity = sized(capacities, role)
        if capacity is not None:
            warnings += [f"tier {role.tier.name} / {role.name}: {w}" for w in capacity.warnings()]
    return warnings


def pod_label_meta(label: str) -> str:
    """The Prometheus Kubernetes discovery label of a pod label: ``app.kubernetes.io/component``
    -> ``__meta_kubernetes_pod_label_app_kubernetes_io_component``."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def pod_monitor(service: InferenceService) -> K8sObject:
    """One PodMonitor scraping every engine and router pod of the service: the engines on
    their serving port, the routers on their metrics port (their serving port answers 404 for
    /metrics: the exposition names tenants and replicas, which clients must not read)."""
    meta = object_meta(
        service, names.bounded_name(service.name, "metrics"), names.service_labels(service.name)
    )
    interval = format_duration(service.spec.monitoring.scrape_interval)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": {names.LABEL_SERVICE: service.name}},
            # Copied onto every series (as fleetpilot_dev_service, ...): the autoscaler's
            # PromQL selects a tier's role by them.
            "podTargetLabels": [names.LABEL_SERVICE, names.LABEL_TIER, names.LABEL_ROLE],
            "podMetricsEndpoints": [
                {
                    "port": "http",
                    "path": "/metrics",
                    "interval": interval,
                    # The routers' pods have an "http" port too; theirs is scraped below.
                    "relabelings": [
                        {
                            "action": "keep",
                            "sourceLabels": [pod_label_meta(names.LABEL_COMPONENT)],
                            "regex": "engine",
                        }
                    ],
                },
                {"port": METRICS_PORT_NAME, "path": "/metrics", "interval": interval},
            ],
        },
    }


def plan(service: InferenceService, options: PlanOptions | None = None) -> list[K8sObject]:
    """Every object the service owns, dependencies first."""
    options = options or PlanOptions()
    return [p.obj for p in _planned(service, options, role_capacities(service))]


def plan_service(service: InferenceService, options: PlanOptions | None = None) -> ServicePlan:
    """The service planned once, for a pass of the operator: its objects with what each waits
    for, or the refusal; its downloads and role sizes either way (the status reports them)."""
    options = options or PlanOptions()
    capacities = role_capacities(service)
    downloads = tuple(download for download, _ in planned_downloads(service, options))
    try:
        objects = _planned(service, options, capacities)
    except PlanError as exc:
        return ServicePlan((), downloads, capacities, exc.refusal)
    return ServicePlan(tuple(objects), downloads, capacities)


def _planned(
    service: InferenceService, options: PlanOptions, capacities: Capacities
) -> list[Planned]:
    """Every object the service owns, dependencies first, each with what it waits for: an
    engine workload for its model's downloads; the model cache's GC Job for every download
    and every engine workload's rollout to them."""
    check(service, options, capacities)
    roles = all_roles(service)

    def ready(objects: list[K8sObject]) -> list[Planned]:
        return [Planned(obj) for obj in objects]

    # Policies first: no engine pod ever runs before the rules that guard it exist.
    planned = ready(network_policies(service, options.operator_namespace))
    planned += ready(router_objects(service, options, capacities))
    claim = cache_claim(service)
    planned += ready([claim] if claim is not None else [])
    downloads = planned_downloads(service, options)
    planned += ready([job for _, job in downloads])
    planned.append(Planned(engine_service_account(service)))
    planned += ready([engine_service(service, role) for role in roles])
    for role in roles:
        workload = (
            engine_leader_worker_set(service, role, options)
            if names.spans_nodes(role)
            else engine_deployment(service, role, options)
        )
        jobs = fetch_job_names(service, role.tier, options)
        planned.append(Planned(workload, tuple(JobComplete(job) for job in jobs)))
    planned += ready([engine_pdb(service, role) for role in roles])
    # After the engines: it waits for their rollout, which a reconcile may have just started.
    engines = [names.engine_workload(service.name, role) for role in roles]
    fetches = [download.job for download, _ in downloads]
    collection = collection_job(service, options, [name for _, name in engines], fetches)
    if collection is not None:
        waits: list[Dependency] = [JobComplete(job) for job in fetches]
        waits += [RolledOut(kind, name) for kind, name in engines]
        planned.append(Planned(collection, tuple(waits)))
    wants_monitor = service.spec.monitoring.pod_monitor is PodMonitorMode.AUTO
    if wants_monitor and options.pod_monitor_available:
        planned.append(Planned(pod_monitor(service)))
    planned += ready(
        gateway_objects(
            service,
            inference_pools=options.inference_pools_available,
            http_routes=options.http_routes_available,
        )
    )
    return planned
