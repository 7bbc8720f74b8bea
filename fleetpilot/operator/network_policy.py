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
  ``spec.networkPolicy.metricsNamespaces`` (where Prometheus runs);
* router pods accept their port from anywhere: they are the fleet's endpoint.

What this does not cover, by design of NetworkPolicy: kubelet probes come from the node and
most CNIs always allow them; a pod in the namespace that copies the engine or router labels is
let in (whoever may create pods there is trusted); and nothing is enforced at all without a
CNI that implements NetworkPolicy. Only ingress is restricted: egress (model downloads, the
router's Kubernetes API watch) stays open.
"""

from __future__ import annotations

from fleetpilot.api import InferenceService
from fleetpilot.engine.vllm_args import ENGINE_PORT, kv_event_ports, launch_for
from fleetpilot.kube import names
from fleetpilot.operator.plan_types import K8sObject, object_meta
from fleetpilot.operator.router_objects import ROUTER_PORT

API_VERSION = "networking.k8s.io/v1"
# Set by the API server on every namespace since Kubernetes 1.21: selects namespaces by name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


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


def engine_policy(service: InferenceService) -> K8sObject:
    """Ingress of the engine pods: the router, peer engines, and the metrics scrape."""
    ingress: list[K8sObject] = [
        {
            "from": [{"podSelector": {"matchLabels": names.router_selector(service.name)}}],
            "ports": _tcp(*_router_ports(service)),
        },
        # No ports: the KV hand-off's ports are not all known in advance (module docstring).
        {"from": [{"podSelector": {"matchLabels": names.engines_selector(service.name)}}]},
    ]
    scrapers = service.spec.network_policy.metrics_namespaces
    if scrapers:
        selector = {
            "matchExpressions": [
                {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": list(scrapers)}
            ]
        }
        ingress.append({"from": [{"namespaceSelector": selector}], "ports": _tcp(ENGINE_PORT)})
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
    """Ingress of the router pods: their port, from anywhere (clients, Prometheus, probes)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": object_meta(
            service, names.router_name(service.name), names.service_labels(service.name)
        ),
        "spec": {
            "podSelector": {"matchLabels": names.router_selector(service.name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": _tcp(ROUTER_PORT)}],
        },
    }


def network_policies(service: InferenceService) -> list[K8sObject]:
    """The service's NetworkPolicies, or none when ``spec.networkPolicy.enabled`` is false."""
    if not service.spec.network_policy.enabled:
        return []
    return [engine_policy(service), router_policy(service)]
