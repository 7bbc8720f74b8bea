"""The fleetpilot command: what a user types and what they see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetpilot.cli import main
from tests.factories import make_manifest, make_tier

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, manifest: object) -> str:
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_plan_prints_yaml_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(REPO / "examples" / "two-tier.yaml")]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert ("Deployment", "chat-large") in [(o["kind"], o["metadata"]["name"]) for o in objects]


def test_plan_prints_json_list(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["plan", "-f", _write(tmp_path, make_manifest()), "-o", "json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List"
    assert listing["items"]


def test_plan_summary_shows_roles_gpus_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(REPO / "examples" / "disaggregated.yaml"), "-o", "summary"]) == 0
    out = capsys.readouterr().out
    assert "tier main / prefill" in out
    assert "GPUs per replica: 8 x NVIDIA-H100-80GB-HBM3" in out
    assert "command: vllm serve /models/llama-3.1-70b-instruct" in out


def test_invalid_file_names_field_and_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = make_tier("main")
    tier["serving"] = {"replicas": {"min": 5, "max": 2}}
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[tier]))]) == 2
    err = capsys.readouterr().err
    assert "spec.tiers[0].serving.replicas: replicas.min must be less than" in err
    assert "Traceback" not in err


def test_plan_refusal_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = make_tier("main", engine={"extraArgs": ["--port=9000"]})
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[tier]))]) == 2
    assert "spec.tiers[0].engine.extraArgs[0]: --port is set by fleetpilot" in (
        capsys.readouterr().err
    )


def test_yaml_error_names_the_line_without_traceback(tmp_path: Path) -> None:
    """Run as a user would, in a subprocess, to see exactly what reaches the terminal."""
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: fleetpilot.dev/v1alpha1\nkind: InferenceService\nspec: [\n")
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot", "plan", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "YAML syntax error at line 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", "/nonexistent/service.yaml"]) == 2
    assert "cannot read file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["router", "--help"], "usage: fleetpilot router"),
        (["engine", "--backend", "reference", "--help"], "usage: fleetpilot engine --backend ref"),
        (["engine", "--backend", "vllm", "--help"], "usage: fleetpilot engine --backend vllm"),
        (["up", "--help"], "usage: fleetpilot up"),
        (["bench", "--help"], "usage: fleetpilot bench"),
    ],
)
def test_components_parse_their_own_flags(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert usage in capsys.readouterr().out


def test_router_with_a_missing_config_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--config", "/nonexistent/router.yaml"]) != 0
    assert "/nonexistent/router.yaml" in capsys.readouterr().err
