"""Per-tenant limits: token buckets per tenant and router replica, 429 with Retry-After and
OpenAI's rate-limit headers, tokens reserved at admission and corrected by the answer's usage."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from fleetpilot.api.router_config import AuthConfig, TenantKeys
from fleetpilot.routing.limits import Bucket, Limiter, RateLimitedError, TenantLimits
from fleetpilot.routing.proxy import usage_tokens
from fleetpilot.runtime.processes import free_ports
from tests.routing.support import (
    SHORT,
    FakeEngine,
    RunningRouter,
    assert_openai_error,
    engines,
    make_config,
    post,
    running_router,
    tier,
    wait_for,
)

KEY = "sk-team-a-0123456789abcdef"


def _limited(tmp_path: Path, replicas: int = 1, **limits: int) -> AuthConfig:
    """Tenant "a" holding KEY, with ``limits`` (requests_per_minute, tokens_per_minute)."""
    (tmp_path / "a").write_text(KEY)
    tenant = TenantKeys(name="a", key_files=[str(tmp_path / "a")], **limits)
    return AuthConfig(tenants=[tenant], router_replicas=replicas)


@contextlib.asynccontextmanager
async def _router_for(auth: AuthConfig) -> AsyncIterator[tuple[RunningRouter, FakeEngine]]:
    """One engine behind a router checking ``auth``."""
    engine = FakeEngine("e")
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])], auth=auth)
        async with running_router(config) as router:
            yield router, engine


def test_a_bucket_refills_at_a_sixtieth_of_its_minute_per_second() -> None:
    bucket = Bucket.full(60, now=0.0)
    bucket.level = 0
    bucket.refill(10.0)
    assert bucket.level == pytest.approx(10)
    bucket.refill(1000.0)
    assert bucket.level == 60  # never above a minute's worth
    bucket.level = -5
    assert bucket.wait(1) == pytest.approx(6.0)


def test_a_request_takes_both_buckets_or_neither() -> None:
    """One request and its tokens; refused for either limit, nothing is taken, and the
    429 says which limit, when to retry, and OpenAI's headers."""
    limits = TenantLimits(Bucket.full(2, 0.0), Bucket.full(100, 0.0))
    headers = limits.admit(60, 0.0)
    assert headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(RateLimitedError) as refused:
        limits.admit(60, 0.0)  # tokens short (40 left): the request is not taken either
    assert refused.value.reason == "rate_limited_tokens"
    assert refused.value.headers["Retry-After"] == "12"  # 20 tokens at 100/60 per second
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "1"
    limits.admit(40, 0.0)
    with pytest.raises(RateLimitedError) as refused:
        limits.admit(0, 0.0)
    assert refused.value.reason == "rate_limited_requests"
    assert refused.value.headers["x-ratelimit-reset-requests"] == "1m0s"


def test_a_request_larger_than_the_minute_can_never_pass() -> None:
    limits = TenantLimits(None, Bucket.full(100, 0.0))
    with pytest.raises(RateLimitedError) as refused:
        limits.admit(101, 0.0)
    assert refused.value.reason == "request_too_large"
    assert "Retry-After" not in refused.value.headers


def test_usage_gives_back_what_the_reserve_overestimated() -> None:
    limits = TenantLimits(None, Bucket.full(1000, 0.0))
    limits.admit(600, 0.0)  # prompt + max_tokens
    limits.settle(600, 150, 0.0)  # the answer used 150
    assert limits.tokens is not None
    assert limits.tokens.level == pytest.approx(850)
    limits.settle(600, None, 0.0)  # unknown usage: the reserve stands
    assert limits.tokens.level == pytest.approx(850)


def test_each_router_replica_admits_its_share_and_unchanged_tenants_keep_their_buckets() -> None:
    limiter = Limiter()
    limiter.configure({"a": (100, None), "b": (None, 1000)}, replicas=3, now=0.0)
    a = limiter.of("a")
    assert a is not None
    assert a.requests is not None
    assert a.requests.capacity == 34  # ceil(100 / 3)
    a.requests.level = 5
    limiter.configure({"a": (100, None), "b": (None, 2000)}, replicas=3, now=1.0)
    assert limiter.of("a") is a
    b = limiter.of("b")
    assert b is not None
    assert b.tokens is not None
    assert b.tokens.capacity == 667
    limiter.configure({"a": (None, None)}, replicas=1, now=2.0)
    assert limiter.of("a") is None
    assert limiter.of("b") is None


def test_with_every_peer_heard_each_router_holds_the_whole_limit_and_pays_for_theirs() -> None:
    """Shared spending (routing.peers): with both routers exchanging, each bucket holds the
    service's limit and is debited by what the other took since its last report; its first
    report is only a baseline. A silent peer shrinks the buckets back to this router's share,
    each keeping its fraction."""
    limiter = Limiter()
    limiter.configure({"a": (100, 1000)}, replicas=2, now=0.0)
    a = limiter.of("a")
    assert a is not None
    assert a.requests is not None
    assert a.tokens is not None
    assert (a.requests.capacity, a.tokens.capacity) == (50, 500)  # alone: its share
    limiter.set_peers(1)
    assert (a.requests.capacity, a.tokens.capacity) == (100, 1000)
    assert a.requests.level == 100  # full stays full
    limiter.peer_spent("b", {"a": (30.0, 200.0)}, now=0.0)  # what it took before: a baseline
    assert a.requests.level == 100
    limiter.peer_spent("b", {"a": (50.0, 300.0)}, now=0.0)
    assert (a.requests.level, a.tokens.level) == (80, 900)
    a.admit(10, now=0.0)
    assert limiter.spent() == {"a": (1.0, 10.0)}  # what this router reports to its peers
    limiter.set_peers(0)
    assert (a.requests.capacity, a.requests.level) == (50, 39.5)
    # Lost, its totals are forgotten: what it admits meanwhile comes out of its own share,
    # so when it is heard again its report is a new baseline, not a debt.
    limiter.forget_peers(set())
    limiter.peer_spent("b", {"a": (60.0, 300.0)}, now=0.0)
    assert a.requests.level == 39.5


def test_a_peers_debt_is_bounded_by_a_minute() -> None:
    limiter = Limiter()
    limiter.configure({"a": (60, None)}, replicas=2, now=0.0)
    limiter.set_peers(1)
    limiter.peer_spent("b", {"a": (0.0, 0.0)}, now=0.0)
    limiter.peer_spent("b", {"a": (1e9, 0.0)}, now=0.0)
    a = limiter.of("a")
    assert a is not None
    assert a.requests is not None
    assert a.requests.level == -60


@pytest.mark.asyncio
async def test_two_routers_sharing_spending_admit_the_limit_whichever_gets_the_requests(
    tmp_path: Path,
) -> None:
    """A tenant of 10 requests a minute sends 8 through one router, then 6 through the other:
    the first admits all 8 (alone it would stop at its share, 5) and the second only what is
    left of the service's 10 (alone it would admit its 5)."""
    auth = _limited(tmp_path, replicas=2, requests_per_minute=10)
    engine = FakeEngine("e")
    headers = {"Authorization": f"Bearer {KEY}"}
    ports = free_ports(2)
    peers = {"addresses": [f"127.0.0.1:{p}" for p in ports], "interval": "50ms"}
    async with engines(engine):
        configs = [
            make_config([tier("only", 1.0, [engine])], auth=auth, metricsPort=p, peers=peers)
            for p in ports
        ]
        async with running_router(configs[0]) as first, running_router(configs[1]) as second:
            for router in (first, second):
                await wait_for(
                    lambda r=router: r.metric("fleetpilot_router_peers", state="live") == 1
                )
            started = time.monotonic()
            one = [(await post(first, SHORT, headers=headers))[0] for _ in range(8)]
            await asyncio.sleep(0.3)  # a few exchanges: the second router has heard of them
            two = [(await post(second, SHORT, headers=headers))[0] for _ in range(6)]
            refill = (time.monotonic() - started) * 10 / 60  # a sixth of a request a second
    assert one == [200] * 8
    assert 2 <= two.count(200) <= 2 + math.ceil(refill)
    assert two.count(429) >= 3


@pytest.mark.asyncio
async def test_the_official_client_reads_the_429_and_its_headers(tmp_path: Path) -> None:
    """Two requests a minute: the third gets 429, which the openai package raises as its
    RateLimitError, with Retry-After and x-ratelimit-* it can read; an admitted answer
    carries the headers too, and a refused request never reaches an engine."""
    async with _router_for(_limited(tmp_path, requests_per_minute=2)) as (router, engine):
        async with openai.AsyncOpenAI(
            base_url=router.url + "/v1", api_key=KEY, max_retries=0
        ) as client:
            raw = await client.completions.with_raw_response.create(model="chat", prompt="hi")
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            assert raw.headers["x-ratelimit-remaining-requests"] == "1"
            await client.completions.create(model="chat", prompt="hi")
            with pytest.raises(openai.RateLimitError) as refused:
                await client.completions.create(model="chat", prompt="hi")
        headers = refused.value.response.headers
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(headers["retry-after"]) <= 30  # a request refills in 30 s
        assert headers["x-fleetpilot-error"] == "rate_limited_requests"
        assert len(engine.requests) == 2
        status, payload, _ = await post(router, SHORT, headers={"Authorization": f"Bearer {KEY}"})
        assert_openai_error(status, payload, 429)


@pytest.mark.asyncio
async def test_tokens_are_reserved_then_corrected_by_the_answers_usage(tmp_path: Path) -> None:
    """A tenant of 1,000 tokens a minute sends max_tokens 400: reserved at admission, then
    the answer's usage (2 tokens) is all that stays taken, so the next such request passes
    where the reserve alone would have refused the third."""
    async with _router_for(_limited(tmp_path, tokens_per_minute=1000)) as (router, _):
        headers = {"Authorization": f"Bearer {KEY}"}
        for _ in range(4):
            status, payload, reply = await post(
                router, {**SHORT, "max_tokens": 400}, headers=headers
            )
            assert status == 200, payload
        # Admission saw ~401 reserved of what was left; each answer used 2.
        assert int(reply["x-ratelimit-remaining-tokens"]) >= 1000 - 3 * 2 - 401 - 1
        status, payload, _ = await post(router, {**SHORT, "max_tokens": 1001}, headers=headers)
        assert_openai_error(status, payload, 429)
        assert "more than the 1000 a minute" in payload["error"]["message"]


@pytest.mark.asyncio
async def test_two_routers_admit_the_services_limit_between_them(tmp_path: Path) -> None:
    """What a limit means with 2 router replicas: each admits half. A tenant of 40 requests
    a minute, its requests spread over both routers (as the router Service spreads
    connections), gets 40 of a burst of 100 at once; sent to one router only, 20."""
    auth = _limited(tmp_path, replicas=2, requests_per_minute=40)
    engine = FakeEngine("e")
    headers = {"Authorization": f"Bearer {KEY}"}
    async with engines(engine):
        config = make_config([tier("only", 1.0, [engine])], auth=auth)
        async with running_router(config) as first, running_router(config) as second:
            started = time.monotonic()
            spread = [
                (await post(router, SHORT, headers=headers))[0]
                for _ in range(50)
                for router in (first, second)
            ]
            # Each router refills a third of a request a second: on a slow machine a few more.
            refill = int((time.monotonic() - started) * 20 / 60)
            assert 40 <= spread.count(200) <= 40 + 2 * refill
            async with running_router(config) as alone:
                started = time.monotonic()
                statuses = [(await post(alone, SHORT, headers=headers))[0] for _ in range(50)]
                refill = int((time.monotonic() - started) * 20 / 60)
            assert 20 <= statuses.count(200) <= 20 + refill


@pytest.mark.parametrize(
    ("data", "used"),
    [
        (b'{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":3,"total_tokens":7}}', 7),
        # vLLM's details object before the total, and a reply that talks about "usage".
        (
            b'{"choices":[{"text":"say \\"usage\\": total_tokens: 99"}],"usage":{"prompt_tokens":'
            b'3,"prompt_tokens_details":{"cached_tokens":2},"total_tokens":12}}',
            12,
        ),
        (b'{"choices":[{"text":"hi"}],"usage":null}', None),
        (b'{"choices":[{"text":"hi"}]}', None),
        # The last events of a stream asked with include_usage.
        (
            b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
            b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2,'
            b'"total_tokens":6}}\n\ndata: [DONE]\n\n',
            6,
        ),
    ],
)
def test_the_tokens_an_answer_used_are_read_from_its_usage(data: bytes, used: int | None) -> None:
    assert usage_tokens(data) == used
