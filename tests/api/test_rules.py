"""Every cross-field rule, checked by both enforcers: the pydantic models and the CRD's CEL."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fleetpilot.api import InvalidManifestError, parse_service
from tests.crd_support import CrdValidator
from tests.rule_cases import RULE_CASES, RuleCase, base_manifest


@pytest.fixture(scope="module")
def validator() -> CrdValidator:
    return CrdValidator()


def test_base_manifest_is_valid_for_both(validator: CrdValidator) -> None:
    """The table's base object must pass, or every case would pass for the wrong reason."""
    parse_service(base_manifest())
    assert validator.validate(base_manifest()) == []


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_pydantic_refuses_with_the_rule_message(case: RuleCase) -> None:
    """A rule the models lose (or word differently from the CRD) lets `fleetpilot plan` accept
    a file the API server refuses, or explain it differently."""
    manifest = base_manifest()
    case.mutate(manifest)
    with pytest.raises(InvalidManifestError) as info:
        parse_service(manifest)
    assert case.message in [p.message for p in info.value.problems]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_cel_refuses_with_the_rule_message(case: RuleCase, validator: CrdValidator) -> None:
    """A CEL rule dropped from the generated CRD, or put on another node, lets `kubectl apply`
    accept what the operator will then refuse."""
    manifest = base_manifest()
    case.mutate(manifest)
    violations = validator.validate(manifest)
    assert (case.path, case.message) in [(v.path, v.message) for v in violations], violations


def test_every_cel_rule_has_a_case(validator: CrdValidator) -> None:
    """A rule added to the models without a case here fails this test."""
    covered = {case.message for case in RULE_CASES}
    messages = {rule["message"] for rule in validator.rules()}
    assert messages - covered == set()


def _mutable_nodes(value: Any) -> dict[int, str]:
    """Every dict and list in a manifest, by identity, with where it sits."""
    found: dict[int, str] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict | list):
            found[id(node)] = where or "<root>"
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                walk(child, f"{where}.{key}" if where else str(key))

    walk(value, "")
    return found


def test_base_manifests_share_no_mutable_node() -> None:
    """Each case mutates its own base_manifest(): a builder handing out a shared dict or list
    (a module-level default) would let one case's mutation leak into every later case, which
    then passes or fails for the wrong reason, whether or not a current case touches it."""
    one, other = base_manifest(), base_manifest()  # both alive, so no id is reused
    first, second = _mutable_nodes(one), _mutable_nodes(other)
    shared = sorted(first[i] for i in first.keys() & second.keys())
    assert shared == []


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_a_case_changes_its_manifest_and_nothing_else(case: RuleCase) -> None:
    """A mutation that changes nothing would test the valid base object; one that reaches
    another manifest (built before or after) would break the cases that follow it."""
    before, mine = base_manifest(), base_manifest()
    pristine = copy.deepcopy(before)
    case.mutate(mine)
    assert mine != pristine
    assert before == pristine
    assert base_manifest() == pristine


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_enforcers_leave_the_manifest_as_given(case: RuleCase, validator: CrdValidator) -> None:
    """Validating refuses, it does not repair: neither pydantic nor the CEL check (which
    applies the schema's defaults first) may default or rewrite the caller's dict, or the
    operator and the next check would see a manifest the user never wrote."""
    manifest = base_manifest()
    case.mutate(manifest)
    given = copy.deepcopy(manifest)
    with pytest.raises(InvalidManifestError):
        parse_service(manifest)
    assert manifest == given
    validator.validate(manifest)
    assert manifest == given


@pytest.mark.parametrize("size", ["0", "0Gi", "0.0", "-64Gi", 0, -1])
def test_a_host_kv_tier_of_no_size_is_refused_by_both(validator: CrdValidator, size: Any) -> None:
    """engine.kvOffload.size above zero (vLLM refuses an offloading connector of no bytes at
    start): the model names the field, the CRD's pattern refuses a string and its minimum an
    integer (e2e/test_api_rules.py shows the real API server does too)."""
    manifest = base_manifest()
    manifest["spec"]["tiers"][0]["engine"]["kvOffload"]["size"] = size
    with pytest.raises(InvalidManifestError) as info:
        parse_service(manifest)
    assert [p.path for p in info.value.problems] == ["spec.tiers[0].engine.kvOffload.size"]
    violations = validator.validate(manifest)
    # jsonschema reports a nullable object's failure at the object (the base's 32Gi passes).
    assert [v.path for v in violations] == ["spec.tiers.0.engine.kvOffload"]
