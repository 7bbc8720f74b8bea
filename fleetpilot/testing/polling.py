"""Waiting for a cluster to converge: its controllers (and the tests' nodes) are asynchronous."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 60.0,
    *,
    interval: float = 0.25,
    error: type[Exception] = AssertionError,
) -> T:
    """Poll ``probe`` until it returns something other than None; past ``timeout`` seconds,
    raise ``error`` naming ``what`` (a test's AssertionError, a demo's TimeoutError)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
