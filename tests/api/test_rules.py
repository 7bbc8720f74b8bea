"""Every cross-field rule, checked by both enforcers: the pydantic models and the CRD's CEL."""

from __future__ import annotations

import copy

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
    manifest = base_manifest()
    case.mutate(manifest)
    with pytest.raises(InvalidManifestError) as info:
        parse_service(manifest)
    assert case.message in [p.message for p in info.value.problems]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda c: c.id)
def test_cel_refuses_with_the_rule_message(case: RuleCase, validator: CrdValidator) -> None:
    manifest = base_manifest()
    case.mutate(manifest)
    violations = validator.validate(manifest)
    assert (case.path, case.message) in [(v.path, v.message) for v in violations], violations


def test_every_cel_rule_has_a_case(validator: CrdValidator) -> None:
    """A rule added to the models without a case here fails this test."""
    covered = {case.message for case in RULE_CASES}
    messages = {rule["message"] for rule in validator.rules()}
    assert messages - covered == set()


def test_mutations_do_not_leak_between_cases() -> None:
    before = copy.deepcopy(base_manifest())
    for case in RULE_CASES:
        case.mutate(base_manifest())
    assert base_manifest() == before
