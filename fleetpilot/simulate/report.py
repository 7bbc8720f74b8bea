"""What a simulation says: latency percentiles, SLO attainment, prefix hits, replicas over time,
GPU-hours and cost - as a table, JSON and a PNG."""

from __future__ import annotations

import importlib
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.loadgen.report import LatencySummary, hit_rate, percentile, percentiles
from fleetpilot.simulate.fleet import Outcome, Request

QUANTILES = (50, 90, 95, 99)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    """The percentiles and the mean (what an engine's histogram sum over count gives, to
    compare with a real fleet's ``vllm:time_to_first_token_seconds``)."""
    return {**percentiles(values, QUANTILES), "mean": statistics.fmean(values) if values else None}


@dataclass(frozen=True)
class TierSummary:
    requests: int  # routed to the tier (and answered)
    ttft_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    prefix_hit_rate: float | None
    # Requests that met every objective the tier sets (TTFT and TPOT under the p95 SLOs;
    # a failed request met none), over all the tier's requests; None without objectives.
    slo_attainment: float | None
    peak_replicas: dict[str, int]
    gpu_count_per_replica: dict[str, int]
    # Of the prompt tokens, those copied back from the host tier (engine.kvOffload): a share
    # of prefix_hit_rate.
    host_hit_rate: float | None = None


@dataclass(frozen=True)
class SimReport(LatencySummary):
    """A simulated run: the latencies a measured run reports too (the same type as
    ``fleetpilot bench``'s summary, so the two compare directly; percentiles here add p90 and
    the mean), and what only a simulation knows: objectives met, tiers, replicas and cost."""

    duration_s: float
    slo_attainment: float | None
    tiers: dict[str, TierSummary]
    gpu_hours: float
    cost: float | None
    wall_s: float
    replicas: list[dict[str, Any]] = field(default_factory=list)  # {"t": s, "tier/role": n}
    decisions: list[dict[str, Any]] = field(default_factory=list)
    host_hit_rate: float | None = None  # as TierSummary's


def _met(r: Request, ttft_slo: float | None, tpot_slo: float | None) -> bool:
    if r.error is not None or r.first_token_s is None:
        return False
    if ttft_slo is not None and r.first_token_s - r.arrival_s > ttft_slo:
        return False
    tpot = r.tpot_s
    return tpot_slo is None or tpot is None or tpot <= tpot_slo


def _latencies(rs: Sequence[Request]) -> tuple[list[float], list[float], list[float]]:
    ttft, tpot, e2e = [], [], []
    for r in rs:
        if r.error is None and r.first_token_s is not None and r.end_s is not None:
            ttft.append(r.first_token_s - r.arrival_s)
            e2e.append(r.end_s - r.arrival_s)
            t = r.tpot_s
            if t is not None:
                tpot.append(t)
    return ttft, tpot, e2e


def _hit_rate(rs: Sequence[Request]) -> float | None:
    prompt = sum(r.prompt_tokens for r in rs if r.error is None)
    cached = sum(r.cached_tokens for r in rs if r.error is None)
    return hit_rate(prompt, cached)


def _host_hit_rate(rs: Sequence[Request]) -> float | None:
    prompt = sum(r.prompt_tokens for r in rs if r.error is None)
    return hit_rate(prompt, sum(r.host_cached_tokens for r in rs if r.error is None))


def summarize(
    outcome: Outcome,
    service: InferenceService,
    price_per_gpu_hour: float | None = None,
    warmup_s: float = 0.0,
) -> SimReport:
    """The report of a run; ``warmup_s``: requests that arrived before it are left out of
    every figure but the GPU-hours (a steady state, past the fleet's cold caches)."""
    requests = [r for r in outcome.requests if r.arrival_s >= warmup_s]
    ok = [r for r in requests if r.error is None]
    by_tier: dict[str, list[Request]] = {}
    for r in ok:
        by_tier.setdefault(r.tier, []).append(r)
    tiers: dict[str, TierSummary] = {}
    met_total = 0
    judged_total = 0
    for tier in service.spec.tiers:
        rs = by_tier.get(tier.name, [])
        slo = tier.autoscaling.slo
        ttft_slo = slo.ttft_p95.total_seconds() if slo.ttft_p95 else None
        tpot_slo = slo.tpot_p95.total_seconds() if slo.tpot_p95 else None
        attainment = None
        if ttft_slo is not None or tpot_slo is not None:
            met = sum(_met(r, ttft_slo, tpot_slo) for r in rs)
            attainment = met / len(rs) if rs else None
            met_total += met
            judged_total += len(rs)
        ttft, tpot, e2e = _latencies(rs)
        roles = [s for s in outcome.roles if s.role.tier.name == tier.name]
        peak = {
            str(s.role.name): max(
                (c.get(f"{tier.name}/{s.role.name}", 0) for _, c in outcome.samples), default=0
            )
            for s in roles
        }
        tiers[tier.name] = TierSummary(
            requests=len(rs),
            ttft_s=_pcts(ttft),
            tpot_s=_pcts(tpot),
            e2e_s=_pcts(e2e),
            prefix_hit_rate=_hit_rate(rs),
            slo_attainment=attainment,
            peak_replicas=peak,
            gpu_count_per_replica={str(s.role.name): s.model.gpus for s in roles},
            host_hit_rate=_host_hit_rate(rs),
        )
    # Refused requests (429, 503) miss every objective.
    failed = len(requests) - len(ok)
    attainment = met_total / (judged_total + failed) if judged_total + failed else None
    ttft, tpot, e2e = _latencies(ok)
    gpu_hours = outcome.gpu_seconds / 3600
    return SimReport(
        requests=len(requests),
        succeeded=len(ok),
        errors=dict(Counter(r.error for r in requests if r.error is not None)),
        duration_s=outcome.duration_s,
        ttft_s=_pcts(ttft),
        tpot_s=_pcts(tpot),
        e2e_s=_pcts(e2e),
        prefix_hit_rate=_hit_rate(ok),
        slo_attainment=attainment,
        tiers=tiers,
        gpu_hours=gpu_hours,
        cost=gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None,
        wall_s=outcome.wall_s,
        replicas=[{"t": t, **counts} for t, counts in outcome.samples],
        decisions=[
            {"t": t, "tier": s.role.tier.name, "role": str(s.role.name), "from": a, "to": b}
            for s in outcome.roles
            for t, a, b, _ in s.decisions
        ],
        host_hit_rate=_host_hit_rate(ok),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _frac(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(report: SimReport) -> str:
    lines = [
        f"simulated {report.duration_s:.0f} s: {report.requests} requests, "
        f"{report.succeeded} succeeded"
        + (f", errors {report.errors}" if report.errors else "")
        + f" ({report.wall_s:.1f} s wall)",
        "",
        f"{'':10} {'reqs':>9} {'TTFT p50':>9} {'p95':>8} {'p99':>8} {'TPOT p50':>9} {'p95':>7} "
        f"{'e2e p95':>8} {'hit rate':>8} {'SLO met':>7}  replicas (peak)",
    ]

    def row(name: str, n: int, s: Any, peak: str) -> str:
        return (
            f"{name:10} {n:>9} {_ms(s.ttft_s['p50']):>9} {_ms(s.ttft_s['p95']):>8} "
            f"{_ms(s.ttft_s['p99']):>8} {_ms(s.tpot_s['p50']):>9} {_ms(s.tpot_s['p95']):>7} "
            f"{_ms(s.e2e_s['p95']):>8} {_frac(s.prefix_hit_rate):>8} "
            f"{_frac(s.slo_attainment):>7}  {peak}"
        )

    for name, tier in report.tiers.items():
        peak = ", ".join(f"{role} {n}" for role, n in tier.peak_replicas.items())
        lines.append(row(name, tier.requests, tier, peak))
    lines.append(row("all", report.succeeded, report, ""))
    lines.append("")
    lines.append("latencies in ms; SLO met: requests under every objective of their tier")
    if report.host_hit_rate:
        lines.append(
            f"of the prompt tokens, {report.host_hit_rate:.3f} came back from host memory "
            "(engine.kvOffload), the rest of the hit rate from the device"
        )
    cost = f", cost {report.cost:,.2f}" if report.cost is not None else ""
    lines.append(f"GPU-hours {report.gpu_hours:,.2f}{cost}")
    return "\n".join(lines)


def write_plot(path: Path, outcome: Outcome, windows: int = 120) -> None:
    """TTFT percentiles per tier, replicas per role, and the arrival rate, over time."""
    mpl: Any = importlib.import_module("matplotlib")
    mpl.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    width = max(outcome.duration_s / windows, 1.0)
    fig, (lat, reps, load) = plt.subplots(3, 1, sharex=True, figsize=(10, 8))
    tiers = sorted({r.tier for r in outcome.requests if r.tier})
    for tier in tiers:
        buckets: dict[int, list[float]] = {}
        for r in outcome.requests:
            if r.tier == tier and r.error is None and r.first_token_s is not None:
                buckets.setdefault(int(r.arrival_s // width), []).append(
                    r.first_token_s - r.arrival_s
                )
        xs = sorted(buckets)
        for q, style in ((50, "-"), (95, "--")):
            ys = [(percentile(buckets[x], q) or 0.0) * 1000 for x in xs]
            lat.plot([x * width for x in xs], ys, style, label=f"{tier} TTFT p{q}")
    lat.set_ylabel("TTFT (ms)")
    lat.set_yscale("log")
    lat.legend(loc="upper left", fontsize="small")
    keys = sorted({k for _, counts in outcome.samples for k in counts})
    for key in keys:
        reps.step(
            [t for t, _ in outcome.samples],
            [c.get(key, 0) for _, c in outcome.samples],
            where="post",
            label=key,
        )
    reps.set_ylabel("replicas")
    reps.legend(loc="upper left", fontsize="small")
    arrivals: Counter[int] = Counter(int(r.arrival_s // width) for r in outcome.requests)
    errors: Counter[int] = Counter(
        int(r.arrival_s // width) for r in outcome.requests if r.error is not None
    )
    xs = sorted(arrivals)
    load.plot([x * width for x in xs], [arrivals[x] / width for x in xs], label="arrivals")
    if errors:
        load.plot([x * width for x in xs], [errors[x] / width for x in xs], label="refused")
    load.set_ylabel("requests/s")
    load.set_xlabel("simulated time (s)")
    load.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
