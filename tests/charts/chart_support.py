"""The chart as `helm template` renders it, shared by the chart's test modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fleetpilot"
K8S_VERSION = "1.36"
RELEASE = "fp"
RELEASE_NAMESPACE = "fleetpilot-system"

Obj = dict[str, Any]


def render(chart: helm.Chart, values: Obj | None = None, *, name: str = RELEASE) -> list[Obj]:
    """The chart's objects for an install of release ``name``, as `helm template` prints them."""
    manifests = chart.render(values or {}, name=name, namespace=RELEASE_NAMESPACE, is_install=True)
    objects: list[Obj] = []
    for path in sorted(manifests):
        if path.endswith(".yaml"):  # NOTES.txt is text for the user, not a manifest
            objects += [obj for obj in yaml.safe_load_all(manifests[path]) if obj]
    return objects


def only(objects: list[Obj], kind: str, namespace: str | None = None) -> Obj:
    found = [
        obj
        for obj in objects
        if obj["kind"] == kind
        and (namespace is None or obj["metadata"].get("namespace") == namespace)
    ]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
