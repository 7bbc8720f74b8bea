"""The generated InferenceService CRD's checks, run in-process as the API server runs them, so
unit tests prove what a cluster would accept without starting one.

``CrdValidator.validate(obj)`` takes the server's steps in its order: structural defaulting,
OpenAPI schema validation (unknown fields under ``spec`` and ``status`` refused, as ``kubectl
apply``'s strict field validation does), then every ``x-kubernetes-validations`` CEL rule at its
node, evaluated with cel-python. ``default_violations()`` checks what the server checks when the
CRD itself is applied: each ``default`` against its own node's schema and rules, as written.
``rules()`` lists every CEL rule, so a test can demand a case for each.

Used by tests/api/test_rules.py (each cross-field rule refuses with its message, in CEL as in
the pydantic models), tests/api/test_crd.py (defaults pass their own rules) and
tests/test_examples.py (every example is accepted). cel-python lacks Kubernetes' CEL list library
(``isSorted``, ``indexOf``, ``lastIndexOf``), which the CRD's rules use, so it is provided here.
The real API server sees the same CRD in the e2e suite, which installs it from the chart.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from fleetpilot.api.crd import crd


@dataclass(frozen=True)
class Violation:
    path: str
    message: str


def crd_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill missing properties that have a default, then descend."""
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                _default_in_place(extra, item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_in_place(schema["items"], item)


def to_json_schema(node: Any, strict: bool) -> Any:
    """OpenAPI v3 (structural) -> JSON Schema 2020-12, refusing unknown fields if strict."""
    if isinstance(node, list):
        return [to_json_schema(item, strict) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub, strict) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[key] = to_json_schema(value, strict)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and value is True:
            bound = "minimum" if key == "exclusiveMinimum" else "maximum"
            out[key] = node[bound]
        elif key == "nullable" or key.startswith("x-kubernetes-"):
            continue
        else:
            out[key] = value
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if node.get(key) is True:
            out.pop("minimum" if key == "exclusiveMinimum" else "maximum", None)
    # The API server keeps (never refuses) the unknown fields of a preserve-unknown-fields node.
    preserved = node.get("x-kubernetes-preserve-unknown-fields") is True
    if strict and "properties" in node and "additionalProperties" not in node and not preserved:
        out["additionalProperties"] = False
    if node.get("nullable"):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _is_sorted(items: celtypes.ListType) -> celtypes.BoolType:
    return celtypes.BoolType(all(a <= b for a, b in pairwise(items)))


def _index_of(items: celtypes.ListType, item: Any) -> celtypes.IntType:
    return celtypes.IntType(next((i for i, x in enumerate(items) if x == item), -1))


def _last_index_of(items: celtypes.ListType, item: Any) -> celtypes.IntType:
    last = -1
    for i, x in enumerate(items):
        if x == item:
            last = i
    return celtypes.IntType(last)


KUBERNETES_LIST_LIBRARY = {
    "isSorted": _is_sorted,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
}


def _path(parent: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{parent}[{part}]"
    return f"{parent}.{part}" if parent else part


class CrdValidator:
    """Compiled once per test session: the schema and every CEL program."""

    def __init__(self) -> None:
        self.schema = crd_schema()
        self.env = celpy.Environment()
        self._programs: dict[str, Any] = {}
        self.json_schema = to_json_schema(self.schema, strict=False)
        for part in ("spec", "status"):
            self.json_schema["properties"][part] = to_json_schema(
                self.schema["properties"][part], strict=True
            )

    def rules(self) -> list[dict[str, str]]:
        """Every CEL rule in the CRD."""
        found: list[dict[str, str]] = []

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                found.extend(node.get("x-kubernetes-validations", []))
                for value in node.values():
                    walk(value)
            elif isinstance(node, list):
                for value in node:
                    walk(value)

        walk(self.schema)
        return found

    def default_violations(self) -> list[Violation]:
        """Defaults the server would refuse when the CRD is applied.

        The API server validates each ``default`` against its node's schema and CEL rules as
        written, without applying the defaults nested inside it first.
        """
        found: list[Violation] = []

        def walk(node: Any, path: str) -> None:
            if not isinstance(node, dict):
                return
            if "default" in node:
                schema = to_json_schema(node, strict=True)
                for err in jsonschema.Draft202012Validator(schema).iter_errors(node["default"]):
                    found.append(Violation(f"{path}.default", err.message))
                self._check_rules(node, node["default"], f"{path}.default", found)
            for name, sub in node.get("properties", {}).items():
                walk(sub, f"{path}.{name}")
            if isinstance(node.get("items"), dict):
                walk(node["items"], f"{path}[]")

        walk(self.schema, "")
        return found

    def _program(self, rule: str) -> Any:
        if rule not in self._programs:
            self._programs[rule] = self.env.program(
                self.env.compile(rule), functions=KUBERNETES_LIST_LIBRARY
            )
        return self._programs[rule]

    def validate(self, obj: dict[str, Any]) -> list[Violation]:
        """Every reason the API server would refuse ``obj`` (empty when accepted)."""
        defaulted = apply_defaults(self.schema, obj)
        validator = jsonschema.Draft202012Validator(self.json_schema)
        schema_errors = [
            Violation(".".join(str(p) for p in err.absolute_path), err.message)
            for err in validator.iter_errors(defaulted)
        ]
        if schema_errors:
            return schema_errors
        violations: list[Violation] = []
        self._check_rules(self.schema, defaulted, "", violations)
        return violations

    def _check_rules(
        self, schema: dict[str, Any], value: Any, path: str, out: list[Violation]
    ) -> None:
        if value is None:
            return
        for rule in schema.get("x-kubernetes-validations", []):
            try:
                result = self._program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
            except celpy.CELEvalError as exc:
                out.append(Violation(path, f"rule {rule['rule']!r} failed to evaluate: {exc}"))
                continue
            if isinstance(result, Exception) or not bool(result):
                out.append(Violation(path, rule["message"]))
        if isinstance(value, dict):
            for name, sub in schema.get("properties", {}).items():
                if name in value:
                    self._check_rules(sub, value[name], _path(path, name), out)
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):
                for key, item in value.items():
                    self._check_rules(extra, item, _path(path, key), out)
        elif isinstance(value, list) and "items" in schema:
            for i, item in enumerate(value):
                self._check_rules(schema["items"], item, _path(path, i), out)
