"""docs/api.md is the API reference rendered from the CRD's schema, and current."""

from __future__ import annotations

import re
from pathlib import Path

from fleetpilot.api.crd import openapi_schema
from fleetpilot.api.reference_doc import COMMAND, render, sections

DOC = Path(__file__).parents[2] / "docs" / "api.md"


def test_docs_api_md_is_current() -> None:
    assert DOC.read_text() == render(), f"docs/api.md is stale: run `{COMMAND}`"


def test_every_field_of_the_schema_has_a_row() -> None:
    """Walk the schema independently of the renderer: every property of every object (through
    lists and maps) is a row in the section of its parent's path."""
    text = render()
    expected: list[tuple[str, str]] = []

    def walk(node: dict[str, object], path: str) -> None:
        props = node.get("properties")
        if not isinstance(props, dict):
            return
        for name, field in props.items():
            expected.append((path, name))
            if "properties" in field:
                walk(field, f"{path}.{name}")
            elif isinstance(field.get("items"), dict) and "properties" in field["items"]:
                walk(field["items"], f"{path}.{name}[]")
            elif isinstance(field.get("additionalProperties"), dict):
                walk(field["additionalProperties"], f"{path}.{name}{{}}")

    schema = openapi_schema()
    for top in ("spec", "status"):
        walk(schema["properties"][top], top)
    assert len(expected) > 100
    parts = re.split(r"^## `([^`]+)`$", text, flags=re.MULTILINE)
    by_path = dict(zip(parts[1::2], parts[2::2], strict=True))
    for path, name in expected:
        assert path in by_path, f"no section for {path}"
        assert re.search(rf"^\| \[?`{re.escape(name)}`", by_path[path], re.MULTILINE), (
            f"{path}.{name} has no row"
        )


def test_a_field_shows_its_type_default_bounds_and_rules() -> None:
    found = {s.path: s for s in sections(openapi_schema()["properties"]["spec"], "spec")}
    tier = found["spec.tiers[]"]
    name_row = next(r for r in tier.rows if r[0] == "`name`")
    assert name_row[1] == "string"
    assert "required" in name_row[3]
    assert "max length 63" in name_row[3]
    offload = found["spec.tiers[].engine.kvOffload"]
    backend = next(r for r in offload.rows if r[0] == "`backend`")
    assert backend[1] == "one of `native`, `lmcache`"
    assert backend[2] == '`"native"`'
    assert any("lmcache is not supported" in rule for rule in offload.rules)
    # A link to a nested object's section resolves to a heading of the document.
    engine_row = next(r for r in tier.rows if r[0].startswith("[`engine`]"))
    anchor = engine_row[0].split("(#", 1)[1].rstrip(")")
    assert anchor == "spectiersengine"
    assert "## `spec.tiers[].engine`" in render()


def test_pipes_in_rules_do_not_break_the_table() -> None:
    for line in render().splitlines():
        if line.startswith("| "):
            cells = re.split(r"(?<!\\)\|", line)
            assert len(cells) == 6, line
