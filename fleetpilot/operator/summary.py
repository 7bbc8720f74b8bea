"""A readable account of a plan: per tier and role, replicas, GPUs, capacity and the engine
command. No I/O: a plan in, text out."""

from __future__ import annotations

import shlex

from fleetpilot.api import InferenceService, ResolvedRole, Tier
from fleetpilot.api.capacity import format_bytes, role_capacity
from fleetpilot.api.layout import Span, role_layout
from fleetpilot.api.spec import AutoscalingMode
from fleetpilot.api.units import format_duration
from fleetpilot.engine.reference_launch import (
    REFERENCE_DEFAULT_MAX_MODEL_LEN,
    REFERENCE_MAX_MODEL_LEN,
)
from fleetpilot.kube import names
from fleetpilot.operator.engine_objects import (
    KV_OFFLOAD_MEMORY_MARGIN_PERCENT,
    REFERENCE_RESOURCES,
    engine_command,
    engine_memory,
    is_reference,
    pod_kv_offload_bytes,
    reference_resources,
)
from fleetpilot.operator.gateway_objects import http_route_name, inference_pool_name
from fleetpilot.operator.model_delivery import weights_summary
from fleetpilot.operator.plan_types import K8sObject
from fleetpilot.operator.planner import all_roles, capacity_warnings, not_sized_reasons, tier_field
from fleetpilot.operator.router_objects import ROUTER_EPP_PORT, endpoint_url


def host_tier_lines(role: ResolvedRole, tokens: str = "") -> list[str]:
    """The role's host KV tier (``engine.kvOffload``): what it holds (``tokens``, when sized),
    its size, and the engine pod's memory that pays for it; nothing without one."""
    offload = role.engine.kv_offload
    if offload is None:
        return []
    data = role.parallelism.data
    size = f"engine.kvOffload.size {offload.size}" + (
        f" x {data} data-parallel ranks" if data > 1 else ""
    )
    held = (
        f"{tokens}  ({size}, {offload.backend.value})"
        if tokens
        else f"{size}, {offload.backend.value}"
    )
    reference = is_reference(role.tier)
    base = (
        f"the reference engine's {REFERENCE_RESOURCES['requests']['memory']}"
        if reference
        else f"resources.memory {role.tier.resources.memory}"
    )
    shm = "" if reference else "; /dev/shm, where vLLM maps it, grown to fit"
    return [
        f"    host KV cache per replica: {held}",
        f"    pod memory: {engine_memory(role)}  ({base} + "
        f"{format_bytes(pod_kv_offload_bytes(role))} of host KV cache + "
        f"{KV_OFFLOAD_MEMORY_MARGIN_PERCENT}%{shm})",
    ]


def capacity_lines(role: ResolvedRole, where: str = "tier") -> list[str]:
    """A replica's weights, LoRA slots and KV cache in GPU memory and, with
    ``engine.kvOffload``, in host memory (``capacity``), or why it is not sized, naming the
    fields to set (``where``: the tier's place in the spec, ``spec.tiers[0]``)."""
    sized = role_capacity(role)
    if sized is None:
        return [
            f"    capacity: not sized: {'; '.join(not_sized_reasons(role, where))}",
            *host_tier_lines(role),
        ]
    seqs = sized.sequences_at_max_len
    at_len = f", {seqs} sequences of {sized.max_model_len}" if seqs is not None else ""
    lora = []
    if sized.lora is not None:
        slots = f"{sized.lora.max_loras} x rank {sized.lora.max_lora_rank}"
        taken = (
            f"{format_bytes(sized.lora_bytes_per_gpu)} per GPU"
            if sized.lora_bytes_per_gpu is not None
            else "not counted (the model's layer widths are unknown)"
        )
        lora.append(f"    LoRA slots: {slots}: {taken}")
    host_seqs = sized.host_sequences_at_max_len
    host_at_len = (
        f", {host_seqs} sequences of {sized.max_model_len}" if host_seqs is not None else ""
    )
    return [
        f"    weights per GPU: {format_bytes(sized.weights_per_gpu_bytes)} of "
        f"{format_bytes(sized.gpu_memory_bytes)}"
        f"  (architecture from the {sized.architecture_source})",
        *lora,
        f"    KV cache per replica: {max(0, sized.kv_tokens):,} tokens{at_len}"
        f"  ({format_bytes(sized.kv_bytes_per_token)} a token); maxNumSeqs {sized.max_num_seqs}",
        *host_tier_lines(role, f"{sized.host_kv_tokens:,} tokens{host_at_len}"),
    ]


def adapter_lines(tier: Tier) -> list[str]:
    """The tier's LoRA adapters, where each comes from, and how the engines hold them."""
    lora = tier.lora_settings
    if lora is None:
        return []
    cpu = lora.max_cpu_loras if lora.max_cpu_loras is not None else lora.max_loras
    lines = [
        f"    LoRA: up to {lora.max_loras} adapters in a batch, {cpu} loaded in CPU memory, "
        f"rank <= {lora.max_lora_rank}; "
        + (
            "loaded into running engines by the operator (a changed list rolls nothing)"
            if lora.dynamic
            else "loaded at engine start (a changed list rolls the pods)"
        )
    ]
    for adapter in tier.adapters:
        hub, pvc = adapter.source.huggingface, adapter.source.pvc
        if hub is not None:
            origin = f"hub {hub.repo}" + (f"@{hub.revision}" if hub.revision else " (main)")
        else:
            assert pvc is not None  # exactly one source (the API's rule)
            origin = f"pvc {pvc.claim_name}:{pvc.path}"
        lines.append(f"    adapter {adapter.name}: {origin}")
    return lines


def layout_lines(role: ResolvedRole) -> list[str]:
    """Nodes per replica and GPUs per node, for a replica that spans nodes."""
    layout = role_layout(role)
    if not layout.multi_node:
        return []
    cut = (
        "one model copy over the nodes"
        if layout.span is Span.MODEL
        else f"{layout.data_local} data-parallel ranks per node"
    )
    return [
        f"    nodes per replica: {layout.nodes} x {layout.gpus_per_pod} GPUs per node"
        f"  ({cut}; a LeaderWorkerSet group, the leader serves the API)"
    ]


def command_lines(service: InferenceService, role: ResolvedRole) -> list[str]:
    """The engine's command line; a multi-node replica's leader's, then its workers'."""
    if not names.spans_nodes(role):
        return [f"    command: {shlex.join(engine_command(service, role))}"]
    return [
        f"    leader command: {shlex.join(engine_command(service, role))}",
        f"    worker command: {shlex.join(engine_command(service, role, worker=True))}",
    ]


def reference_lines(
    service: InferenceService, role: ResolvedRole, objects: list[K8sObject]
) -> list[str]:
    """A reference tier's engine: what it is, the pod it asks for, its image and command (as
    planned: the image is the operator's --reference-image)."""
    engine = role.tier.engine
    resources = reference_resources(role)
    context = role.tier.model.max_model_len or min(
        REFERENCE_DEFAULT_MAX_MODEL_LEN, REFERENCE_MAX_MODEL_LEN[engine.reference_model]
    )
    workload = names.engine_name(service.name, role.tier.name, role.name)
    container = next(
        (
            obj["spec"]["template"]["spec"]["containers"][0]
            for obj in objects
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] == workload
        ),
        None,
    )
    lines = [
        f"    engine: reference (CPU, no GPU; {engine.reference_model.value} preset, "
        f"context {context} tokens), "
        f"cpu {resources['requests']['cpu']} (limit {resources['limits']['cpu']}), "
        f"memory {resources['limits']['memory']} per replica",
    ]
    if container is not None:
        lines += [
            f"    image: {container['image']}",
            f"    command: {shlex.join([*container['command'], *container['args']])}",
        ]
    return [*lines, *host_tier_lines(role)]


def tenant_lines(service: InferenceService) -> list[str]:
    """Who may call the router (routing.auth), what each tenant may use and its limits, and
    what the router does when every replica is busy."""
    flow = service.spec.routing.flow_control
    lines = [
        f"  when saturated: requests wait up to {format_duration(flow.max_wait)} in fair "
        f"turns (at most {flow.max_queued:,} a router), each active tenant keeping "
        f"{flow.headroom} batch slots of a tier free"
        if flow is not None
        else "  when saturated: 429 at once"
    ]
    auth = service.spec.routing.auth
    if auth is None:
        return [*lines, "  API keys: none (every request is admitted)"]
    lines.append("  API keys (routing.auth):")
    for tenant in auth.tenants:
        ref = tenant.keys_secret_ref
        what = [f"tiers {', '.join(tenant.tiers)}" if tenant.tiers else "every tier"]
        if tenant.adapters:
            what.append(f"adapters {', '.join(tenant.adapters)}")
        if tenant.requests_per_minute:
            what.append(f"{tenant.requests_per_minute:,} requests/min")
        if tenant.tokens_per_minute:
            what.append(f"{tenant.tokens_per_minute:,} tokens/min")
        if tenant.weight != 1.0 or tenant.priority:
            what.append(f"weight {tenant.weight:g}, class {tenant.priority}")
        lines.append(f"    tenant {tenant.name}: Secret {ref.name}/{ref.key}; {'; '.join(what)}")
    return lines


def gateway_lines(service: InferenceService) -> list[str]:
    """Where an inference gateway (routing.gateway) sends the service's requests from."""
    gateway = service.spec.routing.gateway
    if gateway is None:
        return []
    pool = inference_pool_name(service.name)
    picker = f"{names.router_name(service.name)}:{ROUTER_EPP_PORT}"
    lines = [
        f"  inference gateway: InferencePool {pool}, endpoint picker {picker} (TLS; "
        f"{gateway.failure_mode.value})"
    ]
    if not gateway.parent_refs:
        return [*lines, "    no HTTPRoute: route to the pool from one of your own"]
    parents = ", ".join(
        f"{ref.namespace or service.namespace}/{ref.name}"
        + (f" ({ref.section_name})" if ref.section_name else "")
        for ref in gateway.parent_refs
    )
    hosts = f" for {', '.join(gateway.hostnames)}" if gateway.hostnames else ""
    return [*lines, f"    HTTPRoute {http_route_name(service.name)} from Gateway {parents}{hosts}"]


# What the summary says of an autoscaled tier when no Prometheus is known: the operator's
# autoscaler reads none (operator.handlers.autoscale), so its replicas stay where they are.
NO_PROMETHEUS = (
    "not autoscaled: no Prometheus (pass --prometheus-url or set prometheusURL, the chart "
    "value, or spec.monitoring.prometheusUrl)"
)
# The modes fleetpilot's own autoscaler decides for (autoscaler.loop.autoscaled_roles).
_OUR_MODES = (AutoscalingMode.AUTO, AutoscalingMode.RECOMMEND)


def autoscaling_lines(
    service: InferenceService, tier: Tier, prometheus_url: str | None
) -> list[str]:
    """That the tier is not autoscaled for want of a Prometheus (none given, the service
    naming none); nothing for a tier the autoscaler does not decide for, or with one."""
    if tier.autoscaling.mode not in _OUR_MODES:
        return []
    if prometheus_url or service.spec.monitoring.prometheus_url:
        return []
    return [f"    {NO_PROMETHEUS}"]


def summarize(
    service: InferenceService, objects: list[K8sObject], prometheus_url: str | None = None
) -> str:
    """Plain text for a person; the YAML/JSON output is for machines. ``prometheus_url``:
    the operator's (``fleetpilot plan --prometheus-url``); without it, and without the
    service's own, its autoscaled tiers are said not to be."""
    lines = [f"InferenceService {service.namespace}/{service.name}"]
    lines.append(f"  endpoint: {endpoint_url(service)}  (router x{service.spec.routing.replicas})")
    lines += gateway_lines(service)
    lines += tenant_lines(service)
    total_start = total_max = 0
    for role in all_roles(service):
        tier = role.tier
        bounds = role.replicas
        lines += [
            "",
            f"  tier {tier.name} / {role.name}: model {tier.model.alias}"
            f" (complexity <= {tier.complexity.up_to:g})",
            f"    replicas: {bounds.start} now, {bounds.min}..{bounds.max} autoscaled"
            f" ({tier.autoscaling.mode.value})",
            *autoscaling_lines(service, tier, prometheus_url),
            f"    weights: {weights_summary(service, tier)}",
        ]
        if is_reference(tier):
            lines += reference_lines(service, role, objects)
            continue
        gpus = role.parallelism.gpus
        total_start += gpus * bounds.start
        total_max += gpus * bounds.max
        product = tier.resources.gpu_product or "any GPU"
        p = role.parallelism
        lines += [
            "    engine: vllm",
            f"    GPUs per replica: {gpus} x {product}"
            f"  (tensor {p.tensor} x pipeline {p.pipeline} x data {p.data}"
            f"{', expert parallel' if p.expert else ''})",
            *layout_lines(role),
            *capacity_lines(role, tier_field(service, role)),
            *adapter_lines(tier),
            f"    image: {tier.engine.image}",
            *command_lines(service, role),
        ]
    lines += [
        "",
        f"  GPUs: {total_start} at start, up to {total_max} at max scale",
        *(f"  warning: {w}" for w in capacity_warnings(service)),
        "",
        f"  objects ({len(objects)}):",
    ]
    lines += [f"    {obj['kind']}/{obj['metadata']['name']}" for obj in objects]
    return "\n".join(lines)
