"""NetworkPolicies of a service: who may reach its engine and router pods. Purely computational.

Engines trust whoever reaches them: the OpenAI API has no authentication, and the P/D hand-off
(vLLM's NIXL side channel, the reference engine's ``/internal/kv``) hands out a prompt's KV
blocks and token ids to any peer that asks. So, per service:

* engine pods accept the serving port and the KV-event ports (the PUB and replay sockets of
  ``--kv-events-config``, every data-parallel rank's) only from the service's router pods,
  which index what each engine caches; every port from the
  service's own engine pods (the KV hand-off: the reference engine serves it on the serving
  port, vLLM's NixlConnector on its side-channel port, 5600 + rank by default, and NIXL/UCX
  moves the blocks over ports it picks at run time, so no fixed list would keep P/D working);
  and the serving port, which also serves ``/metrics``, from the namespaces in
  ``spec.networkPolicy.metricsNamespaces`` (where Prometheus runs); and, when a tier loads
  LoRA adapters at run time (``lora.dynamic``), the serving port from the operator's pods
  (the chart's ``app.kubernetes.io/component: operator`` and ``part-of: fleetpilot`` labels,
  in the operator's namespace), which call the engines' load/unload endpoints;
* router pods accept their API port from anywhere: they are the fleet's endpoint; and their
  metrics port (``/metrics``, which names replicas, tenants and per-tenant counts) only from
  the namespaces in ``spec.networkPolicy.metricsNamespaces``, as the engines' scrape, and from
  the service's router pods, which read each other's in-flight counts there;
* behind an inference gateway (``routing.gateway``) the gateway's proxies ask the router's
  endpoint picker port and send each request to the engine picked, on the serving port: both
  from ``routing.gateway.proxyNamespaces``, or from anywhere when it names none (a managed
  gateway's proxies run outside the cluster, where no namespace selects them).

What this does not cover, by design of NetworkPolicy: kubelet probes come from the node and
most CNIs always allow them; a pod in the namespace that copies the engine or router labels is
let in (whoever may create pods there is trusted); and nothing is enforced at all without a
CNI that implements NetworkPolicy. Only ingress is restricted: egress (model downloads, the
router's Kubernetes API watch) stays open.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetpilot.api import InferenceService
from fleetpilot.engine.vllm_args import ENGINE_PORT, kv_event_ports, launch_for
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, object_meta
from fleetpilot.operator.router_objects import ROUTER_EPP_PORT, ROUTER_METRICS_PORT, ROUTER_PORT

API_VERSION = "networking.k8s.io/v1"
# Set by the API server on every namespace since Kubernetes 1.21: selects namespaces by name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# The chart's labels on the operator's pods (charts/fleetpilot/templates/deployment.yaml).
OPERATOR_POD_LABELS = {
    names.LABEL_COMPONENT: "operator",
    "app.kubernetes.io/part-of": "fleetpilot",
}


def engines_policy_name(service: str) -> str:
    return names.bounded_name(service, "engines")


def _tcp(*ports: int) -> list[K8sObject]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _router_ports(service: InferenceService) -> list[int]:
    """The serving port, then every KV-event port of any engine of the service, ascending."""
    events = {
        port
        for tier in service.spec.tiers
        for role in tier.roles()
        for _, port in kv_event_ports(launch_for(role))
    }
    return [ENGINE_PORT, *sorted(events - {ENGINE_PORT})]


def _operator_peer(operator_namespace: str | None) -> K8sObject:
    namespaces: K8sObject = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}} if operator_namespace else {}
    )
    return {"podSelector": {"matchLabels": OPERATOR_POD_LABELS}, "namespaceSelector": namespaces}


def _namespaces_peer(namespaces: Sequence[str]) -> K8sObject:
    """A peer of every pod in the namespaces of these names."""
    selector = {
        "matchExpressions": [
            {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": list(namespaces)}
        ]
    }
    return {"namespaceSelector": selector}


def _scrapers(service: InferenceService) -> K8sObject | None:
    """The peer of ``spec.networkPolicy.metricsNamespaces`` (where Prometheus runs); None when
    it names none."""
    scrapers = service.spec.network_policy.metrics_namespaces
    return _namespaces_peer(scrapers) if scrapers else None


def _gateway_rule(service: InferenceService, port: int) -> K8sObject | None:
    """``port`` open to the gateway's proxies (``routing.gateway``; None without it): from
    its ``proxyNamespaces``, or from anywhere when it names none."""
    gateway = service.spec.routing.gateway
    if gateway is None:
        return None
    rule: K8sObject = {"ports": _tcp(port)}
    if gateway.proxy_namespaces:
        rule["from"] = [_namespaces_peer(gateway.proxy_namespaces)]
    return rule


def engine_policy(service: InferenceService, operator_namespace: str | None = None) -> K8sObject:
    """Ingress of the engine pods: the router, peer engines, the metrics scrape, the
    operator when it loads adapters into them, and a gateway's proxies."""
    ingress: list[K8sObject] = [
        {
            "from": [{"podSelector": {"matchLabels": names.router_selector(service.name)}}],
            "ports": _tcp(*_router_ports(service)),
        },
        # No ports: the KV hand-off's ports are not all known in advance (module docstring).
        {"from": [{"podSelector": {"matchLabels": names.engines_selector(service.name)}}]},
    ]
    scrapers = _scrapers(service)
    if scrapers is not None:
        ingress.append({"from": [scrapers], "ports": _tcp(ENGINE_PORT)})
    if any(tier.lora is not None and tier.lora.dynamic for tier in service.spec.tiers):
        ingress.append({"from": [_operator_peer(operator_namespace)], "ports": _tcp(ENGINE_PORT)})
    gateway = _gateway_rule(service, ENGINE_PORT)
    if gateway is not None:
        ingress.append(gateway)
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            service, engines_policy_name(service.name), names.service_labels(service.name)
        ),
        "spec": {
            "podSelector": {"matchLabels": names.engines_selector(service.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def router_policy(service: InferenceService) -> K8sObject:
    """Ingress of the router pods: their API port from anywhere (clients, probes), their
    metrics port from each other and the metrics namespaces, their picker port from a
    gateway's proxies."""
    ingress: list[K8sObject] = [{"ports": _tcp(ROUTER_PORT)}]
    # The router replicas read each other's in-flight counts there (``routing.peers``).
    peers = {"podSelector": {"matchLabels": names.router_selector(service.name)}}
    ingress.append({"from": [peers], "ports": _tcp(ROUTER_METRICS_PORT)})
    scrapers = _scrapers(service)
    if scrapers is not None:
        ingress.append({"from": [scrapers], "ports": _tcp(ROUTER_METRICS_PORT)})
    gateway = _gateway_rule(service, ROUTER_EPP_PORT)
    if gateway is not None:
        ingress.append(gateway)
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            service, names.router_name(service.name), names.service_labels(service.name)
        ),
        "spec": {
            "podSelector": {"matchLabels": names.router_selector(service.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def network_policies(
    service: InferenceService, operator_namespace: str | None = None
) -> list[K8sObject]:
    """The service's NetworkPolicies, or none when ``spec.networkPolicy.enabled`` is false."""
    if not service.spec.network_policy.enabled:
        return []
    return [engine_policy(service, operator_namespace), router_policy(service)]
