"""Every benchmark table marked in docs/ is the one its results file renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tables


def test_no_table_in_the_docs_is_stale() -> None:
    assert tables.stale(tables.pages()) == [], "run: python bench/tables.py"


def test_the_docs_mark_tables() -> None:
    marked = [m for p in tables.pages() for m in tables.BLOCK.finditer(p.read_text())]
    assert len(marked) >= 5
    for match in marked:
        assert match["renderer"] in tables.RENDERERS
        assert (tables.ROOT / match["source"]).is_file(), match["source"]


def test_a_changed_number_is_caught_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "r.json"
    doc = json.loads((tables.ROOT / "bench/results/kv_offload_hot_tenant.json").read_text())
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


def test_an_unknown_renderer_is_named() -> None:
    with pytest.raises(KeyError, match="no renderer 'nope'"):
        tables.render("nope", "bench/results/kv_offload.json")
