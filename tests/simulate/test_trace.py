"""``fleetpilot simulate --trace``: a recorded bench run replayed, and bad trace files refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.api import load_services
from fleetpilot.cli import main
from fleetpilot.loadgen.report import result_json, summarize
from fleetpilot.loadgen.runner import RequestRecord, RunConfig, RunResult, Schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate.fleet import Fleet, Outcome, SimSettings
from fleetpilot.simulate.trace import Trace, TraceError, load_trace, parse_trace

EXAMPLES = Path(__file__).parents[2] / "examples"
SERVICE = EXAMPLES / "single-tier.yaml"


def bench_doc(records: list[RequestRecord], workload: str, seed: int, **config: Any) -> Any:
    """What ``fleetpilot bench --out`` writes for these records (its own writer)."""
    result = RunResult(records, 1.8e9, 10.0, RunConfig("http://x/v1", "m", duration_s=10.0))
    meta = {"workload": workload, "seed": seed, "workload_options": {}, "duration_s": 10.0}
    meta.update(config)
    return json.loads(json.dumps(result_json(result, summarize(records, 10.0), meta)))


def record(index: int, start_s: float, tokens: int | None = 8, error: str | None = None) -> Any:
    return RequestRecord(
        index, "chat", start_s, 1.8e9 + start_s, error=error, completion_tokens=tokens
    )


def replay(trace: Trace, duration_s: float | None = None) -> Outcome:
    service = load_services(SERVICE)[0]
    workload = make_workload(trace.workload, trace.seed, **trace.options)
    settings = SimSettings(trace, duration_s or trace.duration_s, autoscale=False)
    return Fleet(service, None, workload, settings).run()


def test_a_trace_keeps_each_sent_request_in_its_place_in_the_workload() -> None:
    """Index order; a dropped arrival is left out but keeps its place; a failed request's
    length is unknown; a send stamped a hair before the one ahead of it is not earlier."""
    records = [
        record(0, 0.0),
        record(2, 0.30, tokens=5),
        record(1, 0.31, tokens=None, error="HTTP 503"),
        record(3, 0.29, error="dropped"),
        record(4, 0.5, tokens=12),
    ]
    trace = parse_trace(bench_doc(records, "multi-turn", 7, workload_options={"max_tokens": 9}))
    assert [r.index for r in trace.requests] == [0, 1, 2, 4]
    assert [r.start_s for r in trace.requests] == [0.0, 0.31, 0.31, 0.5]
    assert [r.output_tokens for r in trace.requests] == [8, None, 5, 12]
    assert (trace.workload, trace.seed, trace.options) == ("multi-turn", 7, {"max_tokens": 9})
    assert trace.dropped == 1
    assert trace.duration_s == 10.0


def test_a_replayed_simulation_is_the_simulation() -> None:
    """A run's own arrivals and answer lengths, written as a bench trace and replayed, give
    the same requests at the same times with the same outcomes; a dropped arrival in the
    trace shifts nothing after it."""
    service = load_services(SERVICE)[0]
    settings = SimSettings(Schedule.constant(20.0), 10.0, autoscale=False)
    direct = Fleet(service, None, make_workload("shared-prefix", 4), settings).run()
    assert len(direct.requests) > 100
    records = [record(r.index, r.arrival_s, r.max_tokens) for r in direct.requests]
    again = replay(parse_trace(bench_doc(records, "shared-prefix", 4)), 10.0)
    assert [(r.arrival_s, r.max_tokens, r.prompt_tokens, r.replica) for r in again.requests] == [
        (r.arrival_s, r.max_tokens, r.prompt_tokens, r.replica) for r in direct.requests
    ]
    assert [r.first_token_s for r in again.requests] == [r.first_token_s for r in direct.requests]

    # Arrival 3 never sent: the replay's fourth request is the workload's fifth.
    records[3] = record(3, records[3].start_s, error="dropped")
    skipped = replay(parse_trace(bench_doc(records, "shared-prefix", 4)), 10.0)
    sizes = [r.prompt_tokens for r in skipped.requests]
    assert sizes == [r.prompt_tokens for i, r in enumerate(direct.requests) if i != 3]


def test_answer_lengths_come_from_the_trace() -> None:
    records = [record(i, 0.1 * i, tokens=3 + i) for i in range(10)]
    out = replay(parse_trace(bench_doc(records, "multi-turn", 1)))
    assert [r.max_tokens for r in out.requests] == [3 + i for i in range(10)]
    assert all(r.error is None and r.end_s is not None for r in out.requests)


def test_a_shorter_simulation_cuts_the_trace() -> None:
    records = [record(i, float(i)) for i in range(10)]
    out = replay(parse_trace(bench_doc(records, "multi-turn", 1)), 4.5)
    assert [r.arrival_s for r in out.requests] == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("config"), "config: missing"),
        (lambda d: d["config"].update(workload="nope"), "config.workload: 'nope' is not one of"),
        (lambda d: d["config"].update(seed="3"), "config.seed: expected an integer"),
        (lambda d: d["config"].update(workload_options=[1]), "config.workload_options"),
        (lambda d: d["config"].update(duration_s=-1), "config.duration_s"),
        (lambda d: d.update(requests={}), "requests: expected a list"),
        (lambda d: d["requests"][1].update(index=0), "requests[1].index: 0 appears twice"),
        (lambda d: d["requests"][0].update(index=True), "requests[0].index"),
        (lambda d: d["requests"][0].update(start_s=-0.5), "requests[0].start_s"),
        (lambda d: d["requests"][0].update(start_s=float("nan")), "requests[0].start_s"),
        (lambda d: d["requests"][1].update(completion_tokens="8"), "completion_tokens"),
        (lambda d: d.update(requests=[]), "no request was sent"),
    ],
)
def test_a_bad_trace_is_refused_naming_the_field(change: Any, message: str) -> None:
    doc = bench_doc([record(0, 0.0), record(1, 0.5)], "multi-turn", 1)
    change(doc)
    with pytest.raises(TraceError) as err:
        parse_trace(doc, "t.json")
    assert str(err.value).startswith("t.json: ")
    assert message in str(err.value)


def test_an_unreadable_trace_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="No such file"):
        load_trace(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(TraceError, match=r"not UTF-8 text \(byte 0: 0xff\)"):
        load_trace(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text('{"config": ')
    with pytest.raises(TraceError, match="invalid JSON at line 1, column 12"):
        load_trace(tmp_path / "broken.json")
    # Regression: a 100,000-deep file was a RecursionError traceback.
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match="JSON nested deeper than the decoder's limit"):
        load_trace(tmp_path / "deep.json")


def test_cli_replays_a_trace_and_refuses_a_workload_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "run.json", tmp_path / "sim.json"
    records = [record(i, 0.2 * i) for i in range(20)]
    path.write_text(json.dumps(bench_doc(records, "multi-turn", 2, duration_s=None)))
    argv = ["simulate", "-f", str(SERVICE), "--trace", str(path), "--quiet", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 20
    assert doc["duration_s"] == pytest.approx(3.8)  # the last send: the record has no duration
    capsys.readouterr()

    assert main([*argv, "--workload", "mixed", "--max-tokens", "4"]) == 2
    assert "--trace replays its own workload; drop --workload, --max-tokens" in (
        capsys.readouterr().err
    )
    assert main(["simulate", "-f", str(SERVICE), "--rate", "1", "--quiet"]) == 2
    assert "--duration is required with --rate or --schedule" in capsys.readouterr().err
    path.write_text("[]")
    assert main(argv) == 2
    assert "expected the JSON object fleetpilot bench --out writes" in capsys.readouterr().err
