"""The benchmark tables in docs/, rendered from their results files.

A table in a page sits between two markers naming its renderer and results file::

    <!-- table: kv_offload bench/results/kv_offload.json -->
    ...rendered Markdown...
    <!-- /table -->

``python bench/tables.py`` rewrites every marked table from its file; ``--check`` exits 1
naming each one that disagrees (tests/bench/test_tables.py runs it), so a number in the docs
is always the one its results file holds, with the commit it was measured on. A rerun of a
benchmark is followed by ``python bench/tables.py``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"(<!-- table: (?P<renderer>[\w-]+) (?P<source>\S+) -->\n)(?P<body>.*?)(<!-- /table -->)",
    re.DOTALL,
)

Results = dict[str, Any]
Renderer = Callable[[Results], list[str]]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _share(value: float, present: bool = True) -> str:
    return f"{value:.3f}" if present else "-"


def caption(doc: Results, source: str) -> str:
    """Where the numbers come from: the file, the commit (a ``-dirty`` one said so), the date
    and machine when the file records them."""
    commit = str(doc.get("commit", "unknown"))
    short = commit[:7] + (" with uncommitted changes" if commit.endswith("-dirty") else "")
    parts = [f"`{source}`", f"commit {short}"]
    if "date" in doc:
        parts.append(str(doc["date"]))
    machine = doc.get("machine") or {}
    if machine.get("cpu"):
        parts.append(f"{machine['cpu']} x {machine.get('cpus', '?')}")
    elif machine.get("cpus"):
        parts.append(f"{machine['cpus']} CPUs")
    return "Source: " + ", ".join(parts) + "."


def kv_offload(doc: Results) -> list[str]:
    """bench/kv_offload.py's arms: hit shares by tier, TTFT p50 and p95 (range over rounds)."""
    lines = [
        "| req/s | arm | device | host | computed | TTFT p50 | TTFT p95 (range) | req/s done |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(doc["by_arm"], key=lambda r: r["rate"]):
        arm = row["arm"].replace("prodstack-prefix", "production-stack prefixaware")
        offload = row["arm"] != "no offload"
        low, high = row["ttft_p95_range_ms"] or (None, None)
        p95 = f"{_ms(row['ttft_p95_ms'])} ({low:.0f}-{high:.0f})" if low is not None else "-"
        if row["arm"] == "offload, tiered":
            arm, p95 = f"**{arm}**", f"**{p95}**"
        lines.append(
            f"| {row['rate']:g} | {arm} | {_share(row['device_hit_rate'])} | "
            f"{_share(row['host_hit_rate'], offload)} | {_share(row['computed_rate'])} | "
            f"{_ms(row['ttft_p50_ms'])} | {p95} | {row['throughput_rps']:.2f} |"
        )
    return lines


def kv_offload_simulator(doc: Results) -> list[str]:
    """The simulator's replay of each round: the offload gain (no offload over tiered) at p50
    and p95, measured and predicted."""
    lines = [
        "| req/s | seed | TTFT p95 measured (no offload / tiered) | simulated | gain p50 "
        "measured / simulated | gain p95 measured / simulated | p95 gain error |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in doc["simulator"]:
        measured = " / ".join(f"{v:.0f}" for v in p["measured_p95_ms"])
        simulated = " / ".join(f"{v:.0f}" for v in p["simulated_p95_ms"])
        lines.append(
            f"| {p['rate']:g} | {p['seed']} | {measured} ms | {simulated} ms | "
            f"{p['measured_p50_gain']:.2f}x / {p['simulated_p50_gain']:.2f}x | "
            f"{p['measured_gain']:.2f}x / {p['simulated_gain']:.2f}x | {p['gain_error']:+.0%} |"
        )
    return lines


RENDERERS: dict[str, Renderer] = {
    "kv_offload": kv_offload,
    "kv_offload_simulator": kv_offload_simulator,
}


def render(renderer: str, source: str) -> str:
    """The Markdown between a block's markers."""
    if renderer not in RENDERERS:
        raise KeyError(f"no renderer {renderer!r} (known: {', '.join(sorted(RENDERERS))})")
    doc = json.loads((ROOT / source).read_text())
    lines = [caption(doc, source), "", *RENDERERS[renderer](doc)]
    return "\n".join(lines) + "\n"


def rewrite(text: str) -> str:
    """``text`` with every marked table rendered afresh."""

    def block(match: re.Match[str]) -> str:
        body = render(match["renderer"], match["source"])
        return match.group(1) + body + match.group(5)

    return BLOCK.sub(block, text)


def stale(pages: list[Path]) -> list[str]:
    """``page: renderer source`` for each table that disagrees with its file."""
    out = []
    for page in pages:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            if match["body"] != render(match["renderer"], match["source"]):
                out.append(f"{page.relative_to(ROOT)}: {match['renderer']} {match['source']}")
    return out


def pages() -> list[Path]:
    return sorted([ROOT / "README.md", *DOCS.glob("*.md")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a table is stale")
    args = parser.parse_args()
    if args.check:
        found = stale(pages())
        for line in found:
            print(f"stale: {line} (run python bench/tables.py)", file=sys.stderr)
        sys.exit(1 if found else 0)
    for page in pages():
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
