"""What a client saw, /metrics already counts: the order of publishing stats and answering.

Regression (issue 12, item 4): the engine thread handed a finished request to the HTTP side
first and published the counters it had just incremented (``vllm:request_success_total``)
after; a client, or the autoscaler scraping right behind it, could find its finished request
missing from /metrics. On a busy machine the engine thread is descheduled between the two
often enough to make ``tests/autoscaler/test_direct.py`` count 11 requests of 12.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetpilot.engine.reference.engine import EngineStats
from fleetpilot.testing.engine_server import BackgroundServer

ARGS = ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
        "--max-model-len", "256", "--served-model-name", "m"]  # fmt: skip
# How long the engine thread is held inside each stats publication: a descheduled thread on a
# loaded machine, made certain. Long enough that the HTTP side answers meanwhile.
PUBLISH_DELAY_S = 0.3


@pytest.fixture
def slow_publishing_engine() -> Iterator[BackgroundServer]:
    """A real engine whose engine thread takes PUBLISH_DELAY_S to publish each stats snapshot."""
    srv = BackgroundServer.from_argv(ARGS)
    metrics = srv.server.metrics
    publish = metrics.set_stats

    def slow_publish(stats: EngineStats) -> None:
        time.sleep(PUBLISH_DELAY_S)
        publish(stats)

    metrics.set_stats = slow_publish  # type: ignore[method-assign]
    srv.start()
    yield srv
    srv.stop()


def successes(text: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


def test_a_finished_request_is_counted_before_its_response_is_sent(
    slow_publishing_engine: BackgroundServer,
) -> None:
    """Each completion is in vllm:request_success_total by the time its client has the answer,
    however slowly the engine thread publishes."""
    with httpx.Client(base_url=slow_publishing_engine.url, timeout=60, trust_env=False) as client:
        before = successes(client.get("/metrics").text)
        for i in range(3):
            body = {"model": "m", "prompt": f"hi {i}", "max_tokens": 2}
            client.post("/v1/completions", json=body).raise_for_status()
            # Read right after the answer, as a scraper racing the client would.
            assert successes(client.get("/metrics").text) == before + i + 1
