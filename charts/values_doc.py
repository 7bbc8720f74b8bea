"""charts/fleetpilot/README.md from the chart's values.yaml: every key the `# --` comments
document, with its default (helm-docs' convention, without its Go binary).

    .venv/bin/python charts/values_doc.py          # rewrite the README
    .venv/bin/python charts/values_doc.py --check  # exit 1 when it is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent / "fleetpilot"
README = CHART / "README.md"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
DOC = re.compile(r"^(?P<indent> *)# -- ?(?P<text>.*)$")
MORE = re.compile(r"^(?P<indent> *)# ?(?P<text>.*)$")


def documented_keys(text: str) -> list[tuple[str, str]]:
    """(dotted key, description) for every key a `# --` comment block precedes."""
    found: list[tuple[str, str]] = []
    parents: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        if (doc := DOC.match(line)) is not None:
            pending = [doc["text"].strip()]
            continue
        if pending is not None and (more := MORE.match(line)) is not None:
            pending.append(more["text"].strip())
            continue
        if (key := KEY.match(line)) is not None:
            indent = len(key["indent"])
            while parents and parents[-1][0] >= indent:
                parents.pop()
            path = ".".join([name for _, name in parents] + [key["key"]])
            if pending is not None:
                found.append((path, " ".join(part for part in pending if part)))
            parents.append((indent, key["key"]))
        pending = None
    return found


def _default(values: dict[str, Any], path: str) -> str:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return json.dumps(node)


def render(values_text: str, chart: dict[str, Any]) -> str:
    values = yaml.safe_load(values_text)
    rows = [
        f"| `{path}` | `{_default(values, path)}` | {text.replace('|', '&#124;')} |"
        for path, text in documented_keys(values_text)
    ]
    return "\n".join(
        [
            f"# {chart['name']} {chart['version']} (app {chart['appVersion']})",
            "",
            f"{chart['description']}",
            "",
            "Generated from `values.yaml` by `charts/values_doc.py` (a test fails when this",
            "file is stale). Installing: the repository's docs/install.md; operating:",
            "docs/operate.md; conditions and alerts: docs/troubleshooting.md.",
            "",
            "```sh",
            "helm install fleetpilot charts/fleetpilot -n fleetpilot-system --create-namespace",
            "helm test fleetpilot -n fleetpilot-system",
            "```",
            "",
            "## Values",
            "",
            "| key | default | description |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is stale")
    args = parser.parse_args()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    text = render((CHART / "values.yaml").read_text(), chart)
    if args.check:
        current = README.read_text() if README.exists() else ""
        if current != text:
            print(f"{README} is stale: run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
