"""Running ``fleetpilot`` as a user would, to check what a refusal looks like from outside."""

from __future__ import annotations

import resource
import subprocess
import sys


def _cap_memory() -> None:
    # A runaway read (/dev/zero) fails fast at 4 GiB instead of eating the machine.
    limit = 4 << 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def one_line_error(*argv: str, returncode: int = 2) -> str:
    """Run ``fleetpilot ARGV`` in a subprocess, its address space capped: exactly one stderr
    line, the expected exit code, no traceback. The line."""
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        preexec_fn=_cap_memory,
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.returncode == returncode, result.stderr
    return lines[0]
