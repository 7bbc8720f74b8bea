"""Percentiles, the summary of known records, the route header, the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetpilot.loadgen.report import (
    first_errors,
    format_table,
    matplotlib_available,
    percentile,
    summarize,
    write_plot,
)
from fleetpilot.loadgen.runner import RequestRecord, Route, parse_route


def test_percentile_matches_linear_interpolation() -> None:
    """Percentiles interpolate like numpy's default (so reported p95s match other tools), whatever
    the input order; none for no data."""
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1
    assert percentile(values, 100) == 100
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    assert percentile([10.0, 0.0], 50) == 5.0  # order of input does not matter
    with pytest.raises(ValueError, match="outside"):
        percentile(values, 101)


def test_parse_route_header() -> None:
    """The router's x-fleetpilot-route header parses into tier, replica, prefix match and reason; a
    missing or garbled header is an empty route, not an error."""
    route = parse_route("tier=small; replica=small-0; prefix-match=0.75; reason=prefix affinity")
    assert route == Route("small", "small-0", 0.75, "prefix affinity")
    extra = parse_route("tier=large;replica=l-1;prefix-match=x;reason=spill;spilled-from=small")
    assert extra == Route("large", "l-1", None, "spill")
    assert parse_route(None) == Route()
    assert parse_route("") == Route()
    assert parse_route("garbage") == Route()


def test_parse_route_header_kv_blocks_by_tier() -> None:
    """A route the engines' KV events judged carries the prompt's KV blocks by tier (device
    cache, host memory, computed): they parse into counts; a malformed or partial one is
    none, and the rest of the route still parses."""
    header = (
        "tier=small; prefix-match=0.67; prefix-source=events; "
        "kv-blocks=device:12,host:4,computed:8; reason=complexity"
    )
    route = parse_route(header)
    assert route == Route("small", None, 0.67, "complexity", (12, 4, 8))
    assert parse_route(header.replace("host:4,", "")).kv_blocks is None
    assert parse_route(header.replace("host:4", "host:x")) == Route(
        "small", None, 0.67, "complexity"
    )


def ok(i: int, ttft: float, tpot: float, e2e: float, tier: str | None, **kw: int) -> RequestRecord:
    return RequestRecord(
        index=i,
        kind="chat",
        start_s=float(i),
        timestamp=1000.0 + i,
        end_s=i + e2e,
        status=200,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        prompt_tokens=kw.get("prompt", 100),
        completion_tokens=kw.get("completion", 10),
        cached_tokens=kw.get("cached", 0),
        route=Route(tier=tier),
    )


def test_summary_of_known_records() -> None:
    """Hand-computed summary of known records: errors by kind, latency percentiles over successes
    only, throughput, prefix-hit rate and tier shares, and the printed table."""
    records = [
        ok(0, 0.1, 0.01, 0.2, "small", cached=0),
        ok(1, 0.2, 0.02, 0.4, "small", cached=50),
        ok(2, 0.3, 0.03, 0.6, "small", cached=100),
        ok(3, 0.4, 0.04, 0.8, "large", cached=50, prompt=200, completion=30),
        RequestRecord(4, "chat", 4.0, 1004.0, status=503, error="HTTP 503", detail="busy"),
        RequestRecord(5, "chat", 5.0, 1005.0, status=503, error="HTTP 503"),
        RequestRecord(6, "chat", 6.0, 1006.0, error="connect", detail="refused"),
    ]
    s = summarize(records, elapsed_s=2.0)
    assert s.requests == 7
    assert s.succeeded == 4
    assert s.errors == {"HTTP 503": 2, "connect": 1}
    assert s.ttft_s["p50"] == pytest.approx(0.25)
    assert s.ttft_s["p95"] == pytest.approx(0.385)
    assert s.tpot_s["p99"] == pytest.approx(0.0397)
    assert s.e2e_s == {"p50": pytest.approx(0.5), "p95": pytest.approx(0.77)}
    assert s.throughput_rps == pytest.approx(2.0)
    assert s.output_tokens_per_s == pytest.approx(30.0)  # (10+10+10+30) / 2 s
    assert s.prompt_tokens == 500
    assert s.cached_tokens == 200
    assert s.prefix_hit_rate == pytest.approx(0.4)
    assert s.tier_shares == {"large": 0.25, "small": 0.75}
    assert first_errors(records) == {"HTTP 503": "busy", "connect": "refused"}

    table = format_table(s)
    assert "7 (4 ok) in 2.0 s" in table
    assert "HTTP 503: 2, connect: 1" in table
    assert "p50    250.0" in table
    assert "2.00 req/s, 30.0 tok/s" in table
    assert "40.0% (200/500 prompt tokens)" in table
    assert "large 25%, small 75%" in table


def test_summary_with_nothing_answered() -> None:
    """A run where nothing succeeded still summarizes and prints (no percentile of nothing, no
    division by zero)."""
    s = summarize([RequestRecord(0, "x", 0.0, 0.0, error="timeout")], elapsed_s=0.0)
    assert s.succeeded == 0
    assert s.ttft_s == {"p50": None, "p95": None, "p99": None}
    assert s.prefix_hit_rate is None
    assert s.throughput_rps == 0.0
    assert s.tier_shares == {}
    table = format_table(s)
    assert "timeout: 1" in table
    assert "no x-fleetpilot-route header" in table


def test_plot_is_a_png_of_latency_and_replicas(tmp_path: Path) -> None:
    """A real matplotlib render (Agg): the file is a PNG with two panels' worth of pixels."""
    assert matplotlib_available()
    records = [
        ok(0, 0.1, 0.01, 0.2, "small"),
        ok(7, 0.1, 0.01, 0.2, "large"),
        RequestRecord(3, "chat", 3.0, 1003.0, error="timeout"),
    ]
    records[0].route = Route("small", "small-0")
    records[1].route = Route("large", "large-1")
    path = tmp_path / "p.png"
    write_plot(path, records)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1000, 600)  # figsize 10x6 at 100 dpi
