"""The process node's image table (``fleetpilot.testing.processnode``): what the harness
writes must cover the images the operator and the chart put in pods, and point at programs
that exist, or every pod they make would be refused on the process nodes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fleetpilot.operator.plan_types import DEFAULT_FLEETPILOT_IMAGE, DEFAULT_REFERENCE_IMAGE
from fleetpilot.testing import processnode
from fleetpilot.testing.errors import ControlPlaneError
from fleetpilot.testing.processnode import ProcessNode, fleetpilot_image_table, netns_name

CHART = Path(__file__).resolve().parents[2] / "charts" / "fleetpilot"


def matches(pattern: str, image: str) -> bool:
    """The agent's rule (imageTable.lookup in e2e/processnode/main.go): exact, or a prefix
    before a trailing `*`."""
    return image == pattern or (pattern.endswith("*") and image.startswith(pattern[:-1]))


def test_the_table_covers_the_images_the_operator_and_the_chart_use() -> None:
    """The operator's default image (router, fetcher pods), the chart's operator image, with
    the chart's appVersion tag, and the reference engine's default image all map to this
    environment; another fleetpilot-* image does not."""
    rules = fleetpilot_image_table()["images"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart_image = f"{values['image']['repository']}:{chart['appVersion']}"
    for image in (DEFAULT_FLEETPILOT_IMAGE, chart_image, DEFAULT_REFERENCE_IMAGE):
        assert any(matches(r["pattern"], image) for r in rules), image
    assert not any(matches(r["pattern"], "ghcr.io/fleetpilot/fleetpilot-other:1") for r in rules)


def test_the_table_points_at_this_environments_programs() -> None:
    """`python` and the image's entrypoint resolve in the table's PATH entry, as in the image."""
    for rule in fleetpilot_image_table()["images"]:
        (bin_dir,) = (Path(p) for p in rule["path"])
        for program in ("python", rule["entrypoint"][0]):
            assert os.access(bin_dir / program, os.X_OK), program


def test_netns_names_are_unique_per_pod_ip() -> None:
    """The agent names each pod's namespace after its IP (podNames in network.go)."""
    assert netns_name("10.244.1.2") == "fpn-1-2"
    assert netns_name("10.244.12.1") != netns_name("10.244.1.21")


def test_a_second_node_waits_for_the_machine_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two agents on one machine sweep each other's pod networks: while one ProcessNode holds
    the machine lock, another's start gives up (here at once) rather than start its agent;
    the lock is free again once the first lets go."""
    monkeypatch.setattr(processnode, "MACHINE_LOCK", tmp_path / "lock")
    first = ProcessNode(tmp_path / "kubeconfig", tmp_path / "first", build=False)
    second = ProcessNode(tmp_path / "kubeconfig", tmp_path / "second", build=False)
    first._take_machine_lock(timeout=0)
    with pytest.raises(ControlPlaneError, match="another process node"):
        second._take_machine_lock(timeout=0)
    first._release_machine_lock()
    second._take_machine_lock(timeout=0)
    second._release_machine_lock()
