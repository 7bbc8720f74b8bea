"""The Prometheus launcher (fleetpilot.runtime.prometheus), against the autoscaler fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetpilot.kube.names import engine_selector
from fleetpilot.runtime.prometheus import (
    PrometheusError,
    PrometheusServer,
    ScrapeTarget,
    find_binary,
    render_config,
    sanitize_label_name,
)
from tests.autoscaler.support import Fleet


def test_pod_labels_reach_prometheus_as_service_discovery_hands_them_over() -> None:
    """Pod labels become __meta_kubernetes_pod_label_* and are relabeled as in a cluster."""
    target = ScrapeTarget("127.0.0.1:9", engine_selector("chat", "small", "decode"), "ml")
    config = render_config([target], 1.0)
    (job,) = config["scrape_configs"]
    assert job["scrape_interval"] == "1s"
    assert job["static_configs"] == [
        {
            "targets": ["127.0.0.1:9"],
            "labels": {
                "__meta_kubernetes_pod_label_fleetpilot_dev_service": "chat",
                "__meta_kubernetes_pod_label_fleetpilot_dev_tier": "small",
                "__meta_kubernetes_pod_label_fleetpilot_dev_role": "decode",
                "__meta_kubernetes_namespace": "ml",
            },
        }
    ]
    assert job["relabel_configs"] == [
        {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
    ]
    assert sanitize_label_name("fleetpilot.dev/role") == "fleetpilot_dev_role"


def test_relabeled_targets_carry_the_reader_labels(fleet: Fleet) -> None:
    """On the real server: the scraped series carry fleetpilot_dev_* and namespace labels."""
    up = fleet.prometheus.query('up{fleetpilot_dev_service="reader",namespace="other"}')
    assert [s["metric"]["fleetpilot_dev_role"] for s in up] == ["unified"]
    assert up[0]["metric"]["fleetpilot_dev_tier"] == "small"


def test_the_server_runs_in_its_own_process_group_on_loopback(fleet: Fleet) -> None:
    """Stopped by pid, never by name; never the packaged service's port."""
    pid = fleet.prometheus.pid
    assert pid is not None
    assert os.getpgid(pid) == pid
    assert fleet.prometheus.url.startswith("http://127.0.0.1:")
    assert not fleet.prometheus.url.endswith(":9090")


def test_start_failure_reports_the_log_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config Prometheus refuses: start() raises with its log, and no process survives."""
    server = PrometheusServer(tmp_path, [ScrapeTarget("127.0.0.1:9")])
    broken = "scrape_configs: [{job_name: a}, {job_name: a}]\n"  # a duplicate job name
    monkeypatch.setattr(server, "_write_config", lambda: server.config_path.write_text(broken))
    with pytest.raises(PrometheusError, match="prometheus exited") as raised:
        server.start()
    assert "found multiple scrape configs with job name" in str(raised.value)
    assert server.pid is None


def test_a_missing_binary_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Prometheus on this machine: the error says how to install one, instead of a bare
    FileNotFoundError."""
    monkeypatch.setenv("FLEETPILOT_PROMETHEUS_BIN", str(tmp_path / "nope"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("fleetpilot.runtime.prometheus.DEFAULT_BINARY", str(tmp_path / "nope"))
    with pytest.raises(PrometheusError, match="apt-get install -y prometheus"):
        find_binary()
