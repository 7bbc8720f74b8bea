"""Every benchmark table marked in docs/ is the one its results file renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tables

# Copies of results files as they were when the rows below were checked by hand: a rerun
# changes bench/results/, not what the renderers must make of these.
FROZEN = Path(__file__).resolve().parent / "frozen"


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> Path:
    """The renderers read the frozen results files."""
    monkeypatch.setattr(tables, "ROOT", FROZEN)
    return FROZEN


def test_no_table_in_the_docs_is_stale() -> None:
    assert tables.stale(tables.pages()) == [], "run: python bench/tables.py"


def test_the_docs_mark_tables() -> None:
    marked = [m for p in tables.pages() for m in tables.BLOCK.finditer(p.read_text())]
    assert len(marked) >= 5
    for match in marked:
        assert match["renderer"] in {*tables.RENDERERS, *tables.MULTI_RENDERERS}
        for source in match["source"].split(","):
            assert (tables.ROOT / source).is_file(), source


def test_a_changed_number_is_caught_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "r.json"
    doc = json.loads((FROZEN / "bench/results/kv_offload_hot_tenant.json").read_text())
    source.write_text(json.dumps(doc))
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- table: kv_offload r.json -->\n<!-- /table -->\nafter\n")
    assert tables.stale([page]) == ["page.md: kv_offload r.json"]
    page.write_text(tables.rewrite(page.read_text()))
    assert tables.stale([page]) == []
    text = page.read_text()
    assert text.startswith(
        "before\n<!-- table: kv_offload r.json -->\nSource: `r.json`, commit 55d075f"
    )
    assert text.endswith("<!-- /table -->\nafter\n")
    assert (
        "| 6 | **offload, tiered** | 0.651 | 0.257 | 0.092 | 25 ms | **49 ms (47-52)** | 5.61 |"
        in text
    )
    doc["by_arm"][1]["ttft_p95_ms"] = 61.0
    source.write_text(json.dumps(doc))
    assert tables.stale([page]) == ["page.md: kv_offload r.json"]


def test_caption_names_date_and_machine_when_recorded() -> None:
    doc = {
        "commit": "0123456789abcdef",
        "date": "2026-12-06",
        "machine": {"cpu": "Xeon", "cpus": 2},
    }
    assert (
        tables.caption(doc, "x.json") == "Source: `x.json`, commit 0123456, 2026-12-06, Xeon x 2."
    )


def test_caption_says_when_the_numbers_are_from_a_quick_run() -> None:
    doc = {"commit": "0123456789abcdef", "run_all": {"mode": "quick", "command": "x"}}
    assert tables.caption(doc, "x.json").endswith(
        "commit 0123456, a quick run (`make bench-quick`: fewer rounds, shorter runs)."
    )
    doc["run_all"]["mode"] = "full"
    assert tables.caption(doc, "x.json") == "Source: `x.json`, commit 0123456."


def test_a_what_if_is_captioned_with_the_commit_it_was_measured_on() -> None:
    doc = {
        "commit": "bbbbbbbbbb",
        "run_all": {"mode": "quick"},
        "machine": {"cpus": 2},
        "measured": {"prefix": {"commit": "bbbbbbbbbb", "date": "2026-12-07"},
                     "candidates": {"commit": "aaaaaaaaaa", "date": "2026-12-04"}},
    }  # fmt: skip
    assert tables.caption(tables.part_view(doc, "prefix"), "w.json") == (
        "Source: `w.json`, commit bbbbbbb, 2026-12-07, 2 CPUs, a quick run "
        "(`make bench-quick`: fewer rounds, shorter runs)."
    )
    assert tables.caption(tables.part_view(doc, "candidates"), "w.json") == (
        "Source: `w.json`, commit aaaaaaa, 2026-12-04, 2 CPUs."
    )
    assert tables.caption(tables.part_view(doc, "hot-tenants"), "w.json") == (
        "Source: `w.json`, commit not recorded, 2 CPUs."  # a part from before parts were dated
    )


def test_an_unknown_renderer_is_named() -> None:
    with pytest.raises(KeyError, match="no renderer 'nope'"):
        tables.render("nope", "bench/results/kv_offload.json")


def test_a_table_from_several_files_names_each_and_catches_a_change_in_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["engine_prefix_cache", "engine_decode_batch"]
    for name in names:
        doc = json.loads((FROZEN / f"bench/results/{name}.json").read_text())
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- table: engine engine_prefix_cache.json,engine_decode_batch.json -->\n"
        "<!-- /table -->\n"
    )
    page.write_text(tables.rewrite(page.read_text()))
    text = page.read_text()
    assert "Source: `engine_prefix_cache.json`, commit not recorded. " in text
    assert "Source: `engine_decode_batch.json`, commit not recorded." in text
    assert "| caching off: TTFT p50 198 ms | caching on: TTFT p50 22 ms, hit rate 86% |" in text
    assert "| batch 1: 346 tok/s | batch 64: 4,304 tok/s | 12.4x |" in text
    assert tables.stale([page]) == []
    doc = json.loads((tmp_path / "engine_decode_batch.json").read_text())
    doc["runs"][-1]["tokens_per_s"] = 5000.0
    (tmp_path / "engine_decode_batch.json").write_text(json.dumps(doc))
    assert tables.stale([page]) == [
        "page.md: engine engine_prefix_cache.json,engine_decode_batch.json"
    ]


def test_a_one_file_renderer_refuses_several_files() -> None:
    with pytest.raises(ValueError, match="reads one results file"):
        tables.render("kv_offload", "bench/results/kv_offload.json,bench/results/kv_offload.json")


@pytest.mark.parametrize(
    ("renderer", "source", "row"),
    [
        (
            "gateway_pickers",
            "gateway_pickers.json",
            "| GIE default x1 | 0.855 / 74 (72-76) | 0.846 / 102 (90-113) | 0.750 / 162 (144-180) "
            "| 0.669 / 681 (532-830) | 0 |",
        ),
        (
            "gateway_pickers_cpu",
            "gateway_pickers.json",
            "| fleetpilot EPP x2 | 14.4 | 10.6 | 10.7 | 9.0 | 125 MiB a replica |",
        ),
        (
            "router_cpu",
            "router_cpu_gie.json",
            "| fleetpilot, EPP | 2.40 ms (2.39-2.40) | 2.46 ms (2.43-2.46) | 300.2 ms | 307.8 ms "
            "| 16% | 18-19% |",
        ),
        (
            "router_auth_overhead",
            "router_auth_overhead.json",
            "| API keys | +0.052 ms | +0.079 ms | +0.052 ms | 0 |",
        ),
        (
            "router_noisy_neighbour",
            "router_noisy_neighbour.json",
            "| fair queue, headroom 2 | 100% | 43 ms | 802 ms | 4.45x | 11 of 80 | 31% |",
        ),
        (
            "router_stream_failover",
            "router_stream_failover.json",
            "| SIGKILL | 0 | 180 | 12 | 58% (5 error events) | - |",
        ),
        (
            "router_slow_bodies",
            "router_slow_bodies.json",
            "| this router, round 3 | 6.2 -> 6.3 ms | 8.0 -> 15.8 ms (1.98x) | 0 of 11,466 "
            "| 10.2 ms |",
        ),
        (
            "simulate_validation",
            "simulate_validation.json",
            "| mixed | 4 | 13.6 / 10.4 ms (-23%) | 57.5 / 47.4 ms (-18%) | 0.195 / 0.199 "
            "| 24.1 / 21.4 ms (-11%) | 15.1 / 15.8 ms (+5%) | - |",
        ),
        (
            "simulate_speed",
            "simulate_speed.json",
            "| 1,000 | 2,000 | candidates | 3,214 | 311 us | 1.61 | 0.897 |",
        ),
        (
            "autoscale_ramp",
            "autoscale_ramp.json",
            "| predictive | 0 | 92% | 946 ms | 83% | 1,110 ms | 99% | 3.4 (3) | 1,216 | 0 |",
        ),
        (
            "operator_scale",
            "operator_scale.json",
            "| 1,000 | 9335351 | 58.9 s (41.9 s) | 182 MB | 26,046 (20,581) "
            "| 28.1 / 63.4 (10.7 / 45.6) | 77.9 s | 0 | 405 MB |",
        ),
        (
            "router_overhead",
            "router_overhead.json",
            "| streamed | 1 | +0.472 ms | +0.637 ms | +0.432 ms | 1,686 | 0 |",
        ),
        (
            "compare_trees",
            "compare_router_overhead.json",
            "| streamed, first chunk | 1 | 0.391 [0.330-0.434] | 0.404 [0.403-0.463] "
            "| - | - | - | - |",
        ),
        (
            "compare_trees",
            "compare_router_kv_events.json",
            "| multi-tenant, high rate | events x2 | 0.812 [0.810-0.814] | 0.802 [0.794-0.810] "
            "| 13.9 [13.3-14.5] | 14.7 [13.9-15.5] | 72.4 [71.1-73.7] | 69.6 [68.5-70.7] |",
        ),
        (
            "router_kv_events",
            "router_kv_events_rounds.json",
            "| shared-prompt | guessed x1 | 3 | 0.826 | 51 ms | 241 ms (218-795) | 0 |",
        ),
        (
            "router_tokenize",
            "router_tokenize.json",
            "| bpe32k | cold at the cap | 44.0 ms | 47.8 ms | 131,035 | 32,368 |",
        ),
        (
            "router_loop_stall",
            "router_loop_stall.json",
            "| 2 | off-loop | 18 ms | 27 ms | 45 ms | 108 ms |",
        ),
        (
            "router_complexity",
            "router_complexity.json",
            "| burst | 597 | 89.3 | 34% | 34% | 0% | 17 / 666 ms | - | 397 |",
        ),
        (
            "whole_loop",
            "whole_loop_busy.json",
            "| scale to zero and back: the large tier given `replicas.min` 0 and a 4 s scale-down "
            "window, idle; then one streamed chat for it | zero pods 15.6 s after the apply; the "
            "chat held by the router, seen by the autoscaler as the router's pending request "
            "through Prometheus, scaled 0 -> 1: **first token 7.1 s after it was sent** |",
        ),
        (
            "whatif_complexity",
            "simulate_whatifs.json",
            "| two tiers, complexity routing | 180,307 | 453 | 17.8 | $45 | 0.986 | 8 ms | 81 ms "
            "| 0.148 | small 1, large 25 |",
        ),
        (
            "whatif_prefix",
            "simulate_whatifs.json",
            "| round-robin | 0.555 | 20 ms | 82 ms |",
        ),
        (
            "whatif_candidates",
            "simulate_whatifs.json",
            "| 200 tenants, Zipf 1.2, 5,000 req/s | 2 | 0.960 / 42 | 0.959 / 406 | 0.958 / 2,824 |",
        ),
        (
            "whatif_hot_tenants",
            "simulate_whatifs.json",
            "| 8, 300, 1,000, 0.8 | 7 | 574.2 (0.860) | 743.0 (0.826) | 931.7 (0.865) "
            "| 4,755.5 (0.438) |",
        ),
    ],
)
def test_each_renderer_reads_its_file(renderer: str, source: str, row: str, frozen: Path) -> None:
    """A row of each table, checked by hand against its results file (as frozen)."""
    assert row in tables.render(renderer, f"bench/results/{source}").split("\n")


def test_an_indented_marker_renders_an_indented_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table inside a list item keeps the item's indentation, blank lines left blank."""
    doc = json.loads((FROZEN / "bench/results/simulate_whatifs.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps(doc))
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("- item\n\n  <!-- table: whatif_prefix w.json -->\n  <!-- /table -->\n")
    assert tables.stale([page]) == ["page.md: whatif_prefix w.json"]
    page.write_text(tables.rewrite(page.read_text()))
    assert tables.stale([page]) == []
    lines = page.read_text().split("\n")
    assert lines[2:6] == [
        "  <!-- table: whatif_prefix w.json -->",
        "  Source: `w.json`, commit not recorded, 2 CPUs.",
        "",
        "  | routing | hit rate | TTFT p50 | TTFT p95 |",
    ]
    assert lines[-2] == "  <!-- /table -->"


@pytest.mark.parametrize(
    ("renderer", "sources", "row"),
    [
        (
            "router_affinity",
            ["router_affinity", "router_affinity_run2"],
            "| fleetpilot | 0.782 / 0.793 | 54 / 63 ms | 308 / 378 ms | 35.3 / 31.3 |",
        ),
        (
            "router_prefix_workloads",
            ["router_prefix_workloads", "router_prefix_workloads_seed11"],
            "| shared-prompt | headroom | - / 6.3 | - / 0.809 | - / 40 ms | - / 202 ms |",
        ),
        (
            "router_pd_local",
            ["router_pd_local", "router_pd_local_seed5"],
            "| shared prompt, short follow-ups | local <= 64 | 64 / 64 | 25% / 25% | 48 / 48 "
            "| 164 / 108 ms | 496 / 431 ms | 0.842 / 0.842 |",
        ),
    ],
)
def test_each_several_file_renderer_reads_its_files(
    renderer: str, sources: list[str], row: str, frozen: Path
) -> None:
    """A row of each table from several files (a value per file), checked by hand."""
    source = ",".join(f"bench/results/{s}.json" for s in sources)
    assert row in tables.render(renderer, source).split("\n")


def test_a_comparison_is_captioned_with_both_commits() -> None:
    doc = {"base": "1e5d35846265", "head": "9335351a1f85", "machine": {"cpus": 2}}
    assert tables.caption(doc, "c.json") == (
        "Source: `c.json`, commits 1e5d358 (before) and 9335351 (after), 2 CPUs."
    )


def test_the_lora_table_has_a_row_per_arm_and_a_value_per_seed(frozen: Path) -> None:
    """Arms in the docs' order (not the file's), seeds ascending, each column its own counter;
    checked by hand against the frozen file (which records no commit)."""
    assert tables.render("router_lora", "bench/results/router_lora.json").split("\n")[:10] == [
        "Source: `bench/results/router_lora.json`, commit not recorded, 2 CPUs.",
        "",
        "| policy | swaps per 1,000 requests (seed 0 / 1) | reads from disk per 1,000 | TTFT p50 "
        "| TTFT p95 |",
        "|---|---|---|---|---|",
        "| **fleetpilot** | **45 / 52** | 42 / 43 | 22 / 20 ms | 168 / 143 ms |",
        "| fleetpilot, scores only | 130 / 126 | 121 / 124 | 21 / 21 ms | 165 / 147 ms |",
        "| fleetpilot without adapter affinity | 558 / 529 | 558 / 529 | 22 / 31 ms "
        "| 150 / 203 ms |",
        "| consistent hashing of the adapter, bounded loads (c = 1.25) | 211 / 267 | 208 / 267 "
        "| 23 / 23 ms | 182 / 161 ms |",
        "| round-robin | 575 / 532 | 575 / 532 | 25 / 24 ms | 195 / 189 ms |",
        "| random | 535 / 514 | 532 / 514 | 25 / 22 ms | 181 / 160 ms |",
    ]


def test_the_lora_skew_table_has_a_column_per_arm_and_two_rows_per_file(frozen: Path) -> None:
    source = "bench/results/router_lora_skew05.json,bench/results/router_lora_skew15.json"
    assert tables.render("router_lora_skews", source).split("\n")[:9] == [
        "Source: `bench/results/router_lora_skew05.json`, commit not recorded, 2 CPUs. "
        "Source: `bench/results/router_lora_skew15.json`, commit not recorded, 2 CPUs.",
        "",
        "| Zipf skew (seed) | fleetpilot | scores only | adapter hashing | round-robin | random |",
        "|---|---|---|---|---|---|",
        "| 0.5, flatter (2): swaps per 1,000 | **44** | 182 | 444 | 697 | 678 |",
        "| 0.5: TTFT p95 | 147 ms | 153 ms | 167 ms | 167 ms | 178 ms |",
        "| 1.5, steeper (3): swaps per 1,000 | **54** | 78 | 162 | 326 | 305 |",
        "| 1.5: TTFT p95 | 164 ms | 161 ms | 150 ms | 167 ms | 140 ms |",
        "",
    ]


def _lora_row(arm: str, seed: int, swaps: float) -> dict[str, object]:
    return {
        "arm": arm,
        "seed": seed,
        "activations_per_1k": swaps,
        "loads_per_1k": swaps - 1,
        "ttft_p50_ms": 20.0 + seed,
        "ttft_p95_ms": 100.0 + seed,
    }


def test_the_lora_tables_mark_what_a_run_lacks() -> None:
    """A seed an arm missed is "-" in its place, seeds sort whatever order the rows came in, an
    arm the docs do not name keeps its own name after the known ones, and a file without an
    arm another file has shows "-" for it."""
    doc = {
        "args": {"skew": 1.0},
        "rows": [
            _lora_row("mystery", 7, 3.0),
            _lora_row("random", 7, 500.0),
            _lora_row("fleetpilot", 7, 40.0),
            _lora_row("fleetpilot", 2, 60.0),
        ],
    }
    assert tables.router_lora(doc) == [
        "| policy | swaps per 1,000 requests (seed 2 / 7) | reads from disk per 1,000 | TTFT p50 "
        "| TTFT p95 |",
        "|---|---|---|---|---|",
        "| **fleetpilot** | **60 / 40** | 59 / 39 | 22 / 27 ms | 102 / 107 ms |",
        "| random | - / 500 | - / 499 | - / 27 ms | - / 107 ms |",
        "| mystery | - / 3 | - / 2 | - / 27 ms | - / 107 ms |",
    ]
    steep = {"args": {"skew": 2.0}, "rows": [_lora_row("random", 4, 300.0)]}
    assert tables.router_lora_skews([doc, steep])[4:] == [
        "| 2, steeper (4): swaps per 1,000 | - | 300 | - |",
        "| 2: TTFT p95 | - | 104 ms | - |",
    ]
    assert tables.router_lora_skews([doc, steep])[:3] == [
        "| Zipf skew (seed) | fleetpilot | random | mystery |",
        "|---|---|---|---|",
        "| 1 (2 / 7): swaps per 1,000 | **60 / 40** | - / 500 | - / 3 |",
    ]
