"""``fleetpilot autoscaler``: its log lines, as the one log setup of every fleetpilot process."""

from __future__ import annotations

import json
import subprocess
import sys

from fleetpilot.runtime.processes import free_port


def give_up_at_once(*flags: str) -> subprocess.CompletedProcess[str]:
    """The autoscaler against a fleet that never answers, giving up on its first try."""
    fleet = f"http://127.0.0.1:{free_port()}"
    argv = ["autoscaler", "--fleet", fleet, "--fleet-timeout", "0", *flags]
    return subprocess.run(
        [sys.executable, "-m", "fleetpilot", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_logs_are_json_lines_by_default() -> None:
    """Without flags every stderr line is one JSON object with the shared keys, so a log
    pipeline reads the autoscaler as it reads the router."""
    result = give_up_at_once()
    assert result.returncode == 1
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    (failure,) = [line for line in lines if line["level"] == "error"]
    assert failure["logger"] == "fleetpilot.autoscaler"
    assert failure["message"].startswith("fleet not answering for 0s: ")


def test_plain_logs_and_level_on_request() -> None:
    """``--log-format plain --log-level error``: text lines, and nothing below an error."""
    result = give_up_at_once("--log-format", "plain", "--log-level", "error")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert " ERROR fleetpilot.autoscaler: fleet not answering for 0s: " in line
