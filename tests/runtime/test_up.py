"""``fleetpilot up --cold-start SECONDS`` and ``--step-delay SECONDS``: each option reaches
every engine the fleet runs (the stack is built as ``up`` builds it; nothing is started), and a
bad value starts nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from fleetpilot.runtime import up
from fleetpilot.runtime.liveness import LivenessProbe
from fleetpilot.runtime.local import Replica
from fleetpilot.runtime.stack import LocalStack
from tests.factories import make_manifest, make_tier


def service_file(tmp_path: Path) -> Path:
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(make_manifest(tiers=[make_tier("small")])))
    return path


def test_cold_start_and_step_delay_reach_every_engine_up_starts_or_the_autoscaler_adds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks: list[LocalStack] = []

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        stacks.append(stack)
        return up.EXIT_OK

    monkeypatch.setattr(up, "_serve", serve)
    argv = ["-f", str(service_file(tmp_path)), "--port", "0", "--workdir", str(tmp_path / "w")]
    paced = ["--cold-start", "7.5", "--step-delay", "0.05"]
    assert up.main([*argv, *paced, "--no-prometheus"]) == up.EXIT_OK
    (stack,) = stacks
    fleet = stack.fleet
    assert fleet.cold_start_s == 7.5
    started: list[Replica] = []
    monkeypatch.setattr(fleet, "_start_engine", started.append)
    fleet.add_replica("small", "unified")  # as the control API does for a scale-up
    assert len(fleet.replicas) == 2
    for replica in fleet.replicas:
        cold_start = replica.argv[replica.argv.index("--cold-start-seconds") + 1]
        assert cold_start == "7.5"
        assert replica.argv[replica.argv.index("--step-delay-seconds") + 1] == "0.05"

    stacks.clear()
    assert up.main([*argv, "--no-prometheus"]) == up.EXIT_OK
    for replica in stacks[0].fleet.replicas:
        assert "--cold-start-seconds" not in replica.argv
        assert "--step-delay-seconds" not in replica.argv


@pytest.mark.parametrize("option", ["--cold-start", "--step-delay"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("-1", "'-1' is negative: a duration is 0 or more"),
        ("nan", "'nan' is not a duration"),
        ("inf", "'inf' is not a duration"),
        ("10x", "'10x' is not a duration: use e.g. 500ms, 30s, 2m, 1h30m"),
    ],
)
def test_a_bad_cold_start_or_step_delay_is_refused_before_anything_starts(
    option: str,
    value: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(up, "_serve", serve)
    argv = ["-f", str(service_file(tmp_path)), option, value]
    with pytest.raises(SystemExit) as info:
        up.main(argv)
    assert info.value.code == up.EXIT_INVALID
    assert f"argument {option}: {message}" in capsys.readouterr().err


def test_durations_take_units_as_every_command_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `up --duration 1m` said "invalid float value". Every duration flag of `up`
    takes 500ms, 30s, 2m, 1h30m, or a plain number of seconds."""
    seen: list[argparse.Namespace] = []
    stacks: list[LocalStack] = []

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        seen.append(args)
        stacks.append(stack)
        return up.EXIT_OK

    monkeypatch.setattr(up, "_serve", serve)
    argv = ["-f", str(service_file(tmp_path)), "--workdir", str(tmp_path / "w"),
            "--duration", "1m", "--status-interval", "10s", "--cold-start", "1m30s",
            "--step-delay", "50ms", "--liveness-period", "2s", "--liveness-timeout", "500ms",
            "--no-prometheus"]  # fmt: skip
    assert up.main(argv) == up.EXIT_OK
    (args,) = seen
    assert (args.duration, args.status_interval) == (60.0, 10.0)
    (stack,) = stacks
    assert stack.fleet.cold_start_s == 90.0
    assert stack.fleet.liveness == LivenessProbe(2.0, 0.5, 3)
    for replica in stack.fleet.replicas:
        assert replica.argv[replica.argv.index("--step-delay-seconds") + 1] == "0.05"


@pytest.mark.parametrize(
    ("option", "value"),
    [("--duration", "0s"), ("--status-interval", "0"), ("--duration", "1 minute")],
)
def test_a_duration_that_cannot_work_is_refused_naming_its_flag(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        up.main(["-f", "service.yaml", option, value])
    assert info.value.code == up.EXIT_INVALID
    assert f"argument {option}: " in capsys.readouterr().err


def test_a_reference_tier_the_planner_refuses_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reference tier runs locally as its pods would, so what the planner refuses for it
    (here a context over the tiny preset's 2048) `up` refuses with the same words, exit 2,
    instead of starting an engine that exits on its flags."""

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(up, "_serve", serve)
    tier = make_tier("small", model="reference-tiny", engine={"backend": "reference"})
    tier["model"]["maxModelLen"] = 4096
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(make_manifest(tiers=[tier])))
    assert up.main(["-f", str(path)]) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.tiers[0].model.maxModelLen" in err
    assert "maxModelLen 4096 > 2048" in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--liveness-period", "0", "argument --liveness-period: '0' is not a duration above 0"),
        ("--liveness-timeout", "nan", "argument --liveness-timeout: 'nan' is not a duration"),
        ("--liveness-failures", "0", "error: --liveness-failures must be at least 1"),
    ],
)
def test_a_liveness_probe_that_cannot_work_is_refused_before_anything_starts(
    option: str,
    value: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A zero period would probe in a busy loop, a zero threshold restart every child: each
    is a one-line error, exit 2, and nothing starts."""

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(up, "_serve", serve)
    argv = ["-f", str(service_file(tmp_path)), option, value]
    code: object
    try:
        code = up.main(argv)
    except SystemExit as exc:  # refused while parsing, as every duration is
        code = exc.code
    assert code == up.EXIT_INVALID
    assert message in capsys.readouterr().err


def test_the_liveness_options_reach_the_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--liveness-period/-timeout/-failures`` are the probe the fleet's supervision uses."""
    stacks: list[LocalStack] = []

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        stacks.append(stack)
        return up.EXIT_OK

    monkeypatch.setattr(up, "_serve", serve)
    argv = ["-f", str(service_file(tmp_path)), "--workdir", str(tmp_path / "w"),
            "--liveness-period", "1.5", "--liveness-timeout", "0.5",
            "--liveness-failures", "4"]  # fmt: skip
    assert up.main(argv) == up.EXIT_OK
    (stack,) = stacks
    assert stack.fleet.liveness == LivenessProbe(1.5, 0.5, 4)


def test_a_reference_checkpoint_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The local fleet has no model cache to read a reference tier's Hub checkpoint from:
    `up` refuses it at its field (exit 2) instead of serving the preset under its name."""

    def serve(stack: LocalStack, args: argparse.Namespace) -> int:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(up, "_serve", serve)
    tier = make_tier("small", model="acme/tiny-llm", engine={"backend": "reference"})
    tier["model"]["source"] = {"huggingface": {"revision": "v1"}}
    path = tmp_path / "service.yaml"
    manifest = make_manifest(tiers=[tier], modelCache={"claimName": "models"})
    path.write_text(yaml.safe_dump(manifest))
    assert up.main(["-f", str(path)]) == up.EXIT_INVALID
    err = capsys.readouterr().err
    assert "spec.tiers[0].model.source.huggingface" in err
    assert "fleetpilot up cannot run a reference checkpoint" in err
