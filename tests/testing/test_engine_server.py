"""The in-process engine server of the tests (``fleetpilot.testing.engine_server``)."""

from __future__ import annotations

import socket
import threading

import pytest

from fleetpilot.testing.engine_server import BackgroundServer


def test_a_server_that_fails_to_start_leaves_no_thread_behind() -> None:
    """Regression (issue 41, probe 6): a start that failed (here: its port is taken) left the
    server's event-loop thread running for the rest of the test process, beside every later
    test - the kind of leftover thread that once broke an unrelated test's ``ast.parse``."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        server = BackgroundServer.from_argv(
            ["--host", "127.0.0.1", "--port", str(port), "--model-config", "tiny"]
        )
        before = set(threading.enumerate())
        with pytest.raises(OSError, match=r"(?i)address already in use"):
            server.start(timeout=60)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []
    server.stop()  # still safe to call after a failed start
