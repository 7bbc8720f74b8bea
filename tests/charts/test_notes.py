"""NOTES.txt, what `helm install` prints: rendered by the Helm engine, and loud when the chart
is installed without a metrics source (no autoscaling then, and nothing else would say so)."""

from __future__ import annotations

import re

import helm_python as helm
import pytest

from tests.charts.chart_support import RELEASE, RELEASE_NAMESPACE, Obj

WARNING = "WARNING: autoscaling is off: no metrics source."


def notes(chart: helm.Chart, values: Obj | None = None) -> str:
    manifests = chart.render(
        values or {}, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True
    )
    (path,) = [p for p in manifests if p.endswith("/NOTES.txt")]
    return manifests[path]


def test_no_prometheus_url_prints_a_warning_block_with_the_fix(chart: helm.Chart) -> None:
    text = notes(chart)
    assert WARNING in text
    block = text[text.index(WARNING) :]
    # A block that stands out: a rule of #s above and below.
    lines = text.splitlines()
    at = lines.index(WARNING)
    assert re.fullmatch(r"#{40,}", lines[at - 1])
    assert any(re.fullmatch(r"#{40,}", line) for line in lines[at + 1 :])
    # How to set it, for this release, in this namespace.
    (upgrade,) = [
        line.strip() for line in block.replace("\\\n", " ").splitlines() if "helm upgrade" in line
    ]
    words = upgrade.split()
    assert words[:3] == ["helm", "upgrade", RELEASE]
    assert words[words.index("-n") + 1] == RELEASE_NAMESPACE
    assert words[words.index("--version") + 1] == chart.metadata["version"]
    assert "--reuse-values" in words
    assert words[words.index("--set") + 1].startswith("prometheusURL=http")
    assert "spec.monitoring.prometheusUrl" in block  # the per-service way out


def test_a_prometheus_url_silences_the_warning(chart: helm.Chart) -> None:
    text = notes(chart, {"prometheusURL": "http://prometheus-operated.monitoring:9090"})
    assert "WARNING" not in text
    assert "autoscaling is off" not in text
    assert f"is installed as {RELEASE}-fleetpilot in {RELEASE_NAMESPACE}" in text


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a", "team-b"]}])
def test_notes_still_say_where_it_serves(chart: helm.Chart, values: Obj) -> None:
    text = notes(chart, values)
    expected = "team-a, team-b" if values else "every namespace"
    assert expected in text
    assert WARNING in text
