"""Child processes that never outlive their parent, stopped by process group, never by name.

Used by the local runtime (engines, router, Prometheus, autoscaler as processes) and by the test
control plane. Every child leads its own session, so its pid is its process-group id and one
``killpg`` reaches whatever it spawned; on Linux it also gets SIGKILL if its parent dies
(``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the parent leaves nothing behind.

A supervisor can also *adopt* a process group another process started and left running (what
``make cluster-up`` leaves for ``make cluster-down``), knowing only its pid and executable: it
watches and stops it like its own children, checking the executable so a reused pid is never
signalled.

Besides exits, the supervisor watches liveness: a child that still runs but stopped answering
its health URL (frozen) is found by :meth:`Supervisor.unresponsive`, as :mod:`.liveness`
decides, for its caller to report and restart with ``kill=True``.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from fleetpilot.argtypes import MAX_PORT
from fleetpilot.runtime.liveness import Liveness, LivenessProbe, Verdict, due, judge

_PR_SET_PDEATHSIG = 1
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


def terminate(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``grace_s``; waited for either way."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class StartsAndStops:
    """A server or agent the caller starts and must stop: ``with X(...) as x:`` starts it and
    stops it on the way out, whatever happened inside."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.stop()
        finally:
            self.after_stop()

    def after_stop(self) -> None:
        """What leaving the ``with`` block does once stopped, even if stopping failed: clean
        up what the server leaves behind (nothing, unless a subclass says otherwise)."""


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
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports the kernel considers free now.

    All sockets stay open until every port is picked so no port is handed out twice. Another
    process can still grab one before its listener binds it; that listener then fails to start
    and says so in its log.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def unresponsive_report(child: Child, probe: LivenessProbe) -> str:
    """The one line a person reads when ``child`` stopped answering its liveness probe."""
    return (
        f"{child.name} (pid {child.pid}) stopped answering {child.probed_url} "
        f"({probe.describe()}); killing and restarting it"
    )


def unresponsive_fields(child: Child, probe: LivenessProbe) -> dict[str, object]:
    """The structured log fields of the same event."""
    return {
        "child": child.name,
        "pid": child.pid,
        "url": child.probed_url,
        "failures": probe.failure_threshold,
        "period_s": probe.period_s,
        "timeout_s": probe.timeout_s,
    }


def http_ok(url: str, timeout_s: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """Whether ``url`` answers 2xx; a connection or HTTP error reads as not ready (yet).

    Children listen on loopback, so an HTTP(S)_PROXY from the environment must never see the
    probe; ``context`` verifies a TLS listener (the test control plane's CA). A malformed answer
    is not ready either: polling a port nobody has bound yet can connect the probe to itself
    (a TCP self-connect on a free ephemeral port), and its own request comes back as the
    "status line".
    """
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=timeout_s) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


class ChildFailedError(RuntimeError):
    """A child exited or never became healthy; carries the tail of its log."""


@dataclass
class Child:
    """One supervised process: started by this supervisor (``popen``) or adopted (``adopted``).

    An adopted child was started by another process, so only its pid and executable are known
    (``argv`` is just the executable) and it cannot be waited for, only watched through /proc.
    """

    name: str
    argv: list[str]
    log_path: Path
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    stopping: bool = False
    cwd: Path | None = None
    adopted: int | None = None
    # Probed for liveness once it runs (health_url when None: what answers "ready" answers
    # "alive" too, except where a server has a separate endpoint, Prometheus' /-/healthy).
    liveness_url: str | None = None
    liveness: Liveness = field(default_factory=Liveness)

    @property
    def started(self) -> bool:
        """Whether there is (or was) a process: spawned or adopted."""
        return self.popen is not None or self.adopted is not None

    @property
    def pid(self) -> int:
        if self.popen is not None:
            return self.popen.pid
        assert self.adopted is not None
        return self.adopted

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        # Not our child, so there is no exit status to poll: /proc says, and a pid reused by
        # another program reads as dead.
        return self.adopted is not None and running(self.adopted, self.argv[0])

    def reused(self) -> bool:
        """Whether an adopted child's pid now runs another program: the kernel reused it after
        ours exited, so that process (and its group) is someone else's."""
        if self.adopted is None:
            return False
        stat = proc_stat(self.adopted)
        live = stat is not None and stat[0] not in ("Z", "X")
        return live and not running(self.adopted, self.argv[0])

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def healthy(self, timeout_s: float = 1.0) -> bool:
        if self.health_url is None:
            return self.alive()
        return http_ok(self.health_url, timeout_s)

    @property
    def probed_url(self) -> str | None:
        """What its liveness probe asks (None: only its exit is watched)."""
        return self.liveness_url or self.health_url

    def watched(self) -> bool:
        """Whether its liveness is probed: a running process of ours, not being stopped."""
        return (
            self.popen is not None
            and not self.stopping
            and self.probed_url is not None
            and self.alive()
        )


class Supervisor:
    """Starts, watches and stops children; ``stop_all`` leaves no process behind.

    ``die_with_parent=False`` is for children meant to outlive the process that starts them
    (``make cluster-up``): another process adopts them later to stop them.
    """

    def __init__(self, log_dir: Path, *, die_with_parent: bool = True) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.die_with_parent = die_with_parent
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        health_url: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        liveness_url: str | None = None,
    ) -> Child:
        child = Child(
            name,
            list(argv),
            self.log_dir / f"{name}.log",
            health_url,
            dict(env or {}),
            cwd=cwd,
            liveness_url=liveness_url,
        )
        self._spawn(child)
        self.children.append(child)
        return child

    def adopt(self, name: str, pid: int, exe: str, log_path: Path | None = None) -> Child:
        """Take over process group ``pid`` (running ``exe``), started by another process.

        It is watched and stopped like a child of ours, by process group; ``alive()`` checks
        that ``pid`` still runs ``exe`` so a pid the kernel reused is never signalled. It
        cannot be restarted: its command line is not known.
        """
        path = log_path if log_path is not None else self.log_dir / f"{name}.log"
        child = Child(name, [exe], path, adopted=pid)
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
                cwd=child.cwd,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()) if self.die_with_parent else None,
            )
        child.stopping = False
        child.liveness = Liveness()  # a new process: judged once it has answered

    def restart(self, child: Child, *, kill: bool = False) -> None:
        """Stop the child (``kill``: SIGKILL at once, for a frozen one) and start it again."""
        if child.adopted is not None:
            raise ValueError(f"{child.name} was adopted; its command line is unknown")
        if kill:
            self.kill(child)
        else:
            self.stop(child)
        self._spawn(child)

    def unresponsive(self, probe: LivenessProbe, now_s: float | None = None) -> list[Child]:
        """Probe every watched child that is due (all at once, so frozen children cost one
        ``timeout_s`` together, not one each) and return those the probes found unresponsive:
        each once, for the caller to report and restart (``restart(child, kill=True)``)."""
        clock = time.monotonic() if now_s is None else now_s
        probed = [c for c in self.children if c.watched() and due(c.liveness, clock, probe)]
        if not probed:
            return []
        with ThreadPoolExecutor(len(probed), thread_name_prefix="liveness-probe") as pool:
            answers = list(pool.map(lambda c: http_ok(str(c.probed_url), probe.timeout_s), probed))
        found = []
        for child, answered in zip(probed, answers, strict=True):
            child.liveness, verdict = judge(child.liveness, answered, clock, probe)
            if verdict is Verdict.UNRESPONSIVE and not child.stopping:
                found.append(child)
        return found

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
        return [c for c in self.children if not c.stopping and c.started and not c.alive()]

    def kill(self, child: Child) -> None:
        """SIGKILL the child's process group at once: a stopped (frozen) process never acts on
        SIGTERM, and a wedged one would only use up the grace period."""
        child.stopping = True
        if not child.started or child.reused():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        self._wait_exit(child, 5)

    def stop(self, child: Child, grace_s: float = 10.0) -> bool:
        """SIGTERM the child's process group, SIGKILL what is left after the grace period.

        Returns False when the child itself ignored SIGTERM for the whole grace period.
        """
        child.stopping = True
        if not child.started or child.reused():
            return True
        clean = True
        if child.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
            self._wait_exit(child, grace_s)
            clean = not child.alive()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group_members({child.pid}):
                os.killpg(child.pid, signal.SIGKILL)
        self._wait_exit(child, 5)
        return clean

    @staticmethod
    def _wait_exit(child: Child, timeout_s: float) -> None:
        if child.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every child, most recently started first (the router before its engines)."""
        for child in reversed(self.children):
            child.stopping = True
            if child.alive():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            self._wait_exit(child, max(0.1, deadline - time.monotonic()))
        for child in self.children:
            self.stop(child, grace_s=0.1)

    def stop_in_turn(self, grace_s: float = 10.0) -> list[str]:
        """Stop children one at a time, most recently started first, each gone before the next
        is signalled: for children that need each other to shut down cleanly (an API server
        that writes to its etcd until it exits). Returns the names of those that ignored
        SIGTERM and were killed."""
        return [child.name for child in reversed(self.children) if not self.stop(child, grace_s)]

    def leftovers(self, wait_s: float = 0.0) -> list[int]:
        """Pids still alive in any child's process group (empty after stop_all), waiting up to
        ``wait_s`` for them to go (a killed grandchild is reaped by init, not by us)."""
        pgids = {c.pid for c in self.children if c.started and not c.reused()}
        deadline = time.monotonic() + wait_s
        while (left := group_members(pgids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left
