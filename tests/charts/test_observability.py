"""The chart's Grafana dashboard and PrometheusRule, rendered by the Helm engine and judged by
Prometheus' own tools.

- the rendered PrometheusRule matches the Prometheus Operator's CRD schema and its groups pass
  `promtool check rules`; `promtool test rules` feeds series to them and checks which alerts
  fire and which stay silent (burn rates over both windows against each tier's own objective,
  conditions, crash loops, the operator), with the exact labels and annotations Alertmanager
  would get; every alert's runbook_url leads to a section of docs/troubleshooting.md;
- every dashboard query, its template variables substituted, parses (through promtool) and
  reads only metrics that fleetpilot's code (or kube-state-metrics) exports.

e2e/test_observability.py evaluates the same expressions against a real Prometheus scraping
a real local fleet.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from fleetpilot.autoscaler.actuator import AutoscalerMetrics
from fleetpilot.autoscaler.prometheus import escaped_name
from fleetpilot.engine.reference.metrics import ServerMetrics
from fleetpilot.operator import metrics as operator_metrics
from fleetpilot.routing.metrics import RouterMetrics
from tests.charts.chart_support import (
    CHART,
    K8S_VERSION,
    RELEASE,
    RELEASE_NAMESPACE,
    REPO,
    Obj,
    only,
    render,
)

DASHBOARD_FILE = CHART / "dashboards" / "fleetpilot.json"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"
ENABLED: Obj = {"dashboards": {"enabled": True}, "prometheusRule": {"enabled": True}}
# Series the rules read that fleetpilot does not export: Prometheus' own and kube-state-metrics'.
EXTERNAL_METRICS = {"up", "kube_pod_container_status_restarts_total", "kube_pod_labels"}
# Concrete values for the dashboard's variables, as Grafana would substitute them.
VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "1m",
    "$namespace": "ml",
    "$service": "chat",
    "$tier": ".*",
    "$role": ".*",
}
REQUIRED_PANELS = {
    "Request rate (engines)",
    "TTFT p50 / p95 vs SLO",
    "TPOT p50 / p95 vs SLO",
    "KV-cache usage",
    "Prefix-cache hit rate",
    "Queue: waiting / running",
    "Replicas: desired vs ready",
    "Scale decisions by direction and reason",
    "Spill-overs",
    "Retries and ejections",
    "Upstream errors by cause",
    "Rejected requests",
}
ALERTS = {
    "FleetpilotTTFTErrorBudgetBurn",
    "FleetpilotTPOTErrorBudgetBurn",
    "FleetpilotScalingInactive",
    "FleetpilotServiceDegraded",
    "FleetpilotServiceStalled",
    "FleetpilotPodCrashLooping",
    "FleetpilotOperatorAbsent",
    "FleetpilotOperatorNotReconciling",
    "FleetpilotOperatorReconcileErrors",
}
# The Prometheus Operator's PrometheusRule spec (monitoring.coreos.com_prometheusrules.yaml,
# v0.82), closed to unknown fields as an API server with fieldValidation=Strict is.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
PROMETHEUS_RULE_SPEC_SCHEMA: Obj = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": _DURATION},
                    "labels": _STRING_MAP,
                    "limit": {"type": "integer"},
                    "partial_response_strategy": {"type": "string"},
                    "query_offset": {"type": "string", "pattern": _DURATION},
                    "rules": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["expr"],
                            "properties": {
                                "alert": {"type": "string"},
                                "record": {"type": "string"},
                                "expr": {"type": ["string", "integer"]},
                                "for": {"type": "string", "pattern": _DURATION},
                                "keep_firing_for": {"type": "string", "pattern": _DURATION},
                                "labels": _STRING_MAP,
                                "annotations": _STRING_MAP,
                            },
                        },
                    },
                },
            },
        }
    },
}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian's package prometheus: make prometheus)")
    return found


def run_promtool(*args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def rule_spec(chart: helm.Chart, values: Obj | None = None) -> Obj:
    spec: Obj = only(render(chart, values or ENABLED), "PrometheusRule")["spec"]
    return spec


def rules(spec: Obj) -> list[Obj]:
    return [rule for group in spec["groups"] for rule in group["rules"]]


def dashboard() -> Obj:
    loaded: Obj = json.loads(DASHBOARD_FILE.read_text())
    return loaded


def panels(board: Obj) -> list[Obj]:
    return [panel for panel in board["panels"] if panel["type"] != "row"]


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """A dashboard query as Grafana sends it: variables replaced, longest names first."""
    for name, value in sorted((values or VARIABLES).items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr.replace("$1", ""), f"unsubstituted variable in {expr}"
    return expr


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in panels(dashboard()) for target in panel["targets"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (every one is written `name{...}`, `name[...]`
    or `absent(name)` in the chart's expressions)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]", without_strings))
    names |= set(re.findall(r"absent\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\)", without_strings))
    return names


def exported(collectors: Iterable[Collector]) -> set[str]:
    """Sample names these collectors expose, labelled children or not."""
    names: set[str] = set()
    for collector in collectors:
        for family in collector.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_count", "_sum")}
            else:
                names.add(family.name)
            names |= {sample.name for sample in family.samples}
    return names


def fleetpilot_metrics() -> set[str]:
    engine = ServerMetrics("m", max_model_len=512).registry
    router = RouterMetrics().registry
    autoscaler = CollectorRegistry()
    AutoscalerMetrics(autoscaler)
    operator = [
        operator_metrics.RECONCILES,
        operator_metrics.RECONCILE_ERRORS,
        operator_metrics.RECONCILE_DURATION,
        operator_metrics.CONDITION,
        operator_metrics.ROLE_REPLICAS,
        operator_metrics.ADAPTER_CALLS,
        operator_metrics.SLO_TTFT,
        operator_metrics.SLO_TPOT,
    ]
    names = exported([engine, router, autoscaler, *operator])
    # A vLLM series may be stored with '_' for ':' (see escaped_name): both names are read.
    return names | {escaped_name(name) for name in names}


# -- off by default, and the objects when on --------------------------------------------------


def test_dashboard_and_rules_are_off_by_default(chart: helm.Chart) -> None:
    kinds = {obj["kind"] for obj in render(chart)}
    assert "PrometheusRule" not in kinds
    assert not [
        obj
        for obj in render(chart)
        if obj["kind"] == "ConfigMap" and "grafana_dashboard" in obj["metadata"]["labels"]
    ]
    assert chart.values["dashboards"]["enabled"] is False
    assert chart.values["prometheusRule"]["enabled"] is False


def test_lint_is_clean_with_both_on() -> None:
    report = helm.lint(CHART, ENABLED, strict=True, namespace=RELEASE_NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_dashboard_configmap_carries_the_file_and_the_sidecar_label(chart: helm.Chart) -> None:
    """A valid ConfigMap with the grafana sidecar's label, holding the chart's JSON unchanged;
    the label, namespace, labels and annotations follow the values."""
    configmap = only(render(chart, ENABLED), "ConfigMap")
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert configmap["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert json.loads(configmap["data"]["fleetpilot.json"]) == dashboard()

    values = {
        "dashboards": {
            "enabled": True,
            "namespace": "monitoring",
            "label": "grafana.example.com/dashboard",
            "labelValue": "fleet",
            "labels": {"team": "ml-platform"},
            "annotations": {"grafana_folder": "LLM"},
        }
    }
    long_name = "a-very-long-release-name-for-a-fleet-operator-in-production-x"
    configmap = only(render(chart, values, name=long_name), "ConfigMap")
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    meta = configmap["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["grafana.example.com/dashboard"] == "fleet"
    assert "grafana_dashboard" not in meta["labels"]
    assert meta["labels"]["team"] == "ml-platform"
    assert meta["annotations"] == {"grafana_folder": "LLM"}
    assert len(meta["name"]) <= 63


def test_prometheus_rule_matches_the_crd_and_promtool_accepts_it(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """The PrometheusRule's spec fits the Prometheus Operator's schema, promtool finds every
    group valid, and every alert has a severity and a summary and description naming what it
    is about."""
    rule = only(render(chart, ENABLED), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == RELEASE_NAMESPACE
    jsonschema.validate(rule["spec"], PROMETHEUS_RULE_SPEC_SCHEMA)
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    output = run_promtool("check", "rules", str(path))
    assert "SUCCESS: 21 rules found" in output, output

    alerts = [r for r in rules(rule["spec"]) if "alert" in r]
    assert {a["alert"] for a in alerts} == ALERTS
    for alert in alerts:
        assert alert["labels"]["severity"] in {"critical", "warning"}, alert["alert"]
        assert set(alert["annotations"]) == {"summary", "description", "runbook_url"}
        text = alert["annotations"]["summary"] + alert["annotations"]["description"]
        if alert["alert"].startswith("FleetpilotOperator"):
            continue  # about the operator, not one service
        assert "{{ $labels.namespace }}" in text, alert["alert"]
        names = r"(service|fleetpilot_dev_service|label_fleetpilot_dev_service)"
        assert re.search(r"\{\{ \$labels\." + names + r" \}\}", text), alert["alert"]


def test_values_reach_the_rules(chart: helm.Chart, tmp_path: Path) -> None:
    """Burn factors and windows, severities, labels, the runbooks' base URL, the group
    interval and disabled alerts all land in the rendered rules, which promtool still accepts."""
    values: Obj = {
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "30s",
            "alertLabels": {"team": "ml-platform"},
            "disabledAlerts": ["FleetpilotPodCrashLooping", "FleetpilotOperatorAbsent"],
            "runbookBaseURL": "https://wiki.example.com/fleetpilot/",
            "burnRates": {
                "fast": {"factor": 10, "longWindow": "2h", "shortWindow": "10m"},
                "slow": {"severity": "ticket"},
            },
            "alerts": {"degraded": {"for": "20m", "severity": "critical"}},
        }
    }
    rule = only(render(chart, values), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = rule["spec"]
    assert {group["interval"] for group in spec["groups"]} == {"30s"}
    by_name: dict[str, list[Obj]] = {}
    for r in rules(spec):
        by_name.setdefault(r.get("alert") or r["record"], []).append(r)
    assert "FleetpilotPodCrashLooping" not in by_name
    assert "FleetpilotOperatorAbsent" not in by_name
    # Per SLI, the tiers' objectives and one histogram rate per window; the fast burn's
    # windows replaced.
    windows = {"10m", "2h", "30m", "6h"}
    assert {n for n in by_name if n.startswith("fleetpilot:")} == {
        name
        for sli in ("ttft", "tpot")
        for name in (
            f"fleetpilot:{sli}_objective_seconds",
            *(f"fleetpilot:{sli}_seconds_bucket:rate{w}" for w in windows),
        )
    }
    assert "[10m]" in by_name["fleetpilot:ttft_seconds_bucket:rate10m"][0]["expr"]
    fast, slow = by_name["FleetpilotTTFTErrorBudgetBurn"]
    # 10x a 5% budget: more than half the requests over the objective, the median above it.
    assert "histogram_quantile(0.5, fleetpilot:ttft_seconds_bucket:rate2h)" in fast["expr"]
    assert "histogram_quantile(0.5, fleetpilot:ttft_seconds_bucket:rate10m)" in fast["expr"]
    assert "histogram_quantile(0.7, fleetpilot:ttft_seconds_bucket:rate6h)" in slow["expr"]
    assert fast["labels"] == {
        "team": "ml-platform",
        "severity": "critical",
        "long_window": "2h",
        "short_window": "10m",
    }
    assert slow["labels"]["severity"] == "ticket"
    assert "more than 50% of the requests" in fast["annotations"]["description"]
    assert "spent in 3.0 days" in fast["annotations"]["description"]
    assert fast["annotations"]["runbook_url"] == (
        "https://wiki.example.com/fleetpilot#fleetpilotttfterrorbudgetburn"
    )
    (degraded,) = by_name["FleetpilotServiceDegraded"]
    assert degraded["for"] == "20m"
    assert degraded["labels"] == {"team": "ml-platform", "severity": "critical"}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_promtool("check", "rules", str(path))


@pytest.mark.parametrize(
    ("values", "where"),
    [
        pytest.param({"slo": {"ttft": {"target": 0.99}}}, "'slo'", id="chart-wide-slo"),
        pytest.param({"runbookBaseURL": "docs/x.md#a"}, "/runbookBaseURL", id="runbook"),
        pytest.param({"burnRates": {"fast": {"factor": 20}}}, "/factor", id="whole-budget"),
        pytest.param({"burnRates": {"fast": {"longWindow": "1d"}}}, "/longWindow", id="window"),
        pytest.param({"burnRates": {"slow": {"factor": 0}}}, "/factor", id="factor"),
        pytest.param({"disabledAlerts": ["KubePodCrashLooping"]}, "/disabledAlerts", id="name"),
        pytest.param({"alerts": {"stalled": {"severity": ""}}}, "/severity", id="severity"),
        pytest.param({"alerts": {"degraded": {"fro": "5m"}}}, "'fro'", id="typo"),
    ],
)
def test_schema_refuses_wrong_rule_values(chart: helm.Chart, values: Obj, where: str) -> None:
    merged = chart.merge_values({"prometheusRule": {"enabled": True, **values}})
    with pytest.raises(helm.HelmValuesError) as refused:
        chart.validate_schema(merged)
    assert where in str(refused.value)


# -- promtool test rules: what fires and what stays silent ------------------------------------

ENGINE = {"namespace": "ml", "fleetpilot_dev_tier": "small", "fleetpilot_dev_role": "unified"}
# The operator's series as the chart's PodMonitor stores them (no honorLabels): the operator
# pod's namespace is `namespace`, the service's own became `exported_namespace`.
OPERATOR_TARGET = {
    "job": "fleetpilot-system/fp-fleetpilot",
    "instance": "10.0.0.5:9090",
    "namespace": "fleetpilot-system",
    "pod": "fp-fleetpilot-7d9f-abcde",
}


def series(name: str, labels: dict[str, str], values: str) -> Obj:
    inner = ", ".join(f"{key}={json.dumps(value)}" for key, value in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def expand(template: str, labels: dict[str, str], value: str, objective: str = "") -> str:
    """What Prometheus makes of the chart's annotation templates for one alert (`objective`:
    what the burn-rate alerts' query of the tier's objective prints)."""
    text = re.sub(r"\{\{ with printf .*? \| query \}\}.*?\{\{ end \}\}", objective, template)
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
    return re.sub(r"\{\{ \$value[^}]*\}\}", value, text)


def expected(
    spec: Obj,
    alert: str,
    window: str | None,
    labels: dict[str, str],
    value: str,
    objective: str = "",
) -> Obj:
    """An exp_alerts entry: the alert's own labels plus the series', annotations expanded."""
    (rule,) = [
        r
        for r in rules(spec)
        if r.get("alert") == alert and (window is None or r["labels"].get("long_window") == window)
    ]
    all_labels = {**labels, **rule["labels"]}
    return {
        "exp_labels": all_labels,
        "exp_annotations": {
            key: expand(text, all_labels, value, objective)
            for key, text in rule["annotations"].items()
        },
    }


def slo_labels(service: str, tier: str = "small") -> dict[str, str]:
    return {**ENGINE, "fleetpilot_dev_service": service, "fleetpilot_dev_tier": tier}


def objective(kind: str, service: str, tier: str, seconds: float, **scrape: str) -> Obj:
    """A tier's objective as the operator exports it, scraped like the chart's PodMonitor does
    (the service's namespace renamed exported_namespace), or as ``scrape`` says."""
    target = scrape or {**OPERATOR_TARGET, "exported_namespace": "ml"}
    labels = {**target, "service": service, "tier": tier, "role": "unified"}
    return series(f"fleetpilot_slo_{kind}_seconds", labels, f"{seconds}x80")


def slo_case(spec: Obj) -> Obj:
    """80 minutes of TTFT and TPOT histograms against each tier's own objective.

    Service `chat` runs three tiers with the same latencies, every request's TTFT between 2.5s
    and 5s: `small`'s objective is 2s (it burns: p28 3.2s, p70 4.25s), `large`'s 5s (within
    it), `medium` has none (no alert whatever its latency). `escaped` is `small` again under
    the underscore names some exporters write, its objective scraped with honorLabels.
    `recovered` (objective 2s) is as slow for 70 minutes, then every first token under 1s.
    TPOT: every token between 50ms and 100ms; `chat`'s `small` objective is 50ms, `large`'s
    200ms."""
    per_minute = {"1": 0, "2.5": 0, "5": 120, "+Inf": 120}

    def ttft(labels: dict[str, str], prefix: str = "vllm:") -> list[Obj]:
        name = f"{prefix}time_to_first_token_seconds"
        return [
            *[
                series(f"{name}_bucket", {**labels, "le": le}, f"0+{n}x80")
                for le, n in per_minute.items()
            ],
            series(f"{name}_count", labels, "0+120x80"),
        ]

    def tpot(labels: dict[str, str]) -> list[Obj]:
        name = "vllm:inter_token_latency_seconds"
        return [
            series(f"{name}_bucket", {**labels, "le": "0.05"}, "0x80"),
            series(f"{name}_bucket", {**labels, "le": "0.1"}, "0+1000x80"),
            series(f"{name}_bucket", {**labels, "le": "+Inf"}, "0+1000x80"),
            series(f"{name}_count", labels, "0+1000x80"),
        ]

    small, large, medium = (slo_labels("chat", tier) for tier in ("small", "large", "medium"))
    escaped, recovered = slo_labels("escaped"), slo_labels("recovered")
    honored = {"job": "fleetpilot", "instance": "10.0.0.6:9090", "namespace": "ml"}
    # Under 1s from minute 71 on.
    fast_after_70 = "0x70 120+120x9"
    return {
        "interval": "1m",
        "input_series": [
            objective("ttft", "chat", "small", 2),
            objective("ttft", "chat", "large", 5),
            objective("ttft", "escaped", "small", 2, **honored),
            objective("ttft", "recovered", "small", 2),
            objective("tpot", "chat", "small", 0.05),
            objective("tpot", "chat", "large", 0.2),
            *ttft(small),
            *ttft(large),
            *ttft(medium),
            *ttft(escaped, prefix="vllm_"),
            series(
                "vllm:time_to_first_token_seconds_bucket", {**recovered, "le": "1"}, fast_after_70
            ),
            series(
                "vllm:time_to_first_token_seconds_bucket",
                {**recovered, "le": "2.5"},
                fast_after_70,
            ),
            series("vllm:time_to_first_token_seconds_bucket", {**recovered, "le": "5"}, "0+120x80"),
            series(
                "vllm:time_to_first_token_seconds_bucket", {**recovered, "le": "+Inf"}, "0+120x80"
            ),
            series("vllm:time_to_first_token_seconds_count", recovered, "0+120x80"),
            *tpot(small),
            *tpot(large),
            *tpot(medium),
        ],
        "alert_rule_test": [
            {
                # Early on, every slow one with a 2s objective burns fast (its p28, 3.2s, over
                # it); the slow burn is still pending (15m).
                "eval_time": "10m",
                "alertname": "FleetpilotTTFTErrorBudgetBurn",
                "exp_alerts": [
                    expected(spec, "FleetpilotTTFTErrorBudgetBurn", "1h", labels, "3.2s", "2s")
                    for labels in (small, escaped, recovered)
                ],
            },
            {
                # `recovered` is still burning in its 1h window (50 of its 60 minutes slow:
                # p28 2.84s), not in the last 5m: the short window ends the alert. Over 6h
                # (70 of 80 minutes: p70 4.143s) and 30m (20 of 30: p70 3.875s) it still burns.
                # `large` and `medium` never alert.
                "eval_time": "80m",
                "alertname": "FleetpilotTTFTErrorBudgetBurn",
                "exp_alerts": [
                    *[
                        expected(spec, "FleetpilotTTFTErrorBudgetBurn", "1h", labels, "3.2s", "2s")
                        for labels in (small, escaped)
                    ],
                    *[
                        expected(spec, "FleetpilotTTFTErrorBudgetBurn", "6h", labels, value, "2s")
                        for labels, value in (
                            (small, "4.25s"),
                            (escaped, "4.25s"),
                            (recovered, "4.143s"),
                        )
                    ],
                ],
            },
            {
                "eval_time": "80m",
                "alertname": "FleetpilotTPOTErrorBudgetBurn",
                "exp_alerts": [
                    expected(spec, "FleetpilotTPOTErrorBudgetBurn", window, small, value, "50ms")
                    for window, value in (("1h", "64ms"), ("6h", "85ms"))
                ],
            },
        ],
        "promql_expr_test": [
            {
                # Each tier's objective under the engines' labels, however it was scraped; the
                # tier without one has none.
                "expr": "fleetpilot:ttft_objective_seconds",
                "eval_time": "80m",
                "exp_samples": [
                    {
                        "labels": "fleetpilot:ttft_objective_seconds" + _promql_labels(labels),
                        "value": value,
                    }
                    for labels, value in [
                        (small, 2),
                        (large, 5),
                        (escaped, 2),
                        (recovered, 2),
                    ]
                ],
            },
            {
                # Histogram rates are recorded for the roles with an objective only.
                "expr": "count by (fleetpilot_dev_service, fleetpilot_dev_tier) "
                "(fleetpilot:tpot_seconds_bucket:rate1h)",
                "eval_time": "80m",
                "exp_samples": [
                    {
                        "labels": _promql_labels(
                            {"fleetpilot_dev_service": "chat", "fleetpilot_dev_tier": tier}
                        ),
                        "value": 3,
                    }
                    for tier in ("small", "large")
                ],
            },
        ],
    }


def _promql_labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"


def conditions_case(spec: Obj) -> Obj:
    """Conditions as the operator exports them: `chat` (scraped like the chart's PodMonitor
    does, its namespace renamed exported_namespace) Degraded and not scaling throughout,
    Stalled for 3 minutes only; `other` (scraped with honorLabels) Degraded; `calm` healthy."""

    def condition(service: str, kind: str, true: str, false: str, **scrape: str) -> list[Obj]:
        target = scrape or {**OPERATOR_TARGET, "exported_namespace": "ml"}
        labels = {**target, "service": service, "type": kind}
        return [
            series("fleetpilot_inferenceservice_condition", {**labels, "status": "True"}, true),
            series("fleetpilot_inferenceservice_condition", {**labels, "status": "False"}, false),
        ]

    honored = {"job": "fleetpilot", "instance": "10.0.0.6:9090", "namespace": "ml2"}
    return {
        "interval": "1m",
        "input_series": [
            *condition("chat", "Degraded", "1x20", "0x20"),
            *condition("chat", "ScalingActive", "0x20", "1x20"),
            *condition("chat", "Stalled", "1 1 1 0x17", "0 0 0 1x17"),
            *condition("calm", "Degraded", "0x20", "1x20"),
            *condition("calm", "ScalingActive", "1x20", "0x20"),
            *condition("other", "Degraded", "1x20", "0x20", **honored),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "FleetpilotServiceDegraded", "exp_alerts": []},
            {
                "eval_time": "15m",
                "alertname": "FleetpilotServiceDegraded",
                "exp_alerts": [
                    expected(spec, "FleetpilotServiceDegraded", None, labels, "1")
                    for labels in (
                        {"namespace": "ml", "service": "chat"},
                        {"namespace": "ml2", "service": "other"},
                    )
                ],
            },
            {
                "eval_time": "15m",
                "alertname": "FleetpilotScalingInactive",
                "exp_alerts": [
                    expected(
                        spec,
                        "FleetpilotScalingInactive",
                        None,
                        {"namespace": "ml", "service": "chat"},
                        "1",
                    )
                ],
            },
            {"eval_time": "15m", "alertname": "FleetpilotServiceStalled", "exp_alerts": []},
        ],
    }


def crash_case(spec: Obj) -> Obj:
    """A fleetpilot engine pod restarting every minute alerts; a pod of something else
    restarting as often does not, nor a fleetpilot pod that restarted once long ago."""
    pod = {"namespace": "ml", "pod": "chat-small-6c9d-x1"}
    pod_labels = {
        "label_fleetpilot_dev_service": "chat",
        "label_fleetpilot_dev_tier": "small",
        "label_fleetpilot_dev_role": "unified",
    }
    ksm = {"job": "kube-state-metrics", "instance": "10.0.0.9:8080"}
    restarts = "kube_pod_container_status_restarts_total"
    web = {"namespace": "ml", "pod": "web-0"}
    once = {"namespace": "ml", "pod": "chat-large-0"}
    return {
        "interval": "1m",
        "input_series": [
            series(restarts, {**ksm, **pod, "container": "engine"}, "0+1x20"),
            series("kube_pod_labels", {**ksm, **pod, **pod_labels}, "1x20"),
            series(restarts, {**ksm, **web, "container": "web"}, "0+1x20"),
            series("kube_pod_labels", {**ksm, **web}, "1x20"),
            series(restarts, {**ksm, **once, "container": "engine"}, "0 1x20"),
            series("kube_pod_labels", {**ksm, **once, **pod_labels}, "1x20"),
        ],
        "alert_rule_test": [
            {
                "eval_time": "20m",
                "alertname": "FleetpilotPodCrashLooping",
                "exp_alerts": [
                    expected(spec, "FleetpilotPodCrashLooping", None, {**pod, **pod_labels}, "15")
                ],
            }
        ],
    }


def operator_case(spec: Obj) -> Obj:
    """Operator A sees a service, never finishes a reconcile and fails one every minute;
    operator B reconciles fine. With no operator series at all, the absence alerts."""
    a = OPERATOR_TARGET
    b = {**OPERATOR_TARGET, "instance": "10.0.0.7:9090", "pod": "fp-fleetpilot-7d9f-fghij"}
    ready = {"exported_namespace": "ml", "service": "chat", "type": "Ready"}
    return {
        "interval": "1m",
        "input_series": [
            series("fleetpilot_operator_reconcile_duration_seconds_count", a, "0x40"),
            series("fleetpilot_operator_reconcile_duration_seconds_count", b, "0+1x40"),
            series("fleetpilot_operator_reconciles_total", {**b, "result": "applied"}, "0+1x40"),
            series("fleetpilot_operator_reconcile_errors_total", a, "0+1x40"),
            series("fleetpilot_operator_reconcile_errors_total", b, "0x40"),
            *[
                series(
                    "fleetpilot_inferenceservice_condition",
                    {**target, **ready, "status": status},
                    "1x40" if status == "False" else "0x40",
                )
                for target in (a, b)
                for status in ("True", "False", "Unknown")
            ],
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "FleetpilotOperatorAbsent", "exp_alerts": []},
            {
                "eval_time": "30m",
                "alertname": "FleetpilotOperatorNotReconciling",
                "exp_alerts": [
                    expected(
                        spec,
                        "FleetpilotOperatorNotReconciling",
                        None,
                        {"job": a["job"], "instance": a["instance"]},
                        "1",
                    )
                ],
            },
            {
                "eval_time": "30m",
                "alertname": "FleetpilotOperatorReconcileErrors",
                "exp_alerts": [expected(spec, "FleetpilotOperatorReconcileErrors", None, a, "15")],
            },
        ],
    }


def absent_case(spec: Obj) -> Obj:
    return {
        "interval": "1m",
        "input_series": [series("up", {"job": "other"}, "1x20")],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "FleetpilotOperatorAbsent", "exp_alerts": []},
            {
                "eval_time": "15m",
                "alertname": "FleetpilotOperatorAbsent",
                "exp_alerts": [expected(spec, "FleetpilotOperatorAbsent", None, {}, "1")],
            },
        ],
    }


CASES = [slo_case, conditions_case, crash_case, operator_case, absent_case]


def write_unit_tests(spec: Obj, folder: Path, cases: list[Any]) -> Path:
    (folder / "rules.yaml").write_text(yaml.safe_dump(spec))
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        # Without an order promtool evaluates the groups in a map's order, different from run
        # to run: an alert evaluated before the recording rules it reads saw the minute before
        # (p70 4.154s for 4.143s, one CI run in several). Recording rules first, as in the file.
        "group_eval_order": [group["name"] for group in spec["groups"]],
        "tests": [case(spec) for case in cases],
    }
    path = folder / "tests.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    return path


def test_alerts_fire_on_bad_series_and_stay_silent_on_good(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """promtool test rules on the rendered rules: fast and slow TTFT/TPOT burns fire (under
    either metric name) against each tier's own objective and end with the short window; two
    tiers as slow, one within its objective, never alert, nor a tier without an objective;
    Degraded and ScalingActive=False alert after 10m, a brief Stalled does not, each naming
    the service's own namespace however the operator was scraped; crash loops of fleet pods
    only; an operator that never reconciles, one that keeps failing, and none at all."""
    spec = rule_spec(chart)
    path = write_unit_tests(spec, tmp_path, CASES)
    output = run_promtool("test", "rules", path.name, cwd=tmp_path)
    assert "SUCCESS" in output, output


def _lose_the_short_window(rule: Obj) -> None:
    if rule.get("alert") == "FleetpilotTTFTErrorBudgetBurn":
        rule["expr"] = rule["expr"].split("\nand on")[0]


def _one_objective_for_every_tier(rule: Obj) -> None:
    """What the alerts did before objectives were per tier: one chart-wide number."""
    if rule.get("alert") == "FleetpilotTTFTErrorBudgetBurn":
        rule["expr"] = re.sub(
            r"> on \([^)]*\) fleetpilot:ttft_objective_seconds", "> 2", rule["expr"]
        )


def _objectives_keep_the_operators_namespace(rule: Obj) -> None:
    if rule.get("record") == "fleetpilot:ttft_objective_seconds":
        rule["expr"] = rule["expr"].replace('"exported_namespace"', '"no_such_label"')


def _conditions_keep_the_operators_namespace(rule: Obj) -> None:
    if rule.get("alert") == "FleetpilotServiceDegraded":
        rule["expr"] = rule["expr"].replace('"exported_namespace"', '"no_such_label"')


@pytest.mark.parametrize(
    ("breakage", "case", "mistake"),
    [
        pytest.param(_lose_the_short_window, slo_case, "recovered", id="short-window"),
        pytest.param(_one_objective_for_every_tier, slo_case, "large", id="chart-wide-slo"),
        pytest.param(_objectives_keep_the_operators_namespace, slo_case, "chat", id="slo-scrape"),
        pytest.param(
            _conditions_keep_the_operators_namespace,
            conditions_case,
            "fleetpilot-system",
            id="condition-scrape",
        ),
    ],
)
def test_the_unit_tests_catch_a_broken_rule(
    chart: helm.Chart,
    tmp_path: Path,
    breakage: Callable[[Obj], None],
    case: Callable[[Obj], Obj],
    mistake: str,
) -> None:
    """The same promtool tests fail for rules that lost the short window, that compare every
    tier with one objective (so a tier with a laxer objective of its own alerts), or that
    forget the exported_namespace a PodMonitor scrape leaves on the operator's objectives or
    conditions: the tests can tell."""
    spec = rule_spec(chart)
    broken = json.loads(json.dumps(spec))
    for rule in rules(broken):
        breakage(rule)
    assert broken != spec
    # Expectations from the correct rules, evaluated on the broken ones.
    tests = {
        "rule_files": ["rules.yaml"],
        "evaluation_interval": "1m",
        "group_eval_order": [group["name"] for group in broken["groups"]],
        "tests": [case(spec)],
    }
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(broken))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = subprocess.run(
        [promtool(), "test", "rules", "tests.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode != 0
    assert mistake in done.stdout + done.stderr


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_'
    dropped, spaces as '-' (a repeated heading gets -1, -2, ...)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def test_every_alert_links_to_its_section_of_the_troubleshooting_page(chart: helm.Chart) -> None:
    """Each alert's runbook_url is the chart's base URL (the repository's
    docs/troubleshooting.md) and an anchor that page has: a heading of the alert's name."""
    base = chart.values["prometheusRule"]["runbookBaseURL"]
    assert base == "https://github.com/fleetpilot/fleetpilot/blob/main/docs/troubleshooting.md"
    assert base.endswith(TROUBLESHOOTING.relative_to(REPO).as_posix())
    anchors = _github_anchors(TROUBLESHOOTING.read_text())
    alerts = [r for r in rules(rule_spec(chart)) if "alert" in r]
    assert {a["alert"] for a in alerts} == ALERTS
    for alert in alerts:
        url, _, anchor = alert["annotations"]["runbook_url"].partition("#")
        assert url == base, alert["alert"]
        assert anchor == alert["alert"].lower(), alert["alert"]
        assert anchor in anchors, f"{alert['alert']}: no heading #{anchor} in {TROUBLESHOOTING}"
    # The check itself sees a missing section.
    assert "fleetpilotnosuchalert" not in anchors
    assert _github_anchors("## A `code` heading: x_y\n## A `code` heading: x_y\n") == {
        "a-code-heading-x_y",
        "a-code-heading-x_y-1",
    }


# -- the dashboard ----------------------------------------------------------------------------


def test_dashboard_is_a_grafana_dashboard_with_the_variables_and_panels() -> None:
    """schemaVersion 39, a Prometheus datasource variable every panel and query uses, the
    namespace/service/tier/role variables from label_values, unique ids, the panels asked for,
    each on the 24-column grid."""
    board = dashboard()
    assert board["schemaVersion"] == 39
    assert board["uid"] == "fleetpilot"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, label in [
        ("namespace", "namespace"),
        ("service", "fleetpilot_dev_service"),
        ("tier", "fleetpilot_dev_tier"),
        ("role", "fleetpilot_dev_role"),
    ]:
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        query = variable["query"]["query"]
        assert query == variable["definition"]
        assert re.fullmatch(rf"label_values\(up\{{.*\}}, {label}\)", query), query
    assert variables["tier"]["multi"]
    assert variables["tier"]["allValue"] == ".*"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        refs = [target["refId"] for target in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].strip()
            assert target["legendFormat"]
    assert {panel["title"] for panel in panels(board)} >= REQUIRED_PANELS


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel query and variable query, variables substituted, is valid PromQL
    (promtool parses them as recording rules)."""
    board = dashboard()
    exprs = [substitute(expr) for expr in dashboard_exprs()]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            selector = re.fullmatch(r"label_values\((.*), \w+\)", variable["query"]["query"])
            assert selector is not None
            exprs.append(substitute(selector.group(1)))
    group = {
        "name": "dashboard",
        "rules": [{"record": f"dashboard:query:{i}", "expr": e} for i, e in enumerate(exprs)],
    }
    path = tmp_path / "dashboard.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    output = run_promtool("check", "rules", str(path))
    assert f"SUCCESS: {len(exprs)} rules found" in output


def test_every_query_reads_metrics_the_code_exports(chart: helm.Chart) -> None:
    """The metric names in the dashboard and the rules are ones the reference engine (vLLM's
    names), the router, the autoscaler or the operator export, or kube-state-metrics' and
    Prometheus' own; recorded series are the ones the rules record."""
    known = fleetpilot_metrics() | EXTERNAL_METRICS
    spec = rule_spec(chart)
    recorded = {r["record"] for r in rules(spec) if "record" in r}
    for expr in dashboard_exprs():
        unknown = metric_names(substitute(expr)) - known
        assert not unknown, f"{unknown} in {expr}"
    for rule in rules(spec):
        unknown = metric_names(rule["expr"]) - known - recorded
        assert not unknown, f"{unknown} in {rule.get('alert') or rule.get('record')}"
    # The check itself sees a typo.
    assert metric_names('rate(fleetpilot_router_ejections{a="b"}[1m])') - known == {
        "fleetpilot_router_ejections"
    }
