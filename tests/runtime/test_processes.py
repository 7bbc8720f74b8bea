"""The supervisor: children start, report health, crash loudly, and never outlive us."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleetpilot.runtime.processes import (
    ChildFailedError,
    PortInUseError,
    Supervisor,
    free_port,
    group_members,
    port_in_use,
    require_free_ports,
)


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_child_becomes_healthy_and_stops_without_leftovers(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    port = free_port()
    child = supervisor.start("web", _http_server(port), health_url=f"http://127.0.0.1:{port}/")
    supervisor.wait_healthy(child, timeout_s=20)
    assert port_in_use(port)
    supervisor.stop_all(grace_s=5)
    assert supervisor.leftovers() == []
    assert not child.alive()
    assert supervisor.crashed() == []  # stopped on purpose is not a crash


def test_grandchildren_are_stopped_with_their_parent(tmp_path: Path) -> None:
    """A child that spawns its own children (a shell, a launcher) loses them all on stop."""
    supervisor = Supervisor(tmp_path)
    child = supervisor.start("shell", ["sh", "-c", "sleep 300 & sleep 300 & wait"])
    deadline = time.monotonic() + 10
    while len(group_members({child.pid})) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members({child.pid})) >= 3
    supervisor.stop_all(grace_s=2)
    assert group_members({child.pid}) == []


def test_crash_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    script = "import sys; print('loading model...'); sys.exit('weights not found')"
    child = supervisor.start("engine", [sys.executable, "-c", script], health_url="http://x/")
    with pytest.raises(ChildFailedError, match="weights not found") as info:
        supervisor.wait_healthy(child, timeout_s=20)
    assert "exited with code 1" in str(info.value)
    assert supervisor.crashed() == [child]
    supervisor.stop_all()


def test_unhealthy_child_times_out_with_its_log(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    child = supervisor.start(
        "stuck",
        [sys.executable, "-c", "print('still loading', flush=True); import time; time.sleep(60)"],
        health_url=f"http://127.0.0.1:{free_port()}/health",
    )
    with pytest.raises(ChildFailedError, match="not healthy after 1s") as info:
        supervisor.wait_healthy(child, timeout_s=1)
    assert "still loading" in str(info.value)
    supervisor.stop_all(grace_s=1)
    assert supervisor.leftovers() == []


def test_restart_replaces_the_process(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path)
    child = supervisor.start("sleeper", ["sleep", "300"])
    first = child.pid
    supervisor.restart(child)
    assert child.alive()
    assert child.pid != first
    assert group_members({first}) == []
    supervisor.stop_all(grace_s=1)


def test_taken_port_is_refused_by_name() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"router port {port}"):
            require_free_ports({"router": port, "engine": free_port()})


def test_ports_beyond_the_range_or_shared_are_refused_by_name() -> None:
    with pytest.raises(PortInUseError, match="ports beyond 65535: small/unified#0 65536"):
        require_free_ports({"router": 65535, "small/unified#0": 65536})
    port = free_port()
    with pytest.raises(PortInUseError, match=f"one port for two listeners: {port} "):
        require_free_ports({"router": port, "control API": port})
    require_free_ports({"router": 0, "control API": 0})  # 0: any free port, never shared


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL of the process that runs the supervisor (no cleanup possible) still leaves no
    child: the kernel delivers the parent-death signal."""
    pid_file = tmp_path / "child.pid"
    program = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from fleetpilot.runtime.processes import Supervisor
        child = Supervisor(Path({str(tmp_path)!r}) / "logs").start("sleeper", ["sleep", "300"])
        Path({str(pid_file)!r}).write_text(str(child.pid))
        time.sleep(300)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", program])
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    assert group_members({child_pid})
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while group_members({child_pid}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert group_members({child_pid}) == []
