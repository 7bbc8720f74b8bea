"""Tokenizing off the event loop (issue 14): a long cold prompt's KV-index keys are computed in
a worker thread while the loop goes on, and route the request as the inline path does; a short
or cached one stays on the loop; the tokenizer gives the same keys under concurrent use; and a
chat reply the proxy relayed is remembered, so the next turn finds it cached."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import httpx
import pytest

from fleetpilot.api.router_config import EndpointGroup, RouterTier
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.kv_events import BlockStored
from fleetpilot.routing.affinity import OFF_LOOP_TOKENIZE_CHARS, PromptPlan
from fleetpilot.routing.endpoints import StaticSource
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.proxy import Proxy
from fleetpilot.routing.router import Router
from fleetpilot.routing.tokenizer.request import PLAN_INLINE_MAX_CHARS, RequestTokenizer
from tests.routing.support import FakeEngine, engines, make_config, running_router, wait_for

BS = 16
ADDRESSES = ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
SYSTEM = {"role": "system", "content": "You are the fleet's support desk. " * 12}


class RecordingPlan:
    """A tokenizer plan that records the thread its keys are computed on; with ``hold``, it
    waits (up to 10 s) in there until the event loop has run again."""

    def __init__(self, owner: RecordingTokenizer, inner: PromptPlan) -> None:
        self.owner = owner
        self.inner = inner

    @property
    def pending_chars(self) -> int:
        return self.inner.pending_chars

    @property
    def prompt_tokens(self) -> int | None:
        return self.inner.prompt_tokens

    def keys(self, block_size: int, lora_name: str | None = None) -> list[bytes]:
        self.owner.threads.append(threading.current_thread().name)
        if self.owner.hold:
            self.owner.tokenizing.set()
            self.owner.loop_ran_meanwhile.append(self.owner.loop_ran.wait(10))
        return self.inner.keys(block_size, lora_name)


class RecordingTokenizer:
    """The reference tokenizer, recording where keys are computed and the replies it is given."""

    def __init__(self, *, hold: bool = False) -> None:
        self.inner = RequestTokenizer.from_dir(REFERENCE_TOKENIZER)
        self.hold = hold
        self.threads: list[str] = []
        self.tokenizing = threading.Event()
        self.loop_ran = threading.Event()
        self.loop_ran_meanwhile: list[bool] = []
        self.replies: list[str] = []

    def plan(self, kind: Any, payload: Mapping[str, Any]) -> RecordingPlan:
        return RecordingPlan(self, self.inner.plan(kind, payload))

    def remember_reply(self, payload: Mapping[str, Any], reply: str) -> None:
        self.inner.remember_reply(payload, reply)
        self.replies.append(reply)


def kv_router(tokenizer: RecordingTokenizer) -> Router:
    """Three unified replicas whose engines publish live KV events; the second one caches the
    shared system prompt."""
    group = EndpointGroup(
        role="unified", service="s", selector={}, port=8000, max_num_seqs=8,
        addresses=list(ADDRESSES), kv_events_port=5557, kv_replay_port=5559,
    )  # fmt: skip
    config = make_config(
        [RouterTier(name="small", model="sm", up_to=1.0, mode="unified", endpoints=[group],
                    tokenizer=str(REFERENCE_TOKENIZER))]
    )  # fmt: skip
    router = Router(
        config, StaticSource(config), rng=random.Random(0), kv_live=lambda _stream: True
    )
    router.tokenizers["small"] = tokenizer
    tokens = tokenizer.inner.token_ids("chat", {"messages": [SYSTEM]})
    full = len(tokens) // BS * BS
    stored = BlockStored(list(range(full // BS)), None, tokens[:full], BS, None, "GPU", None)
    router.kv_index.apply(ADDRESSES[1], [stored])
    return router


def long_chat() -> dict[str, Any]:
    """The shared system prompt, then a user message long enough to go off the loop."""
    rng = random.Random(5)
    words = " ".join(rng.choice(["fleet", "route", "token", "cache", "queue"]) for _ in range(9000))
    assert len(words) > PLAN_INLINE_MAX_CHARS > OFF_LOOP_TOKENIZE_CHARS
    return {"messages": [SYSTEM, {"role": "user", "content": words}]}


@pytest.mark.asyncio
async def test_a_long_cold_prompt_is_tokenized_off_the_loop_and_routed_as_inline() -> None:
    """The keys of a cold prompt over the threshold are computed on a worker thread, during
    which the event loop runs (the worker waits until it has); the route equals what the
    inline decision gives on the same state: the replica caching the system prompt, by its
    events."""
    features = extract_features(long_chat(), "chat")
    tokenizer = RecordingTokenizer(hold=True)
    router = kv_router(tokenizer)

    async def ticker() -> None:
        while not tokenizer.tokenizing.is_set():
            await asyncio.sleep(0.001)
        tokenizer.loop_ran.set()

    ticking = asyncio.create_task(ticker())
    async with aiohttp.ClientSession() as session:
        proxy = Proxy(router, RouterMetrics(), session)
        try:
            route = await proxy._route(router.resolve(features))
        finally:
            proxy.close()
    await ticking
    assert tokenizer.threads
    assert all(name.startswith("fleetpilot-tokenize") for name in tokenizer.threads)
    assert tokenizer.loop_ran_meanwhile == [True]

    inline = kv_router(RecordingTokenizer()).decide(features)
    assert (route.replica.id, route.prefix_source) == (ADDRESSES[1], "events")
    assert route.replica.id == inline.replica.id
    assert route.request.cached == inline.request.cached
    assert route.request.tie_key == inline.request.tie_key
    assert not route.tokenizer_failed


@pytest.mark.asyncio
async def test_a_short_or_cached_prompt_is_tokenized_on_the_loop() -> None:
    """A short prompt, and a long conversation's next turn whose prefix the tokenizer caches
    (a few new characters to encode), are tokenized inline: no thread hop."""
    tokenizer = RecordingTokenizer()
    router = kv_router(tokenizer)
    loop_thread = threading.current_thread().name
    short = extract_features({"messages": [SYSTEM, {"role": "user", "content": "hi"}]}, "chat")
    first = {"messages": [SYSTEM, {"role": "user", "content": "x " * 4000}]}
    turn = {"messages": [*first["messages"], {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "and then?"}]}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        proxy = Proxy(router, RouterMetrics(), session)
        try:
            await proxy._route(router.resolve(short))
            prepared = router.prepare_keys(router.resolve(extract_features(first, "chat")))
            assert prepared is not None
            assert prepared.off_loop  # cold: it would go to the thread
            tokenizer.inner.keys("chat", first, BS)  # now cached
            tokenizer.threads.clear()
            await proxy._route(router.resolve(extract_features(turn, "chat")))
            await proxy._route(router.resolve(short))
        finally:
            proxy.close()
    assert tokenizer.threads == [loop_thread] * 2


def conversations() -> list[dict[str, Any]]:
    """Requests sharing system prompts (two of them) and growing conversations, with repeats."""
    rng = random.Random(3)
    systems = [f"Tenant {n} rules: answer briefly and politely. " * 40 for n in range(2)]
    requests = []
    for n in range(6):
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[n % 2]}]
        for turn in range(4):
            text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(300))
            messages.append({"role": "user", "content": f"{n}/{turn} {text}"})
            requests.append({"messages": list(messages)})
            messages.append({"role": "assistant", "content": f"reply {n}/{turn} " * 20})
    return requests


def test_concurrent_requests_get_the_keys_of_sequential_ones() -> None:
    """Eight threads tokenizing the same and different prefixes at once, each request several
    times and in shuffled order, with plans made on one thread and finished on another, get
    exactly the keys one thread gets; the cache's bookkeeping still adds up."""
    requests = conversations()
    sequential = RequestTokenizer.from_dir(REFERENCE_TOKENIZER)
    expected = [sequential.keys("chat", body, BS) for body in requests]
    shared = RequestTokenizer.from_dir(REFERENCE_TOKENIZER, cache_entries=16)
    order = [i for i in range(len(requests)) for _ in range(3)]
    random.Random(1).shuffle(order)
    plans = [shared.plan("chat", requests[i]) for i in order]
    with ThreadPoolExecutor(8) as pool:
        planned = list(pool.map(lambda plan: plan.keys(BS), plans))
        direct = list(pool.map(lambda i: shared.keys("chat", requests[i], BS), order))
    assert planned == [expected[i] for i in order]
    assert direct == [expected[i] for i in order]
    cache = shared._encoder.cache
    assert shared.stats.entries == len(cache._entries) <= 16
    assert shared.stats.tokens == sum(len(entry.ids) for entry in cache._entries.values())
    assert shared.stats.hits + shared.stats.misses == 2 * len(order)


def tokenizer_tier(engine: FakeEngine) -> RouterTier:
    """Tier "small" (model "sm") of one engine, with the reference tokenizer and KV-event
    ports: the router keys its requests and remembers its replies."""
    group = EndpointGroup(
        role="unified", service="s", selector={}, port=8000, max_num_seqs=8,
        addresses=[engine.address], kv_events_port=5557, kv_replay_port=5559,
    )  # fmt: skip
    return RouterTier(
        name="small", model="sm", up_to=1.0, mode="unified", endpoints=[group],
        tokenizer=str(REFERENCE_TOKENIZER),
    )  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [True, False])
async def test_a_relayed_chat_reply_is_remembered_for_the_next_turn(stream: bool) -> None:
    """The proxy hands the engine's reply (streamed or whole) to the tier's tokenizer after the
    answer: the conversation's next turn then encodes only its new message, not the reply."""
    name = "e" * 100  # the fake engine's reply text repeats its name: long enough to tell
    engine = FakeEngine(name, chunks=20)
    async with engines(engine):
        config = make_config([tokenizer_tier(engine)])
        async with running_router(config) as router, httpx.AsyncClient(timeout=20) as client:
            state = router.state
            await wait_for(lambda: "small" in state.router.tokenizers, timeout_s=20)
            tokenizer = RecordingTokenizer()
            state.router.tokenizers["small"] = tokenizer
            state.router.affinity.kv_live = lambda _stream: True
            messages = [SYSTEM, {"role": "user", "content": "where is my order?"}]
            body = {"model": "sm", "messages": messages, "stream": stream}
            response = await client.post(router.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200
            assert "prefix-source=events" in response.headers["x-fleetpilot-route"]
            await wait_for(lambda: tokenizer.replies)
            reply = "".join(f"{name}-{i} " for i in range(20)) if stream else f"from {name}"
            assert tokenizer.replies == [reply]
    following = {"messages": [*messages, {"role": "assistant", "content": reply},
                              {"role": "user", "content": "thanks"}]}  # fmt: skip
    before = tokenizer.inner.stats.encoded_chars
    tokenizer.inner.keys("chat", following, BS)
    remembered = tokenizer.inner.stats.encoded_chars - before
    control = RequestTokenizer.from_dir(REFERENCE_TOKENIZER)  # saw the request, not the reply
    control.keys("chat", {"messages": messages}, BS)
    before = control.stats.encoded_chars
    control.keys("chat", following, BS)
    assert remembered < len(reply) // 2 < control.stats.encoded_chars - before
