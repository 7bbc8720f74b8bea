"""Summaries of a run: percentiles, the table on stdout, the JSON file and the optional plot."""

from __future__ import annotations

import importlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fleetpilot.loadgen.runner import RequestRecord, RunResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    return sorted_percentile(sorted(values), q)


def sorted_percentile(ordered: Sequence[float], q: float) -> float | None:
    """``percentile`` of values already in ascending order (no sort: several percentiles of
    millions of values sort once)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentiles(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    """``{"p50": ..., "p95": ...}`` of ``values`` for each of ``qs``."""
    ordered = sorted(values)
    return {f"p{q}": sorted_percentile(ordered, q) for q in qs}


@dataclass(frozen=True)
class LatencySummary:
    """What a run's clients saw, in the same fields whether the run was measured
    (``fleetpilot bench``: :class:`Summary`) or simulated (``fleetpilot simulate``:
    ``simulate.report.SimReport``), so the two compare field by field: the requests, how many
    were answered, the errors by kind, TTFT, TPOT and end-to-end latency percentiles of the
    answered (``{"p50": s, ...}``; None with nothing to take them of), and the prefix hit rate.
    Each producer adds what only it knows."""

    requests: int
    succeeded: int
    errors: dict[str, int]
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    prefix_hit_rate: float | None  # cached over prompt tokens of the answered; None for none

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def hit_rate(prompt_tokens: int, cached_tokens: int) -> float | None:
    """Cached over prompt tokens; None where there were no prompt tokens to hit."""
    return cached_tokens / prompt_tokens if prompt_tokens else None


@dataclass(frozen=True)
class Summary(LatencySummary):
    """A measured run: its latencies, and its pace, token counts and routes.
    ``prefix_hit_rate`` counts the answers that reported usage."""

    elapsed_s: float
    throughput_rps: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    tier_shares: dict[str, float] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)


def summarize(records: Sequence[RequestRecord], elapsed_s: float) -> Summary:
    ok = [r for r in records if r.ok]
    errors = Counter(r.error for r in records if r.error is not None)
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in with_usage)
    cached = sum(r.cached_tokens or 0 for r in with_usage)
    output = sum(r.completion_tokens or 0 for r in ok)
    tiers = Counter(r.route.tier for r in ok if r.route.tier is not None)
    routed = sum(tiers.values())
    span = elapsed_s if elapsed_s > 0 else float("nan")
    return Summary(
        requests=len(records),
        succeeded=len(ok),
        errors=dict(sorted(errors.items())),
        elapsed_s=elapsed_s,
        ttft_s=percentiles([r.ttft_s for r in ok if r.ttft_s is not None], (50, 95, 99)),
        tpot_s=percentiles([r.tpot_s for r in ok if r.tpot_s is not None], (50, 95, 99)),
        e2e_s=percentiles([r.e2e_s for r in ok if r.e2e_s is not None], (50, 95)),
        throughput_rps=len(ok) / span if elapsed_s > 0 else 0.0,
        output_tokens_per_s=output / span if elapsed_s > 0 else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        prefix_hit_rate=hit_rate(prompt, cached),
        tier_shares={t: n / routed for t, n in sorted(tiers.items())},
        kinds=dict(sorted(Counter(r.kind for r in records).items())),
    )


def first_errors(records: Sequence[RequestRecord]) -> dict[str, str]:
    """The first detail seen for each error kind (e.g. the server's message for an HTTP 400)."""
    out: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.detail and r.error not in out:
            out[r.error] = r.detail
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(s: Summary) -> str:
    """The human summary: one metric a line, latencies in milliseconds."""
    errors = ", ".join(f"{k}: {n}" for k, n in s.errors.items()) or "none"
    rows: list[tuple[str, str]] = [
        ("requests", f"{s.requests} ({s.succeeded} ok) in {s.elapsed_s:.1f} s"),
        ("errors", errors),
    ]
    for name, pcts in (("TTFT", s.ttft_s), ("TPOT", s.tpot_s), ("e2e", s.e2e_s)):
        cells = "  ".join(f"{k} {_ms(v):>8}" for k, v in pcts.items())
        rows.append((f"{name} ms", cells))
    rows.append(("throughput", f"{s.throughput_rps:.2f} req/s, {s.output_tokens_per_s:.1f} tok/s"))
    hit = "-" if s.prefix_hit_rate is None else f"{s.prefix_hit_rate:.1%}"
    rows.append(("prefix hits", f"{hit} ({s.cached_tokens}/{s.prompt_tokens} prompt tokens)"))
    shares = ", ".join(f"{t} {v:.0%}" for t, v in s.tier_shares.items())
    rows.append(("tier shares", shares or "- (no x-fleetpilot-route header)"))
    rows.append(("workload", ", ".join(f"{k}: {n}" for k, n in s.kinds.items()) or "-"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def result_json(result: RunResult, summary: Summary, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "started_at": result.started_at,
        "config": meta,
        "summary": summary.to_json(),
        "requests": [r.to_json() for r in result.records],
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def matplotlib_available() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def write_plot(path: Path, records: Sequence[RequestRecord], window_s: float = 2.0) -> None:
    """Latency over time, and the replicas seen answering in each window, per tier.

    The replica count is what the route header shows the client: a lower bound on the fleet's
    size (a replica that served nothing in a window is not seen), good enough to see scaling.
    """
    # Imported by name so the package imports (and type-checks) without matplotlib installed.
    mpl: Any = importlib.import_module("matplotlib")
    mpl.use("Agg")  # no display needed
    plt: Any = importlib.import_module("matplotlib.pyplot")
    ok = [r for r in records if r.ok]
    fig, (lat, reps) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    lat.scatter([r.start_s for r in ok], [(r.ttft_s or 0) * 1000 for r in ok], s=4, label="TTFT")
    lat.scatter([r.start_s for r in ok], [(r.e2e_s or 0) * 1000 for r in ok], s=4, label="e2e")
    bad = [r for r in records if not r.ok]
    if bad:
        lat.scatter([r.start_s for r in bad], [0] * len(bad), s=8, marker="x", label="error")
    lat.set_ylabel("latency (ms)")
    lat.legend(loc="upper left")
    seen: dict[str, dict[int, set[str]]] = {}
    for r in ok:
        tier = r.route.tier or "-"
        if r.route.replica:
            seen.setdefault(tier, {}).setdefault(int(r.start_s // window_s), set()).add(
                r.route.replica
            )
    for tier, windows in sorted(seen.items()):
        xs = sorted(windows)
        counts = [len(windows[x]) for x in xs]
        # The last window drawn to its end, not stopped at its start.
        reps.step(
            [x * window_s for x in xs] + [(xs[-1] + 1) * window_s],
            counts + counts[-1:],
            where="post",
            label=tier,
        )
    reps.yaxis.get_major_locator().set_params(integer=True)
    reps.set_ylabel(f"replicas seen / {window_s:g} s")
    reps.set_xlabel("time since start (s)")
    if seen:
        reps.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
