"""The router's decisions over replica state, without HTTP: tier by score and capacity,
staleness of scraped data, P/D picks, state kept across endpoint changes."""

from __future__ import annotations

import math
import random

import pytest

from fleetpilot.api.router_config import EndpointGroup, RouterTier
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.kv_events import BlockRemoved, BlockStored
from fleetpilot.routing.endpoints import Endpoint, StaticSource
from fleetpilot.routing.errors import OverloadedError, UnavailableError
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.policies.candidates import HOLDER_CANDIDATES, HOME_CANDIDATES
from fleetpilot.routing.policies.load import EngineMetrics, make_view
from fleetpilot.routing.policies.types import ReplicaView
from fleetpilot.routing.replica import ADAPTER_MISSING_S, ReplicaState
from fleetpilot.routing.replica_set import TIER_STATE_MAX_AGE_S
from fleetpilot.routing.router import Router
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.routing.support import make_config


def grp(role: str, *addresses: str, seqs: int = 4) -> EndpointGroup:
    return EndpointGroup(
        role=role,
        service=f"s-{role}",
        selector={},
        port=8000,
        max_num_seqs=seqs,
        addresses=list(addresses),
    )


def two_tiers(**overrides: object) -> Router:
    config = make_config(
        [
            RouterTier(name="small", model="sm", up_to=0.4, mode="unified",
                       endpoints=[grp("unified", "10.0.0.1:1", "10.0.0.2:1")]),
            RouterTier(name="large", model="lg", up_to=1.0, mode="unified",
                       endpoints=[grp("unified", "10.0.1.1:1")]),
        ],
        **overrides,
    )  # fmt: skip
    now = [100.0]
    return Router(config, StaticSource(config), rng=random.Random(0), clock=lambda: now[0])


SHORT = extract_features({"prompt": "hi"}, "completions")


def scrape(router: Router, replica: str, waiting: float, at: float = 100.0) -> None:
    state = router.replica(replica)
    assert state is not None
    state.metrics = EngineMetrics(waiting=waiting)
    state.scraped_at = at


def test_spills_when_the_small_tier_queue_is_over_threshold_and_returns() -> None:
    """Mean queue per small replica above 4: spill to large; below: back to small."""
    router = two_tiers()
    assert router.decide(SHORT).tier.name == "small"
    scrape(router, "10.0.0.1:1", 6)
    scrape(router, "10.0.0.2:1", 4)  # mean 5 > 4
    route = router.decide(SHORT)
    assert (route.tier.name, route.reason, route.spilled_from) == ("large", "spillover", "small")
    scrape(router, "10.0.0.1:1", 0)
    assert router.decide(SHORT).tier.name == "small"


def test_stale_scrapes_stop_counting() -> None:
    """A queue scraped long ago (beyond staleAfter) is ignored."""
    router = two_tiers()
    scrape(router, "10.0.0.1:1", 50, at=90.0)
    scrape(router, "10.0.0.2:1", 50, at=90.0)
    assert router.decide(SHORT).tier.name == "small"


def test_in_flight_alone_saturates_a_tier() -> None:
    """Without any scrape, the router's own in-flight counts fill the small tier's batches,
    then its queue slots, then everything: 429 with Retry-After."""
    router = two_tiers(backpressure={"maxWaitingPerReplica": 1})
    for r in router.replicas():
        r.in_flight = r.max_num_seqs
    route = router.decide(SHORT)
    assert route.tier.name == "small"  # both tiers' batches full: stay home
    for r in router.replicas():
        r.in_flight = r.max_num_seqs + 1
    with pytest.raises(OverloadedError) as info:
        router.decide(SHORT)
    assert info.value.headers["Retry-After"] == "1"


def test_pinned_tier_with_no_replicas_is_503() -> None:
    """A tier with nothing discovered: Unavailable, not a hang."""
    config = make_config(
        [RouterTier(name="only", model="m", up_to=1.0, mode="unified", endpoints=[grp("unified")])]
    )
    router = Router(config, StaticSource(config))
    with pytest.raises(UnavailableError):
        router.decide(SHORT)


def test_disaggregated_route_picks_prefill_by_prefix_and_decode_by_load() -> None:
    """P/D: the prefill replica that saw the prefix wins; decode goes to the idler replica."""
    config = make_config(
        [
            RouterTier(
                name="large", model="lg", up_to=1.0, mode="disaggregated",
                endpoints=[grp("prefill", "10.0.2.1:1", "10.0.2.2:1"),
                           grp("decode", "10.0.3.1:1", "10.0.3.2:1")],
            )
        ]
    )  # fmt: skip
    router = Router(config, StaticSource(config), rng=random.Random(3))
    long = extract_features({"prompt": "shared system prompt " * 40}, "completions")
    first = router.decide(long)
    assert first.prefill is not None
    busy = router.replica("10.0.3.1:1")
    assert busy is not None
    busy.in_flight = 3
    for _ in range(5):
        again = router.decide(long)
        assert again.prefill is first.prefill
        assert again.prefix_match == 1.0
        assert again.replica.id == "10.0.3.2:1"


def test_replica_state_survives_endpoint_changes_and_config_reloads() -> None:
    """A reload that keeps an endpoint keeps its in-flight count and scraped data; a removed
    endpoint's prefix index and failures are forgotten."""
    router = two_tiers()
    state = router.replica("10.0.0.1:1")
    assert state is not None
    state.in_flight = 2
    router.prefix_index.record("10.0.0.2:1", [1, 2])
    config = make_config(
        [RouterTier(name="small", model="sm", up_to=1.0, mode="unified",
                    endpoints=[grp("unified", "10.0.0.1:1")])]
    )  # fmt: skip
    router.apply_config(config)
    assert router.replica("10.0.0.1:1") is state
    assert state.in_flight == 2
    assert router.replica("10.0.0.2:1") is None
    assert router.prefix_index.size("10.0.0.2:1") == 0


def test_a_replica_view_is_remade_whenever_what_it_shows_changes() -> None:
    """The view a replica keeps between decisions matches a fresh ``make_view`` after every
    change: in-flight, pending prefill, batch size, ejection, a new scrape, a scrape going
    stale with time alone, and an adapter the replica answered it lacks - marked, the mark
    running out with time alone, and a later scrape showing the adapter running ending it."""
    state = ReplicaState(Endpoint("small", "unified", "10.0.0.1", 1), max_num_seqs=4)
    stale_after = 5.0

    def check(
        now: float, ejected: bool = False, missing: frozenset[str] = frozenset()
    ) -> ReplicaView:
        view = state.view(now, stale_after, ejected)
        fresh = make_view(
            state.id,
            state.max_num_seqs,
            state.in_flight,
            state.metrics,
            state.scraped_at,
            now,
            stale_after,
            ejected,
            state.pending_prefill,
            missing_adapters=missing,
        )
        assert view == fresh
        return view

    first = check(10.0)
    assert state.view(10.0, stale_after, False) is first  # nothing changed: kept
    state.in_flight = 3
    assert check(10.0).demand == 3
    state.pending_prefill = 2.0
    check(10.0)
    state.max_num_seqs = 2
    assert check(10.0).queued == 1
    assert check(10.0, ejected=True).ejected
    state.metrics, state.scraped_at = EngineMetrics(waiting=4.0, running=2.0, kv_usage=0.5), 9.0
    assert check(12.0).waiting == 4.0
    assert check(14.0 + 0.5).waiting == 0.0  # 5.5 s after the scrape: stale
    state.metrics, state.scraped_at = EngineMetrics(waiting=1.0), 14.0
    assert check(14.5).waiting == 1.0
    sql = frozenset({"sql"})
    state.note_adapter_missing("sql", 15.0)
    assert check(15.0, missing=sql).missing_adapters == sql
    assert check(15.0 + ADAPTER_MISSING_S).missing_adapters == frozenset()  # run out
    # A scrape from before the mark still lists the adapter: the 404 is newer.
    state.metrics, state.scraped_at = EngineMetrics(adapters=sql), 29.0
    state.note_adapter_missing("sql", 30.0)
    assert check(30.5, missing=sql).adapters == frozenset()
    # One from after it shows the engine running it: loaded since.
    state.metrics, state.scraped_at = EngineMetrics(adapters=sql), 31.0
    assert check(31.5).adapters == sql


# -- the KV index (engines' events) against the guessed one --------------------------------

BS = 16


class Live:
    """Which event streams the router is told are heard from (the KV-events client's role)."""

    def __init__(self, *streams: str) -> None:
        self.streams = set(streams)

    def __call__(self, stream: str) -> bool:
        return stream in self.streams


def kv_router(live: Live, *, kv: bool = True, data_parallel: int = 1, seed: int = 0) -> Router:
    """Three unified replicas whose engines publish KV events, with the reference tokenizer."""
    group = grp("unified", "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", seqs=8)
    if kv:
        group = group.model_copy(
            update={"kv_events_port": 5557, "kv_replay_port": 5559, "data_parallel": data_parallel}
        )
    config = make_config(
        [RouterTier(name="small", model="sm", up_to=1.0, mode="unified", endpoints=[group],
                    tokenizer=str(REFERENCE_TOKENIZER))]
    )  # fmt: skip
    router = Router(config, StaticSource(config), rng=random.Random(seed), kv_live=live)
    router.tokenizers["small"] = TOKENIZER
    return router


TOKENIZER = RequestTokenizer.from_dir(REFERENCE_TOKENIZER)


CHAT = [
    {"role": "system", "content": "You are the fleet's support desk. " * 12},
    {"role": "user", "content": "where is my order?"},
]


def engine_caches(router: Router, stream: str, messages: list[dict[str, str]]) -> None:
    """The engine behind ``stream`` reports it cached the prompt's full blocks."""
    tokens = TOKENIZER.token_ids("chat", {"messages": messages})
    full = len(tokens) // BS * BS
    hashes = list(range(1000, 1000 + full // BS))
    event = BlockStored(hashes, None, tokens[:full], BS, None, "GPU", None)
    router.kv_index.apply(stream, [event])


def test_the_engines_events_beat_the_routers_own_guess() -> None:
    """The router sent this prompt to one replica (its guess says that one caches it), but
    the engines' events say another holds it: the events decide, and the route says so."""
    router = kv_router(Live())  # no stream heard from yet: the guess decides
    features = extract_features({"messages": CHAT}, "chat")
    guessed = router.decide(features)
    assert guessed.prefix_source == "guessed"
    holder = next(r.id for r in router.replicas() if r.id != guessed.replica.id)
    engine_caches(router, holder, CHAT)
    router.affinity.kv_live = Live(*(r.id for r in router.replicas()))
    route = router.decide(features)
    assert (route.replica.id, route.prefix_source) == (holder, "events")
    assert route.prefix_match > 0.9
    assert "prefix-source=events" in route.header()


def test_one_silent_publisher_sends_the_whole_group_back_to_the_guess() -> None:
    """Events speak for a group only when every replica's stream is live: a silent one's
    truthful-looking 'nothing cached' must not be set against the others' truth."""
    router = kv_router(Live("10.0.0.1:1", "10.0.0.2:1"))
    engine_caches(router, "10.0.0.3:1", CHAT)
    route = router.decide(extract_features({"messages": CHAT}, "chat"))
    assert route.prefix_source == "guessed"


def test_engines_without_events_or_a_tier_without_tokenizer_are_guessed() -> None:
    """No KV-event ports in the config, or no tokenizer for the tier: the guessed index."""
    features = extract_features({"messages": CHAT}, "chat")
    no_ports = kv_router(Live("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"), kv=False)
    assert no_ports.decide(features).prefix_source == "guessed"
    no_tokenizer = kv_router(Live("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"))
    no_tokenizer.tokenizers.clear()
    assert no_tokenizer.decide(features).prefix_source == "guessed"


def test_a_prompt_the_tokenizer_refuses_falls_back_and_is_flagged() -> None:
    """A request the router cannot tokenize as the engine would (an image part: the router
    matches text only) is routed on the guess, never failed, and the route carries the flag
    the proxy counts."""
    router = kv_router(Live("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"))
    engine_caches(router, "10.0.0.2:1", CHAT)  # the index knows a block size
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    bad = [{"role": "user", "content": [{"type": "text", "text": "and this?"}, image]}]
    route = router.decide(extract_features({"messages": [*CHAT, *bad]}, "chat"))
    assert (route.prefix_source, route.tokenizer_failed) == ("guessed", True)
    fine = router.decide(extract_features({"messages": CHAT}, "chat"))
    assert (fine.prefix_source, fine.tokenizer_failed) == ("events", False)


def test_a_data_parallel_replica_is_matched_on_any_ranks_blocks() -> None:
    """vLLM publishes per data-parallel rank: blocks a replica's second rank holds count for
    the replica."""
    router = kv_router(Live(*(f"10.0.0.{i}:1{s}" for i in (1, 2, 3) for s in ("", "#dp1"))),
                       data_parallel=2)  # fmt: skip
    engine_caches(router, "10.0.0.3:1#dp1", CHAT)
    route = router.decide(extract_features({"messages": CHAT}, "chat"))
    assert (route.replica.id, route.prefix_source) == ("10.0.0.3:1", "events")


def test_a_second_request_follows_the_first_before_the_engine_reports_it() -> None:
    """The engine reports a prompt's blocks only after its prefill: a tenant's next request
    in that window goes where the first one was sent, not where nothing is cached yet - and
    once the engine has reported the blocks, its events alone speak (here: evicted)."""
    router = kv_router(Live("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"))
    features = extract_features({"messages": CHAT}, "chat")
    first = router.decide(features)
    first.replica.in_flight = 2  # busier than the others: load alone would go elsewhere
    second = router.decide(features)
    assert (second.replica.id, second.prefix_source) == (first.replica.id, "events")
    assert second.prefix_match > 0.9
    keys = TOKENIZER.keys("chat", {"messages": CHAT}, BS)
    router.recent.confirm(first.replica.id, keys)  # stored, then evicted: the index is empty
    third = router.decide(features)
    assert third.prefix_match == 0.0


def test_a_long_queue_sends_a_prompt_off_its_cache_to_room_but_not_to_evicting_ones() -> None:
    """Replica 1 caches the prompt. One request waiting there keeps it: most queued requests
    hit the cache, so waiting behind one costs less than computing the prompt afresh. A queue
    longer than twice the prompt's blocks (computing them costs this request and the ones behind
    it) sends it to a replica with room; when the others' engines
    are evicting (their events pair every store with a removal), a miss there would push other
    prefixes out too, so the prompt waits where it is cached."""
    streams = ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    features = extract_features({"messages": CHAT}, "chat")

    def routed(waiting: float, pressed: bool = False) -> str:
        router = kv_router(Live(*streams))
        if pressed:
            for n, stream in enumerate(streams[1:]):
                base = 10_000 * (n + 1)
                churn = [BlockStored([base + i], None, [i] * BS, BS, None, "GPU", None)
                         for i in range(300)]  # fmt: skip
                router.kv_index.apply(stream, churn)
                router.kv_index.apply(stream, [BlockRemoved([base + i], "GPU") for i in range(300)])
        engine_caches(router, streams[0], CHAT)
        scrape(router, streams[0], waiting=waiting, at=router.clock())
        return router.decide(features).replica.id

    blocks = len(kv_router(Live(*streams)).decide(features).request.hashes)
    assert routed(1.0) == streams[0]
    assert routed(1.5 * blocks) == streams[0]
    assert routed(2.5 * blocks) != streams[0]
    assert routed(2.5 * blocks, pressed=True) == streams[0]


def test_router_replicas_break_ties_alike_by_the_first_block_no_engine_holds() -> None:
    """Two router replicas (different random seeds) on the same events: a cold tenant's prompt
    lands on the same replica in both, keyed by its own first block, so its next request finds
    it cached whichever router takes it; users sharing one cached system prompt spread by
    their own first private block rather than piling onto one replica."""
    streams = ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    routers = [kv_router(Live(*streams), seed=seed) for seed in (1, 2)]

    def tenant(n: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"Tenant {n} desk. " * 12},
                {"role": "user", "content": "hello"}]  # fmt: skip

    def sent(router: Router, messages: list[dict[str, str]]) -> str:
        """Route and count the request in flight, as the proxy does."""
        route = router.decide(extract_features({"messages": messages}, "chat"))
        route.replica.in_flight += 1
        route.replica.pending_prefill += route.prefill_blocks
        return route.replica.id

    cold = [[sent(r, tenant(n)) for r in routers] for n in range(12)]
    assert all(a == b for a, b in cold)
    assert len({a for a, _ in cold}) > 1

    routers = [kv_router(Live(*streams), seed=seed) for seed in (3, 4)]
    for router in routers:
        for stream in streams:
            engine_caches(router, stream, CHAT[:1])
    users = [
        [sent(r, [CHAT[0], user]) for r in routers]
        for user in ({"role": "user", "content": f"order {n} " * 20} for n in range(12))
    ]
    assert all(a == b for a, b in users)
    assert len({a for a, _ in users}) > 1


def pd_kv_router(tokenizer: RequestTokenizer = TOKENIZER) -> Router:
    """A P/D tier whose prefill and decode engines publish KV events, every stream live."""
    kv = {"kv_events_port": 5557, "kv_replay_port": 5559}
    prefill = grp("prefill", "10.0.2.1:1", "10.0.2.2:1", seqs=8).model_copy(update=kv)
    decode = grp("decode", "10.0.3.1:1", "10.0.3.2:1", seqs=8).model_copy(update=kv)
    config = make_config(
        [RouterTier(name="large", model="lg", up_to=1.0, mode="disaggregated",
                    endpoints=[prefill, decode], tokenizer=str(REFERENCE_TOKENIZER))]
    )  # fmt: skip
    live = Live("10.0.2.1:1", "10.0.2.2:1", "10.0.3.1:1", "10.0.3.2:1")
    router = Router(config, StaticSource(config), rng=random.Random(0), kv_live=live)
    router.tokenizers["large"] = tokenizer
    return router


def test_a_decode_replica_holding_the_prompt_prefills_the_rest_itself() -> None:
    """P/D: when a decode replica's engine holds all of a prompt but its last partial block,
    the request goes to it alone (no prefill hop, no KV pull), and the route says so; a
    prompt no decode replica holds takes the prefill hop."""
    router = pd_kv_router()
    engine_caches(router, "10.0.3.2:1", CHAT)
    held = router.decide(extract_features({"messages": CHAT}, "chat"))
    assert held.local_prefill
    assert held.prefill is None
    assert held.replica.id == "10.0.3.2:1"
    assert held.prefix_source == "events"
    assert held.prefix_match > 0.9
    assert 0 < held.prefill_blocks <= 64 // BS
    assert "prefill=local" in held.header()
    other = [CHAT[0], {"role": "user", "content": "a question nobody asked before. " * 8}]
    cold = router.decide(extract_features({"messages": other}, "chat"))
    assert not cold.local_prefill
    assert cold.prefill is not None
    assert "prefill=local" not in cold.header()


def test_a_prompt_held_but_for_more_than_a_few_tokens_takes_the_prefill_hop() -> None:
    """A decode replica holding the system prompt but not a long new message is not sent the
    whole prefill: the hop computes it on a prefill replica."""
    router = pd_kv_router()
    engine_caches(router, "10.0.3.1:1", CHAT[:1])
    longer = [CHAT[0], {"role": "user", "content": "where is my order, and the other one? " * 3}]
    route = router.decide(extract_features({"messages": longer}, "chat"))
    assert route.replica.id == "10.0.3.1:1"  # the decode pick went where its share is cached
    assert not route.local_prefill
    assert route.prefill is not None


def test_a_prompt_cut_at_the_tokenizers_cap_never_skips_the_hop() -> None:
    """Keys of a prompt's head (a prompt over the tokenizer's character cap) say nothing of
    the rest: a decode replica holding that head still gets the KV from a prefill."""
    capped = RequestTokenizer.from_dir(REFERENCE_TOKENIZER, max_chars=200)
    router = pd_kv_router(capped)
    engine_caches(router, "10.0.3.1:1", CHAT)
    route = router.decide(extract_features({"messages": CHAT}, "chat"))
    assert not route.local_prefill
    assert route.prefill is not None


# -- groups too large to score every replica (policies.candidates) --------------------------


def large_kv_router(
    replicas: int,
    *,
    seed: int = 0,
    full_scan_max: int | None = None,
    now: list[float] | None = None,
) -> Router:
    """``replicas`` unified replicas publishing live KV events, the reference tokenizer; the
    clock reads ``now[0]``."""
    addresses = [f"10.1.{i // 200}.{i % 200 + 1}:1" for i in range(replicas)]
    group = grp("unified", *addresses, seqs=8).model_copy(
        update={"kv_events_port": 5557, "kv_replay_port": 5559}
    )
    config = make_config(
        [RouterTier(name="small", model="sm", up_to=1.0, mode="unified", endpoints=[group],
                    tokenizer=str(REFERENCE_TOKENIZER), adapters=["sql"], max_loras=2)]
    )  # fmt: skip
    clock = now if now is not None else [100.0]
    extra = {} if full_scan_max is None else {"full_scan_max": full_scan_max}
    router = Router(config, StaticSource(config), rng=random.Random(seed),
                    kv_live=Live(*addresses), clock=lambda: clock[0], **extra)  # fmt: skip
    router.tokenizers["small"] = TOKENIZER
    return router


LARGE = 200
FEATURES = extract_features({"messages": CHAT}, "chat")


def test_a_large_group_sends_a_cached_prompt_to_its_holder_scoring_a_few_replicas() -> None:
    """Of 200 replicas one caches the prompt: the pick scores a handful (the holder and the
    prompt's home on the ring) and chooses the holder, as a scan of all 200 does."""
    bounded, full = large_kv_router(LARGE), large_kv_router(LARGE, full_scan_max=10_000)
    holder = bounded.replicas()[137].id
    for router in (bounded, full):
        engine_caches(router, holder, CHAT)
    route = bounded.decide(FEATURES)
    assert route.replica.id == holder == full.decide(FEATURES).replica.id
    assert route.request.candidates is not None
    assert holder in route.request.candidates
    assert len(route.request.candidates) <= HOLDER_CANDIDATES + HOME_CANDIDATES
    assert full.decide(FEATURES).request.candidates is None


def test_large_groups_in_two_router_replicas_send_a_cold_tenant_to_the_same_home() -> None:
    """Each router scores only a few replicas, yet two of them (other random seeds) place
    every cold tenant alike: its home on the ring comes from its tie key, the same in both;
    and the tenants spread over the fleet."""
    routers = [large_kv_router(LARGE, seed=seed) for seed in (1, 2)]

    def sent(router: Router, n: int) -> str:
        messages = [{"role": "system", "content": f"Tenant {n} desk. " * 12},
                    {"role": "user", "content": "hello"}]  # fmt: skip
        route = router.decide(extract_features({"messages": messages}, "chat"))
        route.replica.in_flight += 1
        route.replica.pending_prefill += route.prefill_blocks
        return route.replica.id

    placed = [[sent(r, n) for r in routers] for n in range(20)]
    assert all(a == b for a, b in placed)
    assert len({a for a, _ in placed}) >= 15


def test_a_large_groups_next_request_follows_the_first_before_the_engine_reports_it() -> None:
    """Nothing reported yet: a tenant's second request finds the first one's replica among
    its candidates through what this router just sent there, though that replica is busier."""
    router = large_kv_router(LARGE)
    first = router.decide(FEATURES)
    first.replica.in_flight = 2
    second = router.decide(FEATURES)
    assert second.replica.id == first.replica.id
    assert second.prefix_match > 0.9


def test_a_busy_neighbourhood_looks_further_and_a_full_one_scans_the_group() -> None:
    """Every replica a prompt's pick looks at first is busy (a request waiting): it also
    scores a random few of the rest and goes to one with room. With every replica full but
    one, the candidates all fail the capacity filter and the whole group is scanned."""
    now = [100.0]
    first = large_kv_router(LARGE, now=now).decide(FEATURES).request.candidates
    assert first is not None
    router = large_kv_router(LARGE, now=now)  # nothing sent yet: the same candidates
    for rid in first:
        scrape(router, rid, waiting=1.0, at=now[0])
    route = router.decide(FEATURES)
    assert route.replica.id not in first

    full = large_kv_router(LARGE, now=now)
    limit = full.config.backpressure.max_waiting_per_replica
    spare = full.replicas()[61].id
    for r in full.replicas():
        if r.id != spare:
            scrape(full, r.id, waiting=float(limit), at=now[0])
    route = full.decide(FEATURES)
    assert route.replica.id == spare
    assert spare not in (route.request.candidates or ())


def test_a_large_groups_tier_state_is_read_again_after_its_max_age() -> None:
    """Every replica full: 429. Freed, the group's tier state (read once per
    TIER_STATE_MAX_AGE_S, not every request) answers 429 until it is that old, then routes."""
    now = [100.0]
    router = large_kv_router(LARGE, now=now)
    limit = router.config.backpressure.max_waiting_per_replica
    for r in router.replicas():
        scrape(router, r.id, waiting=float(limit), at=now[0])
    with pytest.raises(OverloadedError):
        router.decide(FEATURES)
    for r in router.replicas():
        scrape(router, r.id, waiting=0.0, at=now[0])
    now[0] += TIER_STATE_MAX_AGE_S / 2
    with pytest.raises(OverloadedError):
        router.decide(FEATURES)
    now[0] += TIER_STATE_MAX_AGE_S
    assert router.decide(FEATURES).replica is not None


def test_a_retry_in_a_large_group_goes_to_another_replica() -> None:
    router = large_kv_router(LARGE)
    route = router.decide(FEATURES)
    tried = {route.replica.id}
    for _ in range(HOLDER_CANDIDATES + HOME_CANDIDATES + 2):
        other = router.alternative(route, tried)
        assert other is not None
        assert other.id not in tried
        tried.add(other.id)


def adapter_router(live: Live) -> Router:
    """kv_router's three replicas, their tier serving the LoRA adapter "sql" too."""
    router = kv_router(live)
    tier = router.config.tiers[0].model_copy(update={"adapters": ["sql"]})
    config = router.config.model_copy(update={"tiers": [tier]})
    router = Router(config, StaticSource(config), rng=random.Random(0), kv_live=live)
    router.tokenizers["small"] = TOKENIZER
    return router


def test_an_adapters_blocks_match_only_requests_for_that_adapter() -> None:
    """The engines key an adapter's blocks by its name (vLLM's block hashes do): a prompt
    cached under "sql" on one replica draws a request for "sql" there, and the same prompt
    for the base model finds nothing cached anywhere. The route names the adapter."""
    streams = ("10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1")
    router = adapter_router(Live(*streams))
    tokens = TOKENIZER.token_ids("chat", {"messages": CHAT})
    full = len(tokens) // BS * BS
    hashes = list(range(1000, 1000 + full // BS))
    stored = BlockStored(hashes, None, tokens[:full], BS, 1, "GPU", "sql")
    router.kv_index.apply("10.0.0.3:1", [stored])
    sql = router.decide(extract_features({"model": "sql", "messages": CHAT}, "chat"))
    assert (sql.replica.id, sql.adapter, sql.prefix_source) == ("10.0.0.3:1", "sql", "events")
    assert sql.prefix_match > 0.9
    assert "adapter=sql" in sql.header()
    base = router.decide(extract_features({"model": "sm", "messages": CHAT}, "chat"))
    assert base.adapter is None
    assert base.prefix_match == 0.0
    assert "adapter=" not in base.header()


def lora_router(max_loras: int = 2) -> Router:
    """Three replicas of one tier serving adapters a..e, ``max_loras`` running at once each."""
    config = make_config(
        [RouterTier(name="t", model="base", up_to=1.0, mode="unified",
                    endpoints=[grp("unified", "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", seqs=8)],
                    adapters=list("abcde"), max_loras=max_loras)]
    )  # fmt: skip
    return Router(config, StaticSource(config), rng=random.Random(0), clock=lambda: 100.0)


def ask(router: Router, adapter: str) -> str:
    route = router.decide(extract_features({"model": adapter, "prompt": "hi"}, "completions"))
    return route.replica.id


def test_requests_for_an_adapter_stay_where_it_is_loaded() -> None:
    """A replica that ran an adapter keeps it loaded: later requests for it go there while it
    has room (no swap elsewhere), other adapters spread over the other replicas."""
    router = lora_router()
    first = ask(router, "a")
    assert [ask(router, "a") for _ in range(4)] == [first] * 4
    assert ask(router, "b") != first or ask(router, "c") != first


def test_a_replica_keeps_only_its_last_max_loras_adapters() -> None:
    """After max_loras other adapters ran on a replica, the first one is no longer counted as
    loaded there (the engine evicted it): the router stops preferring it."""
    router = lora_router(max_loras=2)
    state = router.replica("10.0.0.1:1")
    assert state is not None
    assert state.view(100.0, 5.0, False).adapter_lru_at == -math.inf  # slots free
    for at, adapter in enumerate(("a", "b", "c")):
        state.note_adapter(adapter, 2, float(at))
    view = state.view(100.0, 5.0, False)
    assert view.adapters == {"b", "c"}
    assert view.adapter_lru_at == 1.0  # b's: the one a new adapter would evict
    state.note_adapter("b", 2, 3.0)  # used again: the most recent now
    state.note_adapter("d", 2, 4.0)
    view = state.view(100.0, 5.0, False)
    assert view.adapters == {"b", "d"}
    assert view.adapter_lru_at == 3.0


def test_an_engines_scraped_adapters_count_and_a_full_holder_spreads_the_adapter() -> None:
    """Another router's requests show in the scrape (vllm:lora_requests_info): that replica
    draws the adapter's requests; once its batch is full, the adapter spreads."""
    router = lora_router()
    holder = router.replica("10.0.0.2:1")
    assert holder is not None
    holder.metrics = EngineMetrics(running=1.0, adapters=frozenset({"e"}))
    holder.scraped_at = 100.0
    assert ask(router, "e") == "10.0.0.2:1"
    holder.in_flight = 8  # a full batch: no headroom
    assert ask(router, "e") != "10.0.0.2:1"


def test_an_adapter_nobody_holds_evicts_the_one_sent_longest_ago() -> None:
    """With every replica's slots taken, a new adapter goes where the adapter it evicts was
    last asked for longest ago, not where it would evict one just used."""
    router = lora_router(max_loras=1)
    for address, adapter, at in (("10.0.0.1:1", "a", 90.0), ("10.0.0.2:1", "b", 10.0),
                                 ("10.0.0.3:1", "c", 50.0)):  # fmt: skip
        state = router.replica(address)
        assert state is not None
        state.note_adapter(adapter, 1, at)
    assert ask(router, "d") == "10.0.0.2:1"
    assert ask(router, "b") != "10.0.0.2:1"  # b was evicted there: d replaced it


def test_a_large_group_finds_the_replicas_holding_an_adapter_among_its_candidates() -> None:
    """Of 200 replicas, the ones this router sent an adapter to are among the few a pick
    scores for another tenant's prompt naming it (beside that prompt's own home), so the
    adapter's requests keep going where it is loaded instead of loading it wherever each
    prompt alone would land."""
    router = large_kv_router(LARGE)
    holders = set()
    for user in range(6):
        # Completions without a shared first block: no replica holds any of the next one.
        prompt = f"{user} tenant's desk. " * 40
        route = router.decide(extract_features({"model": "sql", "prompt": prompt}, "completions"))
        assert route.request.candidates is not None
        assert len(route.request.candidates) < 30
        assert holders <= set(route.request.candidates)
        holders.add(route.replica.id)
    assert len(holders) <= 2  # the adapter stays where it went first (and its home)


def test_a_replica_that_lacks_an_adapter_is_no_holder_of_it_until_the_mark_ends() -> None:
    """Dynamic LoRA: a replica this router sent "a" to, restarted, answers 404 for it until the
    operator loads it again. From that answer it is no holder of "a" and scores last for it:
    requests for "a" go elsewhere and stay there. The mark is for "a" alone, and after
    ``ADAPTER_MISSING_S`` the replica is only one among others for "a" again."""
    router = lora_router()
    now = [100.0]
    router.clock = lambda: now[0]
    lacking = router.replica(ask(router, "a"))
    assert lacking is not None
    router.record_adapter_missing(lacking, "a")
    elsewhere = {ask(router, "a") for _ in range(4)}
    assert len(elsewhere) == 1
    assert lacking.id not in elsewhere
    (view,) = [v for v in router.picks.views("t", "unified", now[0]) if v.id == lacking.id]
    assert view.missing_adapters == {"a"}
    now[0] += ADAPTER_MISSING_S
    (view,) = [v for v in router.picks.views("t", "unified", now[0]) if v.id == lacking.id]
    assert view.missing_adapters == frozenset()
    assert "a" not in view.adapters  # what was sent there before the 404 no longer counts


def test_an_answer_for_the_adapter_ends_the_mark() -> None:
    """A replica marked as lacking "a" that then answers a request for it (the operator
    loaded it) is held to have it again at once, not after ``ADAPTER_MISSING_S``."""
    router = lora_router()
    state = router.replica("10.0.0.1:1")
    assert state is not None
    router.record_adapter_missing(state, "a")
    assert state.view(100.0, 5.0, False).missing_adapters == {"a"}
    router.record_adapter_served(state, "a")
    assert state.view(100.0, 5.0, False).missing_adapters == frozenset()


def test_a_retry_avoids_a_replica_known_to_lack_the_adapter_and_notes_where_it_went() -> None:
    """Three replicas; 10.0.0.2 held "a" (requests went there) and then answered it lacks it.
    Neither the decision nor the retry after the first replica picks it, though it is the
    only one with "a" among those this router sent; the retry's replica counts as holding
    "a" from then on, as a decision's does."""
    router = lora_router()
    restarted = router.replica("10.0.0.2:1")
    assert restarted is not None
    restarted.note_adapter("a", 2, 99.0)
    router.record_adapter_missing(restarted, "a")
    route = router.decide(extract_features({"model": "a", "prompt": "hi"}, "completions"))
    assert route.replica.id != restarted.id
    other = router.alternative(route, {route.replica.id})
    assert other is not None
    assert other.id not in (restarted.id, route.replica.id)
    assert "a" in other.view(100.0, 5.0, False).adapters
