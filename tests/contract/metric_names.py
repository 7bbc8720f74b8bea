"""Every ``vllm:`` metric name in fleetpilot's source, found by parsing it: run as a script.

``python metric_names.py PACKAGE_DIR SKIP...`` prints, as one JSON list, every string constant
that is a whole ``vllm:`` metric name in the ``.py`` files under ``PACKAGE_DIR``, except those
under or equal to a ``SKIP`` path.

It runs in a process of its own, never in the test process: CPython 3.11 keeps the AST
constructor's recursion depth in per-interpreter state that a thread switch during
``ast.parse`` corrupts (python/cpython#106905), and a test process has whatever threads
earlier tests left (servers, pools, an exception logged by one formats its traceback, which
parses source in 3.11). A scan beside such a thread failed with ``SystemError: AST constructor
recursion depth mismatch``. This script is single-threaded, so its parses cannot interleave.
Standard library only.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

_METRIC_NAME = re.compile(r"^vllm:[a-z_]+$")


def metric_names(package: Path, skip: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        if any(path == s or s in path.parents for s in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and _METRIC_NAME.match(value):
                names.add(value)
    return names


if __name__ == "__main__":
    package, *skipped = (Path(arg).resolve() for arg in sys.argv[1:])
    print(json.dumps(sorted(metric_names(package, skipped))))
