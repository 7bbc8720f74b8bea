"""An in-process reference server on the tiny model: shared by the server test modules."""

from __future__ import annotations

from fleetpilot.testing.engine_server import BackgroundServer

MODEL = "tiny-model"
BASE_ARGS = [
    "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len", "256",
]  # fmt: skip


def start_server(*extra: str) -> BackgroundServer:
    return BackgroundServer.from_argv([*BASE_ARGS, *extra]).start()
