"""A Prometheus SIGKILLed under a running local fleet is never silent.

Regression (issue 12, item 2): it was not restarted, nothing said so, and the autoscaler held
every role forever. Now, with real processes throughout (reference engine, router, Prometheus,
``fleetpilot autoscaler``): while Prometheus is dead the autoscaler's decisions come from the
engines' /metrics and say so, in the decision and in its log; the stack's supervision restarts
Prometheus on its port and reports the crash with its log tail; the autoscaler goes back to it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.support import autoscaler_log, running_stack, step_until
from fleetpilot.runtime.stack import LocalStack, prometheus_installed
from fleetpilot.testing.polling import eventually
from tests.factories import make_local_manifest

SERVICE = yaml.safe_dump(
    make_local_manifest(
        "watched",
        replicas={"min": 1, "max": 2},
        ttft_p95="5s",
        max_num_seqs=16,
        scale_up_stabilization=None,
    )
)
FALLBACK = "[read from the engines' /metrics directly: "
# Generous bounds for a busy two-core machine; nothing here is a speed assertion.
WAIT_S = 90.0


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    if not prometheus_installed():
        pytest.skip("prometheus is not installed (make prometheus)")
    with running_stack(tmp_path, SERVICE, prometheus=True) as local:
        yield local


def test_a_killed_prometheus_is_restarted_and_reported_while_the_engines_are_read(
    stack: LocalStack,
) -> None:
    """Prometheus SIGKILLed: decisions come from the engines and say so (decision, log,
    status table); the stack restarts Prometheus on its port once and reports the crash; the
    autoscaler reads Prometheus again."""
    assert stack.prometheus is not None
    url = stack.prometheus.url
    decisions = stack.actuator.decisions
    step_until(stack, lambda: bool(decisions), WAIT_S, "a first decision")
    assert FALLBACK not in decisions[-1].reason

    killed = stack.prometheus.pid
    assert killed is not None
    seen = len(decisions)
    os.kill(killed, signal.SIGKILL)
    # Not supervised yet (no step): the autoscaler, its own process, must cope alone.
    fallback = eventually(
        "a decision read from the engines directly",
        lambda: next((d for d in decisions[seen:] if FALLBACK in d.reason), None),
        WAIT_S,
    )
    assert f"cannot connect to prometheus at {url}" in fallback.reason
    assert fallback.replicas >= fallback.current_replicas  # never a scale-down on it
    assert "reading the engines' /metrics directly until it answers again" in autoscaler_log(stack)
    row = next(line for line in stack.status_table().splitlines() if line.startswith("small"))
    assert FALLBACK in row, row

    reports: list[str] = []
    step_until(stack, lambda: bool(reports), WAIT_S, "the crash report", reports)
    (report,) = reports
    assert f"prometheus (pid {killed}) exited with code -9; restarting it on {url}" in report
    assert "Last lines of" in report
    assert stack.prometheus.url == url
    assert stack.prometheus.pid != killed

    back = len(decisions)
    step_until(
        stack,
        lambda: any(FALLBACK not in d.reason for d in decisions[back:]),
        WAIT_S,
        "a decision read from Prometheus again",
        reports,
    )
    assert f"prometheus at {url} answers again: reading it" in autoscaler_log(stack)
    assert len(reports) == 1  # restarted once, and it stayed up
