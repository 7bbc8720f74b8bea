"""The images' lock files are current with pyproject.toml, hashed, and what the Dockerfiles
install.

engine_image/requirements/*.txt are `uv pip compile --generate-hashes` output (`make locks`) for
the images' Python 3.11 on linux/amd64, and for the vLLM image's Python 3.12: its lock,
vllm.txt, holds only what fleetpilot adds to the vllm/vllm-openai base, whose own packages
vllm-image.txt lists. Checked here without a network: every requirement the image's part of
pyproject.toml declares is pinned in its lock (or, for the vLLM image, the base's list) at a
version the bound admits; every pin carries hashes; where a locked version is the one
installed in the test virtualenv, its own requirements are in the lock too (so a lock left
stale by a dependency's new dependency fails here, not in `docker build`); and each Dockerfile
installs only from a lock with --require-hashes, or with --no-deps, then runs `pip check`.
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
# The vLLM image is vLLM's (docker/Dockerfile's PYTHON_VERSION, Makefile's VLLM_TARGET); markers
# name minor releases, the patch release is the image's.
VLLM_ENV = {**IMAGE_ENV, "python_version": "3.12", "python_full_version": "3.12.0"}
# Which extras each image's lock holds (the vLLM image: the base install alone, torch and numpy
# are vLLM's), and the environment its markers are evaluated in.
IMAGE_EXTRAS: dict[str, tuple[str, ...]] = {
    "operator": ("s3",),
    "reference": ("engine",),
    "vllm": (),
}
IMAGE_ENVS = {"operator": IMAGE_ENV, "reference": IMAGE_ENV, "vllm": VLLM_ENV}
TORCH = canonicalize_name("torch")
VLLM = canonicalize_name("vllm")


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


def _applies(
    req: Requirement, extras: tuple[str, ...] = (), env: dict[str, str] = IMAGE_ENV
) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def _project_roots(extras: tuple[str, ...], env: dict[str, str]) -> list[Requirement]:
    texts = list(PROJECT["dependencies"])
    for extra in extras:
        texts += PROJECT["optional-dependencies"][extra]
    return [req for req in map(Requirement, texts) if _applies(req, env=env)]


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
    roots = _project_roots(IMAGE_EXTRAS[image], IMAGE_ENVS[image])
    if any(canonicalize_name(r.name) == TORCH for r in roots):
        roots = [r for r in roots if canonicalize_name(r.name) != TORCH]
        roots += [r for r in _torch_requirements() if canonicalize_name(r.name) not in _excluded()]
    return roots


def _installed(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def image_pins(image: str) -> dict[NormalizedName, Pin]:
    """What the image has once its lock is installed: the lock, and for the vLLM image the
    packages its base holds (vllm-image.txt, the versions vllm.txt was resolved against)."""
    pins = parse_lock(LOCKS / f"{image}.txt")
    if image == "vllm":
        pins = {**parse_lock(LOCKS / "vllm-image.txt"), **pins}
    return pins


def missing_from(
    pins: dict[NormalizedName, Pin], roots: list[Requirement], env: dict[str, str] = IMAGE_ENV
) -> list[str]:
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
            if _applies(child, extras, env):
                stack.append((child, f"{name}=={pin.version}"))
    return problems


@pytest.mark.parametrize("image", sorted(IMAGE_EXTRAS))
def test_lock_holds_every_requirement_of_the_image(image: str) -> None:
    assert missing_from(image_pins(image), image_roots(image), IMAGE_ENVS[image]) == []


@pytest.mark.parametrize("image", sorted(IMAGE_EXTRAS))
def test_the_closure_check_follows_installed_metadata(image: str) -> None:
    """The check above reads dependencies' own requirements: a lock without a dependency of a
    dependency fails it, not only one without a requirement pyproject.toml names."""
    pins = image_pins(image)
    roots = image_roots(image)
    env = IMAGE_ENVS[image]
    direct = {canonicalize_name(r.name) for r in roots}
    followed = [
        (name, canonicalize_name(Requirement(text).name))
        for name, pin in sorted(pins.items())
        if name in direct
        and (dist := _installed(name)) is not None
        and Version(dist.version) == pin.version
        for text in dist.requires or []
        if _applies(Requirement(text), env=env)
    ]
    indirect = [(parent, child) for parent, child in followed if child not in direct]
    assert indirect, "no locked version is the installed one: run `make setup` after `make locks`"
    parent, child = indirect[0]
    without = {name: pin for name, pin in pins.items() if name != child}
    assert any(child in problem for problem in missing_from(without, roots, env)), (parent, child)


@pytest.mark.parametrize("lock", ["build.txt", "operator.txt", "reference.txt", "vllm.txt"])
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


def _commands(dockerfile: str) -> list[str]:
    """The shell commands of the RUN instructions, in order (mount options left on the first)."""
    return [c.strip() for run in _run_instructions(dockerfile) for c in run.split("&&")]


def _pip_installs(dockerfile: str) -> list[str]:
    return [c for c in _commands(dockerfile) if re.search(r"\bpip install\b", c)]


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
    # A lock missing a requirement, or one the base image holds at a refused version, fails the
    # build: `pip check` runs after the last install.
    commands = _commands(dockerfile)
    last = max(i for i, c in enumerate(commands) if re.search(r"\bpip install\b", c))
    assert any(re.search(r"\bpip check$", c) for c in commands[last + 1 :]), image


def test_reference_image_installs_torch_before_its_lock_without_dependencies() -> None:
    dockerfile = (IMAGES / "Dockerfile.reference").read_text()
    installs = _pip_installs(dockerfile)
    (torch,) = [c for c in installs if "torch==" in c]
    assert "--no-deps" in torch
    assert installs.index(torch) < next(i for i, c in enumerate(installs) if "reference.txt" in c)


def _vllm_image_requirements() -> list[Requirement]:
    """What `make locks` resolves into vllm-image.txt: the vllm extra's release and the
    packages vllm-image.in says vLLM's image adds."""
    lines = (LOCKS / "vllm-image.in").read_text().splitlines()
    listed = [line for line in lines if line.strip() and not line.startswith("#")]
    return [Requirement(text) for text in [*PROJECT["optional-dependencies"]["vllm"], *listed]]


def test_vllm_image_list_is_the_dockerfiles_release() -> None:
    """vllm-image.txt, what the vLLM lock is resolved against and leaves out, is resolved from
    the release the Dockerfile builds on (the vllm extra's pin) and holds what vllm-image.in
    names: a vLLM bump without `make locks` fails here."""
    pins = parse_lock(LOCKS / "vllm-image.txt")
    (release,) = [r for r in _vllm_image_requirements() if canonicalize_name(r.name) == VLLM]
    assert str(release.specifier) == f"=={pins[VLLM].version}"
    dockerfile = (IMAGES / "Dockerfile.vllm").read_text()
    tag = re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v(\S+)$", dockerfile, re.M)
    assert tag
    assert Version(tag.group(1)) == pins[VLLM].version
    assert missing_from(pins, _vllm_image_requirements(), VLLM_ENV) == []
    assert canonicalize_name("boto3") in pins  # bounds python-dateutil, which kubernetes needs


def test_vllm_lock_adds_to_the_image_and_replaces_nothing() -> None:
    """vllm.txt pins none of the packages the vLLM base holds (installed without dependencies,
    a pin of one would replace vLLM's own), and was resolved against the current list of them:
    the packages uv left out of it are exactly vllm-image.txt's."""
    lock = parse_lock(LOCKS / "vllm.txt")
    image = parse_lock(LOCKS / "vllm-image.txt")
    assert not set(lock) & set(image)
    # fleetpilot's requirements that vLLM shares are vLLM's, at vLLM's versions.
    assert {TORCH, VLLM, canonicalize_name("pydantic"), canonicalize_name("aiohttp")} <= set(image)
    text = (LOCKS / "vllm.txt").read_text()
    _, _, footer = text.partition("\n# The following packages were excluded from the output:\n")
    assert footer, "vllm.txt leaves nothing out: not resolved against vllm-image.txt"
    left_out = {canonicalize_name(line.lstrip("#").strip()) for line in footer.splitlines()}
    assert left_out == set(image)


def test_vllm_image_installs_its_lock_without_dependencies_on_the_locked_python() -> None:
    """Only the lock's own wheels go into vLLM's environment (--no-deps: nothing of the image is
    resolved anew), through the python3 vLLM is installed in, checked to be the Python the lock
    is resolved for."""
    dockerfile = (IMAGES / "Dockerfile.vllm").read_text()
    (lock,) = [c for c in _pip_installs(dockerfile) if "vllm.txt" in c]
    assert "--no-deps" in lock
    _, _, final = dockerfile.partition("\nFROM ${VLLM_IMAGE}\n")
    pips = [c for c in _commands(final) if re.search(r"\bpip\b", c)]
    assert len(pips) == 3  # the lock, the wheel, the check
    assert all(c.startswith("python3 -m pip ") for c in pips), pips
    checked = re.search(r"sys\.version_info\[:2\] == \((\d+), (\d+)\)", final)
    assert checked
    assert f"{checked[1]}.{checked[2]}" == VLLM_ENV["python_version"]
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^VLLM_TARGET = (.*)$", makefile, re.M)
    assert target
    assert f"--python-version {VLLM_ENV['python_version']} " in f"{target[1]} "


def test_locks_are_regenerated_by_make_locks() -> None:
    """The Makefile's `locks` target writes every lock the Dockerfiles read, with the settings
    the files record."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nlocks:", 1)[1].split("\n\n", 1)[0]
    for name in ("build.txt", "operator.txt", "reference.txt", "vllm-image.txt", "vllm.txt"):
        assert f"-o $(LOCKS)/{name}" in recipe
        assert "make locks" in (LOCKS / name).read_text().splitlines()[1]
    assert "--excludes $(LOCKS)/torch-cuda.txt" in recipe
    assert "--no-emit-package torch" in recipe
    # vllm-image.txt from the vllm extra's release; vllm.txt held to it and leaving it out.
    vllm_image, vllm_lock = recipe.split("-o $(LOCKS)/vllm-image.txt")
    assert "$(VLLM_REQUIREMENT)" in vllm_image
    assert "$(LOCKS)/vllm-image.in" in vllm_image
    for option in ("$(VLLM_TARGET)", "--generate-hashes", "--extra vllm"):
        assert option in vllm_lock, option
    assert "-c $(LOCKS)/vllm-image.txt" in vllm_lock
    assert re.search(r"--no-emit-package \\1/p' \$\(LOCKS\)/vllm-image\.txt", vllm_lock)
    assert "--python-version 3.11" in makefile
    assert "--only-binary :all:" in makefile  # what the images install: wheels alone
    assert any(
        canonicalize_name(Requirement(r).name) == "uv"
        for r in PROJECT["optional-dependencies"]["dev"]
    )
    # The image's Python is the one the locks resolve for (the vLLM image's build stage's, where
    # build.txt is installed: the image itself is vLLM's, checked above).
    for image in IMAGE_EXTRAS:
        text = (IMAGES / f"Dockerfile.{image}").read_text()
        base = re.search(r"^ARG PYTHON_IMAGE=python:(\d+\.\d+)\.(\d+)", text, re.M)
        assert base, image
        assert base.group(1) == IMAGE_ENV["python_version"]
        assert f"{base.group(1)}.{base.group(2)}" == IMAGE_ENV["python_full_version"]


def test_marker_evaluation_is_the_images() -> None:
    """The environment the checks evaluate markers in is a Linux CPython 3.11 one, the vLLM
    image's a 3.12 one."""
    assert Marker('sys_platform == "linux" and python_version < "3.12"').evaluate(IMAGE_ENV)
    assert Marker('sys_platform == "linux" and python_version == "3.12"').evaluate(VLLM_ENV)
