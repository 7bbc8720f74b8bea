"""``fleetpilot bench``'s flags: durations in the syntax every command takes."""

from __future__ import annotations

import argparse

import pytest

from fleetpilot.cli import main
from fleetpilot.loadgen.cli import add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetpilot bench")
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("flag", "text", "seconds"),
    [
        ("--duration", "30s", 30.0),
        ("--duration", "2m", 120.0),
        ("--duration", "1h30m", 5400.0),
        ("--duration", "45", 45.0),  # a plain number is still seconds
        ("--timeout", "500ms", 0.5),
        ("--timeout", "2m", 120.0),
        ("--timeout", "90", 90.0),
    ],
)
def test_bench_durations_take_units(flag: str, text: str, seconds: float) -> None:
    """Regression: `bench --duration 30s` said "'30s' is not a number"."""
    assert getattr(_parse(flag, text), flag.removeprefix("--")) == seconds


def test_bench_defaults_are_unchanged() -> None:
    args = _parse()
    assert args.duration is None  # run() bounds it at 60 s when --requests does not
    assert args.timeout == 60.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration", "30x"], "argument --duration: '30x' is not a duration: use e.g. 500ms"),
        (["--duration", "0s"], "argument --duration: '0s' is not a duration above 0"),
        (["--timeout=-1s"], "argument --timeout: '-1s' is negative"),
    ],
)
def test_a_bad_bench_duration_is_one_line_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["bench", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
