"""The router's background tasks (config watch, endpoint reload, scrapes, probes) share this."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished unwinding (None: nothing to do)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
