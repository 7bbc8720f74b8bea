"""The API reference (docs/api.md), rendered from the CRD's schema.

The schema is generated from the pydantic models (``fleetpilot.api.crd``), so the reference
says what the API server enforces: every field's type, default, bounds and description, and
the CEL rules with the messages a refused object gets. Purely computational;
``python -m fleetpilot.api.reference_doc > docs/api.md`` writes it, and a test fails when the
file is stale.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fleetpilot.api.crd import openapi_schema
from fleetpilot.api.service import GROUP, KIND, VERSION
from fleetpilot.api.units import DURATION_PATTERN, POSITIVE_QUANTITY_PATTERN, QUANTITY_PATTERN

COMMAND = "python -m fleetpilot.api.reference_doc > docs/api.md"

# Keywords that bound a value, in the order a reader wants them, with how each reads.
_BOUNDS = (
    ("minimum", "min {}"),
    ("exclusiveMinimum", "> minimum"),
    ("maximum", "max {}"),
    ("minLength", "min length {}"),
    ("maxLength", "max length {}"),
    ("minItems", "min items {}"),
    ("maxItems", "max items {}"),
    ("maxProperties", "max entries {}"),
    ("pattern", "pattern `{}`"),
)


@dataclass(frozen=True)
class Section:
    """One object of the schema: its path, description, fields and CEL rules."""

    path: str
    description: str
    rows: list[tuple[str, str, str, str]]
    rules: list[str]


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _type_of(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type")
    if kind == "array":
        return f"list of {_type_of(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type_of(node['additionalProperties'])}"
    if kind is None and node.get("x-kubernetes-preserve-unknown-fields"):
        return "any"
    return str(kind or "any")


# Patterns a reader knows by name rather than by their regular expression.
_NAMED_PATTERNS = {
    QUANTITY_PATTERN: "a Kubernetes quantity (e.g. 64Gi, 500m)",
    POSITIVE_QUANTITY_PATTERN: "a positive Kubernetes quantity (e.g. 64Gi)",
    DURATION_PATTERN: "a duration (e.g. 500ms, 30s, 2m, 1h30m)",
}


def _bounds(node: dict[str, Any]) -> list[str]:
    out = []
    for key, form in _BOUNDS:
        if key not in node or node[key] is False:
            continue
        named = _NAMED_PATTERNS.get(node[key]) if key == "pattern" else None
        out.append(named or form.format(node[key]))
    return out


def _default(node: dict[str, Any]) -> str:
    # An object's default is its fields' defaults, each in its own section's table.
    if "default" not in node or _object_below(node) is not None:
        return ""
    return f"`{json.dumps(node['default'], separators=(', ', ': '))}`"


def _object_below(node: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The object a field leads to (itself, its items or its map values) and the path suffix
    that reaches it; ``None`` for a scalar."""
    if "properties" in node:
        return "", node
    items = node.get("items")
    if isinstance(items, dict) and "properties" in items:
        return "[]", items
    values = node.get("additionalProperties")
    if isinstance(values, dict) and "properties" in values:
        return "{}", values
    return None


def sections(node: dict[str, Any], path: str) -> Iterator[Section]:
    """The object at ``path`` and every object below it, depth first in field order."""
    required = set(node.get("required", []))
    rows = []
    below = []
    for name, field in node.get("properties", {}).items():
        notes = _bounds(field)
        if name in required:
            notes.insert(0, "required")
        description = field.get("description", "")
        if notes:
            description = f"{description} ({', '.join(notes)})"
        description = _cell(description)
        nested = _object_below(field)
        label = f"`{name}`"
        if nested is not None:
            suffix, child = nested
            child_path = f"{path}.{name}{suffix}"
            label = f"[`{name}`](#{_anchor(child_path)})"
            below.append((child_path, child, field))
        rows.append((label, _cell(_type_of(field)), _default(field), description))
    rules = [
        f"`{_cell(r['rule'])}`: {_cell(r.get('message', ''))}"
        for r in node.get("x-kubernetes-validations", [])
    ]
    yield Section(path, _cell(node.get("description", "")), rows, rules)
    for child_path, child, field in below:
        described = dict(child)
        described.setdefault("description", field.get("description", ""))
        yield from sections(described, child_path)


def _anchor(path: str) -> str:
    """GitHub's anchor for a heading that is ``path`` in backquotes."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")


def render() -> str:
    """docs/api.md."""
    schema = openapi_schema()
    lines = [
        f"# {KIND} API reference (`{GROUP}/{VERSION}`)",
        "",
        f"Generated from the CRD's schema by `{COMMAND}`;",
        "do not edit (a test fails when it is stale). The schema is generated from the pydantic",
        "models in `fleetpilot/api`, so this is what the API server enforces at `kubectl apply`.",
        "`status` is written by the operator. An object's default is its fields' defaults.",
        "",
    ]
    for top in ("spec", "status"):
        for section in sections(schema["properties"][top], top):
            lines += [f"## `{section.path}`", ""]
            if section.description:
                lines += [section.description, ""]
            if section.rows:
                lines += ["| field | type | default | description |", "|---|---|---|---|"]
                lines += [f"| {' | '.join(row)} |" for row in section.rows]
                lines.append("")
            if section.rules:
                lines += ["Rules (CEL, checked by the API server):", ""]
                lines += [f"- {rule}" for rule in section.rules]
                lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
