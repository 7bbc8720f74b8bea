"""The supervisor: children start, report health, crash loudly, and never outlive us; a group
left running on purpose (``make cluster-up``) is adopted and stopped by a later process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from fleetpilot.runtime.liveness import LivenessProbe
from fleetpilot.runtime.processes import (
    Child,
    ChildFailedError,
    PortInUseError,
    Supervisor,
    free_port,
    free_ports,
    group_members,
    http_ok,
    port_in_use,
    proc_stat,
    require_free_ports,
)
from fleetpilot.testing.polling import eventually


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_child_becomes_healthy_and_stops_without_leftovers(tmp_path: Path) -> None:
    """A child becomes healthy on its health URL, and stop_all leaves no process behind and reports
    no crash."""
    supervisor = Supervisor(tmp_path)
    port = free_port()
    child = supervisor.start("web", _http_server(port), health_url=f"http://127.0.0.1:{port}/")
    supervisor.wait_healthy(child, timeout_s=20)
    assert port_in_use(port)
    supervisor.stop_all(grace_s=5)
    assert supervisor.leftovers() == []
    assert not child.alive()
    assert supervisor.crashed() == []  # stopped on purpose is not a crash


def test_a_probe_answered_with_its_own_request_reads_not_ready() -> None:
    """A TCP self-connect (the probe polling a free ephemeral port before the child binds it)
    hands the probe its own request as the answer; that is "not ready yet", never a crash of
    the supervisor (it once took down ``fleetpilot up`` with BadStatusLine)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        echoed: list[bytes] = []

        def echo_once() -> None:
            conn, _ = listener.accept()
            with conn:
                request = conn.recv(65536)
                echoed.append(request)
                conn.sendall(request)

        thread = threading.Thread(target=echo_once, daemon=True)
        thread.start()
        assert http_ok(f"http://127.0.0.1:{port}/health", timeout_s=5) is False
        thread.join(timeout=5)
    assert len(echoed) == 1
    assert echoed[0].startswith(b"GET /health HTTP/1.1")


def test_grandchildren_are_stopped_with_their_parent(tmp_path: Path) -> None:
    """A child that spawns its own children (a shell, a launcher) loses them all on stop."""
    supervisor = Supervisor(tmp_path)
    child = supervisor.start("shell", ["sh", "-c", "sleep 300 & sleep 300 & wait"])
    eventually(
        "the shell and its two sleeps",
        lambda: group_members({child.pid}),
        10,
        until=lambda members: len(members) >= 3,
        interval=0.05,
    )
    supervisor.stop_all(grace_s=2)
    # Signalled, the sleeps still take their turn on a busy CPU to exit (init reaps them, not
    # us): gone within seconds, where unsignalled ones would live for 300.
    assert supervisor.leftovers(wait_s=10) == []


def test_crash_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    """A child exiting during start-up fails wait_healthy with its exit code and the tail of its
    log, and is listed as crashed."""
    supervisor = Supervisor(tmp_path)
    script = "import sys; print('loading model...'); sys.exit('weights not found')"
    child = supervisor.start("engine", [sys.executable, "-c", script], health_url="http://x/")
    with pytest.raises(ChildFailedError, match="weights not found") as info:
        supervisor.wait_healthy(child, timeout_s=20)
    assert "exited with code 1" in str(info.value)
    assert supervisor.crashed() == [child]
    supervisor.stop_all()


def test_unhealthy_child_times_out_with_its_log(tmp_path: Path) -> None:
    """A child that never becomes healthy fails wait_healthy at its timeout with its log, and is
    still stopped."""
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
    """restart stops the old process group entirely and leaves a new, live process in its place."""
    supervisor = Supervisor(tmp_path)
    child = supervisor.start("sleeper", ["sleep", "300"])
    first = child.pid
    supervisor.restart(child)
    assert child.alive()
    assert child.pid != first
    assert group_members({first}) == []
    supervisor.stop_all(grace_s=1)


def test_a_frozen_child_is_found_unresponsive_once_and_killed_by_its_restart(
    tmp_path: Path,
) -> None:
    """Regression (issue 41, probe 7): a SIGSTOPped child still runs, so no crash is seen.
    Its liveness probes fail and the supervisor names it - once - while a live child and one
    that has never answered (still loading) are left alone; ``restart(kill=True)`` replaces
    it at once (SIGTERM cannot reach a stopped process) and the new one is not reported."""
    supervisor = Supervisor(tmp_path)
    ports = free_ports(2)
    frozen, live = (
        supervisor.start(name, _http_server(port), health_url=f"http://127.0.0.1:{port}/")
        for name, port in zip(("frozen", "live"), ports, strict=True)
    )
    loading = supervisor.start(
        "loading",
        [sys.executable, "-c", "import time; time.sleep(120)"],
        health_url=f"http://127.0.0.1:{free_port()}/health",
    )
    probe = LivenessProbe(period_s=0.2, timeout_s=2.0, failure_threshold=2)
    try:
        for child in (frozen, live):
            supervisor.wait_healthy(child, timeout_s=20)
        assert supervisor.unresponsive(probe, now_s=0.0) == []
        old = frozen.pid
        os.kill(old, signal.SIGSTOP)
        now = 0.0

        def next_period() -> list[Child]:
            nonlocal now
            now += probe.period_s
            return supervisor.unresponsive(probe, now_s=now)

        found = eventually("an unresponsive child", next_period, 60, until=bool, interval=0)
        assert found == [frozen]
        supervisor.restart(frozen, kill=True)
        assert proc_stat(old) is None  # killed and reaped, not left stopped
        supervisor.wait_healthy(frozen, timeout_s=20)
        for _ in range(5):
            now += probe.period_s
            assert supervisor.unresponsive(probe, now_s=now) == []
        assert frozen.pid != old
        assert loading.alive()
    finally:
        supervisor.stop_all(grace_s=2)
    assert supervisor.leftovers(wait_s=10) == []


def test_taken_port_is_refused_by_name() -> None:
    """A port already taken is refused before anything starts, naming the listener that wanted
    it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"router port {port}"):
            require_free_ports({"router": port, "engine": free_port()})


def test_ports_beyond_the_range_or_shared_are_refused_by_name() -> None:
    """A port past 65535, or one port given to two listeners, is refused naming them; port 0 (any
    free port) may repeat."""
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
    written = eventually(
        "the child's pid written",
        pid_file.read_text,
        20,
        until=str.strip,
        interval=0.05,
        ignoring=(FileNotFoundError,),
    )
    child_pid = int(written)
    assert group_members({child_pid})
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    eventually(
        "the child gone with its parent",
        lambda: group_members({child_pid}),
        10,
        until=lambda members: members == [],
        interval=0.05,
    )


def test_a_detached_group_is_adopted_and_stopped_by_a_later_process(tmp_path: Path) -> None:
    """`make cluster-up` starts children that outlive it (die_with_parent=False); `make
    cluster-down`, another process, adopts them by pid and executable and stops the whole
    group, grandchildren included."""
    program = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from fleetpilot.runtime.processes import Supervisor
        supervisor = Supervisor(Path({str(tmp_path)!r}) / "up", die_with_parent=False)
        script = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
        child = supervisor.start("detached", [sys.executable, "-c", script])
        print(child.pid)
        """
    )
    up = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=30, check=True
    )
    pid = int(up.stdout)
    try:
        eventually(
            "the child and its grandchild",
            lambda: group_members({pid}),
            20,
            until=lambda members: len(members) == 2,
            interval=0.05,
        )
        supervisor = Supervisor(tmp_path / "down")
        child = supervisor.adopt("detached", pid, os.path.realpath(sys.executable))
        assert child.alive()
        assert supervisor.crashed() == []
        assert supervisor.leftovers() != []
        assert supervisor.stop_in_turn(grace_s=5) == []
        assert supervisor.leftovers(wait_s=5) == []
        assert not child.alive()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def test_an_adopted_pid_that_runs_another_program_is_never_signalled(tmp_path: Path) -> None:
    """A state file outlives its processes; the kernel may give the pid to something else,
    which must not be stopped as if it were ours."""
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        supervisor = Supervisor(tmp_path)
        child = supervisor.adopt("etcd", stranger.pid, "/nonexistent/etcd")
        assert not child.alive()
        assert child.reused()
        assert supervisor.stop(child, grace_s=0.1)
        supervisor.stop_all(grace_s=0.1)
        assert supervisor.leftovers() == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_an_adopted_child_that_exits_is_a_crash_and_cannot_be_restarted(tmp_path: Path) -> None:
    """A component of a detached cluster that died is reported, not silently respawned with a
    command line nobody recorded."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    supervisor = Supervisor(tmp_path)
    child = supervisor.adopt("sleeper", other.pid, os.path.realpath(shutil.which("sleep") or ""))
    assert child.alive()
    other.kill()
    other.wait()
    assert supervisor.crashed() == [child]
    with pytest.raises(ValueError, match="sleeper was adopted"):
        supervisor.restart(child)


def test_stop_in_turn_stops_the_newest_first_each_gone_before_the_next(tmp_path: Path) -> None:
    """An API server must be gone before its etcd is signalled; one that ignores SIGTERM is
    killed after the grace period and named."""
    record = tmp_path / "record"
    handler = textwrap.dedent(
        f"""
        import signal, sys, time
        name = sys.argv[1]
        def term(*_):
            with open({str(record)!r}, "a") as out:
                out.write(name + " term\\n")
            time.sleep(0.5)
            with open({str(record)!r}, "a") as out:
                out.write(name + " exit\\n")
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print("ready", flush=True)
        time.sleep(300)
        """
    )
    supervisor = Supervisor(tmp_path / "logs")
    children = [
        supervisor.start(name, [sys.executable, "-c", handler, name]) for name in ("etcd", "api")
    ]
    stubborn = supervisor.start(
        "stubborn",
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
         "signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
    )  # fmt: skip
    for child in [*children, stubborn]:
        eventually(
            f"{child.name} ready", child.tail, 20, until=lambda tail: "ready" in tail, interval=0.05
        )
    assert supervisor.stop_in_turn(grace_s=3) == ["stubborn"]
    assert record.read_text().split("\n") == ["api term", "api exit", "etcd term", "etcd exit", ""]
    assert supervisor.leftovers(wait_s=5) == []


def test_free_ports_are_distinct() -> None:
    """Several listeners started at once (the control plane's five) never share a port."""
    assert len(set(free_ports(20))) == 20
