"""Child processes that never outlive their parent, stopped by process group, never by name.

Used by the local runtime (engines, router, Prometheus, autoscaler as processes) and by the test
control plane. Every child leads its own session, so its pid is its process-group id and one
``killpg`` reaches whatever it spawned; on Linux it also gets SIGKILL if its parent dies
(``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the parent leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fleetpilot.argtypes import MAX_PORT

_PR_SET_PDEATHSIG = 1
# Children listen on loopback: an HTTP(S)_PROXY from the environment must never see a probe.
_LOOPBACK_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(parent: int) -> Callable[[], None]:
    """preexec_fn: the child gets SIGKILL when the process that started it dies.

    The signal is tied to the starting *thread*: start children from a thread that lives as
    long as they should.
    """

    def preexec() -> None:
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of ``pid``, or None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def running(pid: int, exe: str) -> bool:
    """Whether ``pid`` is alive and still runs ``exe`` (a reused pid is not ours to signal)."""
    stat = proc_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    try:
        link = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True  # exists, but we may not read its exe: assume it is ours
    return link.removesuffix(" (deleted)") == exe


def group_members(pgids: set[int]) -> list[int]:
    """Live (non-zombie) pids whose process group is in ``pgids``."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = proc_stat(int(entry.name))
        if stat is not None and stat[0] not in ("Z", "X") and stat[1] in pgids:
            found.append(int(entry.name))
    return found


class PortInUseError(RuntimeError):
    """A port the runtime needs cannot be had - taken, wanted by two listeners, or beyond
    65535; says which, so the user can free or change it."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def require_free_ports(ports: Mapping[str, int], host: str = "127.0.0.1") -> None:
    """Refuse to start anything when a wanted port cannot be had (named, with its user): beyond
    65535 (the fleet's engines take the ports after the router's), one port for two listeners,
    or taken. Port 0 (any free port) is always available."""
    beyond = [f"{name} {port}" for name, port in ports.items() if port > MAX_PORT]
    if beyond:
        raise PortInUseError(
            f"ports beyond {MAX_PORT}: {', '.join(beyond)}; pick a lower base port (or 0 for "
            "free ports)"
        )
    users: dict[int, list[str]] = {}
    for name, port in ports.items():
        if port:
            users.setdefault(port, []).append(name)
    shared = [f"{port} ({' and '.join(names)})" for port, names in users.items() if len(names) > 1]
    if shared:
        raise PortInUseError(f"one port for two listeners: {', '.join(shared)}; pick other ports")
    taken = [f"{name} port {port}" for name, port in ports.items() if port_in_use(port, host)]
    if taken:
        raise PortInUseError(
            f"already in use on {host}: {', '.join(taken)}; stop what uses it or pick other ports"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free now (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ChildFailedError(RuntimeError):
    """A child exited or never became healthy; carries the tail of its log."""


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    log_path: Path
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    stopping: bool = False

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self, timeout_s: float = 1.0) -> bool:
        if self.health_url is None:
            return self.alive()
        try:
            with _LOOPBACK_HTTP.open(self.health_url, timeout=timeout_s) as response:
                return bool(200 <= response.status < 300)
        except (urllib.error.URLError, OSError, ValueError):
            return False


class Supervisor:
    """Starts, watches and stops children; ``stop_all`` leaves no process behind."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        health_url: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Child:
        child = Child(name, list(argv), self.log_dir / f"{name}.log", health_url, dict(env or {}))
        self._spawn(child)
        self.children.append(child)
        return child

    def _spawn(self, child: Child) -> None:
        with child.log_path.open("ab") as log:
            child.popen = subprocess.Popen(
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **child.env},
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        child.stopping = False

    def restart(self, child: Child) -> None:
        self.stop(child)
        self._spawn(child)

    def wait_healthy(self, child: Child, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not child.healthy():
            if not child.alive():
                code = child.popen.returncode if child.popen else "?"
                raise ChildFailedError(
                    f"{child.name} exited with code {code}; last lines of {child.log_path}:\n"
                    f"{child.tail()}"
                )
            if time.monotonic() > deadline:
                raise ChildFailedError(
                    f"{child.name} not healthy after {timeout_s:.0f}s; last lines of "
                    f"{child.log_path}:\n{child.tail()}"
                )
            time.sleep(0.1)

    def crashed(self) -> list[Child]:
        """Children that exited without being asked to."""
        return [c for c in self.children if not c.stopping and c.popen and not c.alive()]

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after the grace period."""
        child.stopping = True
        if child.popen is None:
            return
        if child.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group_members({child.pid}):
                os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=5)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every child, most recently started first (the router before its engines)."""
        for child in reversed(self.children):
            child.stopping = True
            if child.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for child in self.children:
            self.stop(child, grace_s=0.1)

    def leftovers(self) -> list[int]:
        """Pids still alive in any child's process group (empty after stop_all)."""
        return group_members({c.pid for c in self.children if c.popen is not None})
