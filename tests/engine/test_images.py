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
    """Each engine image starts ``fleetpilot engine --backend <its backend>``, a backend the
    command line knows."""
    entrypoint = _entrypoint((IMAGES / f"Dockerfile.{name}").read_text())
    assert entrypoint == ["fleetpilot", "engine", "--backend", backend]
    assert backend in ENGINE_BACKENDS


DOCKERFILES = sorted(p for p in IMAGES.glob("Dockerfile.*") if p.suffix != ".dockerignore")
_IMAGE_ARG = re.compile(r"^ARG (\w+_IMAGE)=(\S+)$", re.MULTILINE)
_FROM = re.compile(
    r"^FROM\s+(?:--platform=\S+\s+)?(?P<image>\S+)(?:\s+AS\s+(?P<stage>\S+))?\s*$",
    re.MULTILINE | re.IGNORECASE,
)


def test_every_dockerfile_is_checked() -> None:
    """The glob finds the images (a moved directory would make the tests below vacuous)."""
    assert {p.name for p in DOCKERFILES} >= {
        "Dockerfile.operator",
        "Dockerfile.reference",
        "Dockerfile.vllm",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_build_args(path: Path) -> None:
    """Every base image is an ``ARG *_IMAGE`` with a pinned default (a versioned tag, never
    ``latest``), and every ``FROM`` names one of those args (or an earlier stage), so a
    rebuild gets the same base and release CI can pin a digest with ``--build-arg``."""
    dockerfile = path.read_text()
    args = dict(_IMAGE_ARG.findall(dockerfile))
    assert args, f"{path.name}: no ARG *_IMAGE=<pinned image> line"
    for name, image in args.items():
        reference, _, tag = image.rpartition(":")
        assert reference, f"{name}={image}: no tag"
        assert "/" not in tag, f"{name}={image}: no tag (a registry port is not one)"
        assert tag != "latest", f"{name}={image}"
        assert re.search(r"\d", tag), f"{name}={image}: not a version"
    froms = list(_FROM.finditer(dockerfile))
    assert froms, f"{path.name}: no FROM line"
    stages: set[str] = set()
    for match in froms:
        image = match["image"]
        arg = re.fullmatch(r"\$\{(\w+)\}|\$(\w+)", image)
        if image not in stages:
            assert arg, f"{path.name}: FROM {image} is not one of its ARG *_IMAGE build args"
            assert (arg[1] or arg[2]) in args, f"{path.name}: FROM {image}: no such ARG *_IMAGE"
        if match["stage"]:
            stages.add(match["stage"])


def test_reference_image_takes_the_engine_extras_torch_from_the_cpu_index() -> None:
    """The reference image installs the very torch the engine extra pins, CPU build first."""
    import tomllib

    engine = tomllib.loads((IMAGES.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["engine"]
    (pin,) = [r for r in engine if r.startswith("torch==")]
    dockerfile = (IMAGES / "Dockerfile.reference").read_text()
    assert _arg(dockerfile, "TORCH_VERSION") == pin.removeprefix("torch==")
    assert _arg(dockerfile, "TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    assert '--index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"' in dockerfile
    # Before the lock (tests/test_locks.py), which holds torch's dependencies but not torch.
    assert dockerfile.index('"torch==${TORCH_VERSION}"') < dockerfile.index(
        "-r /requirements/reference.txt"
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_image_has_a_dockerignore_letting_in_exactly_what_it_copies(
    dockerfile: Path,
) -> None:
    """A .dockerignore beside each Dockerfile (BuildKit reads <Dockerfile>.dockerignore) that
    ignores everything but the paths its COPY lines name - no virtualenv in the context."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.exists(), f"{ignore.name} is missing"
    lines = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    copied = set()
    for match in re.finditer(r"^COPY (?!--from)(.+) \S+$", dockerfile.read_text(), re.MULTILINE):
        copied |= set(match.group(1).split())
    assert copied == allowed
