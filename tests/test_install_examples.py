"""docs/install.md's table of examples says what the planner says: each example's namespace,
GPUs at its minimum and maximum replicas, their product, and where its weights come from; and
every example has a row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetpilot.api import load_services
from fleetpilot.api.spec import EngineBackend
from fleetpilot.operator.planner import all_roles

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples"
ROW = re.compile(
    r"^\| `(?P<file>[\w.-]+\.yaml)` \| (?P<ns>[\w-]+) \| (?P<gpus>[^|]+) \|(?P<rest>.*)$"
)


def rows() -> dict[str, re.Match[str]]:
    text = (ROOT / "docs" / "install.md").read_text()
    return {m["file"]: m for m in map(ROW.match, text.splitlines()) if m}


def test_every_example_has_a_row() -> None:
    assert sorted(rows()) == sorted(p.name for p in EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_the_row_matches_the_plan(name: str) -> None:
    row = rows()[name]
    (service,) = load_services(EXAMPLES / name)
    assert row["ns"] == service.namespace
    if name.startswith("local-"):
        return  # for `fleetpilot up`, which ignores GPUs
    start = high = 0
    products = set()
    for role in all_roles(service):
        if role.tier.engine.backend is EngineBackend.REFERENCE:
            continue
        start += role.parallelism.gpus * role.replicas.start
        high += role.parallelism.gpus * role.replicas.max
        products.add(role.tier.resources.gpu_product)
    expected = f"{start} ({high})" + (f" {products.pop()}" if products else "")
    assert row["gpus"].strip() == expected
    claims = {
        t.model.source.pvc.claim_name
        for t in service.spec.tiers
        if t.model.source is not None and t.model.source.pvc is not None
    }
    for claim in claims:
        assert f"PVC `{claim}`" in row["rest"]
    if service.spec.model_cache is not None:
        assert "model cache" in row["rest"]
