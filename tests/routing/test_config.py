"""Loading and reloading the router config the operator writes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from fleetpilot.api import load_services
from fleetpilot.api.router_config import ROUTER_CONFIG_FILE, HostBlocks, RouterConfig
from fleetpilot.operator.plan_types import PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.router_objects import prefix_index_blocks, router_config
from fleetpilot.routing.config import ConfigError, ConfigWatcher, load_config, parse_config
from fleetpilot.routing.endpoints import StaticSource
from fleetpilot.routing.policies.kv_index import DEFAULT_MAX_BLOCKS
from fleetpilot.routing.policies.prefix import PrefillCostScorer
from fleetpilot.routing.router import Router
from tests.factories import make_service, make_tier
from tests.routing.support import make_config, tier

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_planners_configmaps_load(example: Path) -> None:
    """Every example's router ConfigMap, as the planner writes it, is a config the router
    loads, with its prefix index sized from the KV caches the planner computed (the default
    where it could size none)."""
    for service in load_services(example):
        (config_map,) = [
            o
            for o in plan(service, PlanOptions())
            if o["kind"] == "ConfigMap" and ROUTER_CONFIG_FILE in o.get("data", {})
        ]
        config = parse_config(config_map["data"][ROUTER_CONFIG_FILE])
        assert config.tiers
        sized = prefix_index_blocks(service)
        assert config.prefix_index_blocks == (sized if sized is not None else 32768)


def test_configs_written_before_the_tuning_fields_still_parse() -> None:
    """An older ConfigMap without connectTimeout, ejection, scrape or backpressure parses."""
    text = """
apiVersion: fleetpilot.dev/v1alpha1
kind: RouterConfig
service: chat
namespace: ml
tiers:
- name: small
  model: small-m
  upTo: 1.0
  mode: unified
  endpoints:
  - {role: unified, service: chat-small, selector: {a: b}, port: 8000, maxNumSeqs: 256}
"""
    config = parse_config(text)
    assert config.ejection.failures == 3
    assert config.tiers[0].endpoints[0].addresses == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "YAML syntax error at line 1, column 2"),
        ("- a\n", "a RouterConfig is a mapping"),
        ("service: x\n", "tiers"),
        ("service: x\nnamespace: y\ntiers: []\nbogus: 1\n", "bogus"),
        (
            "service: x\nnamespace: y\nfirstByteTimeout: 0s\ntiers: [{name: a, model: m, "
            "upTo: 1.0, mode: unified, endpoints: []}]\n",
            "firstByteTimeout must be positive",
        ),
        (
            "service: x\nnamespace: y\ntiers: [{name: a, model: m, upTo: 1.0, mode: unified, "
            "endpoints: [], firstByteTimeout: 0ms}]\n",
            "firstByteTimeout must be positive",
        ),
    ],
)
def test_bad_configs_name_the_problem(text: str, message: str) -> None:
    """A bad config file is an error naming the field, not a traceback."""
    with pytest.raises(ConfigError, match=message):
        parse_config(text, "router.yaml")


KV_INDEX_BASE = (
    "service: x\nnamespace: y\n"
    "tiers: [{name: a, model: m, upTo: 1.0, mode: unified, endpoints: []}]\n"
)


@pytest.mark.parametrize(
    ("kv_index", "message"),
    [
        ("{hostBlocks: gpu}", "kvIndex.hostBlocks: Input should be 'tiered', 'asDevice' or"),
        ("{hostHitCost: 1.5}", "kvIndex.hostHitCost: Input should be less than or equal to 1"),
        ("{hostHitCost: -0.1}", "kvIndex.hostHitCost: Input should be greater than or equal"),
        ("{maxBlocks: 0}", "kvIndex.maxBlocks: Input should be greater than or equal to 1"),
        ("{hostHitcost: 0.1}", "kvIndex.hostHitcost: Extra inputs are not permitted"),
    ],
)
def test_bad_kv_index_settings_name_the_field(kv_index: str, message: str) -> None:
    """kvIndex's host-tier reading, host hit cost (a fraction of a prefill, 0..1) and bound
    are checked when the config loads, each refusal naming its field."""
    with pytest.raises(ConfigError, match=message):
        parse_config(KV_INDEX_BASE + f"kvIndex: {kv_index}\n", "router.yaml")


def test_kv_index_settings_default_to_the_tiered_reading_and_reach_the_router() -> None:
    """Unset, host blocks are tiered at 0.1 of a prefill and the index keeps its own bound; set,
    the router's index and its prefill-cost scorer follow the config, a reload included."""
    config = parse_config(KV_INDEX_BASE)
    assert (config.kv_index.host_blocks, config.kv_index.host_hit_cost) == (HostBlocks.TIERED, 0.1)
    router = Router(config, StaticSource(config))
    assert router.kv_index.max_blocks == DEFAULT_MAX_BLOCKS
    scorer = router.affinity_scorers()[0].scorer
    assert isinstance(scorer, PrefillCostScorer)
    assert scorer.host_hit_cost == 0.1
    tuned = parse_config(
        KV_INDEX_BASE + "kvIndex: {hostBlocks: asDevice, hostHitCost: 0.25, maxBlocks: 1000}\n"
    )
    router.apply_config(tuned)
    assert router.kv_index.host_blocks is HostBlocks.AS_DEVICE
    assert router.kv_index.max_blocks == 1000
    scorer = router.affinity_scorers()[0].scorer
    assert isinstance(scorer, PrefillCostScorer)
    assert scorer.host_hit_cost == 0.25
    router.apply_config(config)
    assert router.kv_index.host_blocks is HostBlocks.TIERED
    assert router.kv_index.max_blocks == DEFAULT_MAX_BLOCKS


def test_missing_file(tmp_path: Path) -> None:
    """An absent config file is a ConfigError with the system's reason, not a traceback."""
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "absent.yaml")


def test_watcher_applies_valid_changes_and_refuses_invalid_ones(tmp_path: Path) -> None:
    """Same content: nothing; new valid content: applied; invalid: refused and counted, the
    next valid one applied again; a file that disappears is counted once, not per poll."""
    path = tmp_path / ROUTER_CONFIG_FILE
    path.write_text(yaml.safe_dump(make_config([tier("a", 1.0)]).to_wire()))
    applied: list[RouterConfig] = []
    results: list[str] = []
    watcher = ConfigWatcher(path, applied.append, on_result=results.append)
    assert not watcher.check()
    path.write_text(yaml.safe_dump(make_config([tier("b", 1.0)]).to_wire()))
    assert watcher.check()
    assert applied[-1].tiers[0].name == "b"
    path.write_text("service: [")
    assert not watcher.check()
    path.unlink()
    assert not watcher.check()
    assert not watcher.check()
    path.write_text(yaml.safe_dump(make_config([tier("c", 1.0)]).to_wire()))
    assert watcher.check()
    assert results == ["applied", "invalid", "unreadable", "applied"]


@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        ({"ttftP95": "800ms"}, timedelta(milliseconds=3200)),  # 4 x ttftP95
        ({"ttftP95": "100ms"}, timedelta(seconds=2)),  # the floor
        ({"tpotP95": "50ms"}, None),  # no TTFT SLO: the config-wide default applies
    ],
)
def test_the_planner_derives_each_tiers_first_byte_budget_from_its_ttft_slo(
    slo: dict[str, str], expected: timedelta | None
) -> None:
    """A tier's firstByteTimeout is max(2s, 4 x ttftP95), written per tier; without a TTFT
    SLO the tier has none and the router uses firstByteTimeout (5s)."""
    service = make_service(tiers=[make_tier("small", autoscaling={"slo": slo})])
    config = router_config(service)
    assert config.tiers[0].first_byte_timeout == expected
    parsed = parse_config(yaml.safe_dump(config.to_wire()))
    budget = expected or timedelta(seconds=5)
    router = Router(parsed, StaticSource(parsed))
    assert router.first_byte_timeout_s(parsed.tiers[0]) == budget.total_seconds()
