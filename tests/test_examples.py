"""Examples are tests: every file in examples/ is valid, plans, and plans valid objects."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fleetpilot.api import load_services
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from tests.crd_support import CrdValidator

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
KUBERNETES_VERSION = "1.36"
# Kinds from optional CRDs have no schema in kubernetes-validate; checked by shape instead.
OPTIONAL_KINDS = {"PodMonitor"}


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.fixture(scope="module")
def validator() -> CrdValidator:
    return CrdValidator()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_the_crd_schema_and_rules(path: Path, validator: CrdValidator) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        assert validator.validate(document) == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_planned_object_passes_kubernetes_schemas(path: Path) -> None:
    for service in load_services(path):
        objects = plan(service, PlanOptions(pod_monitor_available=True))
        kinds = {obj["kind"] for obj in objects}
        assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
        for obj in objects:
            if obj["kind"] in OPTIONAL_KINDS:
                assert obj["apiVersion"] == "monitoring.coreos.com/v1"
                continue
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
