"""The chart's dashboard and alert expressions against a real Prometheus scraping a real fleet.

The local fleet (``running_stack``: a reference engine, the router, ``fleetpilot autoscaler``
and Debian's Prometheus) labels its scrape targets as the planned PodMonitor labels engine and
router pods in a cluster: ``fleetpilot.runtime.prometheus.render_config`` hands each target its
pod labels as Kubernetes service discovery would and relabels them with the same ``labelmap``
rule, so series carry ``fleetpilot_dev_service``, ``fleetpilot_dev_tier``,
``fleetpilot_dev_role`` and ``namespace`` here too (plus ``fleetpilot_dev_component``, which a
cluster's PodMonitor does not copy and nothing here reads). The dashboard's variables are
therefore substituted with the service's own names, unchanged.

Two more targets stand in for the operator pod, scraped with the operator's namespace as its
``namespace`` target label and no honorLabels, as the chart's PodMonitor does: the
autoscaler process' /metrics (``fleetpilot_autoscaler_*``), and the operator's own gauges
(``fleetpilot.operator.metrics``, set by its ``export_status`` from a service status with
Degraded=True, and the service's spec, whose tier objective it exports as
fleetpilot_slo_ttft_seconds) served from this process. Their own ``namespace`` label is stored as
``exported_namespace``, which the dashboard and the alerts must read.

Every dashboard query (variables substituted) and every rule expression is then sent to
``/api/v1/query`` and must answer 200 with status success; the core panels must have data.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from e2e.chart_support import render
from e2e.support import running_stack
from fleetpilot.operator import metrics as operator_metrics
from fleetpilot.runtime.prometheus import ScrapeTarget
from fleetpilot.runtime.stack import LocalStack, prometheus_installed
from fleetpilot.testing.polling import eventually
from tests.factories import make_local_manifest

Obj = dict[str, Any]

NAME = "observed"
NAMESPACE = "default"  # make_local_manifest's
OPERATOR_NAMESPACE = "fleetpilot-system"
MANIFEST = make_local_manifest(NAME, replicas={"min": 1, "max": 1}, ttft_p95="5s", max_num_seqs=16)
SERVICE = yaml.safe_dump(MANIFEST)
DASHBOARD = Path(__file__).resolve().parents[1] / "charts/fleetpilot/dashboards/fleetpilot.json"
VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$namespace": NAMESPACE,
    "$service": NAME,
}
# One tier, one role; and "All", as Grafana sends it for a multi-value variable.
SELECTIONS = [{"$tier": "small", "$role": "unified"}, {"$tier": ".*", "$role": ".*"}]
STATUS: Obj = {
    **MANIFEST,
    "status": {
        "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "Degraded", "status": "True", "reason": "CrashLooping"},
            {"type": "Stalled", "status": "False"},
            {"type": "ScalingActive", "status": "True"},
        ],
        "tiers": [
            {
                "name": "small",
                "roles": [{"role": "unified", "replicas": 1, "ready": 1, "desired": 1}],
            }
        ],
    },
}
RECORDED = re.compile(
    r"fleetpilot:(?:ttft|tpot)_(?:objective_seconds|seconds_bucket:rate[0-9a-z]+)\b"
)
WAIT_S = 60.0


def substitute(expr: str, selection: dict[str, str]) -> str:
    for name, value in sorted({**VARIABLES, **selection}.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$1", ""), expr
    return expr


def query(prometheus: str, promql: str) -> list[Obj]:
    """An instant query that must succeed; its result vector (or [] for a scalar)."""
    response = httpx.get(
        f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10.0, trust_env=False
    )
    body = response.json()
    assert response.status_code == 200, f"{response.status_code} {body} for {promql}"
    assert body["status"] == "success", f"{body} for {promql}"
    result: list[Obj] = body["data"]["result"] if body["data"]["resultType"] == "vector" else []
    return result


def values(result: list[Obj]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


@pytest.fixture
def operator_endpoint() -> Iterator[str]:
    """The operator's metrics (the module the operator serves), with one service's status."""
    registry = CollectorRegistry()
    for metric in (
        operator_metrics.RECONCILE_ERRORS,
        operator_metrics.RECONCILE_DURATION,
        operator_metrics.CONDITION,
        operator_metrics.ROLE_REPLICAS,
        operator_metrics.SLO_TTFT,
        operator_metrics.SLO_TPOT,
    ):
        registry.register(metric)
    operator_metrics.export_status(STATUS)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        operator_metrics.forget(NAMESPACE, NAME)


@pytest.fixture
def stack(tmp_path: Path, operator_endpoint: str) -> Iterator[LocalStack]:
    if not prometheus_installed():
        pytest.skip("prometheus is not installed (make prometheus)")
    with running_stack(tmp_path, SERVICE, prometheus=True) as local:
        assert local.prometheus is not None
        assert local.autoscaler is not None
        assert local.autoscaler.health_url is not None
        autoscaler = urlsplit(local.autoscaler.health_url).netloc
        # As the operator pod: its own namespace, no pod labels of a service.
        extra = [
            ScrapeTarget(autoscaler, {}, OPERATOR_NAMESPACE),
            ScrapeTarget(operator_endpoint, {}, OPERATOR_NAMESPACE),
        ]
        local.prometheus.set_targets([*local.prometheus.targets, *extra])
        local.prometheus.wait_scraped(30.0)
        yield local


@pytest.fixture(scope="module")
def rule_spec() -> Obj:
    with helm.Chart.load(DASHBOARD.parents[1]) as chart:
        objects = render(chart, {"prometheusRule": {"enabled": True}}, "fp", OPERATOR_NAMESPACE)
    (rule,) = [obj for obj in objects if obj["kind"] == "PrometheusRule"]
    spec: Obj = rule["spec"]
    return spec


def send_requests(endpoint: str, count: int) -> None:
    """Chat completions through the router, half of them streamed; all must succeed."""
    with httpx.Client(base_url=endpoint, timeout=60.0, trust_env=False) as client:
        for i in range(count):
            body = {
                "model": "small-model",
                "messages": [{"role": "user", "content": f"request {i}: tell me about foxes"}],
                "max_tokens": 8,
                "stream": i % 2 == 1,
            }
            response = client.post("/chat/completions", json=body)
            assert response.status_code == 200, response.text
            response.read()


def test_every_dashboard_and_rule_expression_runs_on_real_series(
    stack: LocalStack, rule_spec: Obj
) -> None:
    """Requests through the router in two bursts a few scrapes apart (so every rate has two
    different samples); then every query answers, and the core panels have data."""
    assert stack.prometheus is not None
    prometheus = stack.prometheus.url
    send_requests(stack.endpoint, 6)
    time.sleep(3.0)
    send_requests(stack.endpoint, 6)
    engine_rate = (
        "sum(rate(vllm:request_success_total"
        f'{{fleetpilot_dev_service="{NAME}", namespace="{NAMESPACE}"}}[1m]))'
    )
    eventually(
        "the second burst scraped",
        lambda: True if any(v > 0 for v in values(query(prometheus, engine_rate))) else None,
        WAIT_S,
    )
    board = json.loads(DASHBOARD.read_text())
    # The autoscaler decides every second (holds: min = max = 1); a rate needs two scrapes.
    (holds,) = [p for p in board["panels"] if p["title"] == "Holds by reason"]
    eventually(
        "the autoscaler's holds scraped twice",
        lambda: query(prometheus, substitute(holds["targets"][0]["expr"], SELECTIONS[0])) or None,
        WAIT_S,
    )
    evaluated = 0
    results: dict[tuple[str, str, str], list[Obj]] = {}
    for selection in SELECTIONS:
        for shown in board["panels"]:
            for target in shown.get("targets", []):
                key = (shown["title"], target["refId"], selection["$tier"])
                results[key] = query(prometheus, substitute(target["expr"], selection))
                evaluated += 1

    # The variables' label_values queries, as Grafana runs them (/api/v1/series).
    found: dict[str, set[str]] = {}
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
        assert match is not None
        selector, label = match.groups()
        response = httpx.get(
            f"{prometheus}/api/v1/series",
            params={"match[]": substitute(selector, SELECTIONS[0]), "start": time.time() - 300},
            timeout=10.0,
            trust_env=False,
        )
        assert response.status_code == 200, response.text
        found[variable["name"]] = {s[label] for s in response.json()["data"] if label in s}
        evaluated += 1
    assert NAMESPACE in found["namespace"]
    assert found["service"] == {NAME}
    assert found["tier"] == {"small"}
    assert found["role"] == {"unified"}

    # Every rule expression as written (the alerts read the recorded series, which this
    # Prometheus does not record), and each with the recorded series' own expressions
    # inlined, so the whole of it meets real series: rule_results holds the inlined ones.
    records = {
        r["record"]: r["expr"] for g in rule_spec["groups"] for r in g["rules"] if "record" in r
    }
    rule_results: dict[str, list[Obj]] = {}
    for group in rule_spec["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            rule_results[name] = query(prometheus, rule["expr"])
            evaluated += 1
            if RECORDED.search(rule["expr"]):
                inlined = rule["expr"]
                while RECORDED.search(inlined):  # a recorded series may read another
                    inlined = RECORDED.sub(lambda m: f"({records[m.group(0)]})", inlined)
                rule_results[name] = query(prometheus, inlined)
                evaluated += 1
    print(f"{evaluated} expressions evaluated without error")  # the README quotes it

    def panel(title: str, ref: str = "A", tier: str = "small") -> list[Obj]:
        return results[(title, ref, tier)]

    # The core panels have data for the fleet's one tier and role.
    rate = panel("Request rate (engines)")
    assert [s["metric"] for s in rate] == [
        {"fleetpilot_dev_tier": "small", "fleetpilot_dev_role": "unified"}
    ]
    assert values(rate)[0] > 0
    (p95,) = values(panel("TTFT p50 / p95 vs SLO", "B"))
    assert 0 < p95 < math.inf
    (kv_mean,) = values(panel("KV-cache usage"))
    assert 0 <= kv_mean <= 1
    # The SLO line: the tier's ttftP95, as the operator exports it.
    (slo_line,) = panel("TTFT p50 / p95 vs SLO", "C")
    assert slo_line["metric"] == {"tier": "small", "role": "unified"}
    assert float(slo_line["value"][1]) == 5.0
    assert panel("TPOT p50 / p95 vs SLO", "C") == []  # the tier has no tpotP95
    (over,) = panel("p95 over the SLO (above 1: missing it)")
    assert over["metric"] == {"fleetpilot_dev_tier": "small", "fleetpilot_dev_role": "unified"}
    assert 0 < float(over["value"][1]) < 1  # a p95 well under the 5s objective
    (tpot_p95,) = values(panel("TPOT p50 / p95 vs SLO", "B"))
    assert 0 < tpot_p95 < math.inf
    assert {s["metric"]["status"] for s in panel("Router requests by status")} == {"200"}
    assert values(panel("Router TTFT p95 (client view)"))
    assert values(panel("Queue: waiting / running", "A")) == [0.0]
    # The operator's and the autoscaler's series, stored with exported_namespace.
    replicas = {
        (s["metric"]["state"], float(s["value"][1])) for s in panel("Replicas: desired vs ready")
    }
    assert replicas == {("spec", 1.0), ("ready", 1.0), ("desired", 1.0)}
    assert values(panel("Replicas: desired vs ready", "B")) == [1.0]  # engines scraped
    assert panel("Holds by reason"), "the autoscaler's holds (min = max = 1)"
    states = {s["metric"]["type"]: float(s["value"][1]) for s in panel("Conditions")}
    assert states == {"Ready": 1.0, "Degraded": 1.0, "ScalingActive": 1.0, "Stalled": 0.0}
    # "All" tiers and roles read the same series (the values moved on meanwhile).
    assert [s["metric"] for s in panel("Request rate (engines)", tier=".*")] == [
        s["metric"] for s in rate
    ]

    # How the operator's series are stored, and what the alerts make of it: the service's
    # namespace, not the operator's.
    raw = query(prometheus, 'fleetpilot_inferenceservice_condition{type="Degraded",status="True"}')
    assert {(s["metric"]["namespace"], s["metric"]["exported_namespace"]) for s in raw} == {
        (OPERATOR_NAMESPACE, NAMESPACE)
    }
    assert [s["metric"] for s in rule_results["FleetpilotServiceDegraded"]] == [
        {"namespace": NAMESPACE, "service": NAME}
    ]
    assert rule_results["FleetpilotServiceStalled"] == []
    assert rule_results["FleetpilotScalingInactive"] == []
    assert rule_results["FleetpilotOperatorAbsent"] == []
    # The tier's objective under the engines' labels (from the operator's series, scraped
    # with exported_namespace), and the engines' real histograms recorded for its role only.
    role = {
        "namespace": NAMESPACE,
        "fleetpilot_dev_service": NAME,
        "fleetpilot_dev_tier": "small",
        "fleetpilot_dev_role": "unified",
    }
    (objective,) = rule_results["fleetpilot:ttft_objective_seconds"]
    assert (objective["metric"], float(objective["value"][1])) == (role, 5.0)
    buckets = rule_results["fleetpilot:ttft_seconds_bucket:rate5m"]
    assert buckets
    assert {s["metric"]["fleetpilot_dev_role"] for s in buckets} == {"unified"}
    assert rule_results["fleetpilot:tpot_objective_seconds"] == []  # no tpotP95
    assert rule_results["fleetpilot:tpot_seconds_bucket:rate5m"] == []
    assert rule_results["FleetpilotTTFTErrorBudgetBurn"] == []  # well within 5s
