"""Load: parsing engine /metrics, staleness, load scores, saturation and hard limits."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from fleetpilot.routing.policies.load import (
    EngineMetrics,
    LoadScorer,
    group_saturated,
    is_full,
    is_saturated,
    load_of,
    make_view,
    parse_engine_metrics,
)
from fleetpilot.routing.policies.types import PickRequest, ReplicaView

VLLM_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 3.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 2.0
vllm:num_requests_running{engine="0",model_name="qwen"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="qwen"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="qwen"} 0.7
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen"} 4.0
vllm:num_requests_waiting_other 99
"""


def test_parse_sums_ranks_and_averages_kv() -> None:
    """Data-parallel ranks: queues add up, KV usage is averaged."""
    m = parse_engine_metrics(VLLM_METRICS)
    assert m is not None
    assert (m.waiting, m.running) == (5.0, 7.0)
    assert m.kv_usage == pytest.approx(0.6)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only comments\n",
        "vllm:num_requests_waiting NaN\n",
        'vllm:num_requests_waiting{a="}"} banana\n',
        "garbage {{{ 1 2 3\n",
        "vllm:num_requests_waiting\n",
    ],
)
def test_parse_of_nothing_usable_is_none(text: str) -> None:
    """No usable gauge: None (the view then relies on in-flight counts)."""
    assert parse_engine_metrics(text) is None


def test_old_gpu_cache_name_and_no_labels() -> None:
    """vLLM < 0.10 named it gpu_cache_usage_perc; unlabelled samples parse too."""
    m = parse_engine_metrics("vllm:gpu_cache_usage_perc 0.25\nvllm:num_requests_waiting 1\n")
    assert m == EngineMetrics(waiting=1.0, kv_usage=0.25)


_GAUGE_NAMES = st.sampled_from(
    [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_requests_waiting_other",
    ]
)
_LABELS = st.sampled_from(["", '{engine="0"}', '{a="}"}', "{"]) | st.text(max_size=12)
_VALUES = (
    st.floats().map(repr) | st.sampled_from(["NaN", "+Inf", "-1", "1e400"]) | st.text(max_size=6)
)
_SAMPLE = st.builds(lambda n, lb, v: f"{n}{lb} {v}", _GAUGE_NAMES, _LABELS, _VALUES)
# Random text alone almost never starts a line with "vllm:", so most lines are near-samples.
_EXPOSITION = st.text(max_size=400) | st.lists(_SAMPLE | st.text(max_size=30), max_size=12).map(
    "\n".join
)


@given(_EXPOSITION)
@example("vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n")
@example('vllm:num_requests_running{engine="0"} -3\nvllm:num_requests_waiting +Inf\n')
@example("vllm:kv_cache_usage_perc 1.5\nvllm:gpu_cache_usage_perc 2\n")
def test_parse_never_crashes(text: str) -> None:
    """Whatever a replica serves on /metrics, parsing returns metrics or None, and metrics it
    returns are usable scores: no negative queue, KV usage a fraction (a NaN, negative or >1
    value leaking through would mis-rank replicas or poison the load score)."""
    m = parse_engine_metrics(text)
    assert m is None or isinstance(m, EngineMetrics)
    if m is not None:
        assert m.waiting >= 0.0
        assert m.running >= 0.0
        assert 0.0 <= m.kv_usage <= 1.0


def test_stale_metrics_are_ignored() -> None:
    """Scraped values older than the bound no longer count; in-flight still does."""
    m = EngineMetrics(waiting=9, running=1, kv_usage=0.9)
    fresh = make_view("a", 8, 2, m, scraped_at=100.0, now=101.0, stale_after_s=5.0)
    stale = make_view("a", 8, 2, m, scraped_at=100.0, now=106.0, stale_after_s=5.0)
    assert fresh.waiting == 9
    assert (stale.waiting, stale.kv_usage, stale.in_flight) == (0.0, 0.0, 2)


def test_load_orders_replicas_by_how_busy_they_are() -> None:
    """Idle < busy < queueing < queueing with a full KV cache."""
    idle = ReplicaView("a", 8)
    busy = ReplicaView("b", 8, in_flight=6)
    queueing = ReplicaView("c", 8, in_flight=8, waiting=4)
    full_kv = ReplicaView("d", 8, in_flight=8, waiting=5, kv_usage=1.0)
    loads = [load_of(v, 4.0) for v in (idle, busy, queueing, full_kv)]
    assert loads == sorted(loads)
    assert loads[0] == 0.0
    assert loads[-1] == pytest.approx(1.0)


@given(
    st.integers(0, 10_000), st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 10),
    st.integers(1, 1024),
)  # fmt: skip
def test_load_score_is_in_unit_interval(
    in_flight: int, waiting: float, running: float, kv: float, seqs: int
) -> None:
    """The load scorer returns [0, 1] for any state."""
    v = ReplicaView("a", seqs, in_flight, waiting, running, kv)
    (score,) = LoadScorer(4.0).score(PickRequest(), [v]).values()
    assert 0.0 <= score <= 1.0


def test_router_in_flight_counts_as_queue_past_the_batch_limit() -> None:
    """Without scraped data, in-flight beyond max_num_seqs is a queue."""
    v = ReplicaView("a", 4, in_flight=10)
    assert v.queued == 6
    assert is_saturated(v, 4.0)
    assert is_full(v, 6)
    assert not is_full(v, 7)


@pytest.mark.parametrize(
    ("views", "saturated"),
    [
        ([ReplicaView("a", 8), ReplicaView("b", 8)], False),
        ([ReplicaView("a", 8, waiting=10), ReplicaView("b", 8)], True),  # mean 5 > 4
        ([ReplicaView("a", 8, waiting=6), ReplicaView("b", 8)], False),  # mean 3 <= 4
        ([ReplicaView("a", 8, in_flight=8), ReplicaView("b", 8, running=8)], True),
        ([ReplicaView("a", 8, in_flight=8), ReplicaView("b", 8, running=7)], False),
        ([], True),
    ],
)
def test_group_saturation(views: list[ReplicaView], saturated: bool) -> None:
    """Saturated: mean queue per replica above the threshold, or every batch full."""
    assert group_saturated(views, 4.0) is saturated


def test_the_newest_lora_info_series_names_the_engines_adapters() -> None:
    """vLLM keeps a vllm:lora_requests_info series for every set of adapters it ever reported,
    its value the time it did: the newest one (not the first, not all) says which adapters the
    engine runs now, running and waiting alike; without the gauge, none."""
    text = "\n".join(
        [
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,legal",'
            'waiting_lora_adapters=""} 1.7000000005e+09',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="tax",'
            'waiting_lora_adapters="team/sql:v2"} 1.7000000009e+09',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
            'waiting_lora_adapters=""} 1.7000000001e+09',
            'vllm:num_requests_running{model_name="m"} 2',
        ]
    )
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.adapters == {"tax", "team/sql:v2"}
    assert metrics.running == 2
    plain = parse_engine_metrics('vllm:num_requests_running{model_name="m"} 2')
    assert plain is not None
    assert plain.adapters == frozenset()
    view = make_view("r", 4, 0, metrics, 10.0, 11.0, 5.0, adapters=frozenset({"sql"}))
    assert view.adapters == {"sql", "tax", "team/sql:v2"}
    stale = make_view("r", 4, 0, metrics, 10.0, 20.0, 5.0, adapters=frozenset({"sql"}))
    assert stale.adapters == {"sql"}  # a stale scrape's adapters do not count
