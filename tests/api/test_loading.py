"""Manifests in, InferenceServices out - or errors that name the field and the line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetpilot.api import InvalidManifestError, load_services, parse_service
from fleetpilot.api.spec import DEFAULT_VLLM_IMAGE, ServingMode
from tests.factories import make_manifest, two_tier_manifest


def _problems(manifest: object) -> list[str]:
    with pytest.raises(InvalidManifestError) as info:
        parse_service(manifest)
    return [str(p) for p in info.value.problems]


def test_defaults_fill_a_minimal_manifest() -> None:
    """A manifest with only a tier name and model gets the pinned image, unified mode, the 5m scale-
    down window and the model name as its alias."""
    service = parse_service(make_manifest(tiers=[{"name": "main", "model": {"name": "m/x"}}]))
    tier = service.spec.tiers[0]
    assert tier.engine.image == DEFAULT_VLLM_IMAGE
    assert tier.serving.mode is ServingMode.UNIFIED
    assert tier.autoscaling.scale_down.stabilization.total_seconds() == 300
    assert tier.model.alias == "m/x"


def test_unknown_field_is_refused_with_its_path() -> None:
    """A misspelt field is refused and named, not silently dropped (the user would think it
    applied)."""
    manifest = two_tier_manifest()
    manifest["spec"]["tiers"][1]["engine"] = {"gpuMemUtil": 0.5}
    assert _problems(manifest) == ["spec.tiers[1].engine.gpuMemUtil: unknown field"]


def test_missing_required_field_is_named() -> None:
    """A missing required field names its path, in manifest (camelCase) terms."""
    manifest = make_manifest(tiers=[{"name": "main"}])
    assert _problems(manifest) == ["spec.tiers[0].model: required field is missing"]


def test_bounds_are_enforced_with_the_field_name() -> None:
    """An out-of-range value (gpuMemoryUtilization 1.5) is refused at its field."""
    manifest = make_manifest()
    manifest["spec"]["tiers"][0]["engine"] = {"gpuMemoryUtilization": 1.5}
    (problem,) = _problems(manifest)
    assert problem.startswith("spec.tiers[0].engine.gpuMemoryUtilization:")


def test_wire_form_round_trips() -> None:
    """What the models write is what they read: no field lost, names camelCase."""
    service = parse_service(two_tier_manifest())
    wire = service.to_wire()
    assert "maxNumSeqs" in wire["spec"]["tiers"][0]["engine"]
    assert parse_service(wire) == service


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    """A YAML syntax error says where, instead of a traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text("apiVersion: fleetpilot.dev/v1alpha1\nspec:\n  tiers: [\n    - x\n")
    with pytest.raises(InvalidManifestError) as info:
        load_services(path)
    assert "line " in str(info.value)
    assert "YAML syntax error" in str(info.value)


def test_every_document_of_a_file_is_loaded(tmp_path: Path) -> None:
    """A multi-document file yields every service, in order, not just the first."""
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump_all([make_manifest("a"), make_manifest("b")]))
    assert [s.name for s in load_services(path)] == ["a", "b"]


def test_other_kinds_are_refused_not_skipped(tmp_path: Path) -> None:
    """A file holding another kind (a ConfigMap) is an error, not an empty plan that looks like
    success."""
    path = tmp_path / "cm.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}))
    with pytest.raises(InvalidManifestError) as info:
        load_services(path)
    assert "kind" in str(info.value)


def test_non_mapping_is_refused() -> None:
    """A document that is a list or scalar is refused with one clear message, not a pydantic
    dump."""
    assert _problems(["not", "a", "mapping"]) == ["expected a mapping (a YAML object)"]


def _file_error(path: Path) -> str:
    with pytest.raises(InvalidManifestError) as info:
        load_services(path)
    message = str(info.value)
    assert "\n" not in message  # a problem with the whole file is one line
    return message


def test_a_file_above_the_limit_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    """Regression: `plan -f /dev/zero` read until memory ran out."""
    from fleetpilot.api.loading import MAX_MANIFEST_BYTES, read_manifest

    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_MANIFEST_BYTES + 1))
    assert "larger than 1048576 bytes (1 MiB)" in _file_error(big)
    assert read_manifest(big, limit=MAX_MANIFEST_BYTES + 1) == "#" * (MAX_MANIFEST_BYTES + 1)
    assert "larger than 1048576 bytes" in _file_error(Path("/dev/zero"))


def test_non_utf8_and_deeply_nested_files_name_their_problem(tmp_path: Path) -> None:
    """A Latin-1 file names the offending byte; a 5,000-level nesting is refused instead of blowing
    the stack."""
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"kind: InferenceService # caf\xe9\n")
    assert _file_error(latin1) == f"{latin1}: not UTF-8 text (byte 28: 0xe9)"
    deep = tmp_path / "deep.yaml"
    deep.write_text("spec: " + "{a: " * 5000 + "1" + "}" * 5000)
    expected = f"{deep}: YAML nested deeper than 100 levels (at line 1, column 403)"
    assert _file_error(deep) == expected


@pytest.mark.parametrize(
    ("endpoint", "accepted"),
    [
        ("https://artifactory.example/api/huggingfaceml/hf", True),
        ("http://hf-mirror.internal:8080", True),
        ("ftp://mirror.example", False),  # the Hub's API is HTTP
        ("hf-mirror.com", False),  # no scheme: huggingface_hub would build no URL of it
        ("https://" + "a" * 2041, False),  # 2049 characters
    ],
)
def test_a_hub_endpoint_is_an_http_url_for_the_models_and_the_api_servers(
    endpoint: str, accepted: bool
) -> None:
    """model.source.huggingface.endpoint (a private Hub mirror) is an http(s) URL of at most
    2048 characters, refused at its field by the models and by the CRD's schema alike."""
    from tests.crd_support import CrdValidator

    manifest = make_manifest()
    manifest["spec"]["tiers"][0]["model"]["source"] = {"huggingface": {"endpoint": endpoint}}
    violations = CrdValidator().validate(manifest)
    if accepted:
        hub = parse_service(manifest).spec.tiers[0].model.source.huggingface
        assert hub is not None
        assert hub.endpoint == endpoint
        assert violations == []
        return
    (problem,) = _problems(manifest)
    assert problem.startswith("spec.tiers[0].model.source.huggingface.endpoint:")
    # The schema checker names the source (its nullable wrapper), which the endpoint alone
    # changes between the cases.
    assert [v.path for v in violations] == ["spec.tiers.0.model.source.huggingface"]
