"""End to end: ``fleetpilot bench`` against a real reference engine on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetpilot.api import load_services
from fleetpilot.loadgen import cli
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate.fleet import Fleet, SimSettings
from fleetpilot.simulate.trace import load_trace
from fleetpilot.testing.engine_server import BackgroundServer

ENGINE = [
    "--host", "127.0.0.1", "--port", "0", "--model-config", "tiny", "--served-model-name", "m",
]  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> Iterator[BackgroundServer]:
    srv = BackgroundServer.from_argv(ENGINE).start()
    yield srv
    srv.stop()


def test_closed_loop_shared_prefix_against_the_reference_engine(
    engine: BackgroundServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetpilot bench` end to end against a real engine: 30 successes with TTFT and TPOT,
    ignore_eos honoured, prefix-cache hits counted, and the JSON and PNG outputs written."""
    out = tmp_path / "bench.json"
    argv = [
        "--url", f"{engine.url}/v1", "--model", "m", "--concurrency", "4", "--requests", "30",
        "--workload", "shared-prefix", "--seed", "3", "--ignore-eos", "--max-tokens", "8",
        "--out", str(out), "--plot", str(tmp_path / "bench.png"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "errors       none" in printed.out
    assert "TTFT ms" in printed.out
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"

    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["requests"] == summary["succeeded"] == 30
    assert summary["errors"] == {}
    assert summary["ttft_s"]["p50"] is not None
    assert summary["tpot_s"]["p50"] is not None
    assert summary["cached_tokens"] > 0  # the shared system prompts hit the prefix cache
    assert doc["config"]["mode"] == "closed"
    records = doc["requests"]
    assert len(records) == 30
    for r in records:
        assert r["error"] is None
        assert r["status"] == 200
        assert r["ttft_s"] > 0
        assert r["tpot_s"] > 0
        assert r["completion_tokens"] == 8
        assert r["timestamp"] > 1.7e9
    assert sum(r["cached_tokens"] for r in records) == summary["cached_tokens"]


def test_errors_from_the_engine_are_counted_not_raised(
    engine: BackgroundServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine that refuses every request (unknown model) gives exit 1, counted 404s and the first
    error's detail, not a traceback."""
    argv = [
        "--url", f"{engine.url}/v1", "--model", "not-served", "--concurrency", "2",
        "--requests", "4",
    ]  # fmt: skip
    assert cli.main(argv) == 1  # nothing got through
    printed = capsys.readouterr()
    assert "HTTP 404: 4" in printed.out
    assert "first HTTP 404:" in printed.err


def test_bad_flags_are_refused_before_any_load(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad schedules, rates and option combinations exit 2 with a message naming the flag before any
    request is sent."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["--schedule", "0:2,30", "--duration", "5"])
    assert exc.value.code == 2
    assert "argument --schedule: schedule step '30'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--rate", "0"])
    assert "must be greater than 0" in capsys.readouterr().err
    assert cli.main(["--workload", "mixed", "--context-chars", "10", "--requests", "1"]) == 2
    assert "--context-chars applies to --workload long-context" in capsys.readouterr().err
    assert cli.main(["--rate", "2", "--requests", "3"]) == 2
    assert "needs a --duration" in capsys.readouterr().err
    assert cli.main(["--workload", "mixed", "--tenants", "3", "--requests", "1"]) == 2
    assert "--tenants applies to --workload shared-prefix" in capsys.readouterr().err


def test_the_workloads_shape_is_sent_and_recorded_for_a_replay(
    engine: BackgroundServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--tenants`, `--system-chars` and `--tenant-skew` shape the requests sent (two system
    prompts of 300 characters and a tenant-numbered preamble) and are recorded, so that
    `fleetpilot simulate --trace` regenerates the very same prompts."""
    out = tmp_path / "bench.json"
    argv = [
        "--url", f"{engine.url}/v1", "--model", "m", "--concurrency", "2", "--requests", "6",
        "--workload", "shared-prefix", "--tenants", "2", "--system-chars", "300",
        "--tenant-skew", "1.5", "--seed", "4", "--max-tokens", "2", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    trace = load_trace(out)
    assert trace.options == {"tenants": 2, "system_chars": 300, "tenant_skew": 1.5, "max_tokens": 2}
    workload = make_workload(trace.workload, trace.seed, **trace.options)
    systems = {workload.next().messages[0]["content"] for _ in range(40)}
    assert len(systems) == 2
    assert all(len(s) >= 300 for s in systems)


def test_a_bench_run_replays_in_the_simulator(
    engine: BackgroundServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetpilot simulate --trace` reads what `fleetpilot bench --out` wrote: the same
    requests (kinds, in order), sent at the same times, each answer as long as it was."""
    out = tmp_path / "bench.json"
    argv = [
        "--url", f"{engine.url}/v1", "--model", "m", "--rate", "20", "--duration", "1.5",
        "--workload", "mixed", "--seed", "5", "--max-tokens", "6", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    records = json.loads(out.read_text())["requests"]
    sent = [r for r in records if r["error"] != "dropped"]
    assert len(sent) >= 10

    trace = load_trace(out)
    assert trace.options == {"easy_max_tokens": 6, "hard_max_tokens": 6}
    service = load_services(Path(__file__).parents[2] / "examples" / "two-tier.yaml")[0]
    workload = make_workload(trace.workload, trace.seed, **trace.options)
    settings = SimSettings(trace, trace.duration_s, autoscale=False)
    replayed = Fleet(service, None, workload, settings).run().requests
    assert [r.kind for r in replayed] == [r["kind"] for r in sent]
    assert [r.arrival_s for r in replayed] == pytest.approx([r["start_s"] for r in sent])
    assert [r.max_tokens for r in replayed] == [r["completion_tokens"] for r in sent]
