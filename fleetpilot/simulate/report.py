"""What a simulation says: latency percentiles, SLO attainment, prefix hits, replicas over time,
GPU-hours and cost - as a table, a verdict line, JSON and a PNG."""

from __future__ import annotations

import importlib
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetpilot.api import InferenceService
from fleetpilot.loadgen.report import LatencySummary, hit_rate, percentile, percentiles
from fleetpilot.simulate.fleet import Fleet, Outcome, Request

# Replicas per "tier/role" at a simulated time, as ``Outcome.samples`` holds them.
Samples = Sequence[tuple[float, dict[str, int]]]

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
    # The tier's requests whose TTFT, and those whose TPOT, met the tier's p95 objective, each
    # over all the tier's requests; None where the tier sets no such objective (or had none).
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None


@dataclass(frozen=True)
class MaxReached:
    """A role whose requested replicas reached its ``replicas.max``: the first time, in
    simulated seconds (0 for a role that started there)."""

    tier: str
    role: str
    replicas: int
    at_s: float


@dataclass(frozen=True)
class Verdict:
    """The run in one line: which roles hit their max replicas and when, and each tier's SLO
    attainment (``TierSummary.ttft_attainment``/``tpot_attainment``)."""

    at_max: list[MaxReached]
    # {"tier": {"ttft": share or None, "tpot": share or None}}
    slo_attainment: dict[str, dict[str, float | None]]
    refused: dict[str, int]  # requests no tier answered, by error (they count in no tier)
    line: str


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
    # Ready replicas (started, in the routers' view) as ``replicas`` holds the requested ones;
    # empty when the run was not sampled for them (``ReadySampler``).
    ready_replicas: list[dict[str, Any]] = field(default_factory=list)
    verdict: Verdict | None = None


class ReadySampler:
    """Ready replicas per "tier/role" over a run: what ``Outcome.samples`` (the replicas the
    autoscaler asked for) leaves out, so a cold start shows as the gap between the two. Made
    before ``Fleet.run``, it samples at the fleet's own sample times (``sample_every_s``, from
    0 to the load's end) by scheduling itself on the fleet's clock; it only reads, so the run
    is the same with it or without it."""

    def __init__(self, fleet: Fleet) -> None:
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._fleet = fleet
        fleet.at(0.0, self._sample)

    def _sample(self, now: float) -> None:
        fleet = self._fleet
        counts = {
            f"{tier}/{role}": sum(1 for r in state.replicas if r.ready and not r.retired)
            for (tier, role), state in fleet.roles.items()
        }
        self.samples.append((now, counts))
        if now < fleet.settings.duration_s:
            fleet.at(now + fleet.settings.sample_every_s, self._sample)


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


def _share(rs: Sequence[Request], ttft_slo: float | None, tpot_slo: float | None) -> float | None:
    return sum(_met(r, ttft_slo, tpot_slo) for r in rs) / len(rs) if rs else None


def max_reached(outcome: Outcome) -> list[MaxReached]:
    """Each role whose requested replicas reached its max, at the first time they did (the
    autoscaler's decision, or 0 for a role that started there), earliest first."""
    start = outcome.samples[0][1] if outcome.samples else {}
    found: list[MaxReached] = []
    for s in outcome.roles:
        tier, role = s.key
        ceiling = s.policy.max_replicas
        if start.get(f"{tier}/{role}", 0) >= ceiling:
            found.append(MaxReached(tier, role, ceiling, 0.0))
            continue
        at = next((t for t, _, to, _ in s.decisions if to >= ceiling), None)
        if at is not None:
            found.append(MaxReached(tier, role, ceiling, at))
    return sorted(found, key=lambda m: (m.at_s, m.tier, m.role))


def summarize(
    outcome: Outcome,
    service: InferenceService,
    price_per_gpu_hour: float | None = None,
    warmup_s: float = 0.0,
    ready: Samples = (),
) -> SimReport:
    """The report of a run; ``warmup_s``: requests that arrived before it are left out of
    every figure but the GPU-hours and the replicas (a steady state, past the fleet's cold
    caches); ``ready``: a ``ReadySampler``'s samples, if the run had one."""
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
        ttft_met = _share(rs, ttft_slo, None) if ttft_slo is not None else None
        tpot_met = _share(rs, None, tpot_slo) if tpot_slo is not None else None
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
            ttft_attainment=ttft_met,
            tpot_attainment=tpot_met,
        )
    # Refused requests (429, 503) miss every objective.
    failed = len(requests) - len(ok)
    attainment = met_total / (judged_total + failed) if judged_total + failed else None
    ttft, tpot, e2e = _latencies(ok)
    gpu_hours = outcome.gpu_seconds / 3600
    errors = dict(sorted(Counter(r.error for r in requests if r.error is not None).items()))
    return SimReport(
        requests=len(requests),
        succeeded=len(ok),
        errors=errors,
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
        ready_replicas=[{"t": t, **counts} for t, counts in ready],
        verdict=_verdict(max_reached(outcome), tiers, errors),
    )


def _pct(share: float) -> str:
    """``99.1%``; ``100%`` only when every request met it (99.96% reads ``100.0%``)."""
    return "100%" if share == 1 else f"{share:.1%}"


def _verdict(
    at_max: list[MaxReached], tiers: dict[str, TierSummary], refused: dict[str, int]
) -> Verdict:
    reached: list[str] = []
    for m in at_max:
        role = "" if m.role == "unified" else f" ({m.role})"
        ceiling = f"its max ({m.replicas} replica{'' if m.replicas == 1 else 's'})"
        when = "started at" if m.at_s == 0 else "reached"
        at = "" if m.at_s == 0 else f" at {m.at_s:.0f} s"
        reached.append(f"tier {m.tier}{role} {when} {ceiling}{at}")
    slo: dict[str, dict[str, float | None]] = {}
    parts: list[str] = []
    for name, t in tiers.items():
        slo[name] = {"ttft": t.ttft_attainment, "tpot": t.tpot_attainment}
        shares = [
            f"{label} {_pct(v)}"
            for label, v in (("TTFT", t.ttft_attainment), ("TPOT", t.tpot_attainment))
            if v is not None
        ]
        if shares:
            parts.append(f"{name} " + " ".join(shares))
        elif t.requests == 0:
            parts.append(f"{name} no requests")
        else:
            parts.append(f"{name} no SLO")
    line = "verdict: " + (", ".join(reached) if reached else "no tier reached its max replicas")
    line += "; SLO attainment: " + ", ".join(parts)
    if refused:
        n = sum(refused.values())
        kinds = ", ".join(f"{k} {v}" for k, v in refused.items())
        line += f"; {n} requests refused ({kinds}), in no tier's share"
    return Verdict(at_max, slo, refused, line)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _frac(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# What the simulated routers' refusals mean (``Request.error``: "HTTP <status>").
_ERROR_MEANING = {
    "HTTP 429": "every replica that could serve them was at capacity",
    "HTTP 503": "their tier had no ready replica",
}


def format_errors(errors: dict[str, int]) -> list[str]:
    """One line per kind of error: how many, and what it means where the simulator knows."""
    return [
        f"  {n} {kind}" + (f": {_ERROR_MEANING[kind]}" if kind in _ERROR_MEANING else "")
        for kind, n in sorted(errors.items(), key=lambda item: (-item[1], item[0]))
    ]


def format_table(report: SimReport) -> str:
    failed = report.requests - report.succeeded
    lines = [
        f"simulated {report.duration_s:.0f} s ({report.wall_s:.1f} s wall): "
        f"{report.requests} requests, {report.succeeded} succeeded"
        + (f", {failed} refused by the routers:" if report.errors else ""),
        *format_errors(report.errors),
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


def format_verdict(report: SimReport) -> str:
    """The last line of ``fleetpilot simulate``'s output (``Verdict.line``)."""
    return report.verdict.line if report.verdict is not None else ""


def _by_window(
    outcome: Outcome, tier: str, width: float, value: Callable[[Request], float | None]
) -> dict[int, list[float]]:
    """``value`` of the tier's answered requests, by the window of ``width`` s they arrived in."""
    buckets: dict[int, list[float]] = {}
    for r in outcome.requests:
        if r.tier == tier and r.error is None:
            v = value(r)
            if v is not None:
                buckets.setdefault(int(r.arrival_s // width), []).append(v)
    return buckets


def _ttft(r: Request) -> float | None:
    return None if r.first_token_s is None else r.first_token_s - r.arrival_s


def _tpot(r: Request) -> float | None:
    return r.tpot_s


def slo_label(tier: str, metric: str, seconds: float) -> str:
    """The legend of a tier's objective line on the plot: ``small TTFT SLO (p95 800 ms)``."""
    return f"{tier} {metric} SLO (p95 {seconds * 1000:g} ms)"


def plot_figure(
    outcome: Outcome,
    service: InferenceService,
    *,
    ready: Samples = (),
    title: str = "",
    windows: int = 120,
) -> Any:
    """The run as a matplotlib figure: TTFT and TPOT percentiles per tier with each tier's
    objective as a labelled horizontal line, the replicas each role asked for (dashed) and
    had ready (solid; the gap is cold starts) on integer ticks, and the arrival rate over
    time; ``title`` above (the service, workload and rate)."""
    mpl: Any = importlib.import_module("matplotlib")
    mpl.use("Agg")
    plt: Any = importlib.import_module("matplotlib.pyplot")
    ticker: Any = importlib.import_module("matplotlib.ticker")
    width = max(outcome.duration_s / windows, 1.0)
    fig, (lat, tpot, reps, load) = plt.subplots(4, 1, sharex=True, figsize=(10, 11))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = ((lat, "TTFT", _ttft), (tpot, "TPOT", _tpot))
    for i, tier in enumerate(service.spec.tiers):
        color = colors[i % len(colors)]
        slo = tier.autoscaling.slo
        objectives = {"TTFT": slo.ttft_p95, "TPOT": slo.tpot_p95}
        for ax, metric, value in panels:
            buckets = _by_window(outcome, tier.name, width, value)
            xs = sorted(buckets)
            for q, style in ((50, "-"), (95, "--")):
                ys = [(percentile(buckets[x], q) or 0.0) * 1000 for x in xs]
                ax.plot([x * width for x in xs], ys, style, color=color, label=f"{tier.name} p{q}")
            target = objectives[metric]
            if target is not None:
                seconds = target.total_seconds()
                ax.axhline(
                    seconds * 1000,
                    color=color,
                    linestyle=":",
                    linewidth=1.5,
                    label=slo_label(tier.name, metric, seconds),
                )
    for ax, metric, _ in panels:
        ax.set_ylabel(f"{metric} (ms)")
        ax.set_yscale("log")
        # Plain milliseconds on every labelled tick: matplotlib's default writes a log axis
        # spanning less than a decade as 6x10^0, 2x10^1.
        plain = ticker.FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.legend(loc="upper left", fontsize="small")
    # A tier's roles in the tier's colour (a P/D tier's prefill role thinner).
    tier_color = {t.name: colors[i % len(colors)] for i, t in enumerate(service.spec.tiers)}
    order = {name: i for i, name in enumerate(tier_color)}
    keys = sorted(
        {k for _, counts in outcome.samples for k in counts},
        key=lambda k: (order.get(k.partition("/")[0], len(order)), k),
    )
    for key in keys:
        tier_name, _, role = key.partition("/")
        color = tier_color.get(tier_name, "black")
        lw = 1.0 if role == "prefill" else 1.8
        reps.step(
            [t for t, _ in outcome.samples],
            [c.get(key, 0) for _, c in outcome.samples],
            "--",
            where="post",
            color=color,
            linewidth=lw,
            label=f"{key} requested",
        )
        if ready:
            reps.step(
                [t for t, _ in ready],
                [c.get(key, 0) for _, c in ready],
                where="post",
                color=color,
                linewidth=lw,
                alpha=0.6,
                label=f"{key} ready",
            )
    reps.set_ylabel("replicas")
    reps.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    reps.set_ylim(bottom=0)
    reps.legend(loc="upper left", fontsize="small")
    arrivals: Counter[int] = Counter(int(r.arrival_s // width) for r in outcome.requests)
    errors: Counter[int] = Counter(
        int(r.arrival_s // width) for r in outcome.requests if r.error is not None
    )
    xs = sorted(arrivals)
    # Not in the tiers' colours: arrivals and refusals are the whole service's.
    load.plot(
        [x * width for x in xs], [arrivals[x] / width for x in xs], color="black", label="arrivals"
    )
    if errors:
        load.plot(
            [x * width for x in xs], [errors[x] / width for x in xs], color="red", label="refused"
        )
    load.set_ylabel("requests/s")
    load.set_xlabel("simulated time (s)")
    load.legend(loc="upper left", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_plot(
    path: Path,
    outcome: Outcome,
    service: InferenceService,
    *,
    ready: Samples = (),
    title: str = "",
    windows: int = 120,
) -> None:
    """``plot_figure`` as a PNG at ``path``."""
    plt: Any = importlib.import_module("matplotlib.pyplot")
    fig = plot_figure(outcome, service, ready=ready, title=title, windows=windows)
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
