"""`fleetpilot plan -o summary`: what it says of autoscaling where no Prometheus is known
(issue 47: loud where silent)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetpilot.api import parse_service
from fleetpilot.cli import main
from fleetpilot.operator.planner import plan
from fleetpilot.operator.summary import NO_PROMETHEUS, summarize
from tests.factories import make_manifest, make_tier

PROMETHEUS = "http://prometheus-operated.monitoring:9090"


def _service(*tiers: dict[str, Any], **spec: Any) -> Any:
    manifest = make_manifest(tiers=list(tiers))
    manifest["spec"].update(spec)
    return parse_service(manifest)


def _tier_block(text: str, tier: str) -> str:
    """The summary's lines of one tier's roles, up to the next blank line."""
    start = text.index(f"  tier {tier} /")
    end = text.find("\n\n", start)
    return text[start : end if end != -1 else None]


def test_autoscaled_tiers_are_said_not_to_be_without_a_prometheus() -> None:
    """No --prometheus-url and no spec.monitoring.prometheusUrl: each tier fleetpilot's
    autoscaler decides for (auto, recommend) says it is not autoscaled and how to fix it; a
    disabled or external tier says nothing of Prometheus."""
    svc = _service(
        make_tier("auto", up_to=0.3),
        make_tier("recommend", up_to=0.6, autoscaling={"mode": "recommend"}),
        make_tier("fixed", autoscaling={"mode": "disabled"}),
    )
    text = summarize(svc, plan(svc))
    expected = (
        "not autoscaled: no Prometheus (pass --prometheus-url or set prometheusURL, the chart "
        "value, or spec.monitoring.prometheusUrl)"
    )
    assert expected == NO_PROMETHEUS
    assert NO_PROMETHEUS in _tier_block(text, "auto")
    assert NO_PROMETHEUS in _tier_block(text, "recommend")
    assert "Prometheus" not in _tier_block(text, "fixed")


@pytest.mark.parametrize("where", ["flag", "spec"])
def test_a_known_prometheus_keeps_the_summary_quiet(where: str) -> None:
    """The operator's Prometheus (--prometheus-url) or the service's own: no such line."""
    spec = {"monitoring": {"prometheusUrl": PROMETHEUS}} if where == "spec" else {}
    svc = _service(make_tier("auto"), **spec)
    url = PROMETHEUS if where == "flag" else None
    assert "not autoscaled" not in summarize(svc, plan(svc), url)


def test_plan_takes_the_operators_prometheus_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetpilot plan -o summary --prometheus-url URL` plans as for an operator reading
    that Prometheus; without the flag the tier is said not to be autoscaled."""
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(make_manifest(tiers=[make_tier("auto")])))
    assert main(["plan", "-f", str(path), "-o", "summary"]) == 0
    assert NO_PROMETHEUS in capsys.readouterr().out
    assert main(["plan", "-f", str(path), "-o", "summary", "--prometheus-url", PROMETHEUS]) == 0
    assert "not autoscaled" not in capsys.readouterr().out
