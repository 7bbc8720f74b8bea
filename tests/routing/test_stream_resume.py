"""Streams that survive a dying engine (issue 21, item 4): real reference-engine processes, the
one serving a stream SIGKILLed or SIGSTOPped mid-answer, and the client reading on.

Greedy decoding restricted to printable ASCII (vLLM's ``allowed_token_ids``): the reference
model's random weights otherwise emit bytes that are not UTF-8, whose replacement characters
encode to other tokens, so no text continuation could be compared token for token. Within
ASCII the text is the tokens, and the continued answer must equal an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from fleetpilot.api.router_config import EndpointGroup, RouterTier
from fleetpilot.runtime.processes import Supervisor
from tests.routing.support import Engines, RunningRouter, frozen, make_config, running_router

pytestmark = pytest.mark.asyncio

MODEL = "small-model"
PRINTABLE = list(range(32, 127))
BUDGET_S = 1.5
FAST = {
    "scrape": {"interval": "100ms", "timeout": "300ms", "staleAfter": "2s"},
    "ejection": {"failures": 3, "window": "30s", "probeInterval": "100ms"},
    "requestTimeout": "120s",
    "firstByteTimeout": f"{int(BUDGET_S * 1000)}ms",
    "debugRouteHeader": True,
}
# Long enough that the engine is still generating when the client has read a few events.
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    supervisor = Supervisor(Path(tmp_path_factory.mktemp("resume")))
    engines = Engines(supervisor)
    try:
        for name in ("e0", "e1"):
            engines.start(name, MODEL)
        engines.wait()
        yield engines
    finally:
        supervisor.stop_all()


def config_for(fleet: Engines, names: list[str], **overrides: Any) -> Any:
    addresses = [fleet.addresses[n] for n in names]
    endpoints = [EndpointGroup(role="unified", service="svc", selector={}, port=8000,
                               max_num_seqs=16, addresses=addresses)]  # fmt: skip
    tiers = [RouterTier(name="small", model=MODEL, up_to=1.0, mode="unified", endpoints=endpoints)]
    return make_config(tiers, affinity={"weight": 0.0}, **{**FAST, **overrides})


def serving(fleet: Engines, headers: Any) -> str:
    route = dict(part.split("=", 1) for part in headers["x-fleetpilot-route"].split("; "))
    return next(n for n, a in fleet.addresses.items() if a == route["replica"])


def events_of(raw: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]


async def stream(
    session: aiohttp.ClientSession,
    router: RunningRouter,
    fleet: Engines,
    body: dict[str, Any],
    *,
    after_events: int | None = None,
    fault: Any = None,
) -> tuple[list[str], str]:
    """Stream ``body`` through the router; after ``after_events`` events call ``fault`` with
    the name of the engine serving it. Returns the events' data and that engine's name."""
    async with session.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        name = serving(fleet, resp.headers)
        raw = b""
        faulted = False
        async for chunk in resp.content.iter_any():
            raw += chunk
            if fault is not None and not faulted and raw.count(b"\n\n") >= (after_events or 0):
                faulted = True
                fault(name)
        return events_of(raw), name


def text_and_usage(events: list[str]) -> tuple[str, dict[str, Any], set[str]]:
    text = ""
    usage: dict[str, Any] = {}
    ids = set()
    for data in events:
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        assert "error" not in obj, obj
        ids.add(obj["id"])
        for choice in obj["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        usage = obj.get("usage") or usage
    return text, usage, ids


def body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "allowed_token_ids": PRINTABLE, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def test_a_killed_engine_s_stream_continues_identically_on_another_replica(
    fleet: Engines,
) -> None:
    """SIGKILL the engine mid-stream: the client reads one stream, ended by one [DONE], with
    one id, whose text and usage equal an uninterrupted run's; counted as resumed."""
    request = body("A stream that outlives its engine")
    killed: list[str] = []
    try:
        async with running_router(config_for(fleet, ["e0", "e1"])) as router:
            async with aiohttp.ClientSession() as session:
                whole, _ = await stream(session, router, fleet, request)
                expected, expected_usage, _ = text_and_usage(whole)
                assert expected_usage["completion_tokens"] == MAX_TOKENS

                def kill(name: str) -> None:
                    os.killpg(fleet.children[name].pid, signal.SIGKILL)
                    killed.append(name)

                events, _ = await stream(
                    session, router, fleet, request, after_events=3, fault=kill
                )
            text, usage, ids = text_and_usage(events)
            assert events.count("[DONE]") == 1
            assert events[-1] == "[DONE]"
            assert len(ids) == 1
            assert text == expected
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert [usage[k] for k in counts] == [expected_usage[k] for k in counts]
            resumed = router.metric(
                "fleetpilot_router_stream_resumes_total", tier="small", outcome="resumed"
            )
            assert resumed == 1
    finally:
        # The next tests need two engines again, whether or not this one passed: a failure
        # here must not fail them too.
        for name in killed:
            fleet.start(name, MODEL)
        fleet.wait()


async def test_a_frozen_engine_s_chat_stream_continues_for_the_openai_client(
    fleet: Engines,
) -> None:
    """SIGSTOP the engine mid-stream: past the silence budget its /health probe fails and the
    chat answer continues on the other replica (continue_final_message); the official client
    reads one answer equal to an uninterrupted one, announced once as the assistant's."""
    messages = [{"role": "user", "content": "Keep talking while your engine freezes"}]
    extra = {"allowed_token_ids": PRINTABLE}
    async with running_router(config_for(fleet, ["e0", "e1"])) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused")
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        expected = whole.choices[0].message.content
        response = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra, stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        name = serving(fleet, response.headers)
        chunks = []
        roles = []
        with contextlib.ExitStack() as thaw:
            async for chunk in response.parse():
                chunks.append(chunk)
                for choice in chunk.choices:
                    if choice.delta.role is not None:
                        roles.append(choice.delta.role)
                if len(chunks) == 3:  # a few tokens into the answer
                    thaw.enter_context(frozen(fleet.children[name]))
        await client.close()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert roles == ["assistant"]
        assert {c.id for c in chunks} == {chunks[0].id}
        usage = chunks[-1].usage
        assert usage is not None
        assert whole.usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            whole.usage.prompt_tokens,
            whole.usage.completion_tokens,
        )
        assert (
            router.metric("fleetpilot_router_stream_resumes_total", tier="small", outcome="resumed")
            == 1
        )
        stalls = router.metric(
            "fleetpilot_router_upstream_errors_total",
            tier="small",
            cause="stall",
            replica=fleet.addresses[name],
        )
        assert stalls == 1


async def test_with_no_other_replica_a_frozen_stream_ends_with_an_error_event(
    fleet: Engines,
) -> None:
    """One replica, frozen mid-stream: no continuation exists, so the client gets vLLM's
    error event within the silence budget, not a stream hanging for the request timeout."""
    async with running_router(config_for(fleet, ["e0"])) as router:
        async with aiohttp.ClientSession() as session:
            froze: list[Any] = []

            def freeze(name: str) -> None:
                os.killpg(fleet.children[name].pid, signal.SIGSTOP)
                froze.append(name)

            try:
                events, _ = await stream(
                    session, router, fleet, body("alone"), after_events=2, fault=freeze
                )
            finally:
                for name in froze:
                    os.killpg(fleet.children[name].pid, signal.SIGCONT)
        assert json.loads(events[-1])["error"]["code"] == 502
        assert (
            router.metric(
                "fleetpilot_router_stream_resumes_total", tier="small", outcome="no_replica"
            )
            == 1
        )
