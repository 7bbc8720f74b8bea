"""The chart's README is generated from values.yaml's `# --` comments and kept current."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import yaml

CHARTS = Path(__file__).resolve().parents[2] / "charts"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("values_doc", CHARTS / "values_doc.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_chart_readme_is_current() -> None:
    """Fix: .venv/bin/python charts/values_doc.py (or make chart-readme)."""
    values_doc = _generator()
    chart = yaml.safe_load((CHARTS / "fleetpilot" / "Chart.yaml").read_text())
    expected = values_doc.render((CHARTS / "fleetpilot" / "values.yaml").read_text(), chart)
    assert (CHARTS / "fleetpilot" / "README.md").read_text() == expected


def test_every_doc_comment_documents_a_key_with_its_default() -> None:
    """Each `# --` block lands on the key below it (none lost to a blank line), and nested
    keys are named by their full path."""
    values_doc = _generator()
    text = (CHARTS / "fleetpilot" / "values.yaml").read_text()
    keys = dict(values_doc.documented_keys(text))
    assert len(keys) == len(re.findall(r"^ *# -- ", text, re.MULTILINE))
    assert keys["leaderElection.leaseDuration"].startswith("Seconds a standby waits")
    assert "image.tag" in keys
    sample = "# -- Top.\ntop:\n  # -- Inner, on\n  # two lines.\n  inner: 3\n"
    assert values_doc.documented_keys(sample) == [
        ("top", "Top."),
        ("top.inner", "Inner, on two lines."),
    ]
    assert values_doc.render(sample, {"name": "x", "version": "1", "appVersion": "1",
                                      "description": "d"}).endswith(
        "| `top.inner` | `3` | Inner, on two lines. |\n"
    )  # fmt: skip
