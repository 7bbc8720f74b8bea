"""The planned NetworkPolicies (issue 12 item 11): engines reachable only by their fleet.

Checked against the pod templates of the same plan, so a label change on either side that
would open or close the wrong door fails here (e2e/test_network_policy.py checks the same on
pods the real control plane created).
"""

from __future__ import annotations

from typing import Any

import pytest

from fleetpilot.api import InvalidManifestError, parse_service
from fleetpilot.engine.vllm_args import ENGINE_PORT
from fleetpilot.kube import names
from fleetpilot.operator.network_policy import OPERATOR_POD_LABELS
from fleetpilot.operator.plan_types import K8sObject, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import ROUTER_METRICS_PORT, ROUTER_PORT
from tests.factories import make_manifest, make_service, make_tier

ENGINE_MATCH = {"fleetpilot.dev/service": "chat", "app.kubernetes.io/component": "engine"}
ROUTER_MATCH = {"fleetpilot.dev/service": "chat", "app.kubernetes.io/component": "router"}


def pd_plan(**spec: Any) -> list[K8sObject]:
    tiers = [make_tier("small", up_to=0.4), make_tier("large", mode="disaggregated")]
    return plan(make_service(tiers=tiers, uid="1234", **spec))


def policies(objects: list[K8sObject]) -> dict[str, K8sObject]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}


def selects(match: dict[str, str], labels: dict[str, str]) -> bool:
    return match.items() <= labels.items()


def pod_labels(objects: list[K8sObject], component: str) -> list[dict[str, str]]:
    return [
        o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]


def test_one_policy_for_the_engines_and_one_for_the_router() -> None:
    """Exactly two ingress policies per service, labelled and owned like every planned object, so
    they are pruned and garbage-collected with the service."""
    objects = pd_plan()
    found = policies(objects)
    assert set(found) == {"chat-engines", "chat-router"}
    for policy in found.values():
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["metadata"]["namespace"] == "ml"
        # Labelled and owned like every planned object: listed for pruning, collected with
        # the service.
        assert policy["metadata"]["labels"]["fleetpilot.dev/service"] == "chat"
        assert policy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "fleetpilot"
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "1234"
        assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_engine_policy_selects_every_engine_pod_and_no_router_pod() -> None:
    """The engine policy selects every engine pod of every role (a missed decode pod would stay
    open) and no router pod, and the router policy the reverse."""
    objects = pd_plan()
    engine_spec = policies(objects)["chat-engines"]["spec"]
    engines, routers = pod_labels(objects, "engine"), pod_labels(objects, "router")
    assert len(engines) == 3  # small unified, large prefill and decode
    assert all(selects(engine_spec["podSelector"]["matchLabels"], pod) for pod in engines)
    assert not any(selects(engine_spec["podSelector"]["matchLabels"], pod) for pod in routers)
    router_spec = policies(objects)["chat-router"]["spec"]
    assert all(selects(router_spec["podSelector"]["matchLabels"], pod) for pod in routers)
    assert not any(selects(router_spec["podSelector"]["matchLabels"], pod) for pod in engines)


def test_engine_ports_open_only_to_the_router_peers_and_the_scrape() -> None:
    """Regression: engines (and their KV hand-off) answered anyone who reached them. The router
    reaches the serving port and the KV-event PUB and replay ports (its KV index)."""
    rules = policies(pd_plan())["chat-engines"]["spec"]["ingress"]
    assert rules == [
        {
            "from": [{"podSelector": {"matchLabels": ROUTER_MATCH}}],
            "ports": [
                {"protocol": "TCP", "port": ENGINE_PORT},
                {"protocol": "TCP", "port": 5557},
                {"protocol": "TCP", "port": 5558},
            ],
        },
        # Every port (the KV side channel and transfers) from this service's engines only.
        {"from": [{"podSelector": {"matchLabels": ENGINE_MATCH}}]},
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/metadata.name",
                                "operator": "In",
                                "values": ["monitoring"],
                            }
                        ]
                    }
                }
            ],
            "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
        },
    ]
    # A peer rule without a namespaceSelector means "in this namespace": another service's
    # engines, which carry another fleetpilot.dev/service, are not let in.
    assert all("namespaceSelector" not in peer for peer in rules[0]["from"] + rules[1]["from"])


def test_router_api_port_is_open_to_all_and_its_metrics_port_to_the_scrapers() -> None:
    """The router is the public endpoint: its policy opens its API port to every source; its
    metrics port (tenant names, replica addresses) only to the service's router pods (which
    share their in-flight counts there) and the metrics namespaces - to the routers alone when
    none are listed."""
    rules = policies(pd_plan())["chat-router"]["spec"]["ingress"]
    engine_scrape = policies(pd_plan())["chat-engines"]["spec"]["ingress"][2]
    routers = {"podSelector": {"matchLabels": names.router_selector("chat")}}
    assert rules == [
        {"ports": [{"protocol": "TCP", "port": ROUTER_PORT}]},
        {"from": [routers], "ports": [{"protocol": "TCP", "port": ROUTER_METRICS_PORT}]},
        {
            "from": engine_scrape["from"],
            "ports": [{"protocol": "TCP", "port": ROUTER_METRICS_PORT}],
        },
    ]
    none = pd_plan(networkPolicy={"metricsNamespaces": []})
    assert policies(none)["chat-router"]["spec"]["ingress"] == rules[:2]


def test_metrics_namespaces_are_configurable_and_may_be_none() -> None:
    """spec.networkPolicy.metricsNamespaces replaces the default scrape namespaces; an empty list
    plans no scrape rule rather than one that opens to every namespace."""
    custom = pd_plan(networkPolicy={"metricsNamespaces": ["observability", "0-prom"]})
    scrape = policies(custom)["chat-engines"]["spec"]["ingress"][2]
    expression = scrape["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert expression["values"] == ["observability", "0-prom"]
    none = pd_plan(networkPolicy={"metricsNamespaces": []})
    assert len(policies(none)["chat-engines"]["spec"]["ingress"]) == 2


def test_policies_come_first_and_can_be_turned_off() -> None:
    """Applied before any Deployment, so no engine pod runs unguarded; opt-out plans none."""
    objects = pd_plan()
    kinds = [o["kind"] for o in objects]
    assert kinds[:2] == ["NetworkPolicy", "NetworkPolicy"]
    assert policies(pd_plan(networkPolicy={"enabled": False})) == {}


@pytest.mark.parametrize("namespace", ["Monitoring", "-monitoring", "a" * 64, "mon_itoring"])
def test_invalid_metrics_namespaces_are_refused(namespace: str) -> None:
    """A namespace name that is not a DNS label is refused at the manifest, not planned into a
    policy that matches nothing."""
    manifest = make_manifest(networkPolicy={"metricsNamespaces": [namespace]})
    with pytest.raises(InvalidManifestError, match="metricsNamespaces"):
        parse_service(manifest)


def test_router_reaches_every_data_parallel_ranks_kv_event_ports() -> None:
    """A tier with 2 data-parallel ranks publishes on 5557-5558 and replays on 5559-5560; the
    router's rule lets it reach all of them (and, the ports being one union, the other tier's),
    and the scrape rule still only the serving port."""
    tiers = [
        make_tier("small", up_to=0.4),
        make_tier("large", parallelism={"tensor": 1, "data": 2}),
    ]
    objects = plan(make_service(tiers=tiers, uid="1234"))
    rules = policies(objects)["chat-engines"]["spec"]["ingress"]
    assert [p["port"] for p in rules[0]["ports"]] == [ENGINE_PORT, 5557, 5558, 5559, 5560]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            declared = {p["containerPort"] for p in container.get("ports", [])}
            allowed = {p["port"] for p in rules[0]["ports"]}
            if "chat-router" not in deployment["metadata"]["name"]:
                assert declared <= allowed, deployment["metadata"]["name"]


def _dynamic_lora_tier() -> dict[str, Any]:
    tier = make_tier("small")
    tier["lora"] = {"dynamic": True}
    return tier


def test_engines_that_load_adapters_at_run_time_admit_the_operator_on_the_serving_port() -> None:
    """The operator calls `lora.dynamic` engines' load/unload endpoints: its pods (by the
    chart's labels, in its own namespace) may reach the serving port, and nothing else."""
    service = make_service(tiers=[_dynamic_lora_tier()])
    options = PlanOptions(operator_namespace="fleetpilot-system")
    engines = policies(plan(service, options))["chat-engines"]
    operator_rule = engines["spec"]["ingress"][-1]
    assert operator_rule == {
        "from": [
            {
                "podSelector": {"matchLabels": OPERATOR_POD_LABELS},
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": "fleetpilot-system"}
                },
            }
        ],
        "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
    }
    anywhere = policies(plan(service))["chat-engines"]["spec"]["ingress"][-1]
    assert anywhere["from"][0]["namespaceSelector"] == {}
    static = policies(plan(make_service(tiers=[make_tier("small")]), options))["chat-engines"]
    assert not any(
        peer.get("podSelector", {}).get("matchLabels") == OPERATOR_POD_LABELS
        for rule in static["spec"]["ingress"]
        for peer in rule["from"]
    )
