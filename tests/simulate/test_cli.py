"""``fleetpilot simulate``'s command line (``simulate.cli``): what it prints - the progress
line, the reasons it cannot run, the verdict at the end - and the files it writes."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest
import yaml

from fleetpilot.api import load_services
from fleetpilot.loadgen.runner import Schedule, parse_schedule
from fleetpilot.loadgen.workloads import make_workload
from fleetpilot.simulate import cli
from fleetpilot.simulate.trace import Trace, TracedRequest

EXAMPLES = Path(__file__).parents[2] / "examples"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_progress_stops_at_the_duration_while_the_last_requests_finish() -> None:
    """The fleet runs past the load's end until its requests are answered: the line says so
    and shows the duration, not "121/120 s"; short of the end it shows whole seconds done."""
    stream = io.StringIO()
    show = cli._progress(stream, 120.0)
    show(119.6, 50)
    before = stream.getvalue()
    assert " 119/120 s simulated" in before
    assert " 99%" in before
    assert "finishing" not in before
    show(121.4, 60)
    after = stream.getvalue()[len(before) :]
    assert " 120/120 s simulated" in after
    assert "121" not in after
    assert "100%" in after
    assert "[" + "#" * 30 + "]" in after
    assert "finishing requests in flight" in after
    # The last line (the run's end) is shorter: it is padded over the one it replaces.
    show(120.0, 60)
    last, previous = stream.getvalue().split("\r")[-1], after.removeprefix("\r")
    assert "finishing" not in last
    assert len(last) >= len(previous)


def test_a_reference_engine_tier_is_named_as_such_not_as_gpu_product_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse("-f", str(EXAMPLES / "cpu-two-tier.yaml"), "--rate", "1", "--duration", "10s")
    assert cli.run(args) == 2
    err = capsys.readouterr().err
    assert "tier 'small' runs the reference engine (preset tiny)" in err
    assert "fleetpilot simulate calibrate --out FILE" in err
    assert "None" not in err


def test_a_tier_without_a_gpu_product_is_told_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = yaml.safe_load((EXAMPLES / "single-tier.yaml").read_text())
    del doc["spec"]["tiers"][0]["resources"]["gpuProduct"]
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert cli.run(parse("-f", str(path), "--rate", "1", "--duration", "10s")) == 2
    err = capsys.readouterr().err
    assert "tier 'main' names no GPU product (resources.gpuProduct)" in err
    assert "h100" in err  # the --profile values that would do
    assert "None" not in err


def test_the_plot_title_names_the_service_workload_and_rate() -> None:
    service = load_services(EXAMPLES / "two-tier.yaml")[0]
    workload = make_workload("mixed", 0)
    assert (
        cli._title(service, workload, Schedule.constant(12.5), 600.0)
        == "chat: mixed, 12.5 req/s, 600 s simulated"
    )
    assert (
        cli._title(service, workload, parse_schedule("0:50,600:~500,900:100"), 1200.0)
        == "chat: mixed, schedule 50-500 req/s, 1200 s simulated"
    )
    # A replay cut at 10 s: the requests sent by then, over the 10 s.
    sends = tuple(TracedRequest(i, 0.5 * i, 8) for i in range(40))
    trace = Trace("mixed", 0, {}, sends, 20.0, source="/runs/bench.json")
    assert (
        cli._title(service, workload, trace, 10.0)
        == "chat: mixed, trace bench.json (2.1 req/s), 10 s simulated"
    )


def test_the_output_ends_with_the_verdict_which_the_json_report_holds_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, plot = tmp_path / "report.json", tmp_path / "run.png"
    args = parse(
        "-f", str(EXAMPLES / "two-tier.yaml"), "--workload", "mixed", "--rate", "100",
        "--duration", "40s", "--max-replicas", "2", "--seed", "1", "--quiet",
        "--json", str(report), "--plot", str(plot),
    )  # fmt: skip
    assert cli.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    doc = json.loads(report.read_text())
    assert lines[-1] == doc["verdict"]["line"]
    assert lines[-1].startswith("verdict: tier large reached its max (2 replicas) at ")
    assert "; SLO attainment: small TTFT " in lines[-1]
    assert f"json: {report}" in lines
    assert f"plot: {plot}" in lines
    assert doc["verdict"]["at_max"][0] | {"at_s": None} == {
        "tier": "large",
        "role": "unified",
        "replicas": 2,
        "at_s": None,
    }
    assert doc["ready_replicas"][0]["large/unified"] == 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
