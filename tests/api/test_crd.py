"""The generated CRD: structural, complete, valid, and identical to the committed file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fleetpilot.api.crd import CRD_FILENAME, crd, render_crd
from fleetpilot.cli import main
from tests.crd_support import CrdValidator

REPO = Path(__file__).resolve().parents[2]


def _nodes(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for name, sub in node.get("properties", {}).items():
            found += _nodes(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            found += _nodes(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            found += _nodes(node["additionalProperties"], f"{path}{{}}")
    return found


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_committed_crd_is_current() -> None:
    """crds/ is generated; editing the models without regenerating fails here."""
    assert (REPO / "crds" / CRD_FILENAME).read_text() == render_crd()


def test_crds_check_reports_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetpilot crds --check` (what CI runs) must exit 1 and say so when the committed file
    differs from the models, and 0 when it does not."""
    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 0
    target = tmp_path / CRD_FILENAME
    target.write_text(target.read_text().replace("maxItems: 8", "maxItems: 9"))
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    """No $ref, no null unions, no titles, no closed objects: the server refuses those."""
    text = yaml.safe_dump(schema)
    assert "$ref" not in text
    assert "title:" not in text
    for path, node in _nodes(schema):
        assert node.get("additionalProperties") is not False, path
        for branch in node.get("anyOf", []):
            assert branch != {"type": "null"}, path
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"


def test_every_spec_field_is_described(schema: dict[str, Any]) -> None:
    """A spec field without a description leaves `kubectl explain` blank for users."""
    for path, node in _nodes(schema["properties"]["spec"], "spec"):
        for name, sub in node.get("properties", {}).items():
            described = "description" in sub or path.endswith(("tolerations[]", "env[]"))
            assert described, f"{path}.{name} has no description"


def test_defaults_are_written_as_manifests_write_them(schema: dict[str, Any]) -> None:
    """Defaults appear in the CRD as a user would write them ("15s", "5m"), not as seconds or
    pydantic objects the API server would store verbatim."""
    tier = schema["properties"]["spec"]["properties"]["tiers"]["items"]
    autoscaling = tier["properties"]["autoscaling"]
    assert autoscaling["default"]["interval"] == "15s"
    assert autoscaling["properties"]["interval"]["default"] == "15s"
    assert autoscaling["properties"]["scaleDown"]["default"]["stabilization"] == "5m"


def test_defaults_pass_their_own_rules() -> None:
    """The server refuses a CRD whose default fails the node's CEL rules (seen for real)."""
    assert CrdValidator().default_violations() == []


def test_open_api_exclusive_bounds(schema: dict[str, Any]) -> None:
    """OpenAPI 3.0 wants a boolean exclusiveMinimum next to minimum, not a number."""
    tier = schema["properties"]["spec"]["properties"]["tiers"]["items"]
    target = tier["properties"]["autoscaling"]["properties"]["kvCacheUsageTarget"]
    assert target["minimum"] == 0.0
    assert target["exclusiveMinimum"] is True


def test_crd_passes_kubernetes_schema() -> None:
    """The generated CRD is a valid apiextensions/v1 object: `kubectl apply` of the chart would be
    refused otherwise."""
    kubernetes_validate.validate(crd(), "1.36", strict=True)


def test_crd_shape() -> None:
    """Group, version, status subresource, printer columns and short names: renaming any breaks
    installed clusters, `kubectl get fpsvc` and the operator's status writes."""
    spec = crd()["spec"]
    version = spec["versions"][0]
    assert spec["group"] == "fleetpilot.dev"
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Tiers", "Endpoint", "Age"]
    assert spec["names"]["shortNames"]
