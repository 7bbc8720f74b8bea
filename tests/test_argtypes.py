"""The argparse types every command shares: one duration syntax, Go/Kubernetes style."""

from __future__ import annotations

import argparse

import pytest

from fleetpilot.api.units import parse_duration
from fleetpilot.argtypes import (
    duration_seconds,
    non_negative_seconds,
    parse_duration_seconds,
    positive_duration,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("2m", 120.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("2m30s", 150.0),
        ("250us", 0.00025),
        ("250µs", 0.00025),
        ("10ns", 1e-8),
        ("0s", 0.0),
        ("90", 90.0),  # a plain number is seconds
        ("0.5", 0.5),
        (".5", 0.5),
        ("0", 0.0),
    ],
)
def test_durations_read_as_kubectl_writes_them_or_as_plain_seconds(
    text: str, seconds: float
) -> None:
    assert parse_duration_seconds(text) == pytest.approx(seconds)
    assert duration_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    # (a timedelta holds whole microseconds: the nanoseconds here make whole ones)
    "text",
    ["500ms", "30s", "2m", "1h30m", "1.5h", "2m30s", "250us", "250µs", "2000ns", "0s"],
)
def test_the_command_line_reads_a_duration_as_the_api_does(text: str) -> None:
    """One syntax: a duration with a unit means on the command line what it means in a
    manifest (fleetpilot.api.units, which argtypes may not import)."""
    assert parse_duration_seconds(text) == pytest.approx(parse_duration(text).total_seconds())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("30x", "'30x' is not a duration: use e.g. 500ms, 30s, 2m, 1h30m"),
        ("1d", "'1d' is not a duration"),  # Go and Kubernetes have no days
        ("", "'' is not a duration"),
        ("s", "'s' is not a duration"),
        ("1h 30m", "'1h 30m' is not a duration"),
        ("nan", "'nan' is not a duration"),
        ("inf", "'inf' is not a duration"),
        ("1e3", "'1e3' is not a duration"),
        ("-1", "'-1' is negative: a duration is 0 or more"),
        ("-5m", "'-5m' is negative"),
        ("9" * 400, "is not a finite duration"),
    ],
)
def test_a_bad_duration_is_refused_in_words_that_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        duration_seconds(text)
    assert message in str(info.value)


@pytest.mark.parametrize("text", ["0", "0s", "0ms"])
def test_a_positive_duration_refuses_zero(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a duration above 0"):
        positive_duration(text)
    assert duration_seconds(text) == 0.0


def test_the_routers_seconds_type_is_the_shared_duration() -> None:
    """`router --shutdown-delay 5s` reads as the other commands' durations do."""
    assert non_negative_seconds("5s") == 5.0
    assert non_negative_seconds("5") == 5.0


def test_argparse_names_the_flag_and_the_syntax() -> None:
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--duration", type=positive_duration)
    assert parser.parse_args(["--duration", "1h30m"]).duration == 5400.0
    with pytest.raises(argparse.ArgumentError) as info:
        parser.parse_args(["--duration", "soon"])
    assert str(info.value) == (
        "argument --duration: 'soon' is not a duration: use e.g. 500ms, 30s, 2m, 1h30m; a "
        "plain number is seconds"
    )
