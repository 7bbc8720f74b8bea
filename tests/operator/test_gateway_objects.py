"""``routing.gateway`` planned: the InferencePool of the engine pods with the router as its
endpoint picker, the HTTPRoute from the named Gateways, and every other object that has to
agree with them (the router's config, pod and Service, the NetworkPolicies). The official
schemas judge the same objects in e2e/test_operator.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import yaml

from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, RouterConfig
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.operator.gateway_objects import route_timeout
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import EPP_PORT_NAME, ROUTER_EPP_PORT
from fleetpilot.operator.summary import summarize
from tests.factories import make_service, make_tier

GATEWAY = {
    "parentRefs": [{"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"}],
    "hostnames": ["chat.example.com"],
}


def planned(gateway: dict[str, Any] | None = None, **options: Any) -> list[K8sObject]:
    routing: dict[str, Any] = {"requestTimeout": "10m"}
    if gateway is not None:
        routing["gateway"] = gateway
    tiers = [make_tier("small", up_to=0.4), make_tier("large", mode="disaggregated")]
    service = make_service(tiers=tiers, uid="1234", routing=routing)
    return plan(service, PlanOptions(**options))


def one(objects: list[K8sObject], kind: str, name: str | None = None) -> K8sObject:
    found = [o for o in objects if o["kind"] == kind]
    if name is not None:
        found = [o for o in found if o["metadata"]["name"] == name]
    (obj,) = found
    return obj


def router_config(objects: list[K8sObject]) -> RouterConfig:
    config_map = one(objects, "ConfigMap", names.router_name("chat"))
    return RouterConfig.model_validate(yaml.safe_load(config_map["data"][ROUTER_CONFIG_FILE]))


def test_the_pool_holds_every_engine_pod_and_names_the_routers_picker_port() -> None:
    objects = planned(GATEWAY)
    pool = one(objects, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "chat"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "1234"
    spec = pool["spec"]
    # Every engine pod of both tiers (prefill and decode included) carries these labels.
    selector = spec["selector"]["matchLabels"]
    for deployment in [o for o in objects if o["kind"] == "Deployment"]:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        is_engine = labels.get(names.LABEL_COMPONENT) == "engine"
        assert is_engine == (selector.items() <= labels.items()), deployment["metadata"]["name"]
    assert spec["targetPorts"] == [{"number": ENGINE_PORT}]
    picker = spec["endpointPickerRef"]
    assert picker == {
        "group": "",
        "kind": "Service",
        "name": names.router_name("chat"),
        "port": {"number": ROUTER_EPP_PORT},
        "failureMode": "FailClose",
    }
    # The referenced Service port exists, reaches the router pod's picker port, and the
    # router serves the picker there, over TLS.
    service = one(objects, "Service", names.router_name("chat"))
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ROUTER_EPP_PORT]
    assert port["targetPort"] == EPP_PORT_NAME
    # As GIE's chart: no appProtocol (the picker's own TLS is no cleartext HTTP/2).
    assert "appProtocol" not in port
    router = one(objects, "Deployment", names.router_name("chat"))
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert {"name": EPP_PORT_NAME, "containerPort": ROUTER_EPP_PORT, "protocol": "TCP"} in (
        container["ports"]
    )
    config = router_config(objects)
    assert (config.epp_port, config.epp_tls) == (ROUTER_EPP_PORT, True)


def test_the_route_sends_the_named_gateways_requests_to_the_pool() -> None:
    route = one(planned(GATEWAY), "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": "gateways",
            "sectionName": "http",
        }
    ]
    assert spec["hostnames"] == ["chat.example.com"]
    (rule,) = spec["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat"}
    ]
    # The router's requestTimeout, not the gateway's default (Envoy's 15 s cuts streams).
    assert rule["timeouts"] == {"request": "600s"}


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (timedelta(minutes=10), "600s"),
        (timedelta(milliseconds=1500), "2s"),
        (timedelta(milliseconds=10), "1s"),
        (timedelta(seconds=99_999), "99999s"),
        (timedelta(days=2), "48h"),
    ],
)
def test_the_route_timeout_fits_the_gateway_apis_duration(
    timeout: timedelta, expected: str
) -> None:
    assert route_timeout(timeout) == expected


def test_without_parents_only_the_pool_is_planned_and_without_gateway_nothing() -> None:
    # FailOpen: allowed for one tier without API keys (the API's rules).
    single = make_service(routing={"gateway": {"failureMode": "FailOpen"}})
    pool_only = plan(single, PlanOptions())
    assert one(pool_only, "InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == (
        "FailOpen"
    )
    assert not [o for o in pool_only if o["kind"] == "HTTPRoute"]
    plain = planned()
    assert not [o for o in plain if o["kind"] in ("InferencePool", "HTTPRoute")]
    service = one(plain, "Service", names.router_name("chat"))
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    config = router_config(plain)
    assert (config.epp_port, config.epp_tls) == (None, False)


def test_kinds_the_cluster_does_not_serve_are_not_planned() -> None:
    no_pools = planned(GATEWAY, inference_pools_available=False)
    # A route to a pool that cannot exist would be refused by every gateway.
    assert not [o for o in no_pools if o["kind"] in ("InferencePool", "HTTPRoute")]
    no_routes = planned(GATEWAY, http_routes_available=False)
    assert one(no_routes, "InferencePool")
    assert not [o for o in no_routes if o["kind"] == "HTTPRoute"]


def ingress_on(policy: K8sObject, port: int) -> list[K8sObject]:
    return [
        rule
        for rule in policy["spec"]["ingress"]
        if {"protocol": "TCP", "port": port} in rule.get("ports", [])
    ]


def test_the_gateways_proxies_reach_the_engines_and_the_picker_from_their_namespaces() -> None:
    objects = planned({**GATEWAY, "proxyNamespaces": ["gateways", "envoy-gateway-system"]})
    engines = one(objects, "NetworkPolicy", "chat-engines")
    router = one(objects, "NetworkPolicy", names.router_name("chat"))
    selector = {
        "matchExpressions": [
            {
                "key": "kubernetes.io/metadata.name",
                "operator": "In",
                "values": ["gateways", "envoy-gateway-system"],
            }
        ]
    }
    for policy, port in ((engines, ENGINE_PORT), (router, ROUTER_EPP_PORT)):
        assert {
            "ports": [{"protocol": "TCP", "port": port}],
            "from": [{"namespaceSelector": selector}],
        } in (ingress_on(policy, port))
    # Without proxyNamespaces: from anywhere (a rule without "from").
    anywhere = planned(GATEWAY)
    engines = one(anywhere, "NetworkPolicy", "chat-engines")
    assert {"ports": [{"protocol": "TCP", "port": ENGINE_PORT}]} in ingress_on(engines, ENGINE_PORT)
    # Without a gateway the picker port is closed and engines admit only their router etc.
    plain = planned()
    assert ingress_on(one(plain, "NetworkPolicy", names.router_name("chat")), ROUTER_EPP_PORT) == []
    assert all(
        "from" in rule for rule in one(plain, "NetworkPolicy", "chat-engines")["spec"]["ingress"]
    )


def test_the_plan_summary_says_where_the_gateway_sends_from() -> None:
    routed = make_service(routing={"gateway": GATEWAY})
    text = summarize(routed, plan(routed))
    assert "inference gateway: InferencePool chat, endpoint picker chat-router:9002" in text
    assert "HTTPRoute chat from Gateway gateways/inference-gateway (http) for chat.example.com" in (
        text
    )
    unrouted = make_service(routing={"gateway": {}})
    assert "no HTTPRoute" in summarize(unrouted, plan(unrouted))
    assert "inference gateway" not in summarize(make_service(), plan(make_service()))
