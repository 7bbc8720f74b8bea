"""Session-wide, for ``tests/`` and ``e2e/``: no time limit on Hypothesis examples, and which tests
leave threads running behind them.

A thread a test leaves (a server, a pool, a client's event loop) runs beside every later test.
In CPython 3.11 one that parses source (a logged traceback does) made an unrelated test's
``ast.parse`` fail with ``SystemError: AST constructor recursion depth mismatch`` (issue 41,
python/cpython#106905). That test now parses in a process of its own; this lists, at the end of
the session, every thread still running and the test during which it started, so the next
leak is found by name rather than by a flake. Listed, not failed: a library's idle pool thread
is harmless, and the list costs one ``threading.enumerate()`` per test.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Generator

import pytest
from hypothesis import settings

# Hypothesis fails an example that takes over 200 ms by default: a timed assertion, which a
# busy machine fails (test_picker's bounded-load property took 287 ms beside two CPU hogs).
# The properties are about results, not speed.
settings.register_profile("fleetpilot", deadline=None)
settings.load_profile("fleetpilot")

# Each thread seen -> the test during which it was first seen running. Keyed by the thread
# itself, not its ident: the kernel reuses the ident of a thread that ended.
_first_seen: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    before = set(threading.enumerate())
    yield
    for thread in threading.enumerate():
        if thread not in before:
            _first_seen.setdefault(thread, item.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = [
        (thread, _first_seen[thread])
        for thread in threading.enumerate()
        if thread in _first_seen and thread.is_alive()
    ]
    if not left:
        return
    terminalreporter.section("threads left running by tests")
    for thread, nodeid in sorted(left, key=lambda entry: entry[1]):
        kind = "daemon" if thread.daemon else "non-daemon"
        terminalreporter.line(f"{thread.name} ({kind}), started during {nodeid}")
