"""The engine Dockerfiles agree with the code: pinned bases, the planner's vLLM release."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fleetpilot.api.spec import DEFAULT_VLLM_IMAGE
from fleetpilot.cli import ENGINE_BACKENDS

IMAGES = Path(__file__).resolve().parents[2] / "engine_image"


def _arg(dockerfile: str, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.MULTILINE)
    assert match, f"no ARG {name}"
    return match.group(1)


def _entrypoint(dockerfile: str) -> list[str]:
    match = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.MULTILINE)
    assert match
    return json.loads(match.group(1))  # type: ignore[no-any-return]


def test_vllm_image_is_the_release_the_planner_pins() -> None:
    """Engine pods and the launcher image must run the same vLLM release."""
    dockerfile = (IMAGES / "Dockerfile.vllm").read_text()
    assert _arg(dockerfile, "VLLM_IMAGE") == DEFAULT_VLLM_IMAGE


@pytest.mark.parametrize(("name", "backend"), [("vllm", "vllm"), ("reference", "reference")])
def test_engine_images_enter_through_the_launcher(name: str, backend: str) -> None:
    entrypoint = _entrypoint((IMAGES / f"Dockerfile.{name}").read_text())
    assert entrypoint == ["fleetpilot", "engine", "--backend", backend]
    assert backend in ENGINE_BACKENDS


DOCKERFILES = sorted(p for p in IMAGES.glob("Dockerfile.*") if p.suffix != ".dockerignore")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path: Path) -> None:
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)$", path.read_text(), re.MULTILINE):
        tag = image.rsplit(":", 1)[-1]
        assert ":" in image
        assert tag != "latest"
        assert re.search(r"\d", tag), image
