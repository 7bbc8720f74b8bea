"""``--cold-start-seconds``: the engine answers /health only that long after its model loaded
(a GPU engine's weight load and KV allocation), 503 meanwhile, so a local fleet's readiness
check - the runtime's own ``http_ok``, run here - lists it with the router no earlier.

Timing is asserted only as a lower bound (ready no sooner than the cold start after the load),
which a slow machine cannot break; the upper bound is a generous timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import pytest

from fleetpilot.engine.reference.engine import LLMEngine
from fleetpilot.engine.reference.server import build_server
from fleetpilot.engine.reference.settings import ConfigError, add_arguments
from fleetpilot.runtime.processes import http_ok
from fleetpilot.testing.polling import eventually_async

BASE_ARGS = [
    "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--max-model-len", "256",
]  # fmt: skip
COLD_START_S = 1.5
# asyncio's clock may wake a sleep up to one clock tick early.
CLOCK_SLACK_S = 0.05


def parse(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*BASE_ARGS, *extra])


@pytest.mark.asyncio
async def test_health_turns_ok_only_the_cold_start_after_the_model_loaded() -> None:
    """/health answers 503 from the moment the port listens, still after the model is built
    (the runtime's readiness check says not ready), and 200 no sooner than the cold start after
    the load; requests are refused until then."""
    srv = build_server(parse("--cold-start-seconds", str(COLD_START_S)))
    assert srv.settings.cold_start_s == COLD_START_S
    build = srv.engine_factory
    loaded = threading.Event()
    loaded_at: list[float] = []

    def factory() -> LLMEngine:
        engine = build()
        loaded_at.append(time.monotonic())
        loaded.set()
        return engine

    srv.engine_factory = factory
    loop = asyncio.get_running_loop()

    async def ready() -> bool:
        return await loop.run_in_executor(None, http_ok, srv.url + "/health", 5.0)

    await srv.start()  # listening (on the port it picked) from here on
    try:
        assert srv.port != 0
        assert not await ready()  # listening, not ready
        assert await loop.run_in_executor(None, loaded.wait, 60.0)
        seen_after_load: list[bool] = []

        async def ready_now() -> bool:
            seen_after_load.append(await ready())
            return seen_after_load[-1]

        await eventually_async("/health ready after the cold start", ready_now, 60.0, until=bool)
        ready_at = time.monotonic()
        assert not seen_after_load[0], "ready as soon as the model loaded"
        assert ready_at - loaded_at[0] >= COLD_START_S - CLOCK_SLACK_S
        assert srv.state == "ready"
    finally:
        await srv.drain(1.0)
        await srv.close()


def test_no_cold_start_by_default_and_a_negative_one_is_refused() -> None:
    assert build_server(parse()).settings.cold_start_s == 0.0
    with pytest.raises(ConfigError, match="--cold-start-seconds must not be negative"):
        build_server(parse("--cold-start-seconds", "-1"))
