"""A service behind an inference gateway (``routing.gateway``): the InferencePool of its engine
pods, whose endpoint picker is the router, and the HTTPRoute from the named Gateways to it.
Purely computational.

The pool selects every engine pod of the service, whatever its tier and role: the router picks
among them by its own discovery, so the pool only has to hold every pod it may pick. A
multi-node replica's workers are in it too (an InferencePool selects by labels alone, and a
label only the serving pods carried would restart every engine that gained it); nothing picks
them. Engines serve HTTP/1.1 on ENGINE_PORT: the pool's default appProtocol.
"""

from __future__ import annotations

import math
from datetime import timedelta

from fleetpilot.api import InferenceService
from fleetpilot.api.spec import GatewayRouting
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, object_meta
from fleetpilot.operator.router_objects import ROUTER_EPP_PORT

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_GROUP = INFERENCE_POOL_API.split("/")[0]
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
GATEWAY_GROUP = HTTP_ROUTE_API.split("/")[0]
# The Gateway API's Duration allows at most five digits a unit.
MAX_ROUTE_SECONDS = 99_999


def inference_pool_name(service: str) -> str:
    """The pool is the service as a gateway sees it: it carries the service's name."""
    return service


def http_route_name(service: str) -> str:
    return service


def route_timeout(request_timeout: timedelta) -> str:
    """The HTTPRoute's request timeout: the router's ``requestTimeout`` in whole seconds,
    rounded up. Without one a gateway applies its own default (Envoy's is 15 s), which cuts
    off a long streamed answer the router would have let finish."""
    seconds = max(1, math.ceil(request_timeout.total_seconds()))
    if seconds <= MAX_ROUTE_SECONDS:
        return f"{seconds}s"
    return f"{math.ceil(seconds / 3600)}h"


def inference_pool(service: InferenceService, gateway: GatewayRouting) -> K8sObject:
    """The service's engine pods as an InferencePool, picked for by the router's Service."""
    labels = names.service_labels(service.name)
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": object_meta(service, inference_pool_name(service.name), labels),
        "spec": {
            "selector": {"matchLabels": names.engines_selector(service.name)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": names.router_name(service.name),
                "port": {"number": ROUTER_EPP_PORT},
                "failureMode": gateway.failure_mode.value,
            },
        },
    }


def http_route(service: InferenceService, gateway: GatewayRouting) -> K8sObject:
    """Every request from the named Gateways (on ``hostnames``, if any) to the pool."""
    parents: list[K8sObject] = []
    for ref in gateway.parent_refs:
        parent: K8sObject = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": ref.name}
        if ref.namespace is not None:
            parent["namespace"] = ref.namespace
        if ref.section_name is not None:
            parent["sectionName"] = ref.section_name
        parents.append(parent)
    spec: K8sObject = {"parentRefs": parents}
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    spec["rules"] = [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
            "backendRefs": [
                {
                    "group": INFERENCE_POOL_GROUP,
                    "kind": "InferencePool",
                    "name": inference_pool_name(service.name),
                }
            ],
            "timeouts": {"request": route_timeout(service.spec.routing.request_timeout)},
        }
    ]
    return {
        "apiVersion": HTTP_ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": object_meta(
            service, http_route_name(service.name), names.service_labels(service.name)
        ),
        "spec": spec,
    }


def gateway_objects(
    service: InferenceService, *, inference_pools: bool = True, http_routes: bool = True
) -> list[K8sObject]:
    """The InferencePool and, with ``parentRefs``, the HTTPRoute; none without
    ``routing.gateway``, and none of a kind the cluster does not serve (``inference_pools``,
    ``http_routes``: the status then says what is missing)."""
    gateway = service.spec.routing.gateway
    if gateway is None:
        return []
    objects = [inference_pool(service, gateway)] if inference_pools else []
    if gateway.parent_refs and http_routes and inference_pools:
        objects.append(http_route(service, gateway))
    return objects
