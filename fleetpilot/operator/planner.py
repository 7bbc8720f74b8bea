"""``plan(service) -> objects``: everything a service becomes in the cluster.

Purely computational: no I/O, no clock, no randomness. The same service always yields the
same objects in the same order (dependencies first), so the operator can apply them
idempotently and ``fleetpilot plan`` shows a GitOps user exactly what will be applied.
A service that cannot be realized raises :class:`PlanError` before any object is produced,
so nothing is ever half-applied.
"""

from __future__ import annotations

from fleetpilot.api import InferenceService, ResolvedRole
from fleetpilot.api.capacity import (
    RESERVE_BYTES_PER_GPU,
    format_bytes,
    role_capacity,
    smallest_fitting_tensor,
)
from fleetpilot.api.spec import PodMonitorMode, Tier
from fleetpilot.api.units import format_duration
from fleetpilot.kube import names
from fleetpilot.operator.engine_objects import engine_deployment, engine_pdb, engine_service
from fleetpilot.operator.model_cache import cache_claim, collection_job, fetch_jobs
from fleetpilot.operator.network_policy import network_policies
from fleetpilot.operator.plan_types import (
    K8sObject,
    PlanError,
    PlanOptions,
    object_meta,
)
from fleetpilot.operator.router_objects import router_objects

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
    """Every role of every tier, in spec order: one engine Deployment each."""
    return [role for tier in service.spec.tiers for role in tier.roles()]


def model_cache_collection(service: InferenceService, options: PlanOptions) -> K8sObject | None:
    """The model cache's GC Job, waiting for every engine Deployment's rollout (none without
    a cache the operator created)."""
    engines = [names.engine_name(service.name, r.tier.name, r.name) for r in all_roles(service)]
    return collection_job(service, options, engines)


def _tier_field(service: InferenceService, role: ResolvedRole) -> str:
    """Where a role's tier sits in the spec, for error messages: ``spec.tiers[1]``."""
    index = next(i for i, tier in enumerate(service.spec.tiers) if tier.name == role.tier.name)
    return f"spec.tiers[{index}]"


def check(service: InferenceService) -> None:
    """Refuse what the CRD schema allows but the planner cannot realize."""
    seen: dict[str, str] = {names.router_name(service.name): "the router"}
    for role in all_roles(service):
        # Tier "a" in P/D mode and a unified tier "a-decode" would both name "svc-a-decode".
        derived = names.engine_name(service.name, role.tier.name, role.name)
        owner = f"tier {role.tier.name!r} role {role.name}"
        if derived in seen:
            raise PlanError(
                f"{_tier_field(service, role)}.name",
                f"{owner} and {seen[derived]} would both be named {derived!r}; rename a tier",
            )
        seen[derived] = owner
    for role in all_roles(service):
        tier = role.tier
        where = _tier_field(service, role)
        gpus = role.parallelism.gpus
        per_node = tier.resources.gpus_per_node
        if gpus > per_node:
            raise PlanError(
                f"{where}.parallelism",
                f"tier {tier.name!r} role {role.name} needs {gpus} GPUs per replica "
                f"(tensor x pipeline x data) but resources.gpusPerNode is {per_node}; "
                "multi-node replicas are not supported yet",
            )
        _check_capacity(role, where)
        _check_run_time_adapters(tier, where, service.spec.model_cache is not None)
        for i, arg in enumerate(tier.engine.extra_args):
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise PlanError(
                    f"{where}.engine.extraArgs[{i}]",
                    f"{flag} is set by fleetpilot from the spec; change the matching "
                    "spec field instead",
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


def _check_capacity(role: ResolvedRole, where: str) -> None:
    """Refuse a role whose weights leave its GPUs no room for a KV cache, naming the numbers
    and the smallest tensor-parallel size that fits (roles the planner cannot size pass)."""
    sized = role_capacity(role)
    if sized is None or sized.fits:
        return
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


def capacity_warnings(service: InferenceService) -> list[str]:
    """What a user should know about each role's KV capacity before deploying."""
    warnings = []
    for role in all_roles(service):
        sized = role_capacity(role)
        if sized is not None:
            warnings += [f"tier {role.tier.name} / {role.name}: {w}" for w in sized.warnings()]
    return warnings


def pod_monitor(service: InferenceService) -> K8sObject:
    """One PodMonitor scraping every engine and router pod of the service."""
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
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": interval}],
        },
    }


def plan(service: InferenceService, options: PlanOptions | None = None) -> list[K8sObject]:
    """Every object the service owns, dependencies first."""
    options = options or PlanOptions()
    check(service)
    roles = all_roles(service)
    # Policies first: no engine pod ever runs before the rules that guard it exist.
    objects = network_policies(service, options.operator_namespace)
    objects += router_objects(service, options)
    claim = cache_claim(service)
    objects += [claim] if claim is not None else []
    objects += fetch_jobs(service, options)
    objects += [engine_service(service, role) for role in roles]
    objects += [engine_deployment(service, role, options) for role in roles]
    objects += [engine_pdb(service, role) for role in roles]
    # After the engines: it waits for their rollout, which a reconcile may have just started.
    collection = model_cache_collection(service, options)
    objects += [collection] if collection is not None else []
    wants_monitor = service.spec.monitoring.pod_monitor is PodMonitorMode.AUTO
    if wants_monitor and options.pod_monitor_available:
        objects.append(pod_monitor(service))
    return objects
