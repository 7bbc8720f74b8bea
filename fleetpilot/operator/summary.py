"""A readable account of a plan: per tier and role, replicas, GPUs and the engine command."""

from __future__ import annotations

import shlex

from fleetpilot.api import InferenceService
from fleetpilot.operator.engine_objects import engine_command
from fleetpilot.operator.plan_types import K8sObject
from fleetpilot.operator.planner import all_roles
from fleetpilot.operator.router_objects import endpoint_url


def summarize(service: InferenceService, objects: list[K8sObject]) -> str:
    """Plain text for a person; the YAML/JSON output is for machines."""
    lines = [f"InferenceService {service.namespace}/{service.name}"]
    lines.append(f"  endpoint: {endpoint_url(service)}  (router x{service.spec.routing.replicas})")
    total_start = total_max = 0
    for role in all_roles(service):
        tier = role.tier
        gpus = role.parallelism.gpus
        bounds = role.replicas
        total_start += gpus * bounds.start
        total_max += gpus * bounds.max
        product = tier.resources.gpu_product or "any GPU"
        p = role.parallelism
        lines += [
            "",
            f"  tier {tier.name} / {role.name}: model {tier.model.alias}"
            f" (complexity <= {tier.complexity.up_to:g})",
            f"    replicas: {bounds.start} now, {bounds.min}..{bounds.max} autoscaled"
            f" ({tier.autoscaling.mode.value})",
            f"    GPUs per replica: {gpus} x {product}"
            f"  (tensor {p.tensor} x pipeline {p.pipeline} x data {p.data})",
            f"    image: {tier.engine.image}",
            f"    command: {shlex.join(engine_command(role))}",
        ]
    lines += [
        "",
        f"  GPUs: {total_start} at start, up to {total_max} at max scale",
        "",
        f"  objects ({len(objects)}):",
    ]
    lines += [f"    {obj['kind']}/{obj['metadata']['name']}" for obj in objects]
    return "\n".join(lines)
