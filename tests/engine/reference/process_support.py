"""A reference server run as a process, as its pods run it: shared by the test modules that
start one."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable

import httpx

from fleetpilot.testing.polling import eventually

LISTENING = re.compile(r"listening on (http://\S+)$")


class ServerProcess:
    """A server subprocess whose stderr is read on a thread (so the pipe never fills)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        """``env``: the process's whole environment (default: this one's)."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetpilot.engine.reference.server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)

    def wait_listening(self, timeout: float = 60.0) -> str:
        """The server's URL, from its "listening on" log line (a JSON line by default)."""

        def next_line() -> str | None:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise AssertionError("server exited:\n" + "".join(self.log)) from None
                return None
            match = LISTENING.search(_message(line))
            return match.group(1) if match else None

        # The probe itself waits on the log's queue: no sleep between rounds.
        return eventually(
            "its 'listening on' line",
            next_line,
            timeout,
            interval=0,
            context=lambda: "its log:\n" + "".join(self.log),
        )

    def messages(self) -> list[str]:
        """The ``message`` of every JSON log line so far."""
        return [_message(line) for line in self.log if line.startswith("{")]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def _message(line: str) -> str:
    """A JSON log line's ``message``; any other line (a library's own print) as it is."""
    try:
        record = json.loads(line)
    except ValueError:
        return line.rstrip("\n")
    return str(record.get("message", "")) if isinstance(record, dict) else line.rstrip("\n")


def wait_ok(
    url: str, timeout: float = 60.0, *, get: Callable[[str], httpx.Response] = httpx.get
) -> None:
    """Until ``url`` answers 200 (refused connections meanwhile: the server is starting)."""
    eventually(
        f"{url} answering 200",
        lambda: get(url).status_code,
        timeout,
        until=lambda status: status == 200,
        interval=0.05,
        ignoring=(httpx.TransportError,),
    )
