"""``fleetpilot up`` watches liveness, not only exits: a frozen child is reported and restarted.

Regression (issue 41, probe 7): under ``fleetpilot up`` a router SIGSTOPped for 25 s was
neither reported nor restarted (every request hung), a frozen Prometheus was not reported, and
a Prometheus crash was printed twice (on stdout and again on stderr). One real ``fleetpilot
up`` runs here - a reference engine, the router, Prometheus - with short liveness probes, and
each test freezes or kills one of its children and reads what ``up`` printed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from fleetpilot.runtime.processes import http_ok, proc_stat
from fleetpilot.runtime.stack import prometheus_installed
from fleetpilot.testing.polling import eventually
from tests.factories import make_local_manifest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = yaml.safe_dump(
    make_local_manifest("liveness", replicas={"min": 1, "max": 1}, ttft_p95="5s")
)
# Probed every second, 2 s to answer, 3 failures: a freeze is found within 5 s, and a child
# slowed down by a busy machine still has three chances of 2 s.
LIVENESS = ("--liveness-period", "1", "--liveness-timeout", "2", "--liveness-failures", "3")
# Generous bounds for a busy two-core machine; nothing here is a speed assertion.
START_S = 240.0
WAIT_S = 90.0


@dataclass
class Up:
    """A running ``fleetpilot up`` and the files its stdout and stderr go to."""

    process: subprocess.Popen[bytes]
    workdir: Path
    stdout: Path
    stderr: Path

    def output(self) -> str:
        """Everything printed so far, stdout then stderr: what a person saw in a terminal."""
        return self.stdout.read_text(errors="replace") + self.stderr.read_text(errors="replace")

    def printed(self, line: str) -> str | None:
        """The first printed line that starts with ``line``, once there is one."""
        return next((x for x in self.output().splitlines() if x.startswith(line)), None)

    def pid_of(self, text: str) -> int:
        """The one live process of this fleet whose command line contains ``text``."""
        (pid,) = processes_mentioning(text)
        return pid

    @property
    def endpoint(self) -> str:
        line = self.printed("fleet is up; OpenAI endpoint: ")
        assert line is not None
        return line.rsplit(" ", 1)[1]

    @property
    def prometheus_url(self) -> str:
        line = self.printed("prometheus: ")
        assert line is not None
        return line.split()[1]


def processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) pids whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            stat = proc_stat(int(entry.name))
            if text in cmdline and stat is not None and stat[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def completes(endpoint: str) -> bool:
    """Whether one completion through the router comes back (a frozen router never answers)."""
    body = b'{"model": "small-model", "prompt": "hello there", "max_tokens": 2}'
    request = urllib.request.Request(
        f"{endpoint}/completions", body, {"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    if not prometheus_installed():
        pytest.skip("prometheus is not installed (make prometheus)")
    tmp = tmp_path_factory.mktemp("liveness")
    service = tmp / "service.yaml"
    service.write_text(SERVICE)
    workdir = tmp / "fleet"
    argv = [sys.executable, "-m", "fleetpilot", "up", "-f", str(service), "--port", "0",
            "--workdir", str(workdir), "--prometheus", "--no-autoscale",
            "--status-interval", "3600", *LIVENESS]  # fmt: skip
    stdout, stderr = tmp / "stdout", tmp / "stderr"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, cwd=ROOT)
    running = Up(process, workdir, stdout, stderr)
    try:
        eventually(
            "fleetpilot up to start its fleet",
            lambda: running.printed("control API: ") or process.poll(),
            START_S,
        )
        assert process.poll() is None, running.output()
        yield running
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, running.output()
    assert processes_mentioning(str(workdir)) == []


def test_a_frozen_router_is_reported_once_and_restarted(up: Up) -> None:
    """The router SIGSTOPped (it still runs, so no exit is seen; every request hangs): its
    liveness probe fails, ``up`` says so in one line, once, kills it (SIGTERM cannot reach a
    stopped process) and starts it again on its port; requests complete again."""
    assert completes(up.endpoint)
    frozen = up.pid_of(str(up.workdir / "router.yaml"))
    os.kill(frozen, signal.SIGSTOP)
    report = f"router (pid {frozen}) stopped answering "
    eventually("the frozen router's report", lambda: up.printed(report), WAIT_S)
    eventually("a completion through the new router", lambda: completes(up.endpoint) or None)
    assert proc_stat(frozen) is None  # killed and reaped, not left stopped
    assert up.pid_of(str(up.workdir / "router.yaml")) != frozen
    (line,) = [x for x in up.output().splitlines() if x.startswith(report)]
    assert "3 probes in a row, 1 s apart, 2 s timeout); killing and restarting it" in line
    assert '"child": "router"' in (up.workdir / "logs" / "up.log").read_text()


def test_a_frozen_prometheus_is_reported_once_and_restarted(up: Up) -> None:
    """Prometheus SIGSTOPped: its /-/healthy stops answering; ``up`` reports it once and
    restarts it on the same URL (meanwhile the autoscaler reads the engines directly)."""
    config = str(up.workdir / "prometheus" / "prometheus.yml")
    frozen = up.pid_of(config)
    os.kill(frozen, signal.SIGSTOP)
    report = f"prometheus (pid {frozen}) stopped answering {up.prometheus_url}/-/healthy"
    eventually("the frozen Prometheus' report", lambda: up.printed(report), WAIT_S)
    eventually(
        "the restarted Prometheus",
        lambda: http_ok(f"{up.prometheus_url}/-/healthy") or None,
        WAIT_S,
    )
    assert proc_stat(frozen) is None
    assert up.pid_of(config) != frozen
    assert sum(x.startswith(report) for x in up.output().splitlines()) == 1


def test_a_prometheus_crash_is_printed_once(up: Up) -> None:
    """Prometheus SIGKILLed: the crash report (exit code, log tail) is printed once, not on
    stdout and again on stderr; the structured log has it as an event of its own."""
    config = str(up.workdir / "prometheus" / "prometheus.yml")
    killed = up.pid_of(config)
    os.kill(killed, signal.SIGKILL)
    report = f"prometheus (pid {killed}) exited with code -9; restarting it"
    eventually("the crash report", lambda: up.printed(report), WAIT_S)
    eventually(
        "the restarted Prometheus",
        lambda: http_ok(f"{up.prometheus_url}/-/healthy") or None,
        WAIT_S,
    )
    # The stack logs its event before ``up`` prints the report: a copy on stderr, if any,
    # is written by now.
    assert len(re.findall(re.escape(report), up.output())) == 1, up.output()
    logged = (up.workdir / "logs" / "up.log").read_text()
    assert '"message": "prometheus exited; restarting it"' in logged
