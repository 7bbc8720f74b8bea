"""What a simulation reports (``simulate.report``): the latency summary a measured run reports
(``loadgen.report.LatencySummary``, the one type both produce), so the two compare directly."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from fleetpilot.api import load_services
from fleetpilot.loadgen.report import LatencySummary
from fleetpilot.loadgen.report import summarize as summarize_measured
from fleetpilot.loadgen.runner import RequestRecord, Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate.fleet import Fleet, Request, SimSettings
from fleetpilot.simulate.report import SimReport, summarize

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
