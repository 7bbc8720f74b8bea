"""The release and CI workflows: checked by actionlint (with ShellCheck on every `run:`), and
held to the chart, the operator's default images and docs/install.md.

The release cannot run here (no registry, no Docker), so what it would publish is read from
.github/workflows/release.yml and compared with what consumes it: the chart's image values
(its default tag is the appVersion the release packages the chart with), the images the
operator deploys by default, the Dockerfiles, and the install guide's commands. The chart is
packaged as the workflow packages it, by the Helm engine the tests render with.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from fleetpilot import __version__
from fleetpilot.api.spec import VLLM_VERSION
from fleetpilot.operator.plan_types import DEFAULT_FLEETPILOT_IMAGE, DEFAULT_REFERENCE_IMAGE
from tests.charts.chart_support import CHART, RELEASE_NAMESPACE, only, render

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
VERSION_SCRIPT = REPO / ".github" / "scripts" / "release_version.py"
ACTIONLINT = REPO / ".cache" / "actionlint" / "bin" / "actionlint"
INSTALL_DOC = REPO / "docs" / "install.md"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
# A release number no file here carries, so nothing below passes by coincidence.
TAG_VERSION = "7.8.9"

Obj = dict[str, Any]


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    if not ACTIONLINT.exists():
        raise AssertionError(f"{ACTIONLINT} is missing: run `make actionlint`")
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        raise AssertionError("shellcheck is not on PATH: run `make shellcheck`")
    return subprocess.run(
        [str(ACTIONLINT), "-no-color", f"-shellcheck={shellcheck}", "-pyflakes=", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )


def workflow(path: Path) -> Obj:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def triggers(flow: Obj) -> Obj:
    # YAML 1.1 reads the bare key `on` as true.
    found = flow.get("on", flow.get(True))
    assert isinstance(found, dict)
    return found


def expand(text: str, context: dict[str, str]) -> str:
    """``${{ a.b.c }}`` replaced from ``context`` (plain references only; anything else, or an
    unknown name, fails)."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        assert name in context, f"{name} in {text!r}"
        return context[name]

    expanded = re.sub(r"\$\{\{\s*([\w.-]+)\s*\}\}", one, text)
    assert "${{" not in expanded, expanded
    return expanded


def release_context(flow: Obj, matrix: Obj | None = None) -> dict[str, str]:
    context = {f"env.{k}": str(v) for k, v in flow["env"].items()}
    context["needs.version.outputs.version"] = TAG_VERSION
    context["github.sha"] = "0" * 40
    for key, value in (matrix or {}).items():
        context[f"matrix.{key}"] = str(value)
    return context


def step(job: Obj, uses: str) -> Obj:
    (found,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith(uses + "@")]
    return found


def pushed_images() -> dict[str, str]:
    """Dockerfile (repository path) -> the image reference the release pushes it as."""
    flow = workflow(RELEASE)
    job = flow["jobs"]["images"]
    build = step(job, "docker/build-push-action")
    pushed = {}
    for matrix in job["strategy"]["matrix"]["include"]:
        context = release_context(flow, matrix)
        settings = {key: expand(str(value), context) for key, value in build["with"].items()}
        assert settings["context"] == "."  # the Dockerfiles' COPY paths are from the root
        assert build["with"]["push"] is True
        (tag,) = settings["tags"].split()
        pushed[settings["file"]] = tag
    return pushed


def split(reference: str) -> tuple[str, str]:
    repository, _, tag = reference.rpartition(":")
    assert repository, reference
    assert "/" not in tag, reference
    return repository, tag


# -- actionlint --------------------------------------------------------------------------------


def test_workflows_pass_actionlint() -> None:
    flows = sorted(WORKFLOWS.glob("*.yml"))
    assert {p.name for p in flows} >= {"release.yml", "ci.yml"}
    done = actionlint(*flows)
    assert done.returncode == 0, done.stdout + done.stderr


BROKEN = """
on:
  push:
    tags: ["v*"]
jobs:
  images:
    runs-on: ubuntu-24.04
    steps:
      - uses: docker/build-push-action@v7
        with:
          context: .
          tag: ghcr.io/example/image:1
      - run: echo ${{ github.event.head_commit.message }}
      - run: cp $SOURCE_FILE dist/
"""


def test_actionlint_catches_the_mistakes_it_is_here_for(tmp_path: Path) -> None:
    """The built checker knows the actions' inputs, flags untrusted input in a script and runs
    ShellCheck: each mistake of a broken workflow is reported (so a passing run above means
    something)."""
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(BROKEN)
    done = actionlint(broken)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'input "tag" is not defined in action "docker/build-push-action@v7"' in done.stdout
    assert "github.event.head_commit.message" in done.stdout
    assert "[expression]" in done.stdout or "potentially untrusted" in done.stdout
    assert "SC2086" in done.stdout, done.stdout


# -- what the release publishes ----------------------------------------------------------------


def test_release_runs_on_version_tags() -> None:
    flow = workflow(RELEASE)
    assert triggers(flow) == {"push": {"tags": ["v*"]}}
    assert flow["permissions"] == {"contents": "read"}
    for name in ("images", "chart"):
        assert flow["jobs"][name]["permissions"]["packages"] == "write"
    run = " ".join(s.get("run", "") for s in flow["jobs"]["version"]["steps"])
    assert '.github/scripts/release_version.py "$GITHUB_REF_NAME"' in run
    assert '>> "$GITHUB_OUTPUT"' in run


def test_release_builds_every_image_dockerfile() -> None:
    dockerfiles = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "engine_image").glob("Dockerfile.*")
        if p.suffix != ".dockerignore"
    }
    assert set(pushed_images()) == dockerfiles


def test_chart_image_values_are_the_operator_image_the_release_pushes() -> None:
    """values.yaml's image is what Dockerfile.operator is pushed as, its empty tag meaning the
    appVersion, which the release sets to the tag's version (as it tags the image)."""
    repository, tag = split(pushed_images()["engine_image/Dockerfile.operator"])
    assert VALUES["image"]["repository"] == repository
    assert VALUES["image"]["tag"] == ""
    assert VALUES["image"]["digest"] == ""
    assert tag == TAG_VERSION
    assert split(DEFAULT_FLEETPILOT_IMAGE) == (repository, __version__)


def test_engine_images_are_the_ones_the_operator_and_docs_name() -> None:
    pushed = pushed_images()
    assert split(pushed["engine_image/Dockerfile.reference"]) == (
        split(DEFAULT_REFERENCE_IMAGE)[0],
        TAG_VERSION,
    )
    assert VALUES["referenceImage"] == ""  # the operator's default, at its own version
    assert split(DEFAULT_REFERENCE_IMAGE)[1] == __version__
    vllm_repository, vllm_tag = split(pushed["engine_image/Dockerfile.vllm"])
    assert vllm_tag == f"{TAG_VERSION}-v{VLLM_VERSION}"
    assert vllm_repository.endswith("/fleetpilot-vllm")


def chart_job() -> tuple[Obj, list[str]]:
    flow = workflow(RELEASE)
    job = flow["jobs"]["chart"]
    context = release_context(flow)
    runs = [expand(s["run"], context) for s in job["steps"] if "run" in s]
    return job, runs


def test_release_pushes_the_chart_packaged_at_the_tags_version() -> None:
    flow = workflow(RELEASE)
    job, runs = chart_job()
    assert "images" in job["needs"]  # never a chart pointing at images not pushed
    assert expand(job["env"]["VERSION"], release_context(flow)) == TAG_VERSION
    (package,) = [shlex.split(r) for r in runs if r.startswith("helm package")]
    assert package[:3] == ["helm", "package", "charts/fleetpilot"]
    assert package[package.index("--version") + 1] == "$VERSION"
    assert package[package.index("--app-version") + 1] == "$VERSION"
    destination = package[package.index("--destination") + 1]
    (push,) = [shlex.split(r) for r in runs if r.startswith("helm push")]
    assert push[2] == f"{destination}/fleetpilot-$VERSION.tgz"
    assert push[3] == "$CHART_REPOSITORY"
    assert flow["env"]["CHART_REPOSITORY"].startswith("oci://")
    setup = step(job, "azure/setup-helm")
    assert setup["with"]["version"] == helm.EXPECTED_HELM_SDK_VERSION


def test_chart_packaged_as_released_deploys_the_released_image(tmp_path: Path) -> None:
    """`helm package --version V --app-version V`, as the release runs it (same Helm engine):
    the archive's name is the one pushed, and its default image is the one pushed for V."""
    archive = Path(
        helm.package(CHART, destination=tmp_path, version=TAG_VERSION, app_version=TAG_VERSION)
    )
    assert archive.name == f"fleetpilot-{TAG_VERSION}.tgz"
    with helm.Chart.load(archive) as packaged:
        assert packaged.metadata["version"] == packaged.metadata["appVersion"] == TAG_VERSION
        deployment = only(render(packaged), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == pushed_images()["engine_image/Dockerfile.operator"]


def released_chart_reference() -> str:
    flow = workflow(RELEASE)
    return f"{flow['env']['CHART_REPOSITORY']}/{CHART.name}"


def test_notes_upgrade_command_names_the_published_chart() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert f"helm upgrade {{{{ .Release.Name }}}} {released_chart_reference()} " in notes


# -- the tag's version -------------------------------------------------------------------------


def version_of(tag: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(VERSION_SCRIPT), tag],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )


def test_a_tag_of_the_package_version_releases_it() -> None:
    done = version_of(f"v{__version__}")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"version={__version__}\n"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


@pytest.mark.parametrize(
    ("tag", "says"),
    [
        ("v99.0.0", "pyproject.toml says"),
        (__version__, "is not v<MAJOR>.<MINOR>.<PATCH>"),
        ("v0.1", "is not v<MAJOR>.<MINOR>.<PATCH>"),
        ("v0.1.0rc1", "is not v<MAJOR>.<MINOR>.<PATCH>"),
        ("v01.2.3", "is not v<MAJOR>.<MINOR>.<PATCH>"),
    ],
)
def test_other_tags_are_refused_with_what_to_change(tag: str, says: str) -> None:
    done = version_of(tag)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("::error::"), done.stderr
    assert says in done.stderr


def test_the_version_script_reads_the_code_version_too(tmp_path: Path) -> None:
    """A checkout whose __init__ lags pyproject.toml is refused (the images would deploy the
    routers of the old version)."""
    sys.path.insert(0, str(VERSION_SCRIPT.parent))
    try:
        import release_version
    finally:
        sys.path.remove(str(VERSION_SCRIPT.parent))
    (tmp_path / "fleetpilot").mkdir()
    (tmp_path / "pyproject.toml").write_text('[project]\nversion = "2.0.0"\n')
    (tmp_path / "fleetpilot" / "__init__.py").write_text('__version__ = "1.9.0"\n')
    with pytest.raises(ValueError, match=r"fleetpilot/__init__\.py says 1\.9\.0"):
        release_version.release_version("v2.0.0", tmp_path)
    (tmp_path / "fleetpilot" / "__init__.py").write_text('__version__ = "2.0.0"\n')
    assert release_version.release_version("v2.0.0", tmp_path) == "2.0.0"


# -- CI ----------------------------------------------------------------------------------------


def test_ci_runs_the_projects_entry_point() -> None:
    flow = workflow(WORKFLOWS / "ci.yml")
    assert set(triggers(flow)) == {"push", "pull_request"}
    (job,) = flow["jobs"].values()
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert any(re.search(r"\bbash \.ci/run$", r) for r in runs), runs
    go = step(job, "actions/setup-go")["with"]["go-version"]
    for module in sorted((REPO / "e2e").glob("*/go.mod")):
        wanted = re.search(r"^go (\d+\.\d+)", module.read_text(), re.M)
        assert wanted, module
        assert tuple(map(int, wanted.group(1).split("."))) <= tuple(map(int, go.split("."))), (
            f"{module} needs Go {wanted.group(1)}; CI sets up {go}"
        )


# -- docs/install.md ---------------------------------------------------------------------------


def _shell_commands(markdown: str) -> list[list[str]]:
    """The commands of the guide's ```sh blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```(?:sh|bash|console)\n(.*?)```", markdown, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(shlex.split(line, comments=True))
    return commands


def _has_value(path: str) -> bool:
    node: Any = VALUES
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def test_install_guide_uses_the_published_chart_and_real_values() -> None:
    commands = _shell_commands(INSTALL_DOC.read_text())
    installs = [c for c in commands if c[:2] in (["helm", "install"], ["helm", "upgrade"])]
    assert installs
    charts = {c[3] for c in installs if c[3].startswith("oci://")}
    assert charts == {released_chart_reference()}
    for command in installs:
        for index, word in enumerate(command):
            if word == "--set":
                key = command[index + 1].split("=", 1)[0]
                assert _has_value(key), f"--set {key}: not a key of values.yaml"
            if word == "--namespace" or word == "-n":
                assert command[index + 1] == RELEASE_NAMESPACE


def test_install_guide_builds_the_images_as_the_release_does() -> None:
    """Each `docker build` in the guide uses a Dockerfile the release builds, from the root as
    context; the images it builds are the ones its --set lines point the chart at."""
    commands = _shell_commands(INSTALL_DOC.read_text())
    builds = [c for c in commands if c[:2] == ["docker", "build"]]
    pushed = pushed_images()
    assert {c[c.index("-f") + 1] for c in builds} == set(pushed)
    for build in builds:
        assert build[-1] == "."
    built = {c[c.index("-f") + 1]: c[c.index("-t") + 1] for c in builds}
    settings = {
        word.split("=", 1)[0]: word.split("=", 1)[1]
        for command in commands
        for index, word in enumerate(command)
        if index and command[index - 1] == "--set"
    }
    operator = built["engine_image/Dockerfile.operator"]
    assert settings["image.repository"] == operator.rpartition(":")[0]
    assert settings["image.tag"] == operator.rpartition(":")[2]
    assert settings["referenceImage"] == built["engine_image/Dockerfile.reference"]
