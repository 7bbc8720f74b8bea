"""A second KV tier at the router (issue 46): decisions over an index whose engines hold blocks
on the device and in host memory, the route header's blocks by tier, the metrics and the
counts of events the index cannot key."""

from __future__ import annotations

import random

import pytest

from fleetpilot.api.router_config import EndpointGroup, HostBlocks, RouterTier
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from fleetpilot.loadgen.runner import parse_route
from fleetpilot.routing.endpoints import StaticSource
from fleetpilot.routing.features import extract_features
from fleetpilot.routing.kv_events_client import KVEventsClient
from fleetpilot.routing.metrics import RouterMetrics
from fleetpilot.routing.policies.kv_index import KVIndex, chain_keys
from fleetpilot.routing.router import Router
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.routing.support import make_config

BS = 16
DEVICE, HOST, COLD = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
TOKENIZER = RequestTokenizer.from_dir(REFERENCE_TOKENIZER)
CHAT = [
    {"role": "system", "content": "You are the fleet's support desk. " * 12},
    {"role": "user", "content": "where is my order?"},
]
FEATURES = extract_features({"messages": CHAT}, "chat")
TOKENS = TOKENIZER.token_ids("chat", {"messages": CHAT})
FULL = len(TOKENS) // BS  # the prompt's full blocks


def router_over(host_blocks: HostBlocks = HostBlocks.TIERED, **kv_index: object) -> Router:
    """Three unified replicas publishing live KV events, the reference tokenizer, a clock that
    stands still (the tests move it)."""
    group = EndpointGroup(
        role="unified", service="s", selector={}, port=8000, max_num_seqs=8,
        addresses=[DEVICE, HOST, COLD], kv_events_port=5557, kv_replay_port=5559,
    )  # fmt: skip
    config = make_config(
        [RouterTier(name="small", model="sm", up_to=1.0, mode="unified", endpoints=[group],
                    tokenizer=str(REFERENCE_TOKENIZER))],
        kvIndex={"hostBlocks": host_blocks.value, **kv_index},
    )  # fmt: skip
    now = [100.0]
    router = Router(
        config,
        StaticSource(config),
        rng=random.Random(0),
        clock=lambda: now[0],
        kv_live=lambda _stream: True,
    )
    router.tokenizers["small"] = TOKENIZER
    return router


def caches(router: Router, replica: str, medium: str, blocks: int = FULL) -> None:
    """The replica's engine reports the prompt's first ``blocks`` blocks stored on ``medium``."""
    hashes: list[BlockHash] = list(range(1000, 1000 + blocks))
    event = BlockStored(hashes, None, TOKENS[: blocks * BS], BS, None, medium, None)
    router.kv_index.apply(replica, [event])


def route_parts(router: Router) -> dict[str, str]:
    return dict(part.split("=", 1) for part in router.decide(FEATURES).header().split("; "))


def test_the_pick_prefers_a_device_hit_then_a_host_hit_then_any_replica() -> None:
    """One replica holds the prompt on its device, one in host memory only, one nothing: the
    device holder is chosen, its header saying so; without it the host holder is, its blocks
    counted as host (copied back, not computed)."""
    router = router_over()
    caches(router, DEVICE, MEDIUM_GPU)
    caches(router, HOST, MEDIUM_CPU)
    route = router.decide(FEATURES)
    assert route.replica.id == DEVICE
    assert route.kv_blocks == (FULL, 0, 0)
    assert f"kv-blocks=device:{FULL},host:0,computed:0" in route.header()
    device = router.replica(DEVICE)
    assert device is not None
    while not router.record_failure(device):  # ejected: a pick passes it over
        pass
    route = router.decide(FEATURES)
    assert route.replica.id == HOST
    assert route.kv_blocks == (0, FULL, 0)
    assert route.prefix_match == 1.0  # what the engine will not compute


def test_the_header_counts_device_host_and_computed_blocks_of_one_replica() -> None:
    """A replica whose device evicted the tail of a prompt it wrote through to host memory:
    the header says how many blocks come from each tier and how many are computed, and they
    add up to the prompt's full blocks; the loadgen's parser reads them back."""
    router = router_over()
    hashes: list[BlockHash] = list(range(1000, 1000 + FULL))
    router.kv_index.apply(
        HOST,
        [
            BlockStored(hashes, None, TOKENS[: FULL * BS], BS, None, MEDIUM_GPU, None),
            BlockStored(hashes[:-1], None, TOKENS[: (FULL - 1) * BS], BS, None, MEDIUM_CPU, None),
            BlockRemoved(hashes[2:], MEDIUM_GPU),
        ],
    )
    route = router.decide(FEATURES)
    assert route.replica.id == HOST
    header = route.header()
    assert f"kv-blocks=device:2,host:{FULL - 3},computed:1" in header
    assert parse_route(header).kv_blocks == (2, FULL - 3, 1)
    assert header.index("prefix-source=events") < header.index("kv-blocks") < header.index("reason")


def test_a_guessed_route_carries_no_blocks_by_tier() -> None:
    """Without a tokenizer the guessed index judges the prompt in text blocks and knows no
    media: the header has no kv-blocks, and keeps its other fields."""
    router = router_over()
    router.tokenizers.clear()
    route = router.decide(FEATURES)
    assert route.prefix_source == "guessed"
    assert route.kv_blocks is None
    assert "kv-blocks" not in route.header()
    assert set(dict(p.split("=", 1) for p in route.header().split("; "))) == {
        "tier",
        "prefix-match",
        "prefix-source",
        "reason",
        "score",
    }


def test_blocks_just_sent_to_a_host_holder_count_as_on_its_device() -> None:
    """The router sent the prompt to the host holder a moment ago: its engine copies the
    blocks back to its device, so until its events say otherwise they are device hits there."""
    router = router_over()
    caches(router, HOST, MEDIUM_CPU)
    first = router.decide(FEATURES)
    assert (first.replica.id, first.kv_blocks) == (HOST, (0, FULL, 0))
    again = router.decide(FEATURES)
    assert (again.replica.id, again.kv_blocks) == (HOST, (FULL, 0, 0))


def test_the_three_readings_of_host_blocks_pick_differently() -> None:
    """The device holder has half a block of others' prefill queued; the host holder is idle.
    Tiered: a full device hit behind half a block beats copying the prompt back (0.1 a block);
    medium-blind: both look like full device hits and the idle one wins; ignored: the host
    holder looks cold."""
    picks = {}
    for reading in HostBlocks:
        router = router_over(reading)
        caches(router, DEVICE, MEDIUM_GPU)
        caches(router, HOST, MEDIUM_CPU)
        router.replica_set.get(DEVICE).pending_prefill = 0.5  # type: ignore[union-attr]
        route = router.decide(FEATURES)
        picks[reading] = (route.replica.id, route.kv_blocks)
    assert picks[HostBlocks.TIERED] == (DEVICE, (FULL, 0, 0))
    assert picks[HostBlocks.AS_DEVICE] == (HOST, (FULL, 0, 0))
    assert picks[HostBlocks.IGNORED][0] == DEVICE


def test_the_host_hit_cost_from_the_config_moves_the_pick() -> None:
    """The config's hostHitCost reaches the scorer: at 0.1 the idle host holder beats the
    device holder behind two blocks of prefill; priced at a whole prefill it does not."""
    for cost, expected in ((0.1, HOST), (1.0, DEVICE)):
        router = router_over(hostHitCost=cost)
        caches(router, DEVICE, MEDIUM_GPU)
        caches(router, HOST, MEDIUM_CPU)
        router.replica_set.get(DEVICE).pending_prefill = 2.0  # type: ignore[union-attr]
        assert router.decide(FEATURES).replica.id == expected


def test_decisions_count_their_blocks_by_tier() -> None:
    """Each decision the events judged adds its blocks to the counter by source; a guessed
    one adds none."""
    metrics = RouterMetrics()
    metrics.count_decision("small", "complexity", 0.5, "events", (3, 2, 5))
    metrics.count_decision("small", "complexity", 0.8, "events", (8, 0, 2))
    metrics.count_decision("small", "complexity", 0.0, "guessed", None)

    def blocks(source: str) -> float | None:
        return metrics.registry.get_sample_value(
            "fleetpilot_router_predicted_kv_blocks_total", {"tier": "small", "source": source}
        )

    assert (blocks("device"), blocks("host"), blocks("computed")) == (11.0, 2.0, 7.0)


def test_placeholder_host_events_are_counted_per_replica() -> None:
    """An engine whose offloading connector publishes placeholders (no
    self_describing_kv_events) shows up in kv_event_errors, cause placeholder, its device
    events still indexed."""
    client = KVEventsClient(KVIndex(), RouterMetrics())
    client.ctx.destroy(linger=0)  # no subscription here: only the decoding and counting
    placeholder = BlockStored([7], None, [], 0, None, MEDIUM_CPU, None)
    device = BlockStored([7], None, TOKENS[:BS], BS, None, MEDIUM_GPU, None)
    client.apply("e", encode_batch(EventBatch(1.0, [device, placeholder, placeholder])))
    errors = client.metrics.registry.get_sample_value(
        "fleetpilot_router_kv_event_errors_total", {"replica": "e", "cause": "placeholder"}
    )
    assert errors == 2.0
    assert client.index.match_keys(chain_keys(TOKENS, BS)) == {"e": 1}


@pytest.mark.parametrize("reading", list(HostBlocks))
def test_a_config_reload_changes_the_reading_of_an_index_already_built(
    reading: HostBlocks,
) -> None:
    """The index keeps what the events said; the reading follows the reloaded config."""
    router = router_over()
    caches(router, HOST, MEDIUM_CPU)
    config = router.config.model_copy(
        update={"kv_index": router.config.kv_index.model_copy(update={"host_blocks": reading})}
    )
    router.apply_config(config)
    route = router.decide(FEATURES)
    expected = {
        HostBlocks.TIERED: (0, FULL, 0),
        HostBlocks.AS_DEVICE: (FULL, 0, 0),
        HostBlocks.IGNORED: (0, 0, FULL),
    }
    assert route.kv_blocks == expected[reading]
