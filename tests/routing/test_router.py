"""The router's decisions over replica state, without HTTP: tier by score and capacity,
staleness of scraped data, P/D picks, state kept across endpoint changes."""

from __future__ import annotations

import random

import pytest

from fleetpilot.api.router_config import EndpointGroup, RouterTier
from fleetpilot.routing.discovery import StaticSource
from fleetpilot.routing.errors import OverloadedError, UnavailableError
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.policies.load import EngineMetrics
from fleetpilot.routing.router import Router
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
