"""What a simulation reports (``simulate.report``): the latency summary a measured run reports
(``loadgen.report.LatencySummary``, the one type both produce), so the two compare directly."""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest

from fleetpilot.api import InferenceService, load_services
from fleetpilot.loadgen.report import LatencySummary, write_json
from fleetpilot.loadgen.report import summarize as summarize_measured
from fleetpilot.loadgen.runner import RequestRecord, Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate.fleet import Fleet, Outcome, Request, SimSettings
from fleetpilot.simulate.report import (
    ReadySampler,
    SimReport,
    format_table,
    format_verdict,
    plot_figure,
    slo_label,
    summarize,
    write_plot,
)

EXAMPLES = Path(__file__).parents[2] / "examples"


def as_measured(r: Request) -> RequestRecord:
    """A simulated request as the load generator's client would have recorded it."""
    ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
    e2e = None if r.end_s is None else r.end_s - r.arrival_s
    return RequestRecord(
        r.index,
        r.kind,
        r.arrival_s,
        r.arrival_s,
        end_s=r.end_s,
        error=r.error,
        ttft_s=ttft,
        tpot_s=r.tpot_s,
        e2e_s=e2e,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.max_tokens,
        cached_tokens=r.cached_tokens,
    )


def test_a_simulated_run_summarizes_as_the_same_run_measured_would() -> None:
    """The simulated requests, summarized by the simulator and (as a client's records) by the
    load generator: one type, and the same value in every field both report - counts, errors,
    the prefix hit rate and each percentile both take (the simulator adds p90 and the mean)."""
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    settings = SimSettings(Schedule.constant(20.0), 30.0)
    outcome = Fleet(service, None, make_workload("mixed", 0), settings).run()
    assert all(r.end_s is not None for r in outcome.requests if r.error is None)
    simulated = summarize(outcome, service)
    measured = summarize_measured([as_measured(r) for r in outcome.requests], outcome.duration_s)
    assert isinstance(simulated, SimReport)
    assert isinstance(simulated, LatencySummary)
    assert isinstance(measured, LatencySummary)
    assert simulated.succeeded > 100
    assert simulated.prefix_hit_rate
    for f in fields(LatencySummary):
        sim, real = getattr(simulated, f.name), getattr(measured, f.name)
        if f.name in ("ttft_s", "tpot_s", "e2e_s"):
            shared = sim.keys() & real.keys()
            assert shared >= {"p50", "p95"}, f.name
            assert {k: sim[k] for k in shared} == pytest.approx({k: real[k] for k in shared})
        else:
            assert sim == pytest.approx(real), f.name


def answered(index: int, tier: str, ttft_s: float, tpot_s: float, tokens: int = 11) -> Request:
    """A request of ``tier`` that arrived at ``index`` s with this TTFT and TPOT."""
    first = index + ttft_s
    return Request(
        index,
        "chat",
        float(index),
        tokens,
        None,
        prompt_tokens=100,
        tier=tier,
        first_token_s=first,
        end_s=first + tpot_s * (tokens - 1),
    )


def refused(index: int, error: str) -> Request:
    return Request(index, "chat", float(index), 11, None, end_s=float(index), error=error)


def cpu_service() -> InferenceService:
    """Two tiers: small with a TTFT objective only (500 ms), large with both (4 s, 400 ms)."""
    return load_services(EXAMPLES / "cpu-two-tier.yaml")[0]


def handmade_run() -> Outcome:
    small = [answered(i, "small", 0.1, 0.01) for i in range(9)] + [
        answered(9, "small", 0.9, 0.01)  # misses small's 500 ms
    ]
    large = [answered(10 + i, "large", 1.0, 0.1) for i in range(3)] + [
        answered(13, "large", 1.0, 0.5)  # misses large's TPOT (400 ms), meets its TTFT
    ]
    errors = [refused(20, "HTTP 429"), refused(21, "HTTP 429"), refused(22, "HTTP 503")]
    return Outcome(small + large + errors, [], 0.0, 60.0, [])


def test_slo_attainment_is_per_tier_and_per_objective() -> None:
    """Each tier's TTFT and TPOT objectives are judged apart (a request late on TPOT still met
    the TTFT one), over the tier's own requests; a tier without an objective has no share of
    it; requests the routers refused belong to no tier and are named on their own."""
    report = summarize(handmade_run(), cpu_service())
    small, large = report.tiers["small"], report.tiers["large"]
    assert (small.ttft_attainment, small.tpot_attainment) == (pytest.approx(0.9), None)
    assert (large.ttft_attainment, large.tpot_attainment) == (1.0, pytest.approx(0.75))
    assert (small.slo_attainment, large.slo_attainment) == (pytest.approx(0.9), 0.75)
    assert format_verdict(report) == (
        "verdict: no tier reached its max replicas; SLO attainment: small TTFT 90.0%, "
        "large TTFT 100% TPOT 75.0%; 3 requests refused (HTTP 429 2, HTTP 503 1), in no "
        "tier's share"
    )


def test_the_verdict_is_in_the_json_report(tmp_path: Path) -> None:
    report = summarize(handmade_run(), cpu_service())
    path = tmp_path / "report.json"
    write_json(path, report.to_json())
    verdict = json.loads(path.read_text())["verdict"]
    assert verdict["line"] == format_verdict(report)
    assert verdict["at_max"] == []
    assert verdict["refused"] == {"HTTP 429": 2, "HTTP 503": 1}
    assert verdict["slo_attainment"] == {
        "small": {"ttft": pytest.approx(0.9), "tpot": None},
        "large": {"ttft": 1.0, "tpot": 0.75},
    }


def test_the_table_names_each_error_on_a_line_of_its_own() -> None:
    """Refusals read as lines (count, status, meaning), not as a Python dict."""
    table = format_table(summarize(handmade_run(), cpu_service()))
    lines = table.splitlines()
    assert lines[0].endswith(": 17 requests, 14 succeeded, 3 refused by the routers:")
    assert lines[1:3] == [
        "  2 HTTP 429: every replica that could serve them was at capacity",
        "  1 HTTP 503: their tier had no ready replica",
    ]
    assert "{" not in table


# A load the large tier of two-tier.yaml (72B, 4 GPUs a replica) cannot hold on one replica,
# with every max cut to 2: the autoscaler takes it there early, and the second replica's
# cold start (~78 s) ends within the run.
BUSY = SimSettings(Schedule.constant(100.0), 110.0, seed=1, max_replicas=2)


def busy_run(sampled: bool) -> tuple[Outcome, list[tuple[float, dict[str, int]]]]:
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    fleet = Fleet(service, None, make_workload("mixed", 1), BUSY)
    sampler = ReadySampler(fleet) if sampled else None
    outcome = fleet.run()
    return outcome, sampler.samples if sampler is not None else []


@pytest.fixture(scope="module")
def busy() -> tuple[Outcome, list[tuple[float, dict[str, int]]]]:
    return busy_run(sampled=True)


def test_the_verdict_names_the_tier_at_its_max_and_when_it_got_there(
    busy: tuple[Outcome, list[tuple[float, dict[str, int]]]],
) -> None:
    """The first time the large tier's requested replicas reached 2 is between the last
    sample that had fewer and the first that had 2 (samples every 10 s)."""
    outcome, ready = busy
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    report = summarize(outcome, service, ready=ready)
    assert report.verdict is not None
    at_max = {(m.tier, m.role): m for m in report.verdict.at_max}
    assert ("large", "unified") in at_max
    reached = at_max["large", "unified"]
    assert reached.replicas == 2
    counts = [(t, c["large/unified"]) for t, c in outcome.samples]
    first = next(t for t, n in counts if n == 2)
    before = max(t for t, n in counts if t < first)
    assert before < reached.at_s <= first
    assert f"tier large reached its max (2 replicas) at {reached.at_s:.0f} s" in (
        format_verdict(report)
    )


def test_ready_replicas_lag_the_requested_by_the_cold_start(
    busy: tuple[Outcome, list[tuple[float, dict[str, int]]]],
) -> None:
    """Sampled at the same times as the requested replicas, the ready ones never exceed them,
    and the replica asked for at the max is ready no sooner than its cold start later."""
    outcome, ready = busy
    assert [t for t, _ in ready] == [t for t, _ in outcome.samples]
    for (_, asked), (_, up) in zip(outcome.samples, ready, strict=True):
        assert all(up[k] <= asked[k] for k in asked)
    state = next(s for s in outcome.roles if s.key == ("large", "unified"))
    cold = state.model.costs.cold_start_s
    assert cold > BUSY.sample_every_s  # else a sample could not see the gap
    at = next(t for t, _, to, _ in state.decisions if to == 2)
    assert any(
        up["large/unified"] < asked["large/unified"]
        for (_, asked), (_, up) in zip(outcome.samples, ready, strict=True)
    )
    first_ready = next(t for t, up in ready if up["large/unified"] == 2)
    assert at + cold <= first_ready < at + cold + BUSY.sample_every_s + 1e-9
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    doc = summarize(outcome, service, ready=ready).to_json()
    assert doc["ready_replicas"][0] == {"t": 0.0, "small/unified": 1, "large/unified": 1}


def test_sampling_ready_replicas_leaves_the_run_as_it_was(
    busy: tuple[Outcome, list[tuple[float, dict[str, int]]]],
) -> None:
    sampled, _ = busy
    plain, _ = busy_run(sampled=False)

    def run(o: Outcome) -> list[tuple[object, ...]]:
        return [(r.tier, r.replica, r.first_token_s, r.end_s, r.error) for r in o.requests]

    assert run(sampled) == run(plain)
    assert sampled.samples == plain.samples
    assert [s.decisions for s in sampled.roles] == [s.decisions for s in plain.roles]


def test_the_plot_shows_slo_lines_ready_replicas_integer_ticks_and_a_title(
    tmp_path: Path, busy: tuple[Outcome, list[tuple[float, dict[str, int]]]]
) -> None:
    outcome, ready = busy
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    fig = plot_figure(outcome, service, ready=ready, title="chat: mixed, 100 req/s")
    fig.savefig(tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ttft, tpot, replicas, _ = fig.axes

    def lines(ax: Any) -> dict[str, list[float]]:
        return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}

    # two-tier.yaml: small 800 ms / 60 ms, large 2 s / 80 ms, as horizontal lines in ms.
    assert lines(ttft)[slo_label("small", "TTFT", 0.8)] == pytest.approx([800, 800])
    assert lines(ttft)[slo_label("large", "TTFT", 2.0)] == pytest.approx([2000, 2000])
    assert lines(tpot)[slo_label("small", "TPOT", 0.06)] == pytest.approx([60, 60])
    assert lines(tpot)[slo_label("large", "TPOT", 0.08)] == pytest.approx([80, 80])
    assert slo_label("small", "TTFT", 0.8) == "small TTFT SLO (p95 800 ms)"
    legend = [t.get_text() for t in ttft.get_legend().get_texts()]
    assert "small TTFT SLO (p95 800 ms)" in legend
    drawn = lines(replicas)
    assert drawn["large/unified requested"] != drawn["large/unified ready"]  # a cold start
    assert max(drawn["large/unified ready"]) == 2
    ticks = [
        t for t in replicas.get_yticks() if replicas.get_ylim()[0] <= t <= replicas.get_ylim()[1]
    ]
    assert len(ticks) >= 2
    assert all(float(t).is_integer() for t in ticks), ticks
    assert fig.get_suptitle() == "chat: mixed, 100 req/s"
    # The latency axes' labels are plain milliseconds, not 6x10^1 mathtext.
    fig.canvas.draw()
    for ax in (ttft, tpot):
        shown = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
        assert any(shown), shown
        assert all(re.fullmatch(r"[0-9.]*", text) for text in shown), shown
    plt.close(fig)


def test_write_plot_writes_a_png_and_closes_its_figure(
    tmp_path: Path, busy: tuple[Outcome, list[tuple[float, dict[str, int]]]]
) -> None:
    outcome, ready = busy
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    path = tmp_path / "run.png"
    open_before = plt.get_fignums()
    write_plot(path, outcome, service, ready=ready, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == open_before
