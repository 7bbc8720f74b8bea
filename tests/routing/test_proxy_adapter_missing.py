"""A replica that has not loaded a LoRA adapter yet, through the router over real HTTP.

With dynamic LoRA the operator loads a tier's adapters into an engine only after its pod turns
Ready, so a new or restarted replica answers a request for one with vLLM's 404 "model does not
exist" for a moment. The router retries such a request on another replica of the group, counts
it apart from upstream failures (the replica is healthy: no ejection), and sends the adapter's
next requests elsewhere. A 404 for the base model, or one with no replica left to try, reaches
the client as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleetpilot.openai_errors import error_type
from fleetpilot.routing.replica import ReplicaState
from tests.routing.support import (
    FakeEngine,
    RunningRouter,
    engines,
    make_config,
    running_router,
    tier,
)

pytestmark = pytest.mark.asyncio

SQL = {"model": "sql", "prompt": "hi", "max_tokens": 5}
# One failure ejects: an adapter's 404 counted as a failure would take the replica out.
EJECT_AT_ONCE = {"ejection": {"failures": 1}}


@dataclass
class LoRAEngine(FakeEngine):
    """A fake engine that answers a request naming a model in ``lacks`` as vLLM does for a
    LoRA adapter it has not loaded: 404 ``NotFoundError`` in vLLM 0.33's ``{"error": {...}}``,
    or with ``flat`` older vLLM's top-level ``{"object": "error", ...}``."""

    lacks: set[str] = field(default_factory=set)
    flat: bool = False

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model = body.get("model")
        if model not in self.lacks:
            return await super()._completions(request)  # aiohttp keeps the body: read again
        self.requests.append(body)
        message = f"The model `{model}` does not exist."
        if self.flat:
            error: dict[str, Any] = {
                "object": "error",
                "message": message,
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            }
        else:
            error = {
                "error": {
                    "message": message,
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
        return web.json_response(error, status=404)


def sql_tier(replicas: list[FakeEngine]) -> Any:
    return tier("only", 1.0, replicas).model_copy(update={"adapters": ["sql"]})


async def post(router: RunningRouter, body: dict[str, Any]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", json=body) as resp,
    ):
        return resp.status, json.loads(await resp.text())


def state_of(router: RunningRouter, engine: FakeEngine) -> ReplicaState:
    state = router.state.router.replica(engine.address)
    assert state is not None
    return state


def upstream_errors(router: RunningRouter, engine: FakeEngine) -> float:
    """Failed upstream attempts on a replica, whatever the cause."""
    return sum(
        sample.value
        for metric in router.state.metrics.upstream_errors.collect()
        for sample in metric.samples
        if sample.name.endswith("_total") and sample.labels["replica"] == engine.address
    )


def assert_counted(router: RunningRouter, lacking: FakeEngine, missing: int, retries: int) -> None:
    """The router counted ``missing`` adapter 404s from ``lacking`` and ``retries`` retries,
    and none of it as an upstream failure: the replica is not ejected."""
    assert (
        router.metric("fleetpilot_router_adapter_missing_total", tier="only",
                      replica=lacking.address)
        == missing
    )  # fmt: skip
    assert router.metric("fleetpilot_router_retries_total", tier="only") == retries
    assert upstream_errors(router, lacking) == 0
    assert not router.state.router.health.is_ejected(lacking.address)


@pytest.mark.parametrize("flat", [False, True], ids=["vllm-0.33", "older-vllm"])
async def test_a_replica_without_the_adapter_is_retried_around_and_not_ejected(
    flat: bool,
) -> None:
    """Replica a held "sql" (this router sent it requests for it) and restarted without it;
    b serves it. The request goes to a first, is answered 404, and the client gets b's 200.
    a is not ejected (one failure would eject it here) and serves the base model; the next
    request for "sql" goes straight to b."""
    a = LoRAEngine("a", lacks={"sql"}, flat=flat)
    b = LoRAEngine("b")
    async with engines(a, b):
        config = make_config([sql_tier([a, b])], **EJECT_AT_ONCE)
        async with running_router(config) as router:
            lacking, holder = state_of(router, a), state_of(router, b)
            lacking.note_adapter("sql", config.tiers[0].max_loras, 0.0)  # before its restart
            status, body = await post(router, SQL)
            assert (status, body["served_by"]) == (200, "b")
            assert [r["model"] for r in a.requests] == ["sql"]
            assert_counted(router, a, missing=1, retries=1)

            status, body = await post(router, SQL)
            assert (status, body["served_by"]) == (200, "b")
            assert len(a.requests) == 1  # not tried again

            holder.in_flight += 7  # b all but full: the base model's request goes to a
            try:
                status, body = await post(router, {**SQL, "model": "chat"})
            finally:
                holder.in_flight -= 7
            assert (status, body["served_by"]) == (200, "a")
            assert router.metric("fleetpilot_router_retries_total", tier="only") == 1


async def test_a_404_for_the_base_model_is_relayed_unretried() -> None:
    """A 404 for a request naming no adapter is the engine's answer to the client, as it was:
    no retry on the other replica, nothing counted as a missing adapter."""
    a = LoRAEngine("a", lacks={"only-model"})
    b = LoRAEngine("b")
    async with engines(a, b):
        config = make_config([sql_tier([a, b])], **EJECT_AT_ONCE)
        async with running_router(config) as router:
            holder = state_of(router, b)
            holder.in_flight += 7  # the request goes to a
            try:
                status, body = await post(router, {**SQL, "model": "chat"})
            finally:
                holder.in_flight -= 7
            assert status == 404
            assert body["error"]["message"] == "The model `only-model` does not exist."
            assert b.requests == []
            assert router.metric("fleetpilot_router_retries_total", tier="only") == 0
            assert (
                router.metric(
                    "fleetpilot_router_adapter_missing_total", tier="only", replica=a.address
                )
                == 0
            )


@pytest.mark.parametrize("flat", [False, True], ids=["vllm-0.33", "older-vllm"])
async def test_with_no_other_replica_the_404_reaches_the_client_in_vllms_shape(
    flat: bool,
) -> None:
    """The only replica lacks the adapter: its 404 is relayed (older vLLM's top-level shape
    made vLLM 0.33's), counted as a missing adapter and not as a failure."""
    a = LoRAEngine("a", lacks={"sql"}, flat=flat)
    async with engines(a):
        config = make_config([sql_tier([a])], **EJECT_AT_ONCE)
        async with running_router(config) as router:
            status, body = await post(router, SQL)
            assert status == 404
            assert body == {
                "error": {
                    "message": "The model `sql` does not exist.",
                    "type": error_type(404),
                    "param": None if flat else "model",
                    "code": 404,
                }
            }
            assert len(a.requests) == 1
            assert_counted(router, a, missing=1, retries=0)
