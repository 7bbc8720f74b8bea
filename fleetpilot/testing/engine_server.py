"""A reference engine server inside the test process, on its own event loop in a thread.

Tests that need a real engine over HTTP (the engine's own, the router's, the load generator's,
the autoscaler's) start one with ``BackgroundServer.from_argv([...]).start()`` and talk to its
``url``; faster than a subprocess, and the test can reach into ``server`` (its engine, metrics,
settings). Importing this module imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

from fleetpilot.engine.reference.server import EngineServer, build_server
from fleetpilot.engine.reference.settings import add_arguments


class BackgroundServer:
    """An ``EngineServer`` on its own event loop in a thread.

    ``start()`` returns once the engine is ready; ``stop()`` drains and closes it.
    """

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-server")
        self._thread.daemon = True

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> BackgroundServer:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return cls(build_server(parser.parse_args(list(argv))))

    @property
    def url(self) -> str:
        return self.server.url

    def _run(self, coro: Awaitable[Any], timeout: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(coro), self._loop)
        return future.result(timeout)

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self._thread.start()
        try:
            self._run(self.server.start(), timeout)
            self._run(self.server.wait_ready(timeout), timeout)
        except BaseException:
            # A server that failed to start (a taken port, a bad flag) must not leave its loop's
            # thread running beside every later test of the process (issue 41: a thread left
            # behind broke an unrelated test).
            with contextlib.suppress(Exception):
                self._run(self.server.close(), 30.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._loop.close()
            raise
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._run(self._shutdown(grace_s), grace_s + 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            self._loop.close()

    async def _shutdown(self, grace_s: float) -> None:
        await self.server.drain(grace_s)
        await self.server.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _as_coroutine(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
