"""The images' lock files are current with pyproject.toml, hashed, and what the Dockerfiles
install.

engine_image/requirements/*.txt are `uv pip compile --generate-hashes` output (`make locks`) for
the images' Python 3.11 on linux/amd64. Checked here without a network: every requirement the
image's part of pyproject.toml declares is pinned in its lock at a version the bound admits;
every pin carries hashes; where a locked version is the one installed in the test virtualenv,
its own requirements are in the lock too (so a lock left stale by a dependency's new
dependency fails here, not in `docker build`); and each Dockerfile installs only from a lock
with --require-hashes, or with --no-deps.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "engine_image"
LOCKS = IMAGES / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
# The images run python:3.11 on linux/amd64 (Dockerfiles' PYTHON_IMAGE, `make locks`).
IMAGE_ENV = {
    "python_version": "3.11",
    "python_full_version": "3.11.13",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# Which extras each image's lock holds, and the packages it leaves to another source.
IMAGE_EXTRAS = {"operator": ("s3",), "reference": ("engine",)}
TORCH = canonicalize_name("torch")


@dataclass(frozen=True)
class Pin:
    version: Version
    hashes: tuple[str, ...]
    via: tuple[str, ...]


def _entries(text: str) -> list[str]:
    """Logical lines (backslash continuations joined), keeping the `# via` comment blocks."""
    return re.sub(r"\\\n", " ", text).splitlines()


def parse_lock(path: Path) -> dict[NormalizedName, Pin]:
    pins: dict[NormalizedName, Pin] = {}
    current: NormalizedName | None = None
    via: list[str] = []

    def close() -> None:
        if current is not None:
            pins[current] = Pin(pins[current].version, pins[current].hashes, tuple(via))

    for line in _entries(path.read_text()):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            # An entry's `# via` block is indented under it; notes at the margin are the file's.
            comment = stripped.lstrip("#").strip()
            if current is not None and line[0].isspace() and comment and comment != "via":
                via.append(comment.removeprefix("via ").strip())
            continue
        close()
        requirement, *options = stripped.split(" --")
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", requirement.strip())
        assert match, f"{path.name}: not a pin: {stripped[:80]}"
        options = [o.strip() for o in options]
        hashes = tuple(o.removeprefix("hash=") for o in options if o.startswith("hash="))
        current = canonicalize_name(match.group(1))
        assert current not in pins, f"{path.name}: {current} pinned twice"
        pins[current] = Pin(Version(match.group(2)), hashes, ())
        via = []
    close()
    return pins


def _applies(req: Requirement, extras: tuple[str, ...] = ()) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**IMAGE_ENV, "extra": e}) for e in ("", *extras))


def _project_roots(extras: tuple[str, ...]) -> list[Requirement]:
    texts = list(PROJECT["dependencies"])
    for extra in extras:
        texts += PROJECT["optional-dependencies"][extra]
    return [req for req in map(Requirement, texts) if _applies(req)]


def _torch_requirements() -> list[Requirement]:
    """The installed torch's requirements for the image's platform, extras aside."""
    texts = importlib.metadata.requires("torch") or []
    return [req for req in map(Requirement, texts) if _applies(req)]


def _cuda_stack() -> set[NormalizedName]:
    """What PyPI's torch requires on Linux alone: its CUDA libraries and triton."""
    linux_only = set()
    for req in map(Requirement, importlib.metadata.requires("torch") or []):
        if req.marker is not None and _applies(req):
            on_mac = req.marker.evaluate(
                {**IMAGE_ENV, "sys_platform": "darwin", "platform_system": "Darwin", "extra": ""}
            )
            if not on_mac:
                linux_only.add(canonicalize_name(req.name))
    return linux_only


def _excluded() -> set[NormalizedName]:
    lines = (LOCKS / "torch-cuda.txt").read_text().splitlines()
    return {canonicalize_name(line) for line in lines if line.strip() and not line.startswith("#")}


def image_roots(image: str) -> list[Requirement]:
    """What the image's lock must hold: the base install and the image's extras, with torch
    (the reference image's CPU build, from PyTorch's index) replaced by its requirements less
    the CUDA stack."""
    roots = _project_roots(IMAGE_EXTRAS[image])
    if any(canonicalize_name(r.name) == TORCH for r in roots):
        roots = [r for r in roots if canonicalize_name(r.name) != TORCH]
        roots += [r for r in _torch_requirements() if canonicalize_name(r.name) not in _excluded()]
    return roots


def _installed(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_from(pins: dict[NormalizedName, Pin], roots: list[Requirement]) -> list[str]:
    """Requirements reachable from ``roots`` that the lock lacks or pins outside their bound.
    A pin's own requirements are followed where the test virtualenv has that very version
    installed (its metadata is the lock's then); other pins are taken as closed."""
    problems: list[str] = []
    seen: set[tuple[NormalizedName, tuple[str, ...]]] = set()
    stack = [(req, "pyproject.toml") for req in roots]
    while stack:
        req, parent = stack.pop()
        name = canonicalize_name(req.name)
        pin = pins.get(name)
        if pin is None:
            problems.append(f"{req} (for {parent}) is not in the lock")
            continue
        if not req.specifier.contains(pin.version, prereleases=True):
            problems.append(f"{name}=={pin.version} does not satisfy {req} (for {parent})")
        extras = tuple(sorted(req.extras))
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        dist = _installed(name)
        if dist is None or Version(dist.version) != pin.version:
            continue
        for text in dist.requires or []:
            child = Requirement(text)
            if _applies(child, extras):
                stack.append((child, f"{name}=={pin.version}"))
    return problems


@pytest.mark.parametrize("image", sorted(IMAGE_EXTRAS))
def test_lock_holds_every_requirement_of_the_image(image: str) -> None:
    pins = parse_lock(LOCKS / f"{image}.txt")
    assert missing_from(pins, image_roots(image)) == []


def test_the_closure_check_follows_installed_metadata() -> None:
    """The check above reads dependencies' own requirements: a lock without a dependency of a
    dependency fails it, not only one without a requirement pyproject.toml names."""
    pins = parse_lock(LOCKS / "operator.txt")
    roots = image_roots("operator")
    direct = {canonicalize_name(r.name) for r in roots}
    followed = [
        (name, canonicalize_name(Requirement(text).name))
        for name, pin in sorted(pins.items())
        if name in direct
        and (dist := _installed(name)) is not None
        and Version(dist.version) == pin.version
        for text in dist.requires or []
        if _applies(Requirement(text))
    ]
    indirect = [(parent, child) for parent, child in followed if child not in direct]
    assert indirect, "no locked version is the installed one: run `make setup` after `make locks`"
    parent, child = indirect[0]
    without = {name: pin for name, pin in pins.items() if name != child}
    assert any(child in problem for problem in missing_from(without, roots)), (parent, child)


@pytest.mark.parametrize("lock", ["build.txt", "operator.txt", "reference.txt"])
def test_every_pin_is_exact_and_hashed(lock: str) -> None:
    pins = parse_lock(LOCKS / lock)
    assert pins
    for name, pin in pins.items():
        assert pin.hashes, f"{lock}: {name} has no hash"
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in pin.hashes), name


@pytest.mark.parametrize("image", sorted(IMAGE_EXTRAS))
def test_no_pin_is_left_over_from_a_removed_requirement(image: str) -> None:
    """A package the lock says pyproject.toml asks for directly is one it still asks for."""
    pins = parse_lock(LOCKS / f"{image}.txt")
    direct = {canonicalize_name(r.name) for r in image_roots(image)}
    stale = [
        name
        for name, pin in pins.items()
        if any(v.startswith("fleetpilot") for v in pin.via) and name not in direct
    ]
    assert stale == []
    assert any(any(v.startswith("fleetpilot") for v in pin.via) for pin in pins.values())


def test_build_lock_holds_the_build_backend() -> None:
    pins = parse_lock(LOCKS / "build.txt")
    roots = [Requirement(text) for text in PYPROJECT["build-system"]["requires"]]
    assert missing_from(pins, roots) == []


def test_reference_lock_leaves_torch_and_its_cuda_stack_out() -> None:
    """torch comes from PyTorch's CPU index; the lock has none of the CUDA stack PyPI's Linux
    wheel pulls in, and torch-cuda.txt names exactly that stack of the pinned torch."""
    (pin,) = [r for r in PROJECT["optional-dependencies"]["engine"] if r.startswith("torch==")]
    assert importlib.metadata.version("torch") == pin.removeprefix("torch==")
    stack = _cuda_stack()
    assert stack == _excluded()
    assert {"triton", "nvidia-nccl-cu13"} <= stack
    pins = parse_lock(LOCKS / "reference.txt")
    assert TORCH not in pins
    assert not stack & set(pins)
    assert not any(name.startswith(("nvidia-", "cuda-")) for name in pins)


def test_operator_lock_has_no_engine_stack() -> None:
    pins = parse_lock(LOCKS / "operator.txt")
    assert TORCH not in pins
    assert canonicalize_name("boto3") in pins  # model delivery from S3 runs in this image


def _run_instructions(dockerfile: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", dockerfile)
    return [line for line in joined.splitlines() if line.startswith("RUN ")]


def _pip_installs(dockerfile: str) -> list[str]:
    commands = []
    for run in _run_instructions(dockerfile):
        commands += [c.strip() for c in run.split("&&") if re.search(r"\bpip install\b", c)]
    return commands


@pytest.mark.parametrize("image", sorted(IMAGE_EXTRAS))
def test_dockerfile_installs_from_the_locks(image: str) -> None:
    """Every `pip install` takes a lock with --require-hashes or adds no dependencies
    (--no-deps): the image's lock, the build backend's lock, and the package itself."""
    dockerfile = (IMAGES / f"Dockerfile.{image}").read_text()
    installs = _pip_installs(dockerfile)
    locks = set()
    for command in installs:
        lock = re.search(r"-r (\S+)", command)
        if lock:
            assert "--require-hashes" in command, command
            assert "--only-binary :all:" in command, command  # no compiler in the image
            locks.add(Path(lock.group(1)).name)
        else:
            assert "--no-deps" in command, command
    assert locks == {"build.txt", f"{image}.txt"}
    assert any(re.search(r"--no-deps --no-index\s+/wheels/fleetpilot-\*\.whl", c) for c in installs)
    copied = re.search(r"^COPY (engine_image/requirements/\S+(?: \S+)*) \S+$", dockerfile, re.M)
    assert copied
    assert set(copied.group(1).split()) == {
        "engine_image/requirements/build.txt",
        f"engine_image/requirements/{image}.txt",
    }
    # The package is built with the locked backend, not one an isolated build fetches.
    assert re.search(
        r"pip wheel .*--no-deps --no-build-isolation", "\n".join(_run_instructions(dockerfile))
    )


def test_reference_image_installs_torch_before_its_lock_without_dependencies() -> None:
    dockerfile = (IMAGES / "Dockerfile.reference").read_text()
    installs = _pip_installs(dockerfile)
    (torch,) = [c for c in installs if "torch==" in c]
    assert "--no-deps" in torch
    assert installs.index(torch) < next(i for i, c in enumerate(installs) if "reference.txt" in c)


def test_locks_are_regenerated_by_make_locks() -> None:
    """The Makefile's `locks` target writes every lock the Dockerfiles read, with the settings
    the files record."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nlocks:", 1)[1].split("\n\n", 1)[0]
    for name in ("build.txt", "operator.txt", "reference.txt"):
        assert f"$(LOCKS)/{name}" in recipe
        assert "make locks" in (LOCKS / name).read_text().splitlines()[1]
    assert "--excludes $(LOCKS)/torch-cuda.txt" in recipe
    assert "--no-emit-package torch" in recipe
    assert "--python-version 3.11" in makefile
    assert "--only-binary :all:" in makefile  # what the images install: wheels alone
    assert any(
        canonicalize_name(Requirement(r).name) == "uv"
        for r in PROJECT["optional-dependencies"]["dev"]
    )
    # The image's Python is the one the locks resolve for.
    for image in IMAGE_EXTRAS:
        text = (IMAGES / f"Dockerfile.{image}").read_text()
        base = re.search(r"^ARG PYTHON_IMAGE=python:(\d+\.\d+)\.(\d+)", text, re.M)
        assert base, image
        assert base.group(1) == IMAGE_ENV["python_version"]
        assert f"{base.group(1)}.{base.group(2)}" == IMAGE_ENV["python_full_version"]


def test_marker_evaluation_is_the_images() -> None:
    """The environment the checks evaluate markers in is a Linux CPython 3.11 one."""
    assert Marker('sys_platform == "linux" and python_version < "3.12"').evaluate(IMAGE_ENV)
