"""Manifests in, InferenceServices out - or errors that name the field and the line."""

from __future__ import annotations

import json
from collections.abc import Mapping
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


def _objects(*documents: Mapping[str, object]) -> str:
    return yaml.safe_dump_all(list(documents), sort_keys=False)


NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}
CLAIM = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"}}


def test_other_kinds_in_a_file_are_skipped_each_with_a_note(tmp_path: Path) -> None:
    """As kubectl applies it: a file with the Namespace and PVC a service needs plans the
    service, and says on the side what it left out, naming the file, document and object."""
    path = tmp_path / "stack.yaml"
    path.write_text(_objects(NAMESPACE, CLAIM, make_manifest("a")))
    notes: list[str] = []
    assert [s.name for s in load_services(path, on_skip=notes.append)] == ["a"]
    assert notes == [
        f"{path} (document 1): skipped Namespace/llm: not an InferenceService",
        f"{path} (document 2): skipped PersistentVolumeClaim/models: not an InferenceService",
    ]


def test_skipped_kinds_are_noted_on_stderr_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(_objects(make_manifest("a"), NAMESPACE))
    assert [s.name for s in load_services(path)] == ["a"]
    captured = capsys.readouterr()
    assert (
        captured.err
        == f"note: {path} (document 2): skipped Namespace/llm: not an InferenceService\n"
    )
    assert captured.out == ""


def test_a_file_without_an_inference_service_is_refused_naming_it_and_what_it_holds(
    tmp_path: Path,
) -> None:
    """A file holding only other kinds is an error, not an empty plan that looks like success."""
    path = tmp_path / "cm.yaml"
    path.write_text(_objects({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}, CLAIM))
    notes: list[str] = []
    with pytest.raises(InvalidManifestError) as info:
        load_services(path, on_skip=notes.append)
    assert str(info.value) == (
        f"{path}: no fleetpilot.dev InferenceService in file (it holds ConfigMap/<unnamed>, "
        "PersistentVolumeClaim/models)"
    )
    assert notes == []  # the error says it all


def test_another_groups_inference_service_is_skipped(tmp_path: Path) -> None:
    """KServe's kind has the same name: it is not ours, and is skipped as another kind is."""
    kserve = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService"}
    path = tmp_path / "mixed.yaml"
    path.write_text(_objects({**kserve, "metadata": {"name": "k"}}, make_manifest("a")))
    notes: list[str] = []
    assert [s.name for s in load_services(path, on_skip=notes.append)] == ["a"]
    assert notes == [
        f"{path} (document 1): skipped InferenceService/k (serving.kserve.io/v1beta1): not a "
        "fleetpilot.dev InferenceService"
    ]


def test_a_wrong_version_of_ours_is_refused_at_its_field_not_skipped(tmp_path: Path) -> None:
    manifest = make_manifest("a")
    manifest["apiVersion"] = "fleetpilot.dev/v1"
    path = tmp_path / "old.yaml"
    path.write_text(_objects(manifest))
    with pytest.raises(InvalidManifestError) as info:
        load_services(path)
    assert [p.path for p in info.value.problems] == ["apiVersion"]


def test_a_list_is_read_item_by_item(tmp_path: Path) -> None:
    """`kubectl get fpsvc -o yaml` writes a v1 List: its items are the documents."""
    path = tmp_path / "list.yaml"
    items = [make_manifest("a"), NAMESPACE, make_manifest("b")]
    path.write_text(_objects({"apiVersion": "v1", "kind": "List", "items": items}))
    notes: list[str] = []
    assert [s.name for s in load_services(path, on_skip=notes.append)] == ["a", "b"]
    assert notes == [f"{path} (document 1, item 2): skipped Namespace/llm: not an InferenceService"]


def test_a_folder_is_read_as_kubectl_reads_one(tmp_path: Path) -> None:
    """`-f DIR`: every *.yaml, *.yml and *.json file in it, by name; not its subfolders
    unless recursive; other files ignored; a file of other kinds noted, not refused."""
    (tmp_path / "b.yml").write_text(_objects(make_manifest("b")))
    (tmp_path / "a.yaml").write_text(_objects(NAMESPACE, make_manifest("a")))
    (tmp_path / "c.json").write_text(json.dumps(make_manifest("c"), indent="\t"))
    (tmp_path / "0-claim.yaml").write_text(_objects(CLAIM))
    (tmp_path / "README.md").write_text("kind: InferenceService\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text(_objects(make_manifest("d")))
    notes: list[str] = []
    assert [s.name for s in load_services(tmp_path, on_skip=notes.append)] == ["a", "b", "c"]
    assert notes == [
        f"{tmp_path / '0-claim.yaml'} (document 1): skipped PersistentVolumeClaim/models: not "
        "an InferenceService",
        f"{tmp_path / 'a.yaml'} (document 1): skipped Namespace/llm: not an InferenceService",
    ]
    names = [s.name for s in load_services(tmp_path, recursive=True, on_skip=notes.append)]
    assert names == ["a", "b", "c", "d"]


def test_an_invalid_file_in_a_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(_objects(make_manifest("a")))
    (tmp_path / "b.yaml").write_text("kind: InferenceService\nspec: [\n")
    with pytest.raises(InvalidManifestError) as info:
        load_services(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'b.yaml'}: YAML syntax error at line 3")


def test_a_folder_without_services_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidManifestError) as info:
        load_services(tmp_path)
    assert str(info.value) == f"{tmp_path}: no *.yaml, *.yml or *.json file in folder"
    (tmp_path / "ns.yaml").write_text(_objects(NAMESPACE))
    with pytest.raises(InvalidManifestError) as info:
        load_services(tmp_path, on_skip=lambda note: None)
    assert str(info.value) == (
        f"{tmp_path}: no InferenceService in any *.yaml, *.yml or *.json file of the folder"
    )


def test_a_json_file_is_read_as_json(tmp_path: Path) -> None:
    """Tab-indented JSON (which YAML refuses) is read; a JSON error names its line."""
    good = tmp_path / "svc.json"
    good.write_text(json.dumps(make_manifest("a"), indent="\t"))
    assert [s.name for s in load_services(good)] == ["a"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "InferenceService",\n}')
    with pytest.raises(InvalidManifestError) as info:
        load_services(bad)
    assert str(info.value).startswith(f"{bad}: invalid JSON at line 2")


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
