"""The version a release tag stands for, checked against the code it tags.

``python3 .github/scripts/release_version.py v0.2.0`` prints ``version=0.2.0`` (a line for
``$GITHUB_OUTPUT``) when the tag is ``v`` and a SemVer ``MAJOR.MINOR.PATCH`` (what Helm needs for
the chart's version) and the package at that commit has the same version, in pyproject.toml and
in ``fleetpilot.__version__``. The second matters beyond tidiness: the operator deploys routers
and reference engines from ``ghcr.io/fleetpilot/...:<its __version__>``, so a tag ahead of the
code would publish images that the released operator never pulls. Otherwise it prints a GitHub
``::error::`` line saying what to change and exits 1. Standard library only: it runs before any
install.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TAG = re.compile(r"v(?P<version>(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*))")
INIT_VERSION = re.compile(r'^__version__ = "(?P<version>[^"]+)"$', re.MULTILINE)


def release_version(tag: str, repo: Path = REPO) -> str:
    """The version ``tag`` releases; ValueError saying why when it cannot be released."""
    match = TAG.fullmatch(tag)
    if match is None:
        raise ValueError(f"tag {tag!r} is not v<MAJOR>.<MINOR>.<PATCH>, e.g. v0.2.0")
    version = match["version"]
    with (repo / "pyproject.toml").open("rb") as file:
        package = tomllib.load(file)["project"]["version"]
    init = INIT_VERSION.search((repo / "fleetpilot" / "__init__.py").read_text())
    code = init["version"] if init else None
    for where, found in (("pyproject.toml", package), ("fleetpilot/__init__.py", code)):
        if found != version:
            raise ValueError(
                f"tag {tag} releases {version} but {where} says {found}: bump the version in "
                "pyproject.toml and fleetpilot/__init__.py (the images' tag and the chart's "
                "appVersion follow the tag) and tag that commit"
            )
    return version


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: release_version.py TAG", file=sys.stderr)
        return 2
    try:
        version = release_version(argv[0])
    except ValueError as exc:
        print(f"::error::{exc}", file=sys.stderr)
        return 1
    print(f"version={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
