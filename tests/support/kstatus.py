"""Flux's kstatus, computed by the real library: `sigs.k8s.io/cli-utils` built into a small
checker (`e2e/kstatus`, `make kstatus`) that objects are piped through."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHECKER = Path(__file__).resolve().parents[2] / ".cache" / "kstatus" / "bin" / "kstatus"


def kstatus(objects: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """``{"status": "InProgress" | "Current" | "Failed" | ..., "message": ...}`` per object."""
    if not CHECKER.exists():
        raise AssertionError(f"{CHECKER} is missing: run `make kstatus`")
    done = subprocess.run(
        [str(CHECKER)],
        input=json.dumps(list(objects)).encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return [json.loads(line) for line in done.stdout.decode().splitlines()]
